"""The transfer engine facade.

An :class:`Engine` registers this process's KV caches, exchanges metadata with peers (opaque
bytes you carry over your own control plane), and moves blocks with READ (pull) or WRITE (push
per layer) transfers. Every transfer ends in exactly one :class:`TransferEvent` from
:meth:`Engine.poll_events`. No byte of a transfer lands after its event -- except where the
event says ``drained=False``: the transfer ended while its operations were still in flight, its
destination is quarantined, and :meth:`Engine.poll_drained` reports it once nothing of it can
write any more (never, for a WRITE whose writes the transport could not confirm before its
connection closed: the peer's blocks may change at any time). All methods are thread-safe;
none waits for a transfer except ``poll_events`` with a timeout (which releases the GIL and
honours Ctrl-C).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from moriio_native import _native
from moriio_native._native import CacheSpec, DrainedTransfer, TransferEvent
from moriio_native.errors import InvalidArgumentError
from moriio_native.integers import is_integer
from moriio_native.layout import (
    WHOLE_BLOCK,
    BlockIds,
    CellWindow,
    KvPlaneAxis,
    _layer_geometry,
)

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


def _torch_storage(tensor: Any) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of a torch tensor's whole storage, or None for anything else."""
    storage = getattr(tensor, "untyped_storage", None)
    if storage is None or not callable(storage):
        return None
    s = storage()
    return int(s.data_ptr()), int(s.nbytes())


BackendRole = Literal["serve", "local"]

# The order "auto" tries backends in, per use:
# * serve -- two serving instances (vLLM prefill and decode), usually on different hosts: MoRI-IO
#   first (the native RDMA engine of AMD GPUs: GPU-direct over RDMA NICs and XGMI, which UCX
#   reaches on ROCm only partly), then UCX (every other fabric, NVIDIA GPUs, CPU hosts). Never
#   loopback: it moves bytes inside ONE process and cannot connect two instances.
# * local -- the demo and the benchmarks on one machine with host memory: UCX first (two real
#   processes over shared memory / CMA, as a deployment moves bytes), else loopback (both
#   sides in one process: the protocol still runs, the transport is a memcpy). MoRI-IO is not
#   tried: it needs an RDMA NIC or XGMI even between processes of one host.
AUTO_BACKENDS: dict[str, tuple[str, ...]] = {"serve": ("mori", "ucx"), "local": ("ucx", "loopback")}


def choose_backend(
    name: str, options: Mapping[str, Any] | None = None, *, role: BackendRole
) -> str:
    """The backend to use: ``name`` when it is not ``auto`` (BackendUnavailableError with the
    reason when it cannot run here), else the first available of :data:`AUTO_BACKENDS` for
    ``role``."""
    from moriio_native.errors import BackendUnavailableError

    if role not in AUTO_BACKENDS:
        raise InvalidArgumentError(f"choose_backend: role must be serve or local, got {role!r}")
    infos = {info.name: info for info in available_backends(options)}
    if name != "auto":
        info = infos.get(name)
        if info is None:
            known = ", ".join(sorted(infos))
            raise InvalidArgumentError(f"unknown backend {name!r} (known: {known}, auto)")
        if not info.available:
            shown = {"ucx": "UCX", "mori": "MoRI-IO"}.get(name, name)
            raise BackendUnavailableError(f"{shown} backend unavailable: {info.reason}")
        return name
    for candidate in AUTO_BACKENDS[role]:
        info = infos.get(candidate)
        if info is not None and info.available:
            return candidate
    reasons = "; ".join(f"{n}: {infos[n].reason}" for n in AUTO_BACKENDS[role] if n in infos)
    raise BackendUnavailableError(f"no transfer backend available for backend=auto ({reasons})")


@dataclass(frozen=True)
class LayerRegistration:
    """One layer to register: its cache tensor (or TensorGeometry with data_ptr), its spec and
    the allocation the view lives in, as ``(base_address, size_bytes)``.

    The engine registers page-aligned regions inside the allocation (never outside it), and
    everything inside may be exposed to peers for remote reads and writes. For a torch tensor the
    allocation defaults to the tensor's ``untyped_storage()``, and a claim that does not lie inside
    that storage is InvalidArgumentError. Any other tensor, or a raw TensorGeometry, must name the
    allocation, and the caller guarantees it: one live allocation this process owns, that holds the
    whole view, stays allocated while registered, and whose every byte peers may read and write.
    """

    name: str
    tensor: Any
    spec: CacheSpec
    allocation: tuple[int, int] | None = None
    memory: MemoryKind = "host"
    device: int = -1
    kv_plane_axis: KvPlaneAxis = "auto"

    def _allocation(self) -> tuple[int, int]:
        """The checked allocation: the torch storage, or a claim inside it."""
        storage = _torch_storage(self.tensor)
        if self.allocation is None:
            if storage is None:
                raise InvalidArgumentError(
                    f"layer {self.name!r}: allocation=(base, size) is required for a "
                    f"{type(self.tensor).__name__} (only a torch tensor's storage is known)"
                )
            return storage
        base, size = (int(v) for v in self.allocation)
        if storage is not None:
            start, nbytes = storage
            if base < start or size < 0 or base + size > start + nbytes:
                raise InvalidArgumentError(
                    f"layer {self.name!r}: the allocation claim ({base:#x}, {size} bytes) is not "
                    f"inside the tensor's storage ({start:#x}, {nbytes} bytes); registering it "
                    "would expose memory outside the tensor to peers (omit allocation to use the "
                    "storage)"
                )
        return base, size

    def _check_memory_kind(self) -> None:
        """A tensor whose own device contradicts ``memory`` is refused: a GPU tensor registered
        as host memory would be copied with host memcpy (loopback) or mapped as host memory."""
        if isinstance(self.tensor, np.ndarray):
            device_type = "cpu"
        else:
            device_type = getattr(getattr(self.tensor, "device", None), "type", None)
        if not isinstance(device_type, str):
            return  # a TensorGeometry or a duck-typed tensor: the caller names the memory
        on_host = device_type == "cpu"
        if on_host != (self.memory in ("host", "cpu")):
            raise InvalidArgumentError(
                f"layer {self.name!r}: the tensor is on device {device_type!r} but memory is "
                f"{self.memory!r} (pass memory='cuda' or 'rocm' and device= for a GPU tensor, "
                "'host' for host memory)"
            )

    def _native(self) -> Any:
        self._check_memory_kind()
        flags = getattr(self.tensor, "flags", None)
        if isinstance(self.tensor, np.ndarray) and flags is not None and not flags.writeable:
            raise InvalidArgumentError(
                f"layer {self.name!r}: the array is read-only (numpy writeable=False); peers "
                "write into registered memory"
            )
        base, size = self._allocation()
        return _native._LayerRegistration(
            self.name,
            _layer_geometry(self.name, self.tensor),
            self.spec,
            self.kv_plane_axis,
            int(base),
            int(size),
            self.memory,
            int(self.device),
        )


@dataclass(frozen=True)
class BlockSegment:
    """One part of a transfer: ``layers`` (None: every layer of the transfer) x the block pairs
    ``(local_blocks[i], remote_blocks[i])`` x the cells of ``local_window`` <-> ``remote_window``
    of each pair.

    Several segments make ONE transfer (one event, one abort): four prefill 16-token blocks into
    token windows 0/16/32/48 of one 64-token decode block, a head range of a peer with other TP,
    or layer groups with their own block ids. A local list shorter than the remote one pairs
    with the first remote ids."""

    local_blocks: BlockIds
    remote_blocks: BlockIds
    layers: Sequence[str] | None = None
    local_window: CellWindow = WHOLE_BLOCK
    remote_window: CellWindow = WHOLE_BLOCK

    def _native(self) -> tuple[list[str], Any, Any, Any, Any]:
        return (
            _layer_names(self.layers, "segment"),
            self.local_blocks,
            self.remote_blocks,
            self.local_window._native(),
            self.remote_window._native(),
        )


def _refuse_text(layers: object, what: str) -> None:
    """A string given for a sequence of layer names would be read character by character."""
    if isinstance(layers, (str, bytes)):
        raise InvalidArgumentError(
            f"{what}: layers must be a sequence of layer names, got the string {layers!r}"
        )


def _layer_names(layers: Sequence[str] | None, what: str) -> list[str]:
    """``layers`` as a list; None (every layer) as []. An empty sequence is refused: it would
    be taken as every layer."""
    if layers is None:
        return []
    _refuse_text(layers, what)
    names = list(layers)
    if not names:
        raise InvalidArgumentError(f"{what}: layers is empty (None means every layer)")
    return names


def _native_segments(segments: Sequence[BlockSegment]) -> list[Any]:
    out = []
    for k, segment in enumerate(segments):
        if not isinstance(segment, BlockSegment):
            raise InvalidArgumentError(
                f"segment {k}: expected a BlockSegment, got {type(segment).__name__}"
            )
        out.append(segment._native())
    return out


def _seconds(value: object, what: str) -> float:
    """``value`` as float seconds; InvalidArgumentError naming ``what`` when it is none."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(
            f"{what} must be a number of seconds, got {value!r:.80}"
        ) from None


def _check_count(value: object, what: str, limit: int = 2**64) -> None:
    """A count: a non-negative integer below ``limit`` (the native field's range; never a bool
    or a float, which int() would truncate)."""
    if not is_integer(value) or not 0 <= value < limit:
        raise InvalidArgumentError(f"{what} must be an integer in [0, {limit}), got {value!r:.80}")


def _check_cuda_event(value: object) -> None:
    if not is_integer(value) or not 0 <= value < 2**64:
        raise InvalidArgumentError(
            f"cuda_event must be 0 or an event handle (an integer in [0, 2**64)), got {value!r}"
        )


def _keep(_tensors: tuple[object, ...]) -> None:
    """weakref.finalize's callback for a native engine: its argument, the registered tensors,
    lives until the native engine is gone, and is dropped after it."""


class _Keeper:
    """What the arrays of :meth:`Engine.allocate_host_backing` keep alive: the native engine
    that owns their memory, not the Engine. The Engine keeps every registered layer, views of
    those arrays among them, and numpy does not show the garbage collector an array's base, so
    a cycle through the Engine would never be collected."""

    def __init__(self, native: Any) -> None:
        self.native = native
        self.allocations: list[tuple[int, int]] = []

    def outside_allocations(
        self, layers: Sequence[LayerRegistration]
    ) -> tuple[LayerRegistration, ...]:
        """The layers whose allocation lies in none of the engine's own."""

        def inside(layer: LayerRegistration) -> bool:
            base, size = layer._allocation()
            return any(start <= base and base + size <= start + n for start, n in self.allocations)

        return tuple(layer for layer in layers if not inside(layer))


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
        _check_count(terminal_history, "terminal_history")
        _check_count(page_size, "page_size")
        timeout_s = _seconds(transfer_timeout, "transfer_timeout")
        if 0 < timeout_s < 0.001:
            raise InvalidArgumentError(
                f"transfer_timeout must be at least one millisecond, got {transfer_timeout!r} s"
            )
        self._engine = _native._Engine(
            engine_id,
            backend,
            _backend_options(backend, options),
            timeout_s,
            int(terminal_history),
            int(page_size),
        )
        self._keeper = _Keeper(self._engine)
        self._registered: tuple[LayerRegistration, ...] = ()
        # Events wait() took and could not return (it was interrupted): delivered first by the
        # next poll_events, never dropped.
        self._undelivered: list[TransferEvent] = []
        self._undelivered_lock = threading.Lock()
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

    @property
    def quarantined_transfers(self) -> int:
        """Transfers that ended with operations in flight and have not drained yet."""
        return self._engine.quarantined_transfers

    def allocate_host_backing(self, nbytes: int) -> np.ndarray:
        """A ``numpy.uint8`` array of ``nbytes`` allocated by the backend for a KV backing.

        With UCX this is shared memory that a peer on the same host maps and copies with plain
        memcpy (the fastest host path). The array keeps the native engine alive, and with it every
        registered layer outside the engine's own allocations; the memory lives until the engine
        is destroyed. FailedPreconditionError when the backend cannot allocate.
        """
        _check_count(nbytes, "allocate_host_backing: nbytes")
        address, size = self._engine.allocate_backing(int(nbytes), "host", -1)
        buffer = (ctypes.c_uint8 * size).from_address(address)
        buffer._owner = self._keeper  # type: ignore[attr-defined]  # the memory dies with it
        self._keeper.allocations.append((address, size))
        return np.frombuffer(buffer, dtype=np.uint8)

    def register_kv_caches(self, layers: Sequence[LayerRegistration]) -> bytes:
        """Register every layer (once) and return the metadata peers need. The engine keeps the
        layers' tensors alive: their memory stays registered and reachable by peers."""
        layers = tuple(layers)  # kept below: an iterator would be consumed by the native call
        metadata = self._engine.register_kv_caches([layer._native() for layer in layers])
        self._registered = layers
        # The memory the engine did not allocate lives as long as the native engine serves it,
        # and goes only after it: tied to the native object, whose weak references pybind11
        # clears after its destructor ran. (Not through this Engine, whose attributes a
        # collection of cyclic garbage may clear in any order; not the engine's own memory,
        # which it keeps itself and which would keep it alive for good.)
        foreign = self._keeper.outside_allocations(layers)
        weakref.finalize(
            self._engine, _keep, tuple(layer.tensor for layer in foreign)
        ).atexit = False
        return metadata

    def local_metadata(self) -> bytes:
        return self._engine.local_metadata()

    def add_peer(
        self, metadata: bytes, *, replace: bool = False, expected_engine_id: str = ""
    ) -> str:
        """Validate and connect a peer; returns its engine id. IncompatiblePeerError names the
        layer that differs. The same metadata again is a no-op; other metadata under a connected
        engine id is AlreadyExistsError -- unless ``replace``: that peer restarted, and once the
        new connection stands the old one's pending transfers end (never ``done``) and it is
        disconnected (on error the old peer stays). Use ``replace`` only for metadata a
        handshake with that peer returned, with the engine id that handshake answered as in
        ``expected_engine_id``: metadata naming another engine is then IncompatiblePeerError
        and changes nothing (an answer cannot replace another engine's connection)."""
        return self._engine.add_peer(bytes(metadata), replace, expected_engine_id)

    def remove_peer(self, peer: str) -> None:
        """Disconnect ``peer``; its pending transfers end (never ``done``). NotFoundError for
        an unknown peer."""
        self._engine.remove_peer(peer)

    def remove_idle_peer(self, peer: str) -> bool:
        """Disconnect ``peer`` only while no transfer with it is pending or quarantined (so
        nothing ends or is stranded): True when removed, False (nothing changed) when it is
        busy. NotFoundError for an unknown peer."""
        return self._engine.remove_idle_peer(peer)

    def peers(self) -> list[str]:
        return self._engine.peers()

    def waits_for_device_events(self, peer: str) -> bool:
        """Whether ``write_layer`` to ``peer`` honours ``cuda_event``: UCX with its CUDA copy
        plugin and CUDA layers, or MoRI-IO and ROCm layers (``torch.cuda.Event`` is a HIP event
        there). The copy waits for the event on the GPU where UCX maps the peer's memory into
        this process (CUDA IPC on one node); where the copies are UCX operations (RDMA to
        another node, ``ucx_direct_copy`` off) or MoRI-IO's, the engine's own thread polls the
        event and posts the layer once it completed. The caller never waits either way. A
        caller holding a layer's event passes it when True and synchronises it on the host
        otherwise (host memory, loopback). NotFoundError for an unknown peer."""
        return self._engine.waits_for_device_events(peer)

    def read(
        self,
        transfer_id: str,
        peer: str,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        layers: Sequence[str] | None = None,
    ) -> None:
        """Pull ``remote_blocks`` of every layer (or ``layers``) into ``local_blocks``."""
        names = _layer_names(layers, f"read {transfer_id!r}")
        self._engine.read(transfer_id, peer, local_blocks, remote_blocks, names)

    def read_segments(self, transfer_id: str, peer: str, segments: Sequence[BlockSegment]) -> None:
        """Pull every segment (its layers x block pairs x windows) as ONE transfer.

        Everything is checked before anything starts; InvalidArgumentError / OutOfRangeError /
        NotFoundError / IncompatiblePeerError name the segment index, layer, block id and window
        (unknown layer, ids out of range on either side, a window outside its block, windows
        that do not pair, two segments writing the same local cells: the same local block of a
        layer under overlapping local windows). On error no transfer exists."""
        self._engine.read_segments(transfer_id, peer, _native_segments(segments))

    def write_layer(
        self,
        transfer_id: str,
        layer: str,
        peer: str,
        local_blocks: BlockIds | None = None,
        remote_blocks: BlockIds | None = None,
        cuda_event: int = 0,
        *,
        segments: Sequence[BlockSegment] | None = None,
    ) -> bool:
        """Push one layer's blocks; False when this (transfer, layer) was scheduled before or
        the transfer failed, ended or was aborted.

        Either ``local_blocks`` and ``remote_blocks`` (whole blocks), or ``segments``: this
        layer's block pairs and windows, several of them in one write (their ``layers`` must be
        None: the call names the layer). Two segments writing the same remote cells (the same
        remote block under overlapping remote windows) are refused; disjoint windows of one
        block are how two prefill ranks' head ranges fill one decode block.

        A refused layer (unknown peer or layer, bad block ids, a CUDA event it cannot honour,
        ...) raises AND fails the transfer, so no seal can make it ``done``.
        InvalidArgumentError, with nothing changed, when ``transfer_id`` is a READ.

        ``cuda_event``: the handle of a CUDA event recorded after the work that produces this
        layer (``torch.cuda.Event().cuda_event`` once recorded); the copy then waits for it (on
        the GPU, or in the engine's progress thread, see ``waits_for_device_events``), so this
        may be called before that work finished. Needs a GPU layer and a peer for which
        ``waits_for_device_events`` is True (FailedPreconditionError otherwise). Use one event per
        layer and keep it until the transfer's event arrives.
        """
        if segments is not None:
            if local_blocks is not None or remote_blocks is not None:
                raise InvalidArgumentError(
                    f"write_layer {transfer_id!r} layer {layer!r}: pass segments or "
                    "local_blocks/remote_blocks, not both"
                )
            _check_cuda_event(cuda_event)
            return self._engine.write_layer_segments(
                transfer_id, layer, peer, _native_segments(segments), cuda_event
            )
        if local_blocks is None or remote_blocks is None:
            raise InvalidArgumentError(
                f"write_layer {transfer_id!r} layer {layer!r}: local_blocks and remote_blocks "
                "(or segments) are required"
            )
        _check_cuda_event(cuda_event)
        return self._engine.write_layer(
            transfer_id, layer, peer, local_blocks, remote_blocks, cuda_event
        )

    def write_layers(
        self,
        transfer_id: str,
        layers: Sequence[str],
        peer: str,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        cuda_event: int = 0,
    ) -> bool:
        """Push several layers' whole blocks in one call: each layer counts as one write of the
        transfer (towards ``seal``), and the layers go batched as ``read`` batches them (a few
        batches, not one per layer), so a WRITE flushed after the forward pays one plan.

        False when every one of ``layers`` was scheduled before or the transfer failed, ended
        or was aborted. Refusals raise AND fail the transfer as ``write_layer``'s do, naming
        the layer (unknown or repeated, bad block ids, a CUDA event it cannot honour); some of
        ``layers`` scheduled before but not all is InvalidArgumentError that fails the transfer.
        Empty ``layers``: InvalidArgumentError, nothing changed.

        ``cuda_event``: one event recorded after the work that produces every one of
        ``layers``; each of their copies waits for it (see ``write_layer``)."""
        _refuse_text(layers, f"write_layers {transfer_id!r}")
        _check_cuda_event(cuda_event)
        return self._engine.write_layers(
            transfer_id, list(layers), peer, local_blocks, remote_blocks, cuda_event
        )

    def seal(self, transfer_id: str, peer: str, *, expected_writes: int) -> bool:
        """This WRITE transfer consists of exactly ``expected_writes`` distinct layers, scheduled
        before or after this call; it is ``done`` once all of them completed.

        ``expected_writes=0`` says "nothing to send" (a full prefix hit): the transfer is done at
        once. InvalidArgumentError for a READ id, another peer or a second seal with another
        count; more layers than ``expected_writes`` fail the transfer. False when the engine
        remembers the transfer as ended (a late seal, or a reused id): ignored, and no event
        follows from it."""
        if not is_integer(expected_writes):
            raise InvalidArgumentError(
                f"transfer {transfer_id!r}: expected_writes must be an integer, got "
                f"{expected_writes!r}"
            )
        if not -(2**63) <= expected_writes < 2**63:  # the native count (negatives named there)
            raise InvalidArgumentError(
                f"transfer {transfer_id!r}: expected_writes {expected_writes} is out of range"
            )
        return self._engine.seal(transfer_id, peer, int(expected_writes))

    def abort(self, transfer_id: str) -> None:
        self._engine.abort(transfer_id)

    def poll_events(self, max_events: int = 1024, timeout: float = 0.0) -> list[TransferEvent]:
        """Terminal events, oldest first, waiting up to ``timeout`` seconds for the first."""
        _check_count(max_events, "poll_events: max_events")
        wait_s = _seconds(timeout, "poll_events: timeout")
        if self._undelivered and max_events:
            with self._undelivered_lock:
                kept = self._undelivered[: int(max_events)]
                del self._undelivered[: len(kept)]
            if kept:
                more = int(max_events) - len(kept)
                self._engine.poll_events_into(kept, more, 0.0)
                return kept
        return self._engine.poll_events(int(max_events), wait_s)

    def poll_drained(self, max_transfers: int = 1024) -> list[DrainedTransfer]:
        """Quarantined transfers (their event had ``drained=False``) whose operations have all
        completed since the last call; each is reported exactly once. Only then may their
        destination blocks be reused. Never blocks."""
        _check_count(max_transfers, "poll_drained: max_transfers")
        return self._engine.poll_drained(int(max_transfers))

    def wait(self, transfer_ids: Sequence[str], timeout: float) -> dict[str, TransferEvent]:
        """Poll until every id in ``transfer_ids`` has its event or ``timeout`` passes; returns
        the events seen (others that arrive meanwhile are returned too, keyed by id). ``timeout``
        0 or below polls once; ``math.inf`` waits for all of them; NaN is refused
        (InvalidArgumentError), since no deadline would ever pass.

        It consumes events as ``poll_events`` does (each is delivered once): one thread of the
        process polls. Two threads waiting at once each take the other's events, so one may
        never see its own (with ``math.inf``, wait forever)."""
        import math
        import time

        timeout = _seconds(timeout, "wait: timeout")
        if math.isnan(timeout):
            raise InvalidArgumentError(
                f"wait: timeout must be a number of seconds, got {timeout!r}"
            )
        deadline = time.monotonic() + timeout
        if isinstance(transfer_ids, (str, bytes)):
            raise InvalidArgumentError(
                f"wait: transfer_ids must be a sequence of ids, got the string {transfer_ids!r}"
            )
        seen: dict[str, TransferEvent] = {}
        wanted = set(transfer_ids)
        # Each event taken is in ``taken`` (the native poll appends it there before returning)
        # until it is in ``seen``: a Ctrl-C wherever it comes finds it in one of them.
        taken: list[TransferEvent] = []
        try:
            taken.extend(self._take_undelivered())
            while True:
                left = deadline - time.monotonic()
                self._engine.poll_events_into(taken, 1024, min(max(left, 0.0), 0.1))
                for event in taken:
                    seen[event.transfer_id] = event
                taken.clear()
                if wanted.issubset(seen) or left <= 0:
                    return seen
        except BaseException:
            # Interrupted (Ctrl-C): the events taken are each delivered once -- by the next
            # poll_events, not dropped with this call.
            for event in taken:
                seen[event.transfer_id] = event
            self._give_back(list(seen.values()))
            raise

    def _take_undelivered(self) -> list[TransferEvent]:
        """The events an interrupted ``wait`` took, oldest first, now the caller's."""
        with self._undelivered_lock:
            taken, self._undelivered = self._undelivered, []
        return taken

    def _give_back(self, events: list[TransferEvent]) -> None:
        """Keeps ``events`` (taken by an interrupted ``wait``) for the next poll, before any
        kept already; one object kept twice (an interrupt between taking and keeping) once."""
        with self._undelivered_lock:
            kept = {id(event) for event in self._undelivered}
            self._undelivered[:0] = [event for event in events if id(event) not in kept]


__all__ = [
    "BackendInfo",
    "BlockSegment",
    "DrainedTransfer",
    "Engine",
    "LayerRegistration",
    "TransferEvent",
    "available_backends",
    "choose_backend",
]
