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
import os
from typing import Any

CONNECTOR_NAME = "MoRIIONativeConnector"

logger = logging.getLogger("moriio_native.vllm")


class _VllmLogHandler(logging.Handler):
    """Hands each record to the handlers the ``vllm`` logger has at that moment (vLLM may
    configure, or reconfigure, its logging after this package was loaded); to the root
    logger's when vLLM has none (``VLLM_CONFIGURE_LOGGING=0``)."""

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers or logging.getLogger().handlers
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def use_vllm_logging() -> None:
    """Show the package's log records (``moriio_native.*``) where vLLM shows its own, at vLLM's
    level (``VLLM_LOGGING_LEVEL``, default INFO).

    vLLM configures only its own ``vllm`` logger (not the root), so without this the connector's
    INFO lines (registrations, handshakes) never appear under ``vllm serve``. Does nothing when
    the ``moriio_native`` logger already has a real handler (the user's own logging config, e.g.
    through ``VLLM_LOGGING_CONFIG_PATH``). Idempotent.
    """
    ours = logging.getLogger("moriio_native")
    if any(not isinstance(h, logging.NullHandler) for h in ours.handlers):
        return
    ours.addHandler(_VllmLogHandler())
    if ours.level == logging.NOTSET:
        ours.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    # The handler already reaches the root's handlers when vLLM has none: no second copy.
    ours.propagate = False


def register() -> None:
    """Register ``MoRIIONativeConnector`` with vLLM's KVConnectorFactory and route the
    package's logging to vLLM's handlers (idempotent; a no-op when vLLM is not installed)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        logger.debug("vllm is not importable; %s not registered", CONNECTOR_NAME)
        return
    use_vllm_logging()
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


__all__ = ["CONNECTOR_NAME", "MoRIIONativeConnector", "register", "use_vllm_logging"]
