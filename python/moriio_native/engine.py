"""The transfer engine facade.

An :class:`Engine` registers this process's KV caches, exchanges metadata with peers (opaque
bytes you carry over your own control plane), and moves blocks with READ (pull) or WRITE (push
per layer) transfers. Every transfer ends in exactly one :class:`TransferEvent` from
:meth:`Engine.poll_events`. All methods are thread-safe; none waits for a transfer except
``poll_events`` with a timeout (which releases the GIL and honours Ctrl-C).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from moriio_native import _native
from moriio_native._native import CacheSpec, TransferEvent
from moriio_native.layout import BlockIds, KvPlaneAxis, geometry_of

logger = logging.getLogger("moriio_native.engine")

MemoryKind = Literal["host", "cuda", "rocm"]


class BackendInfo(NamedTuple):
    name: str
    available: bool
    reason: str


def _ucx_wheel_library_dir() -> str | None:
    """lib/ of an installed libucx wheel (libucx-cu13 or -cu12), if any."""
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    lib = os.path.join(os.path.dirname(libucx.__file__), "lib")
    return lib if os.path.isdir(lib) else None


def _backend_options(backend: str, options: Mapping[str, Any] | None) -> dict[str, str]:
    """String options for the native backend, with the UCX library found in the Python env."""
    opts = {str(k): str(v) for k, v in (options or {}).items()}
    if (
        backend == "ucx"
        and "ucx_library_path" not in opts
        and not os.environ.get("MORIIO_NATIVE_UCX_LIBRARY_PATH")
    ):
        wheel_lib = _ucx_wheel_library_dir()
        if wheel_lib:
            opts["ucx_library_path"] = wheel_lib
    return opts


def available_backends(options: Mapping[str, Any] | None = None) -> list[BackendInfo]:
    """Every known backend with whether it can run here and, if not, why."""
    opts = _backend_options("ucx", options)
    return [BackendInfo(*row) for row in _native.available_backends(opts)]


@dataclass(frozen=True)
class LayerRegistration:
    """One layer to register: its cache tensor (or TensorGeometry with data_ptr), its spec and
    the allocation the view lives in, as ``(base_address, size_bytes)``."""

    name: str
    tensor: Any
    spec: CacheSpec
    allocation: tuple[int, int]
    memory: MemoryKind = "host"
    device: int = -1
    kv_plane_axis: KvPlaneAxis = "auto"

    def _native(self) -> Any:
        base, size = self.allocation
        return _native._LayerRegistration(
            self.name,
            geometry_of(self.tensor),
            self.spec,
            self.kv_plane_axis,
            int(base),
            int(size),
            self.memory,
            int(self.device),
        )


class Engine:
    """A transfer engine on one backend ("loopback", "ucx" or "mori").

    Raises BackendUnavailableError with the reason when the backend cannot run here.
    """

    def __init__(
        self,
        engine_id: str,
        backend: str = "loopback",
        options: Mapping[str, Any] | None = None,
        transfer_timeout: float = 30.0,
        terminal_history: int = 65536,
        page_size: int = 4096,
    ) -> None:
        self._engine = _native._Engine(
            engine_id,
            backend,
            _backend_options(backend, options),
            float(transfer_timeout),
            int(terminal_history),
            int(page_size),
        )
        logger.debug("engine %s on backend %s created", engine_id, backend)

    @property
    def engine_id(self) -> str:
        return self._engine.engine_id

    @property
    def backend(self) -> str:
        return self._engine.backend

    @property
    def pending_transfers(self) -> int:
        return self._engine.pending_transfers

    def allocate_host_backing(self, nbytes: int) -> np.ndarray:
        """A ``numpy.uint8`` array of ``nbytes`` allocated by the backend for a KV backing.

        With UCX this is shared memory that a peer on the same host maps and copies with plain
        memcpy (the fastest host path). The array keeps this engine alive; the memory lives until
        the engine is destroyed. FailedPreconditionError when the backend cannot allocate.
        """
        address, size = self._engine.allocate_backing(int(nbytes), "host", -1)
        buffer = (ctypes.c_uint8 * size).from_address(address)
        buffer._owner = self  # type: ignore[attr-defined]  # the memory dies with the engine
        return np.frombuffer(buffer, dtype=np.uint8)

    def register_kv_caches(self, layers: Sequence[LayerRegistration]) -> bytes:
        """Register every layer (once) and return the metadata peers need. The engine keeps the
        layers' tensors alive: their memory stays registered and reachable by peers."""
        metadata = self._engine.register_kv_caches([layer._native() for layer in layers])
        self._registered = tuple(layers)
        return metadata

    def local_metadata(self) -> bytes:
        return self._engine.local_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Validate and connect a peer; returns its engine id. IncompatiblePeerError names the
        layer that differs."""
        return self._engine.add_peer(bytes(metadata))

    def remove_peer(self, peer: str) -> None:
        self._engine.remove_peer(peer)

    def peers(self) -> list[str]:
        return self._engine.peers()

    def read(
        self,
        transfer_id: str,
        peer: str,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Pull ``remote_blocks`` of every layer (or ``layers``) into ``local_blocks``."""
        self._engine.read(transfer_id, peer, local_blocks, remote_blocks, list(layers or []))

    def write_layer(
        self,
        transfer_id: str,
        layer: str,
        peer: str,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        cuda_event: int = 0,
    ) -> bool:
        """Push one layer's blocks; False when this (transfer, layer) was scheduled before.

        ``cuda_event``: the handle of a CUDA event recorded after the work that produces this
        layer (``torch.cuda.Event().cuda_event`` once recorded); the copy then waits for it on
        the GPU, so this may be called before that work finished. Needs a CUDA layer and the UCX
        backend with its CUDA copy plugin (FailedPreconditionError otherwise). Use one event per
        layer and keep it until the transfer's event arrives.
        """
        return self._engine.write_layer(
            transfer_id, layer, peer, local_blocks, remote_blocks, cuda_event
        )

    def seal(self, transfer_id: str, peer: str = "") -> None:
        """No more layers for this WRITE transfer; it completes when the scheduled ones have."""
        self._engine.seal(transfer_id, peer)

    def abort(self, transfer_id: str) -> None:
        self._engine.abort(transfer_id)

    def poll_events(self, max_events: int = 1024, timeout: float = 0.0) -> list[TransferEvent]:
        """Terminal events, oldest first, waiting up to ``timeout`` seconds for the first."""
        return self._engine.poll_events(int(max_events), float(timeout))

    def wait(self, transfer_ids: Sequence[str], timeout: float) -> dict[str, TransferEvent]:
        """Poll until every id in ``transfer_ids`` has its event or ``timeout`` passes; returns
        the events seen (others that arrive meanwhile are returned too, keyed by id)."""
        import time

        deadline = time.monotonic() + timeout
        seen: dict[str, TransferEvent] = {}
        wanted = set(transfer_ids)
        while not wanted.issubset(seen):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for event in self.poll_events(timeout=min(left, 0.1)):
                seen[event.transfer_id] = event
        return seen


__all__ = ["BackendInfo", "Engine", "LayerRegistration", "TransferEvent", "available_backends"]
