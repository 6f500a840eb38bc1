"""The P/D protocol core of one engine rank: what the vLLM connector and the demo both run.

:class:`PdCore` owns this rank's control endpoints (handshake server, notify listener, notify
sender), the peer directory, the decode-side :class:`~moriio_native.pd.puller.Puller` and the
prefill-side :class:`~moriio_native.pd.pusher.Pusher`. It takes block ids, layer names and
peer addresses (:mod:`moriio_native.pd.tasks`) and reports, at each :meth:`take_reports`,
which requests finished sending / receiving, which loads failed and which blocks must be
recomputed. It imports no framework (no vLLM, no torch).

Threads (all named ``moriio-native-*``):

* ``notify``: control messages from peers (release, remote_blocks, write_done, ...);
* ``events``: engine terminal events and drain notices, and every 0.5 s the timeouts;
* ``writer``: WRITE pushes, in order (waits on each layer's device event first);
* ``verify`` (with ``verify`` on): block checksums computed and compared
  (:mod:`moriio_native.pd.verify`);
* ``confirm`` (with ``confirm_reads`` on and ``verify`` off, decode): each READ's hold check;
* ``handshake-N`` (4) and ``probe`` (1): the peer directory's executors.

Every machine changes under one lock (the context's), which is never held across a network
call or a blocking queue put. The caller's hooks (:meth:`begin_step`, :meth:`start_loads`, ...)
never wait on the network; only :meth:`wait_sync_reads` waits, and only in synchronous READ
mode.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from moriio_native.control.channel import (
    HandshakeServer,
    NotifyListener,
    NotifySender,
    RateLimitedWarnings,
)
from moriio_native.control.messages import (
    AbortWrite,
    ChecksumRequest,
    ChecksumResponse,
    HandshakeRequest,
    HandshakeResponse,
    Misaddressed,
    NotifyMessage,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
)
from moriio_native.control.security import ControlSecurity
from moriio_native.engine import DrainedTransfer, Engine
from moriio_native.errors import (
    FailedPreconditionError,
    IncompatiblePeerError,
    InvalidArgumentError,
)
from moriio_native.pd.config import PdConfig
from moriio_native.pd.context import Context, Reports, StatsSink
from moriio_native.pd.peers import PeerDirectory
from moriio_native.pd.puller import Puller
from moriio_native.pd.pusher import WRITER_QUEUE, Pusher
from moriio_native.pd.tasks import RecvTask, SaveTask, SendTask
from moriio_native.pd.verify import Checksummer, ReadConfirmer, Verifier

logger = logging.getLogger("moriio_native.pd.core")

WAIT_SLICE_S = 0.1
TIMEOUT_CHECK_EVERY_S = 0.5


class PdCore:
    """One rank's transfers. Thread-safe; see the module docstring for the threads."""

    def __init__(
        self,
        config: PdConfig,
        security: ControlSecurity,
        stats: StatsSink,
        *,
        engine: Callable[[], Engine],
        bind_host: str = "127.0.0.1",
        writer_queue: int = WRITER_QUEUE,
        checksums: Callable[[], Checksummer] | None = None,
    ) -> None:
        """``checksums`` gives this rank's block checksums; required with ``config.verify``."""
        if config.verify and checksums is None:
            raise InvalidArgumentError(
                f"protocol core {config.engine_id}: verify is on but no checksums were given"
            )
        self.cfg = config
        self._security = security
        self._bind_host = bind_host
        # Messages a sender may send whatever this instance is (a flood of them must not
        # become a flood of log lines): logged through one rate limit.
        self._stray = RateLimitedWarnings(logger, "notify messages ignored or failed")
        self._engine = engine
        sender = NotifySender(security)
        directory = PeerDirectory(
            engine,
            security,
            config.engine_id,
            timeout=config.transfer_timeout,
            max_peers=config.max_peers,
            in_use=self._peers_in_use,
            # The WRITE side posts under the context lock after check_current.
            replacing=lambda: self.ctx.lock,
            on_handshake=lambda peer: self._on_handshake(),
            on_bound=self._on_peer_bound,
            verify=config.verify,
            confirm_reads=config.confirms_reads,
        )
        self.ctx = Context(
            cfg=config,
            engine=engine,
            sender=sender,
            directory=directory,
            stats=stats,
            mark_terminal=self._mark_terminal,
        )
        if config.verify:
            assert checksums is not None
            self.ctx.verifier = Verifier(
                checksums, security, config.engine_id, timeout=config.transfer_timeout
            )
        elif config.confirms_reads:
            self.ctx.confirmer = ReadConfirmer(
                security, config.engine_id, timeout=config.transfer_timeout
            )
        self.puller = Puller(self.ctx)
        self.pusher = Pusher(self.ctx, writer_queue)
        self.server: HandshakeServer | None = None
        self.listener: NotifyListener | None = None
        self._threads: list[threading.Thread] = []
        # WRITE jobs whose drain notice overtook their undrained terminal event (the two come
        # from separate engine queues): the event, when it comes, is taken as drained.
        self._drained_jobs: set[str] = set()

    @property
    def incarnation(self) -> str:
        """This process's incarnation of the rank: peers compare it with the one a request
        names before they read from it or write into it (a restarted rank holds other bytes
        under the same block ids)."""
        return self.ctx.incarnation

    def address(self) -> tuple[str, int, int]:
        """(host, handshake port, notify port) this rank's peers reach it at (once started)."""
        if self.server is None or self.listener is None:
            raise FailedPreconditionError(f"protocol core {self.cfg.engine_id} is not started")
        return self.cfg.host_ip, self.server.port, self.listener.port

    @property
    def lock(self) -> threading.RLock:
        return self.ctx.lock

    def _on_handshake(self) -> None:
        with self.ctx.lock:
            self.ctx.stats.record_handshake()

    def _on_peer_bound(self, evicted: bool) -> None:
        with self.ctx.lock:
            self.ctx.stats.record_peer_bound(evicted=evicted)

    def _peers_in_use(self) -> set[str]:
        """Engine peers a live READ or WRITE job holds: the peer directory never evicts them,
        whether or not a transfer of theirs is in the engine yet."""
        with self.ctx.lock:
            return self.puller.peers_in_use() | self.pusher.peers_in_use()

    def _mark_terminal(self, transfer_id: str) -> None:
        if self.listener is not None:
            self.listener.mark_terminal(transfer_id)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, handshake_port: int, notify_port: int) -> None:
        """Open this rank's handshake server and notify listener (on its OWN ports; 0 binds
        any free port) and start the threads. The engine must be registered."""
        if self.server is not None:
            raise FailedPreconditionError(f"protocol core {self.cfg.engine_id} started twice")
        answers_checksums = self.cfg.verify or self.cfg.answers_hold_checks
        self.server = HandshakeServer(
            handshake_port,
            self._handshake_response,
            self._security,
            bind_host=self._bind_host,
            checksums=self._checksum_response if answers_checksums else None,
            at_once=self._hold_check_at_once if answers_checksums else None,
            when_ready=self._when_checksums_ready if answers_checksums else None,
        )
        try:
            self.listener = NotifyListener(notify_port, self._security, bind_host=self._bind_host)
        except BaseException:
            self.server.close()  # a refused start leaves nothing bound
            self.server = None
            raise
        if (
            self.cfg.tp_size == 1
            and self.cfg.dp_size == 1
            and 0
            in (
                self.cfg.handshake_port,
                self.cfg.notify_port,
            )
        ):
            # A single-rank instance configured with port 0 (any free port, as the demo runs):
            # its base ports are the ones just bound, which is what peers and messages carry.
            self.cfg = self.ctx.cfg = dataclasses.replace(
                self.cfg, handshake_port=self.server.port, notify_port=self.listener.port
            )
        for target, name in (
            (self._notify_loop, "notify"),
            (self._events_loop, "events"),
            (self.pusher.writer_loop, "writer"),
        ):
            thread = threading.Thread(target=target, name=f"moriio-native-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _handshake_response(self, request: HandshakeRequest) -> HandshakeResponse:
        cfg = self.cfg
        if request.verify != cfg.verify:
            raise IncompatiblePeerError(
                f"{request.requester_engine_id} "
                f"{'verifies' if request.verify else 'does not verify'} transfers, "
                f"{cfg.engine_id} {'does' if cfg.verify else 'does not'}; set the same 'verify' "
                "on both instances"
            )
        if request.confirm_reads and not cfg.confirm_reads:
            raise IncompatiblePeerError(
                f"{request.requester_engine_id} confirms its READs with the prefill, "
                f"{cfg.engine_id} does not answer such checks; set 'confirm_reads' on this "
                "instance too"
            )
        return HandshakeResponse(
            engine_id=cfg.engine_id,
            engine_metadata=self._engine().local_metadata(),
            dp_rank=cfg.dp_rank,
            tp_rank=cfg.tp_rank,
            dp_size=cfg.dp_size,
            tp_size=cfg.tp_size,
            transfer_mode=cfg.transfer_mode,
            verify=cfg.verify,
            total_kv_heads=cfg.total_kv_heads if cfg.split_layers else 0,
            kv_groups=cfg.groups,
            incarnation=self.ctx.incarnation,
        )

    def _hold_check_at_once(self, request: ChecksumRequest) -> ChecksumResponse | None:
        """A hold check's answer when it is a lookup (its transfer known here: held, or its
        hold ended), on the server's reading thread; None leaves the request to the
        answering pool (checksums read the blocks; a send task not come yet is waited for)."""
        if not request.hold_only or not self.pusher.hold_known(request.transfer_id):
            return None
        return self._checksum_response(request)

    def _when_checksums_ready(self, request: ChecksumRequest, go: Callable[[], None]) -> None:
        """``go`` once ``request``'s transfer is known here (held, or its hold ended), or once
        its send task has not come within SEND_TASK_WAIT_S of now (the decode may ask before
        the step that hands it over)."""
        self.pusher.when_hold_known(request.transfer_id, go)

    def _checksum_response(self, request: ChecksumRequest) -> ChecksumResponse:
        """A decode's checksums of the blocks its READ took, only while this rank still holds
        them, before and after computing (freed blocks may hold another request's KV, and
        their checksums would match what a READ of them took), and only of blocks the
        transfer's answer named. A hold check (``hold_only``) gets no checksums, only that."""
        verifier = self.ctx.verifier
        tid = request.transfer_id
        asked = "hold check" if request.hold_only else "checksums"
        if verifier is None and not request.hold_only:
            raise FailedPreconditionError(
                f"checksums of transfer {tid} asked, but {self.cfg.engine_id} does not verify "
                "transfers (verify is off here)"
            )
        hold = request.hold_until_ms
        sizes = request.answer_sizes
        unheld = self.pusher.held_for_checksums(
            tid, request.block_ids, hold, request.answer_ids, sizes
        )
        if unheld is None and request.hold_only:
            return ChecksumResponse(transfer_id=tid, checksums={})
        if unheld is None:
            assert verifier is not None
            response = verifier.answer(request)
            unheld = self.pusher.held_for_checksums(tid, (), hold, request.answer_ids, sizes)
            if unheld is None:
                return response
            unheld += " while its checksums were computed"
        raise FailedPreconditionError(f"{asked} of transfer {tid}: {unheld}")

    def shutdown(self) -> None:
        """Stop the threads and close every socket. Idempotent."""
        ctx = self.ctx
        if ctx.stop.is_set():
            return
        ctx.stop.set()
        self.pusher.stop_hold_waits()
        for thread in self._threads:
            thread.join(timeout=5.0)
        for checker in (ctx.verifier, ctx.confirmer):
            if checker is not None:
                checker.shutdown()
        ctx.directory.close()
        for closer in (self.listener, self.server):
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    logger.exception("error closing %s", type(closer).__name__)
        ctx.sender.close()

    # ---- the caller's hooks (never wait on the network) ---------------------------------------

    def drop_preempted(self, sends: Sequence[SendTask]) -> None:
        """The preempted requests among this step's send tasks: their writes stop now, before
        the step's GPU work may overwrite their blocks (vLLM's handle_preemptions)."""
        self.pusher.drop_preempted(list(sends))

    def begin_step(self, saves: Sequence[SaveTask], sends: Sequence[SendTask]) -> None:
        """This step's prefill work: prompt blocks handed over, requests finished."""
        self.pusher.begin_step(list(saves), list(sends))

    def start_loads(self, tasks: Sequence[RecvTask]) -> None:
        """Begin every decode load (READ pull, WRITE announcement, release-only)."""
        for task in tasks:
            self.puller.start(task)

    def wait_sync_reads(self) -> None:
        """Synchronous READ mode: wait for the READs started this step (see Puller)."""
        if self.cfg.sync_read:
            self.puller.wait_step_reads()

    def layer_saved(self, layer: str, event: Any) -> None:
        self.pusher.layer_saved(layer, event)

    def forward_done(self, layers: list[str], event: Any) -> None:
        self.pusher.forward_done(layers, event)

    def has_step_jobs(self) -> bool:
        return self.pusher.has_step_jobs()

    def take_reports(self) -> Reports:
        """What ended since the last call (each request / block reported once)."""
        self.check_timeouts(time.monotonic())
        with self.ctx.lock:
            return self.ctx.reports.take()

    def take_load_errors(self) -> set[int]:
        with self.ctx.lock:
            out, self.ctx.reports.invalid_blocks = self.ctx.reports.invalid_blocks, set()
        return out

    def check_timeouts(self, now: float) -> None:
        """One timeout pass. Each part runs whatever an earlier one raised (logged): the events
        thread and vLLM's step (take_reports) call it, and neither may stop on a defect here."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("the decode's deadlines", lambda: self.puller.check_timeouts(now)),
            ("the prefill's deadlines", lambda: self.pusher.check_timeouts(now)),
            ("the peer directory's expiry", self.ctx.directory.expire),
        ]
        for what, step in steps:
            try:
                step()
            except Exception:
                logger.exception("timeout pass: %s failed", what)

    # ---- threads ------------------------------------------------------------------------------

    def _events_loop(self) -> None:
        ctx = self.ctx
        last_check = time.monotonic()
        while not ctx.stop.is_set():
            try:
                engine = self._engine()
                events = engine.poll_events(timeout=WAIT_SLICE_S)
                drained = engine.poll_drained()
            except Exception:
                logger.exception("poll_events failed")
                time.sleep(WAIT_SLICE_S)
                continue
            for event in events:
                self._handle_event(event)
            for notice in drained:
                try:
                    self._on_drained(notice)
                except Exception:
                    logger.exception("error handling %s", notice)
            now = time.monotonic()
            if now - last_check >= TIMEOUT_CHECK_EVERY_S:
                last_check = now
                self.check_timeouts(now)

    def _handle_event(self, event: Any) -> None:
        """One terminal event to the puller (READ) or the pusher (WRITE). Whether nothing of
        it can land any more is settled first: its drain notice may have come before it (and
        is taken now, so the error path below must be told too)."""
        with self.ctx.lock:
            drained = bool(event.drained or event.transfer_id in self._drained_jobs)
            self._drained_jobs.discard(event.transfer_id)
        try:
            if not self.puller.on_event(event):
                self.pusher.on_event(event, drained)
        except Exception as exc:
            logger.exception("error handling %s", event)
            self._on_event_error(event, drained, exc)

    def _on_event_error(self, event: Any, drained: bool, exc: Exception) -> None:
        """Handling ``event`` raised: its READ or WRITE job still ends (failed: a READ is
        recomputed, a WRITE's decode told ``write_failed``, at once or once its writes
        drained); awaits end at their own deadlines (abort_timeout)."""
        why = f"internal error handling its {event.state} event ({type(exc).__name__}: {exc})"
        try:
            if not self.puller.on_event_error(event, why):
                self.pusher.on_event_error(event, drained, why)
        except Exception:
            logger.exception("transfer %s: it could not be ended", event.transfer_id)

    def _on_drained(self, drained: DrainedTransfer) -> None:
        tid = drained.transfer_id
        if self.puller.on_drained(tid, drained.seconds):
            return
        if self.pusher.on_drained(tid) == "early":
            with self.ctx.lock:
                self._drained_jobs.add(tid)

    def _notify_loop(self) -> None:
        listener = self.listener
        assert listener is not None
        while not self.ctx.stop.is_set():
            message = listener.get(WAIT_SLICE_S)
            if message is None:
                continue
            try:
                self._on_message(message)
            except Exception:  # one message must never stop the thread
                logger.exception("error handling %s", message)
            self.pusher.feed_writer()

    def _on_message(self, message: NotifyMessage) -> None:
        cfg = self.cfg
        tid = message.transfer_id
        if isinstance(message, (WriteDone, WriteFailed, WriteAborted, Misaddressed)):
            if not cfg.consumer:
                self._stray.warn(
                    "ignoring %s for transfer %s: this instance is not a consumer",
                    message.TYPE,
                    tid,
                )
                return
            if isinstance(message, WriteAborted) and message.decode_engine_id != cfg.engine_id:
                # Steered here by an abort_write naming another rank (or this port): the
                # prefill's writes of the transfer into this rank may still land.
                self._stray.warn(
                    "ignoring write_aborted for transfer %s: it acknowledges decode rank %s, "
                    "this is %s",
                    tid,
                    message.decode_engine_id,
                    cfg.engine_id,
                )
                return
            if isinstance(message, Misaddressed):
                self.puller.on_misaddressed(message)
                return
            if isinstance(message, WriteFailed):
                self._stray.warn(
                    "transfer %s: the prefill failed to write: %s", tid, message.reason
                )
            self.puller.on_write_result(
                tid,
                ok=isinstance(message, WriteDone),
                writer_rank=message.writer_rank,
                checksums=message.checksums if isinstance(message, WriteDone) else None,
                writer_incarnation=(
                    message.writer_incarnation if isinstance(message, WriteFailed) else ""
                ),
            )
            return
        if not cfg.producer:
            self._stray.warn(
                "ignoring %s for transfer %s: this instance is not a producer", message.TYPE, tid
            )
            return
        if isinstance(message, AbortWrite):
            self.pusher.on_abort_write(message)
        elif isinstance(message, Release):
            self.pusher.on_release(message)
        elif isinstance(message, RemoteBlocks):
            self.pusher.on_remote_blocks(message)
        else:
            self._stray.warn("ignoring unexpected %s for transfer %s", message.TYPE, tid)


__all__ = ["PdCore"]
