"""moriio-native: KV-cache transfer for prefill/decode disaggregated LLM serving.

The native core (layout engine, registration planning, transfer engine, backends) is reached
through this package; ``moriio_native._native`` is private.
"""

from __future__ import annotations

import logging

from moriio_native.engine import (
    BackendInfo,
    BlockSegment,
    DrainedTransfer,
    Engine,
    LayerRegistration,
    TransferEvent,
    available_backends,
)
from moriio_native.errors import (
    AbortedError,
    AlreadyExistsError,
    BackendUnavailableError,
    FailedPreconditionError,
    IncompatiblePeerError,
    InternalError,
    InvalidArgumentError,
    MoriioError,
    NotFoundError,
    OutOfRangeError,
    TransferTimeoutError,
    TransportError,
)
from moriio_native.layout import (
    BlockPairs,
    BlockTemplate,
    CacheSpec,
    CellWindow,
    CopyPlan,
    LayerLayout,
    TensorGeometry,
    block_template,
    describe_layer,
    plan_block_copies,
)
from moriio_native.memory import (
    RegistrationPlan,
    allocate_host_backing,
    allocate_kv_backing,
    plan_registration,
)

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "BackendInfo",
    "BackendUnavailableError",
    "BlockPairs",
    "BlockSegment",
    "BlockTemplate",
    "CacheSpec",
    "CellWindow",
    "CopyPlan",
    "DrainedTransfer",
    "Engine",
    "FailedPreconditionError",
    "IncompatiblePeerError",
    "InternalError",
    "InvalidArgumentError",
    "LayerLayout",
    "LayerRegistration",
    "MoriioError",
    "NotFoundError",
    "OutOfRangeError",
    "RegistrationPlan",
    "TensorGeometry",
    "TransferEvent",
    "TransferTimeoutError",
    "TransportError",
    "__version__",
    "allocate_host_backing",
    "allocate_kv_backing",
    "available_backends",
    "block_template",
    "describe_layer",
    "plan_block_copies",
    "plan_registration",
]
