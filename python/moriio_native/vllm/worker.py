"""The worker-side half of MoRIIONativeConnector (one per vLLM worker process / GPU).

It owns the native :class:`~moriio_native.Engine` (the registered KV caches), this rank's
control-plane endpoints (handshake server, notify listener, notify sender, and on rank 0 the
proxy pinger) and the state of every transfer this rank takes part in.

Decode side
  READ: ``start_load_kv`` handshakes the prefill rank with the same TP rank (once per peer,
  over the allowlist) and posts one engine READ per request; ``wait_for_layer_load`` waits
  for this step's reads (bounded by ``transfer_timeout``). A read that fails leaves its blocks
  in ``get_block_ids_with_load_errors`` so vLLM recomputes them. Done or not, the prefill gets
  a ``release`` (its engine id and address come from the handshake, checked against what the
  request named).
  WRITE: ``start_load_kv`` handshakes the prefill rank (which lets it dial us back) and sends
  ``remote_blocks``; ``write_done`` makes the request finished-receiving, ``write_failed`` or
  ``abort_timeout`` finished-and-failed (vLLM recomputes).

Prefill side
  READ: passive; blocks are held until the decode's ``release`` (or ``abort_timeout``).
  WRITE: ``save_kv_layer`` records the layer's CUDA event (GPU tensors) and queues the layer;
  once the decode's ``remote_blocks`` arrived and its metadata was fetched, a writer thread
  waits for each event and posts the layer's write; ``wait_for_save`` queues layers whose hook
  did not run and seals. When the engine reports the transfer, exactly one ``write_done`` (or
  ``write_failed``) goes to the decode and the request's blocks are released.

Threads: a notify thread (control messages), an events thread (engine completions and
timeouts), a writer thread (WRITE pushes in order) and a small pool for handshakes. All state
is guarded by one lock; vLLM's hooks are called from the model-runner thread. Work for the
writer is staged under the lock and moved into its bounded queue after the lock is released
(:meth:`WorkerSide._feed_writer`): the writer takes the lock after each get, so a producer that
waited for room while holding it would deadlock.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moriio_native.control.addressing import ZmqAddress, validate_host
from moriio_native.control.channel import (
    HandshakeServer,
    NotifyListener,
    NotifySender,
    ProxyPinger,
    fetch_metadata,
)
from moriio_native.control.messages import (
    AbortWrite,
    HandshakeRequest,
    HandshakeResponse,
    NotifyMessage,
    ProxyRegistration,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
)
from moriio_native.control.ports import rank_port
from moriio_native.control.security import ControlSecurity
from moriio_native.engine import DrainedTransfer, Engine, LayerRegistration, available_backends
from moriio_native.errors import (
    AlreadyExistsError,
    BackendUnavailableError,
    FailedPreconditionError,
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    TransportError,
)
from moriio_native.vllm.config import ConnectorConfig
from moriio_native.vllm.metadata import MoRIIONativeMetadata, RecvTask, SaveTask, SendTask
from moriio_native.vllm.specs import cache_specs, first_split_across_tp
from moriio_native.vllm.stats import MoRIIONativeStats
from moriio_native.vllm.tp import expected_releases, read_source, release_targets, releases

logger = logging.getLogger("moriio_native.vllm.worker")

_WAIT_SLICE_S = 0.1
# A quarantined WRITE's prefill is re-handshaken this often: failing, it is dead (nothing of it
# can write any more) and the blocks are freed.
_PROBE_WRITER_EVERY_S = 5.0
_MAX_EARLY_MESSAGES = 65536
# Releases one decode rank sends to unread prefill ranks when no handshake confirmed the
# prefill's TP size (the request's number could name thousands of ranks).
_MAX_UNCONFIRMED_RELEASES = 16
_WRITER_QUEUE = 65536
_RETRY_HANDSHAKE_AFTER_S = 5.0


# ("write", job, layer, CUDA event or None) or ("seal", job, "", number of writes queued).
_WriterOp = tuple[str, "_WriteJob", str, Any]


@dataclass
class _Peer:
    """A handshaken peer rank."""

    engine_peer: str  # the native engine id, for Engine.read / write_layer
    host: str
    notify_port: int
    response: HandshakeResponse


@dataclass
class _Read:
    task: RecvTask
    started: float
    peer: _Peer | None = None
    state: str | None = None  # terminal state once known (for a quarantined read: drained)
    message: str = ""
    quarantined: float | None = None  # when the engine reported it ended undrained


@dataclass
class _Await:
    """Decode WRITE: waiting for the prefill's writes."""

    task: RecvTask
    deadline: float
    peer: _Peer | None = None  # the prefill rank, once the announcement reached it
    # Set when we gave up: the blocks stay allocated (quarantined) until the prefill says its
    # writes drained (write_aborted / write_done / write_failed), dies, or the bound passes.
    quarantined: float | None = None
    next_probe: float = 0.0
    probing: bool = False


@dataclass
class _Releases:
    """The decode ranks that released one transfer on this prefill rank so far."""

    consumer_tp_size: int = 0  # the decode's TP size, from its first release (0: none yet)
    ranks: set[int] = field(default_factory=set)


@dataclass
class _Send:
    """Prefill READ: blocks held for the decode's releases (one per decode rank that pairs with
    this rank, see moriio_native.vllm.tp)."""

    task: SendTask
    deadline: float
    released: _Releases = field(default_factory=_Releases)


@dataclass
class _EarlyRelease:
    """Releases that arrived before the scheduler handed us the request."""

    seen: float
    released: _Releases = field(default_factory=_Releases)


@dataclass
class _WriteJob:
    """Prefill WRITE: one request's push to one decode rank."""

    transfer_id: str
    created: float
    save: SaveTask | None = None
    remote: RemoteBlocks | None = None
    peer: _Peer | None = None
    connecting: bool = False
    pending: list[tuple[str, Any]] = field(default_factory=list)  # (layer, cuda event | None)
    seen: set[str] = field(default_factory=set)
    submitted: int = 0
    forward_done: bool = False
    sealed: bool = False
    # (local, remote) block ids, fixed once the decode said what it lacks; int64 arrays, so the
    # write of every layer passes them as they are instead of converting a list per layer.
    block_ids: tuple[np.ndarray, np.ndarray] | None = None
    send: SendTask | None = None
    deadline: float = 0.0
    failed: str | None = None
    released: bool = False  # the decode said it needs nothing (release)
    abort_requested: AbortWrite | None = None  # the decode gave up: answer once drained
    undrained: str | None = None  # ended (reason) with writes in flight: waiting for the drain
    terminal: bool = False


def _memory_kind(tensor: Any) -> tuple[str, int]:
    device = tensor.device
    if device.type == "cpu":
        return "host", -1
    import torch

    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return kind, device.index if device.index is not None else torch.cuda.current_device()


def choose_backend(name: str, options: Mapping[str, str]) -> str:
    """The backend to use: ``name``, or for ``auto`` the first available of mori, ucx."""
    if name != "auto":
        return name
    infos = {info.name: info for info in available_backends(options)}
    for candidate in ("mori", "ucx"):
        info = infos.get(candidate)
        if info is not None and info.available:
            return candidate
    reasons = "; ".join(f"{n}: {i.reason}" for n, i in infos.items() if not i.available)
    raise BackendUnavailableError(f"no transfer backend available for backend=auto ({reasons})")


class WorkerSide:
    """Transfers of one vLLM worker. Thread-safe (one lock); vLLM calls the hooks from its
    model-runner thread, the control and engine threads feed completions in."""

    def __init__(
        self,
        config: ConnectorConfig,
        specs: Mapping[str, Any],
        *,
        dp_rank: int = 0,
        tp_rank: int = 0,
        context_parallel: bool = False,
    ) -> None:
        self.cfg = config
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank
        # Context parallelism splits every cache by token across ranks: no rank holds a layer
        # whole, so only equal TP sizes pair.
        self._context_parallel = context_parallel
        self.engine_id = f"{config.engine_id}/dp{dp_rank}/tp{tp_rank}"
        self._specs = dict(specs)
        self._security = ControlSecurity.from_config(config.control_config())
        self._sender = NotifySender(self._security)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._engine: Engine | None = None
        self._layers: list[str] = []
        self._server: HandshakeServer | None = None
        self._listener: NotifyListener | None = None
        self._pinger: ProxyPinger | None = None
        self._threads: list[threading.Thread] = []
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="moriio-native-handshake")
        self._writer_q: queue.Queue[_WriterOp] = queue.Queue(_WRITER_QUEUE)
        self._writer_staged: list[_WriterOp] = []  # guarded by _lock, fed by _feed_writer
        # Serialises feeding so staged ops enter the queue in order; the writer never takes it.
        self._writer_feed = threading.Lock()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._failed_peers: dict[tuple[str, int], tuple[float, MoriioError]] = {}
        # decode side
        self._reads: dict[str, _Read] = {}
        # Transfers whose drain notice overtook their undrained terminal event (the two come
        # from separate queues): the event, when it arrives, is then taken as drained.
        self._drained_early: set[str] = set()
        self._step_reads: list[str] = []
        self._awaiting: dict[str, _Await] = {}
        self._invalid_blocks: set[int] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # prefill side
        self._sends: dict[str, _Send] = {}
        self._jobs: dict[str, _WriteJob] = {}
        self._step_jobs: list[_WriteJob] = []
        self._early_releases: OrderedDict[str, _EarlyRelease] = OrderedDict()
        self._done_sending: set[str] = set()
        self._stats = MoRIIONativeStats()
        self._gpu = False
        self._pending_recv: list[RecvTask] = []

    # ---- setup --------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise FailedPreconditionError("KV caches are not registered yet")
        return self._engine

    @property
    def layers(self) -> list[str]:
        return list(self._layers)

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Register every transferable layer with the engine (layers viewing one backing share
        one memory region) and open this rank's control endpoints. Raises on any bad layer
        before anything is registered."""
        if self._engine is not None:
            raise FailedPreconditionError("register_kv_caches was called twice")
        names = [n for n in kv_caches if n in self._specs]
        skipped = [n for n in kv_caches if n not in self._specs]
        if skipped:
            logger.info(
                "not transferring %d layer(s) outside transfer groups: %s",
                len(skipped),
                skipped[:4],
            )
        if not names:
            raise InvalidArgumentError(
                "register_kv_caches: no layer belongs to a KV-transfer group"
            )
        specs = cache_specs(self._specs, names, {name: kv_caches[name].dim() for name in names})
        regs = []
        for name in names:
            tensor = kv_caches[name]
            storage = tensor.untyped_storage()
            memory, device = _memory_kind(tensor)
            regs.append(
                LayerRegistration(
                    name=name,
                    tensor=tensor,
                    spec=specs[name],
                    allocation=(storage.data_ptr(), storage.nbytes()),
                    memory=memory,  # type: ignore[arg-type]
                    device=device,
                )
            )
        backend = choose_backend(self.cfg.backend, self.cfg.engine_options)
        engine = Engine(
            self.engine_id,
            backend,
            options=self.cfg.engine_options,
            transfer_timeout=self.cfg.transfer_timeout,
        )
        engine.register_kv_caches(regs)
        self._engine = engine
        self._layers = names
        self._gpu = any(r.memory != "host" for r in regs)
        ports = self.cfg.ports
        self._server = HandshakeServer(
            ports.handshake_port(self.dp_rank, self.tp_rank),
            self._handshake_response,
            self._security,
            bind_host=self.cfg.bind_host,
        )
        self._listener = NotifyListener(
            ports.notify_port(self.dp_rank, self.tp_rank),
            self._security,
            bind_host=self.cfg.bind_host,
        )
        for target, name in (
            (self._notify_loop, "notify"),
            (self._events_loop, "events"),
            (self._writer_loop, "writer"),
        ):
            thread = threading.Thread(target=target, name=f"moriio-native-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.cfg.proxy_ip is not None and self.dp_rank == 0 and self.tp_rank == 0:
            role = "D" if self.cfg.role == "kv_consumer" else "P"
            assert self.cfg.http_port is not None
            registration = ProxyRegistration(
                role=role,
                http_address=f"{self.cfg.host_ip}:{self.cfg.http_port}",
                zmq_address=ZmqAddress(
                    self.cfg.host_ip, self.cfg.handshake_port, self.cfg.notify_port
                ),
                dp_size=self.cfg.dp_size,
                tp_size=self.cfg.tp_size,
                transfer_mode=self.cfg.transfer_mode,
            )
            self._pinger = ProxyPinger(
                self.cfg.proxy_ip,
                self.cfg.proxy_ping_port,
                registration,
                interval=self.cfg.ping_interval,
            ).start()
        logger.info(
            "engine %s (%s, %s mode) registered %d layers; handshake port %d, notify port %d",
            self.engine_id,
            backend,
            self.cfg.mode,
            len(names),
            self._server.port,
            self._listener.port,
        )

    def _handshake_response(self, request: HandshakeRequest) -> HandshakeResponse:
        return HandshakeResponse(
            engine_id=self.engine_id,
            engine_metadata=self.engine.local_metadata(),
            dp_rank=self.dp_rank,
            tp_rank=self.tp_rank,
            dp_size=self.cfg.dp_size,
            tp_size=self.cfg.tp_size,
            transfer_mode=self.cfg.transfer_mode,
        )

    def _check_tp_mismatch_allowed(self, host: str, remote_tp_size: int) -> None:
        """Different TP sizes work only where any peer rank holds what we need: READ mode over
        caches every rank holds whole (MLA). Raises FailedPreconditionError otherwise."""
        mismatch = f"peer {host}: TP size {remote_tp_size} differs from ours ({self.cfg.tp_size})"
        if self.cfg.mode != "read":
            raise FailedPreconditionError(
                f"{mismatch}; different TP sizes are supported in READ mode only"
            )
        if self._context_parallel:
            raise FailedPreconditionError(
                f"{mismatch}, and context parallelism splits the caches by token across ranks"
            )
        split = first_split_across_tp(self._specs)
        if split is not None:
            raise FailedPreconditionError(
                f"{mismatch}, and layer {split} is split across TP ranks (attention heads); "
                "different TP sizes need caches every rank holds whole (MLA)"
            )

    def _connect(
        self,
        address: ZmqAddress,
        remote_dp_rank: int,
        remote_tp_size: int,
        expect_engine: str | None,
    ) -> _Peer:
        """The peer rank that pairs with ours at ``address`` (handshake once, then cached).
        Blocks up to ``transfer_timeout``; raises on a refused, unreachable or incompatible
        peer. The notify target is derived from the handshaken host, never from a message."""
        tp_size = remote_tp_size or self.cfg.tp_size
        if tp_size != self.cfg.tp_size:
            self._check_tp_mismatch_allowed(address.host, tp_size)
        remote_rank = read_source(self.tp_rank, tp_size)
        host = validate_host(address.host)
        hs_port = rank_port(address.handshake_port, remote_dp_rank, remote_rank, tp_size)
        key = (host, hs_port)
        with self._lock:
            cached = self._peers.get(key)
            failed = self._failed_peers.get(key)
        if cached is not None:
            self._check_engine(cached, expect_engine)
            return cached
        if failed is not None and time.monotonic() < failed[0]:
            # A peer that just failed its handshake fails fast for a moment instead of
            # stalling every request's step for transfer_timeout again.
            raise failed[1]
        try:
            response = fetch_metadata(
                host,
                hs_port,
                timeout=self.cfg.transfer_timeout,
                security=self._security,
                requester_engine_id=self.engine_id,
            )
        except MoriioError as exc:
            with self._lock:
                self._failed_peers[key] = (time.monotonic() + _RETRY_HANDSHAKE_AFTER_S, exc)
            raise
        if response.transfer_mode != self.cfg.transfer_mode:
            raise IncompatiblePeerError(
                f"peer {response.engine_id} at {host}:{hs_port} runs {response.transfer_mode} "
                f"mode, we run {self.cfg.transfer_mode}; set the same 'mode' on both instances"
            )
        if (response.dp_rank, response.tp_rank, response.tp_size) != (
            remote_dp_rank,
            remote_rank,
            tp_size,
        ):
            raise IncompatiblePeerError(
                f"peer at {host}:{hs_port} is dp{response.dp_rank}/tp{response.tp_rank} of "
                f"{response.tp_size}, expected dp{remote_dp_rank}/tp{remote_rank} of {tp_size} "
                "(do both sides use the same handshake base port?)"
            )
        peer_id = self._add_engine_peer(response)
        peer = _Peer(
            engine_peer=peer_id,
            host=host,
            notify_port=rank_port(address.notify_port, remote_dp_rank, remote_rank, tp_size),
            response=response,
        )
        self._check_engine(peer, expect_engine)
        with self._lock:
            self._peers[key] = peer
            self._stats.record_handshake()
        logger.info("handshake with %s at %s:%d done", response.engine_id, host, hs_port)
        return peer

    def _add_engine_peer(self, response: HandshakeResponse) -> str:
        """Connect the engine to the handshaken peer. The same engine id with other metadata is
        that peer restarted under the same address (the handshake proved who answers): the old
        connection is dropped, which ends whatever still used it, and the new one replaces it."""
        try:
            return self.engine.add_peer(response.engine_metadata)
        except AlreadyExistsError as exc:
            stale = response.engine_id
            if f"peer '{stale}'" not in str(exc):
                raise  # the metadata names another engine than the handshake: not a restart
            logger.info("peer %s restarted with new metadata; reconnecting", stale)
            with self._lock:
                for key, value in list(self._peers.items()):
                    if value.engine_peer == stale:
                        del self._peers[key]
            self.engine.remove_peer(stale)
            return self.engine.add_peer(response.engine_metadata)

    @staticmethod
    def _check_engine(peer: _Peer, expect_engine: str | None) -> None:
        if expect_engine and not peer.response.engine_id.startswith(expect_engine + "/"):
            raise IncompatiblePeerError(
                f"the request names engine {expect_engine!r} but {peer.host} serves "
                f"{peer.response.engine_id!r}"
            )

    def _forget_peer(self, peer: _Peer | None) -> None:
        """Drop a cached handshake after a failure (the peer may have restarted)."""
        if peer is None:
            return
        with self._lock:
            for key, value in list(self._peers.items()):
                if value is peer:
                    del self._peers[key]

    # ---- per-step entry points ----------------------------------------------------------------

    def bind_metadata(self, meta: MoRIIONativeMetadata) -> None:
        """Take in one step's metadata (once per step). Prefill tasks take effect at once
        (saves happen during the forward); decode loads start in :meth:`start_load_kv`."""
        now = time.monotonic()
        with self._lock:
            self._step_jobs = []
            for save in meta.save:
                job = self._job(save.transfer_id, now)
                job.save = save
                self._step_jobs.append(job)
                self._advance(job)
            for send in meta.send:
                self._on_send_task(send, now)
            self._pending_recv.extend(meta.recv)
        self._feed_writer()

    def start_load_kv(self) -> None:
        with self._lock:
            tasks, self._pending_recv = self._pending_recv, []
        for task in tasks:
            if task.aborted:
                self._give_up_await(task.transfer_id, "the request was aborted")
            elif task.error:
                self._fail_unplanned(task)
            elif not task.notify_only and self.cfg.mode == "read":
                self._start_read(task)
            elif not task.notify_only:
                with self._lock:
                    self._awaiting[task.transfer_id] = _Await(
                        task, time.monotonic() + self.cfg.abort_timeout
                    )
                self._pool.submit(self._announce, task)
            else:
                self._pool.submit(self._release_only, task)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._finish_step_reads()

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        if not self._step_jobs or layer_name not in self._specs:
            return
        event = self._record_event(kv_layer)
        with self._lock:
            for job in self._step_jobs:
                if layer_name not in job.seen:
                    job.seen.add(layer_name)
                    job.pending.append((layer_name, event))
                    self._advance(job)
        self._feed_writer()

    def wait_for_save(self) -> None:
        """Queue every layer whose save hook did not run (after the whole forward) and seal."""
        if not self._step_jobs:
            return
        event = None
        if self._engine is not None and self._layers:
            event = self._record_event(None)
        with self._lock:
            for job in self._step_jobs:
                for name in self._layers:
                    if name not in job.seen:
                        job.seen.add(name)
                        job.pending.append((name, event))
                job.forward_done = True
                self._advance(job)
            self._step_jobs = []
        self._feed_writer()

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        self._finish_step_reads()
        self._check_timeouts(time.monotonic())
        with self._lock:
            out = (self._done_sending, self._done_recving, self._failed_recving)
            self._done_sending, self._done_recving, self._failed_recving = set(), set(), set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def get_stats(self) -> MoRIIONativeStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()

    # ---- decode side --------------------------------------------------------------------------

    def _start_read(self, task: RecvTask) -> None:
        read = _Read(task, time.monotonic())
        with self._lock:
            self._reads[task.transfer_id] = read
            self._step_reads.append(task.transfer_id)
        try:
            read.peer = self._connect(
                task.peer, task.remote_dp_rank, task.remote_tp_size, task.remote_engine_id
            )
            self.engine.read(
                task.transfer_id, read.peer.engine_peer, task.local_block_ids, task.remote_block_ids
            )
        except Exception as exc:  # any failure: recompute locally, free the prefill
            logger.error(
                "request %s (transfer %s): READ from %s not started: %s",
                task.req_id,
                task.transfer_id,
                task.peer.host,
                exc,
            )
            self._forget_peer(read.peer)
            self._finish_read(task.transfer_id, "failed", str(exc))

    def _fail_unplanned(self, task: RecvTask) -> None:
        """A load the scheduler could not plan: its blocks are recomputed, the prefill freed."""
        with self._lock:
            self._invalid_blocks.update(task.local_block_ids)
            if task.report_done:
                self._done_recving.add(task.req_id)
                self._failed_recving.add(task.req_id)
            self._stats.record(ok=False)
        self._pool.submit(self._release_only, task)

    def _finish_read(self, transfer_id: str, state: str, message: str, event: Any = None) -> None:
        """Record a READ's terminal state once: release the prefill, and on failure mark the
        blocks for recomputation."""
        with self._lock:
            read = self._reads.get(transfer_id)
            if read is None or read.state is not None:
                return
            read.state, read.message = state, message
            ok = state == "done"
            if ok and event is not None:
                self._stats.record_transfer(event)
            elif not ok:
                self._stats.record(ok=False)
                self._invalid_blocks.update(read.task.local_block_ids)
            self._cond.notify_all()
        if not ok:
            # The next request handshakes again: a prefill that restarted under the same
            # address is reached at its new transport address instead of failing forever.
            self._forget_peer(read.peer)
            logger.warning(
                "request %s (transfer %s): READ %s (%s); its %d blocks will be recomputed",
                read.task.req_id,
                transfer_id,
                state,
                message,
                len(read.task.local_block_ids),
            )
        self._send_release(read.task, read.peer)

    def _finish_step_reads(self) -> None:
        """Wait until every READ posted this step is terminal and drained: vLLM runs the forward
        over (or recomputes into) these blocks as soon as this returns, so a read the engine
        ended with operations in flight (quarantined) is waited for until the engine reports
        it drained. The engine ends every transfer within 2 x transfer_timeout; a quarantine
        longer than quarantine_timeout raises rather than let vLLM reuse blocks that may
        still be written."""
        with self._lock:
            if not self._step_reads:
                return
            ids, self._step_reads = self._step_reads, []
        for tid in ids:
            with self._lock:
                read = self._reads.get(tid)
                if read is None:
                    continue
                deadline = (
                    read.started + 2 * self.cfg.transfer_timeout + self.cfg.quarantine_timeout
                )
                while (
                    read.state is None and time.monotonic() < deadline and not self._stop.is_set()
                ):
                    self._cond.wait(_WAIT_SLICE_S)
                state = read.state
                self._reads.pop(tid, None)
            if state is None and not self._stop.is_set():
                raise TransportError(
                    f"request {read.task.req_id} (transfer {tid}): the READ into blocks "
                    f"{list(read.task.local_block_ids)} was not proven drained within "
                    f"quarantine_timeout ({self.cfg.quarantine_timeout:.0f}s); refusing to let "
                    "vLLM reuse blocks that may still be written"
                )

    def _send_release(self, task: RecvTask, peer: _Peer | None) -> None:
        """Tell the prefill it may free the request's blocks: the rank we read from (at its
        handshaken address when we have one) and the unread ranks assigned to us when its TP
        size is larger than ours (moriio_native.vllm.tp)."""
        if peer is not None:  # the TP size the prefill confirmed in the handshake
            tp_size, host = peer.response.tp_size, peer.host
        else:  # what the request said: bounded, since nothing confirmed it
            tp_size, host = task.remote_tp_size or self.cfg.tp_size, task.peer.host
        targets = release_targets(self.tp_rank, self.cfg.tp_size, tp_size)
        if peer is None and len(targets) > _MAX_UNCONFIRMED_RELEASES:
            logger.warning(
                "request %s (transfer %s): the request names a prefill TP size of %d, which no "
                "handshake confirmed; releasing only prefill rank %d",
                task.req_id,
                task.transfer_id,
                tp_size,
                targets[0],
            )
            targets = targets[:1]
        release = Release(
            task.transfer_id, consumer_tp_size=self.cfg.tp_size, consumer_tp_rank=self.tp_rank
        )
        for i, rank in enumerate(targets):
            try:
                if i == 0 and peer is not None:
                    port = peer.notify_port
                else:
                    port = rank_port(task.peer.notify_port, task.remote_dp_rank, rank, tp_size)
                self._sender.send(host, port, release)
            except MoriioError as exc:
                logger.warning(
                    "request %s (transfer %s): release to prefill rank %d not sent (%s); it "
                    "frees its blocks after its abort_timeout",
                    task.req_id,
                    task.transfer_id,
                    rank,
                    exc,
                )

    def _release_only(self, task: RecvTask) -> None:
        self._send_release(task, None)

    def _announce(self, task: RecvTask) -> None:
        """Decode WRITE: handshake the prefill rank, then tell it where to write."""
        peer = None
        try:
            peer = self._connect(
                task.peer, task.remote_dp_rank, task.remote_tp_size, task.remote_engine_id
            )
            with self._lock:
                waiting = self._awaiting.get(task.transfer_id)
                if waiting is None or waiting.quarantined is not None:
                    return  # given up before the prefill had our blocks (and released)
                waiting.peer = peer  # from now on the prefill may write into the blocks
            self._sender.send(
                peer.host,
                peer.notify_port,
                RemoteBlocks(
                    transfer_id=task.transfer_id,
                    block_ids=(task.local_block_ids,),
                    decode_engine_id=self.engine_id,
                    decode_dp_rank=self.dp_rank,
                    req_id=task.req_id,
                ),
            )
        except Exception as exc:
            logger.error(
                "request %s (transfer %s): cannot announce blocks to %s: %s; computing locally",
                task.req_id,
                task.transfer_id,
                task.peer.host,
                exc,
            )
            self._forget_peer(peer)
            self._finish_await(task.transfer_id, ok=False)
            # The prefill holds the blocks for our remote_blocks, which will not come.
            self._send_release(task, peer)

    def _finish_await(self, transfer_id: str, ok: bool) -> None:
        with self._lock:
            waiting = self._awaiting.pop(transfer_id, None)
            if waiting is None:
                return
            self._done_recving.add(waiting.task.req_id)
            if not ok:
                # Both signals: failed_recving (request level) and the blocks (for callers of
                # get_finished, which has no failure channel) -- vLLM recomputes either way.
                self._failed_recving.add(waiting.task.req_id)
                self._invalid_blocks.update(waiting.task.local_block_ids)
                self._stats.record(ok=False)
        if self._listener is not None:
            self._listener.mark_terminal(transfer_id)

    # ---- prefill side -------------------------------------------------------------------------

    def _job(self, transfer_id: str, now: float) -> _WriteJob:
        job = self._jobs.get(transfer_id)
        if job is None:
            job = self._jobs[transfer_id] = _WriteJob(transfer_id, created=now)
        return job

    def _record_release(self, released: _Releases, release: Release) -> None:
        """Counts ``release`` in ``released`` when it can be one of the releases this rank waits
        for: the decode TP size of the first release, from a decode rank that reads this rank
        or was assigned to release it (moriio_native.vllm.tp). Others are logged and ignored,
        so no message can free blocks a decode rank may still be reading."""
        size, rank = release.consumer_tp_size, release.consumer_tp_rank
        released.consumer_tp_size = released.consumer_tp_size or size
        expected_size = released.consumer_tp_size
        if size != expected_size or not releases(rank, size, self.tp_rank, self.cfg.tp_size):
            logger.warning(
                "transfer %s: ignoring a release from decode rank %d of %d (expected releases "
                "from the decode ranks of %d that pair with prefill rank %d of %d)",
                release.transfer_id,
                rank,
                size,
                expected_size,
                self.tp_rank,
                self.cfg.tp_size,
            )
            return
        released.ranks.add(rank)

    def _fully_released(self, released: _Releases) -> bool:
        """Whether every decode rank that pairs with this rank has released."""
        if not released.consumer_tp_size:
            return False
        readers = expected_releases(self.tp_rank, self.cfg.tp_size, released.consumer_tp_size)
        return len(released.ranks) >= readers

    def _on_send_task(self, send: SendTask, now: float) -> None:
        """The scheduler finished the request and holds its blocks for us (lock held)."""
        tid = send.transfer_id
        deadline = now + self.cfg.abort_timeout
        if self.cfg.mode == "read":
            early = self._early_releases.pop(tid, None)
            held = _Send(send, deadline, early.released if early is not None else _Releases())
            if send.aborted or self._fully_released(held.released):
                self._done_sending.add(send.req_id)
                return
            self._sends[tid] = held
            return
        job = self._job(tid, now)
        job.send, job.deadline = send, deadline
        early = self._early_releases.pop(tid, None)
        if job.terminal:
            self._done_sending.add(send.req_id)
            self._jobs.pop(tid, None)
        elif send.aborted:
            self._fail_job(job, "the request was aborted")
        elif early is not None and early.released.ranks:
            # The decode gave up before we had the request (its release came first).
            job.released = True
            self._fail_job(job, "the decode released the transfer")

    def _record_event(self, tensor: Any) -> Any:
        """A CUDA event after the work queued so far on the current stream, when the caches are
        on a GPU; None on CPU (the forward already ran synchronously)."""
        on_gpu = self._gpu if tensor is None else bool(getattr(tensor, "is_cuda", False))
        if not on_gpu:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def _advance(self, job: _WriteJob) -> None:
        """Move a WRITE job as far as its inputs allow (lock held). Writes and the seal are
        staged for the writer thread, in order; the caller feeds them to it after releasing
        the lock (:meth:`_feed_writer`)."""
        if job.terminal or job.failed is not None:
            return
        if job.remote is None or job.save is None:
            return
        if job.peer is None:
            if not job.connecting:
                if job.save.peer is None:
                    self._fail_job(job, "the request names no decode address")
                    return
                job.connecting = True
                self._pool.submit(self._connect_job, job)
            return
        if job.block_ids is None:
            groups = job.remote.block_ids
            wanted = groups[0] if len(groups) == 1 else None
            have = job.save.block_ids
            if wanted is None or len(wanted) > len(have) or not wanted:
                self._fail_job(
                    job,
                    f"decode asked for {len(groups)} group(s) / "
                    f"{sum(len(g) for g in groups)} blocks, the prompt has {len(have)}",
                )
                return
            # The decode announces the tail of the prompt it lacks: align it to our tail.
            job.block_ids = (
                np.asarray(have[len(have) - len(wanted) :], dtype=np.int64),
                np.asarray(wanted, dtype=np.int64),
            )
        for layer, event in job.pending:
            self._writer_staged.append(("write", job, layer, event))
            job.submitted += 1
        job.pending = []
        if job.forward_done and not job.sealed:
            job.sealed = True
            self._writer_staged.append(("seal", job, "", job.submitted))

    def _feed_writer(self) -> None:
        """Move staged writer work into the bounded writer queue, waiting for room when it is
        full (backpressure). Must be called without ``_lock`` held: the writer thread takes it
        after each get, so it could never make room for a producer that held it."""
        with self._writer_feed:
            with self._lock:
                ops, self._writer_staged = self._writer_staged, []
            for op in ops:
                while not self._stop.is_set():
                    try:
                        self._writer_q.put(op, timeout=_WAIT_SLICE_S)
                        break
                    except queue.Full:
                        continue

    def _connect_job(self, job: _WriteJob) -> None:
        assert job.save is not None and job.save.peer is not None and job.remote is not None
        peer = None
        try:
            peer = self._connect(
                job.save.peer, job.remote.decode_dp_rank, job.save.remote_tp_size, None
            )
            if peer.response.engine_id != job.remote.decode_engine_id:
                raise IncompatiblePeerError(
                    f"remote_blocks came from engine {job.remote.decode_engine_id!r}, but the "
                    f"decode address of the request serves {peer.response.engine_id!r}"
                )
        except Exception as exc:
            logger.error("transfer %s: cannot reach the decode rank: %s", job.transfer_id, exc)
            self._forget_peer(peer)
            with self._lock:
                job.peer = peer if isinstance(exc, IncompatiblePeerError) else None
                self._fail_job(job, str(exc))
            return
        with self._lock:
            job.peer = peer
            self._advance(job)
        self._feed_writer()

    def _fail_job(self, job: _WriteJob, reason: str) -> None:
        """End a WRITE job as failed (lock held). With writes in flight the engine is aborted
        and its terminal event finishes the job; otherwise it finishes now."""
        if job.terminal or job.failed is not None:
            return
        job.failed = reason
        logger.warning("transfer %s: WRITE failed: %s", job.transfer_id, reason)
        if job.undrained is not None:
            return  # the engine ended it with writes in flight: only their drain completes it
        if job.submitted or job.sealed:
            try:
                self.engine.abort(job.transfer_id)
                return  # the aborted event completes the job
            except MoriioError:
                pass
        self._complete_job(job, ok=False, reason=reason)

    def _complete_job(
        self, job: _WriteJob, *, ok: bool, reason: str = "", event: Any = None
    ) -> None:
        """Terminal WRITE job (lock held): one write_done/write_failed to the decode, then the
        blocks are reported as sent once the scheduler finished the request."""
        if job.terminal:
            return
        job.terminal = True
        if ok and event is not None:
            self._stats.record_transfer(event)
        elif not ok and not job.released:
            self._stats.record(ok=False)
        if job.abort_requested is not None:
            self._send_write_aborted(job)
        elif job.peer is not None and not job.released:
            message: NotifyMessage = (
                WriteDone(job.transfer_id, writer_rank=self.tp_rank, num_writers=1)
                if ok
                else WriteFailed(
                    job.transfer_id, writer_rank=self.tp_rank, reason=reason[:1000] or "failed"
                )
            )
            try:
                self._sender.send(job.peer.host, job.peer.notify_port, message)
            except MoriioError as exc:
                logger.warning("transfer %s: %s not sent: %s", job.transfer_id, message.TYPE, exc)
        if self._listener is not None:
            self._listener.mark_terminal(job.transfer_id)
        if job.send is not None:
            self._done_sending.add(job.send.req_id)
            self._jobs.pop(job.transfer_id, None)

    def _writer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                op, job, layer, arg = self._writer_q.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                continue
            with self._lock:
                if job.failed is not None or job.terminal:
                    continue
            try:
                if op == "write" and arg is not None:
                    arg.synchronize()  # the layer's CUDA event: its KV is computed
                # Posted under the lock (never blocks on the transfer): a job failed meanwhile
                # (an abort_write already acknowledged) must not start writing after all.
                with self._lock:
                    if job.failed is not None or job.terminal:
                        continue
                    peer = job.peer
                    assert peer is not None and job.block_ids is not None
                    if op == "write":
                        local_ids, remote_ids = job.block_ids
                        self.engine.write_layer(
                            job.transfer_id, layer, peer.engine_peer, local_ids, remote_ids
                        )
                    else:
                        # The seal carries the number of layers queued for the job, so it
                        # cannot end the transfer before every one of them was written.
                        self.engine.seal(job.transfer_id, peer.engine_peer, expected_writes=arg)
            except Exception as exc:
                with self._lock:
                    self._fail_job(job, f"{op} {layer}: {exc}".strip())

    # ---- background threads -------------------------------------------------------------------

    def _notify_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            message = listener.get(_WAIT_SLICE_S)
            if message is None:
                continue
            try:
                self._on_message(message)
            except Exception:  # one message must never stop the thread
                logger.exception("error handling %s", message)
            self._feed_writer()

    def _on_message(self, message: NotifyMessage) -> None:
        tid = message.transfer_id
        now = time.monotonic()
        if isinstance(message, (WriteDone, WriteFailed, WriteAborted)):
            if not self.cfg.is_consumer:
                logger.warning(
                    "ignoring %s for transfer %s: this instance is not a consumer",
                    message.TYPE,
                    tid,
                )
                return
            # The prefill sends each of these only once none of its writes can land any more,
            # so they also end a quarantine.
            if isinstance(message, WriteFailed):
                logger.warning("transfer %s: the prefill failed to write: %s", tid, message.reason)
            self._finish_await(tid, ok=isinstance(message, WriteDone))
            return
        if not self.cfg.is_producer:
            logger.warning(
                "ignoring %s for transfer %s: this instance is not a producer", message.TYPE, tid
            )
            return
        with self._lock:
            if isinstance(message, AbortWrite):
                self._on_abort_write(message, now)
                return
            if isinstance(message, Release):
                send = self._sends.get(tid)
                job = self._jobs.get(tid)
                if send is not None:
                    self._record_release(send.released, message)
                    if not self._fully_released(send.released):
                        return  # other decode ranks read this rank's blocks too
                    del self._sends[tid]
                    self._done_sending.add(send.task.req_id)
                elif job is not None:
                    job.released = True
                    self._fail_job(job, "the decode released the transfer")
                else:
                    early = self._early_releases.setdefault(tid, _EarlyRelease(now))
                    self._record_release(early.released, message)
                    while len(self._early_releases) > _MAX_EARLY_MESSAGES:
                        self._early_releases.popitem(last=False)
                    return
                if self._listener is not None:
                    self._listener.mark_terminal(tid)
                return
            assert isinstance(message, RemoteBlocks)
            if self.cfg.mode != "write":
                logger.warning(
                    "ignoring remote_blocks for transfer %s: this instance runs READ mode", tid
                )
                return
            job = self._job(tid, now)
            if job.remote is not None:
                return
            job.remote = message
            if not any(message.block_ids):
                job.released = True
                self._fail_job(job, "the decode needs no blocks")
                return
            self._advance(job)

    def _on_abort_write(self, message: AbortWrite, now: float) -> None:
        """Prefill (lock held): the decode gave up on a WRITE and holds its blocks quarantined.
        Stop the transfer; once none of its writes can land, answer write_aborted."""
        if self.cfg.mode != "write":
            logger.warning(
                "ignoring abort_write for transfer %s: this instance runs READ mode",
                message.transfer_id,
            )
            return
        job = self._job(message.transfer_id, now)
        job.abort_requested = message
        if job.terminal:
            self._send_write_aborted(job)  # it ended drained already
            return
        self._fail_job(job, "the decode aborted the transfer")

    def _send_write_aborted(self, job: _WriteJob) -> None:
        """The ack of abort_write (lock held; nothing of the job writes any more), to the decode
        rank handshaken for this job, or else one handshaken now in the background."""
        request = job.abort_requested
        assert request is not None
        peer = job.peer
        if peer is None:
            peer = next(
                (
                    p
                    for p in self._peers.values()
                    if p.response.engine_id == request.decode_engine_id
                ),
                None,
            )
        if peer is None:
            self._pool.submit(self._connect_and_ack, request)
            return
        self._ack_abort(peer, request.transfer_id)

    def _connect_and_ack(self, request: AbortWrite) -> None:
        """Handshake the decode rank that asked (allowlist checked, engine id verified) and ack."""
        try:
            peer = self._connect(
                request.decode_address, request.decode_dp_rank, self.cfg.tp_size, None
            )
            if peer.response.engine_id != request.decode_engine_id:
                raise IncompatiblePeerError(
                    f"abort_write came from engine {request.decode_engine_id!r}, but its address "
                    f"serves {peer.response.engine_id!r}"
                )
        except Exception as exc:
            logger.warning(
                "transfer %s: cannot acknowledge the decode's abort (%s); it frees the blocks "
                "after its quarantine_timeout",
                request.transfer_id,
                exc,
            )
            return
        self._ack_abort(peer, request.transfer_id)

    def _ack_abort(self, peer: _Peer, transfer_id: str) -> None:
        try:
            self._sender.send(
                peer.host, peer.notify_port, WriteAborted(transfer_id, writer_rank=self.tp_rank)
            )
        except MoriioError as exc:
            logger.warning("transfer %s: write_aborted not sent: %s", transfer_id, exc)

    def _events_loop(self) -> None:
        last_check = time.monotonic()
        while not self._stop.is_set():
            try:
                events = self.engine.poll_events(timeout=_WAIT_SLICE_S)
                drained = self.engine.poll_drained()
            except Exception:
                logger.exception("poll_events failed")
                time.sleep(_WAIT_SLICE_S)
                continue
            for item in (*events, *drained):
                try:
                    if isinstance(item, DrainedTransfer):
                        self._on_drained(item)
                    else:
                        self._on_event(item)
                except Exception:
                    logger.exception("error handling %s", item)
            now = time.monotonic()
            if now - last_check >= 0.5:
                last_check = now
                self._check_timeouts(now)

    def _on_event(self, event: Any) -> None:
        tid = event.transfer_id
        ok = event.state == "done"
        with self._lock:
            drained = event.drained or tid in self._drained_early
            self._drained_early.discard(tid)
            read = self._reads.get(tid)
            if read is None:
                job = self._jobs.get(tid)
                if job is None or job.terminal:
                    return
                reason = job.failed or f"{event.state}: {event.message}"
                if not drained:
                    # Writes may still land in the decode's blocks (and read ours): nothing is
                    # reported, nothing freed, until the engine says they drained.
                    job.undrained = reason
                    logger.warning(
                        "transfer %s: WRITE ended with writes in flight (%s); holding it until "
                        "they drain",
                        tid,
                        event.message,
                    )
                    return
                self._complete_job(job, ok=ok and job.failed is None, reason=reason, event=event)
                return
            if not drained:
                read.quarantined = time.monotonic()
                self._stats.record_quarantine(len(read.task.local_block_ids))
                peer = read.peer
        if not drained:
            self._quarantine_read(read, peer, event)
            return
        self._finish_read(tid, event.state, event.message, event)

    def _quarantine_read(self, read: _Read, peer: _Peer | None, event: Any) -> None:
        """A READ ended with operations in flight: its blocks stay unreported (vLLM keeps them
        and waits in wait_for_layer_load) until the engine reports the drain. Dropping the
        peer closes the endpoint those operations use, which cancels them."""
        logger.warning(
            "request %s (transfer %s): READ %s with operations in flight (%s); its %d blocks "
            "are quarantined until they drain",
            read.task.req_id,
            read.task.transfer_id,
            event.state,
            event.message,
            len(read.task.local_block_ids),
        )
        if peer is not None:
            self._forget_peer(peer)
            with contextlib.suppress(MoriioError):
                self.engine.remove_peer(peer.engine_peer)

    def _on_drained(self, drained: DrainedTransfer) -> None:
        """A quarantined transfer's operations all completed: nothing of it writes any more."""
        tid = drained.transfer_id
        with self._lock:
            read = self._reads.get(tid)
            job = self._jobs.get(tid)
            if read is None and job is not None and job.undrained is not None:
                self._complete_job(job, ok=False, reason=job.undrained)
                return
            if read is None and job is None:
                return
            if read is None or read.quarantined is None:
                self._drained_early.add(tid)  # its undrained event is still queued
                return
        self._finish_read(
            tid, "timed_out", f"operations drained {drained.seconds:.3g}s after the start"
        )

    def _give_up_await(self, transfer_id: str, why: str) -> None:
        """Decode WRITE: stop waiting for the prefill's writes. Blocks the prefill was told
        about are quarantined (abort_write) until it confirms; others are recomputed now."""
        now = time.monotonic()
        with self._lock:
            waiting = self._awaiting.get(transfer_id)
            if waiting is None or waiting.quarantined is not None:
                return
            announced = self._quarantine_await(waiting, now)
        if announced:
            self._abort_write(waiting, why)
        else:
            self._finish_await(transfer_id, ok=False)
            self._send_release(waiting.task, None)

    def _quarantine_await(self, waiting: _Await, now: float) -> bool:
        """Quarantine an await whose blocks the prefill may be writing (lock held); False when
        it never had them (the announcement did not reach it), so nothing can write them."""
        if waiting.peer is None:
            waiting.quarantined = now  # stops a late announcement; freed by the caller
            return False
        waiting.quarantined = now
        waiting.next_probe = now + _PROBE_WRITER_EVERY_S
        self._stats.record_quarantine(len(waiting.task.local_block_ids))
        return True

    def _check_timeouts(self, now: float) -> None:
        expired_awaits: list[_Await] = []
        to_quarantine: list[_Await] = []
        with self._lock:
            for waiting in list(self._awaiting.values()):
                if waiting.quarantined is not None:
                    self._check_quarantine(waiting, now)
                elif now > waiting.deadline and self._quarantine_await(waiting, now):
                    to_quarantine.append(waiting)  # the prefill may be writing our blocks
                elif now > waiting.deadline:
                    expired_awaits.append(waiting)  # never announced: nothing can write
            for tid, send in list(self._sends.items()):
                if now > send.deadline:
                    del self._sends[tid]
                    self._done_sending.add(send.task.req_id)
                    logger.warning(
                        "request %s (transfer %s): no release within abort_timeout (%.0fs); "
                        "freeing",
                        send.task.req_id,
                        tid,
                        self.cfg.abort_timeout,
                    )
            for tid, job in list(self._jobs.items()):
                if job.terminal and (job.send is not None or job.save is not None):
                    continue  # the scheduler still reports it (a send task frees it)
                if job.send is not None and now > job.deadline:
                    self._fail_job(
                        job, f"not finished within abort_timeout ({self.cfg.abort_timeout:.0f}s)"
                    )
                elif (
                    job.send is None
                    and job.save is None
                    and now > job.created + self.cfg.abort_timeout
                ):
                    del self._jobs[tid]  # remote_blocks for a request we never saw
            for key, (until, _exc) in list(self._failed_peers.items()):
                if now >= until:
                    del self._failed_peers[key]
            while self._early_releases:
                tid, early = next(iter(self._early_releases.items()))
                if now - early.seen <= self.cfg.abort_timeout:
                    break
                self._early_releases.popitem(last=False)
        for waiting in expired_awaits:
            logger.warning(
                "request %s (transfer %s): the prefill's KV did not arrive within abort_timeout "
                "(%.0fs); computing locally",
                waiting.task.req_id,
                waiting.task.transfer_id,
                self.cfg.abort_timeout,
            )
            self._finish_await(waiting.task.transfer_id, ok=False)
            self._send_release(waiting.task, None)
        for waiting in to_quarantine:
            self._abort_write(
                waiting,
                f"the KV did not arrive within abort_timeout ({self.cfg.abort_timeout:.0f}s)",
            )

    def _abort_write(self, waiting: _Await, why: str) -> None:
        """Decode WRITE: we gave up; ask the prefill to stop and acknowledge once drained."""
        task, peer = waiting.task, waiting.peer
        assert peer is not None
        logger.warning(
            "request %s (transfer %s): %s; its %d blocks are quarantined until the prefill "
            "confirms its writes stopped (at most quarantine_timeout, %.0fs)",
            task.req_id,
            task.transfer_id,
            why,
            len(task.local_block_ids),
            self.cfg.quarantine_timeout,
        )
        try:
            self._sender.send(
                peer.host,
                peer.notify_port,
                AbortWrite(
                    task.transfer_id,
                    self.engine_id,
                    decode_host=self.cfg.host_ip,
                    decode_handshake_port=self.cfg.handshake_port,
                    decode_notify_port=self.cfg.notify_port,
                    decode_dp_rank=self.dp_rank,
                ),
            )
        except MoriioError as exc:
            logger.warning("transfer %s: abort_write not sent: %s", task.transfer_id, exc)

    def _check_quarantine(self, waiting: _Await, now: float) -> None:
        """A quarantined decode WRITE (lock held): free it past the bound; otherwise check from
        time to time whether the prefill is still alive."""
        tid = waiting.task.transfer_id
        if waiting.peer is None or waiting.quarantined is None:
            return  # never announced: being freed by whoever quarantined it
        if now > waiting.quarantined + self.cfg.quarantine_timeout:
            logger.warning(
                "transfer %s: no drain confirmation from the prefill within quarantine_timeout "
                "(%.0fs); freeing its %d blocks",
                tid,
                self.cfg.quarantine_timeout,
                len(waiting.task.local_block_ids),
            )
            self._pool.submit(self._finish_await, tid, False)
        elif now >= waiting.next_probe and not waiting.probing:
            waiting.probing = True
            waiting.next_probe = now + _PROBE_WRITER_EVERY_S
            self._pool.submit(self._probe_writer, waiting)

    def _probe_writer(self, waiting: _Await) -> None:
        """Re-handshake a quarantined WRITE's prefill: an unreachable prefill, or one that came
        back as another engine instance, cannot write the blocks any more."""
        peer = waiting.peer
        assert peer is not None
        dead = ""
        try:
            response = fetch_metadata(
                peer.host,
                rank_port(
                    waiting.task.peer.handshake_port,
                    waiting.task.remote_dp_rank,
                    peer.response.tp_rank,
                    peer.response.tp_size,
                ),
                timeout=self.cfg.transfer_timeout,
                security=self._security,
                requester_engine_id=self.engine_id,
            )
            if response.engine_metadata != peer.response.engine_metadata:
                dead = f"it restarted as another engine ({response.engine_id})"
        except MoriioError as exc:
            dead = f"it is unreachable ({exc})"
        with self._lock:
            waiting.probing = False
        if dead:
            logger.warning(
                "transfer %s: the prefill %s died: %s; freeing the quarantined blocks",
                waiting.task.transfer_id,
                peer.response.engine_id,
                dead,
            )
            self._forget_peer(peer)
            self._finish_await(waiting.task.transfer_id, ok=False)

    # ---- teardown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the threads and close every socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for closer in (self._pinger, self._listener, self._server):
            if closer is not None:
                try:
                    closer.stop() if isinstance(closer, ProxyPinger) else closer.close()
                except Exception:
                    logger.exception("error closing %s", type(closer).__name__)
        self._sender.close()
        logger.info("engine %s shut down", self.engine_id)


__all__ = ["WorkerSide", "choose_backend"]
