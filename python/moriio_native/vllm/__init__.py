"""vLLM integration: the ``MoRIIONativeConnector`` KV connector for prefill/decode serving.

Importing this package does not import vLLM; :class:`MoRIIONativeConnector` is loaded on first
access (``from moriio_native.vllm import MoRIIONativeConnector``), which needs ``vllm==0.33.0``.

:func:`register` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process
it starts, and it registers the connector name with vLLM's connector factory, so
``"kv_connector": "MoRIIONativeConnector"`` works without ``kv_connector_module_path``.

Modules: :mod:`.config` (keys and defaults), :mod:`.connector` (the class), :mod:`.scheduler`,
:mod:`.worker`, :mod:`.metadata`, :mod:`.specs`, :mod:`.stats`. Operator guide: docs/vllm.md.
"""

from __future__ import annotations

import logging
from typing import Any

CONNECTOR_NAME = "MoRIIONativeConnector"

logger = logging.getLogger("moriio_native.vllm")


def register() -> None:
    """Register ``MoRIIONativeConnector`` with vLLM's KVConnectorFactory (idempotent; a no-op
    when vLLM is not installed)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        logger.debug("vllm is not importable; %s not registered", CONNECTOR_NAME)
        return
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)
    except ValueError:
        # Registered concurrently (or by another copy of this package): nothing to do.
        if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
            raise


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        from moriio_native.vllm.connector import MoRIIONativeConnector

        return MoRIIONativeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONNECTOR_NAME", "MoRIIONativeConnector", "register"]
