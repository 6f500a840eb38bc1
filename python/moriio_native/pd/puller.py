"""The decode side of the protocol: READ pulls and WRITE awaits (one rank).

READ (:class:`ReadState`): the prefill rank that pairs with ours is handshaken in the
background (:class:`~moriio_native.pd.peers.PeerDirectory`), then one engine READ moves the
request's blocks. Its engine event ends it: ``done``; failed (drained) -- its blocks are
reported for recomputation; ended with operations in flight -- QUARANTINED, its blocks
reported only once the engine says they drained (until then nothing can reuse them). The
prefill gets its release (every prefill rank assigned to us, see :mod:`moriio_native.pd.tp`)
at the end, done or not.

WRITE await (:class:`AwaitState`): the prefill rank is handshaken, then told our blocks
(``remote_blocks``); its ``write_done`` / ``write_failed`` ends the load. Giving up (abort, or
``abort_timeout``) after the announcement quarantines the blocks: ``abort_write`` asks the
prefill to stop, and they are freed on its ``write_aborted`` (or any final message), on its
proven death, or after ``quarantine_timeout``.

Every change of state goes through :meth:`Machine.advance` under the context lock; network
calls (releases, announcements) are made after the lock is released.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from moriio_native.control.messages import AbortWrite, Release, RemoteBlocks
from moriio_native.control.ports import rank_port
from moriio_native.errors import MoriioError
from moriio_native.pd.context import Context, check_engine, plan_grouped
from moriio_native.pd.fsm import Machine
from moriio_native.pd.groups import check_groups, post_read
from moriio_native.pd.peers import Peer
from moriio_native.pd.tasks import RecvTask
from moriio_native.pd.tp import release_targets

logger = logging.getLogger("moriio_native.pd.puller")

# Releases one decode rank sends to unread prefill ranks when no handshake confirmed the
# prefill's TP size (the request's number could name thousands of ranks).
MAX_UNCONFIRMED_RELEASES = 16
# A quarantined WRITE's prefill is re-handshaken this often ...
PROBE_WRITER_EVERY_S = 5.0
# ... and taken as dead only after this many consecutive failed probes (one missed handshake
# of a busy prefill proves nothing) or at once when another instance answers.
PROBE_FAILURES_FOR_DEATH = 3


class ReadState(Enum):
    CONNECTING = auto()  # handshake (background) before the engine READ
    READING = auto()  # the engine READ is posted
    QUARANTINED = auto()  # ended with operations in flight: waiting for the drain
    DONE = auto()
    FAILED = auto()


class ReadEvent(Enum):
    POSTED = auto()  # the peer is known and the engine accepted the READ
    DONE = auto()  # engine event: done
    FAILED = auto()  # refused before posting, or an engine event that ended drained
    UNDRAINED = auto()  # engine event that ended with operations in flight
    DRAINED = auto()  # the engine reports the quarantined READ drained


READ_TRANSITIONS: dict[tuple[ReadState, ReadEvent], ReadState] = {
    (ReadState.CONNECTING, ReadEvent.POSTED): ReadState.READING,
    (ReadState.CONNECTING, ReadEvent.FAILED): ReadState.FAILED,
    (ReadState.READING, ReadEvent.DONE): ReadState.DONE,
    (ReadState.READING, ReadEvent.FAILED): ReadState.FAILED,
    (ReadState.READING, ReadEvent.UNDRAINED): ReadState.QUARANTINED,
    (ReadState.QUARANTINED, ReadEvent.DRAINED): ReadState.FAILED,
}
READ_TERMINAL = frozenset({ReadState.DONE, ReadState.FAILED})


class AwaitState(Enum):
    CONNECTING = auto()  # handshake, then remote_blocks (the prefill cannot write yet)
    ANNOUNCED = auto()  # the prefill knows our blocks: it may be writing them
    QUARANTINED = auto()  # we gave up after announcing: waiting for its writes to stop
    DONE = auto()
    FAILED = auto()


class AwaitEvent(Enum):
    ANNOUNCED = auto()
    WRITE_DONE = auto()
    WRITE_FAILED = auto()  # write_failed or write_aborted: none of its writes lands any more
    GIVE_UP = auto()  # abort or abort_timeout
    UNREACHABLE = auto()  # the announcement could not be made
    WRITER_GONE = auto()  # the prefill died, or quarantine_timeout passed


AWAIT_TRANSITIONS: dict[tuple[AwaitState, AwaitEvent], AwaitState] = {
    (AwaitState.CONNECTING, AwaitEvent.ANNOUNCED): AwaitState.ANNOUNCED,
    (AwaitState.CONNECTING, AwaitEvent.GIVE_UP): AwaitState.FAILED,
    (AwaitState.CONNECTING, AwaitEvent.UNREACHABLE): AwaitState.FAILED,
    # A final message may overtake our announcement's own bookkeeping (sent, answered at once).
    (AwaitState.CONNECTING, AwaitEvent.WRITE_DONE): AwaitState.DONE,
    (AwaitState.CONNECTING, AwaitEvent.WRITE_FAILED): AwaitState.FAILED,
    (AwaitState.ANNOUNCED, AwaitEvent.WRITE_DONE): AwaitState.DONE,
    (AwaitState.ANNOUNCED, AwaitEvent.WRITE_FAILED): AwaitState.FAILED,
    (AwaitState.ANNOUNCED, AwaitEvent.GIVE_UP): AwaitState.QUARANTINED,
    (AwaitState.QUARANTINED, AwaitEvent.WRITE_DONE): AwaitState.DONE,
    (AwaitState.QUARANTINED, AwaitEvent.WRITE_FAILED): AwaitState.FAILED,
    (AwaitState.QUARANTINED, AwaitEvent.WRITER_GONE): AwaitState.FAILED,
}
AWAIT_TERMINAL = frozenset({AwaitState.DONE, AwaitState.FAILED})


@dataclass
class _Read:
    task: RecvTask
    started: float
    machine: Machine[ReadState, ReadEvent]
    peer: Peer | None = None
    message: str = ""
    sync: bool = False  # waited for in the caller's load hook (not reported as finished)


@dataclass
class _Await:
    task: RecvTask
    deadline: float
    machine: Machine[AwaitState, AwaitEvent]
    peer: Peer | None = None
    quarantined: float = 0.0
    next_probe: float = 0.0
    failed_probes: int = 0
    probe: Future[str] | None = field(default=None, repr=False)


class Puller:
    """Decode-side transfers of one rank. Thread-safe through the context lock."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._reads: dict[str, _Read] = {}
        self._awaits: dict[str, _Await] = {}
        # Drain notices that overtook their undrained terminal event (separate engine queues):
        # the event, when it comes, is taken as drained.
        self._drained_early: set[str] = set()
        self._step_reads: list[str] = []

    # ---- entry points (any thread) ------------------------------------------------------------

    def start(self, task: RecvTask) -> None:
        """Begin ``task``: never waits on the network."""
        cfg = self._ctx.cfg
        if task.aborted:
            self.give_up(task.transfer_id, "the request was aborted")
        elif task.error:
            self._fail_unplanned(task)
        elif task.notify_only:
            self.send_release(task, None)
        elif cfg.mode == "read":
            self._start_read(task)
        else:
            self._start_await(task)

    def read_states(self) -> dict[str, ReadState]:
        with self._ctx.lock:
            return {tid: r.machine.state for tid, r in self._reads.items()}

    def await_states(self) -> dict[str, AwaitState]:
        with self._ctx.lock:
            return {tid: a.machine.state for tid, a in self._awaits.items()}

    # ---- READ ---------------------------------------------------------------------------------

    def _connect(self, task: RecvTask) -> Future[Peer]:
        """The prefill rank that pairs with ours, for ``task`` (raises before any network when
        the TP sizes cannot pair)."""
        peer = task.peer
        return self._ctx.connect(
            peer.host,
            peer.handshake_port,
            peer.notify_port,
            task.remote_dp_rank,
            task.remote_tp_size,
        )

    def _start_read(self, task: RecvTask) -> None:
        ctx = self._ctx
        machine = Machine("READ", task.transfer_id, READ_TRANSITIONS, ReadState.CONNECTING)
        read = _Read(task, time.monotonic(), machine, sync=ctx.cfg.sync_read)
        with ctx.lock:
            if task.transfer_id in self._reads:
                logger.warning("transfer %s: a second READ for it is ignored", task.transfer_id)
                return
            self._reads[task.transfer_id] = read
            if read.sync:
                self._step_reads.append(task.transfer_id)
        try:
            future = self._connect(task)
        except MoriioError as exc:
            self._read_failed(read, f"not started: {exc}")
            return
        future.add_done_callback(lambda f: self._post_read(read, f))

    def _post_read(self, read: _Read, future: Future[Peer]) -> None:
        """The handshake ended (a pool thread, or the caller's when cached): post the READ."""
        task = read.task
        try:
            peer = future.result()
            check_engine(peer, task.remote_engine_id)
            read.peer = peer
            if task.grouped is not None:
                segments = plan_grouped(self._ctx.cfg, peer, task.grouped, "local")
                post_read(self._ctx.engine(), task.transfer_id, peer.engine_peer, segments)
            else:
                self._ctx.engine().read(
                    task.transfer_id, peer.engine_peer, task.local_block_ids, task.remote_block_ids
                )
        except Exception as exc:  # any failure: recompute locally, free the prefill
            self._ctx.directory.forget(read.peer)
            self._read_failed(read, f"not started: {exc}")
            return
        with self._ctx.lock:
            if read.machine.state is ReadState.CONNECTING:
                read.machine.advance(ReadEvent.POSTED)

    def on_event(self, event: Any) -> bool:
        """An engine terminal event; False when it is not one of our READs."""
        ctx = self._ctx
        tid = event.transfer_id
        with ctx.lock:
            read = self._reads.get(tid)
            if read is None or read.machine.state in READ_TERMINAL:
                return read is not None
            if read.machine.state is ReadState.CONNECTING:
                # The engine answered before our own bookkeeping caught up with the post.
                read.machine.advance(ReadEvent.POSTED)
            drained = event.drained or tid in self._drained_early
            self._drained_early.discard(tid)
            if not drained:
                read.machine.advance(ReadEvent.UNDRAINED)
                read.message = f"{event.state}: {event.message}"
                ctx.stats.record_quarantine(len(read.task.local_block_ids))
        if not drained:
            self._quarantine_read(read, event)
            return True
        self._end_read(
            read,
            ReadEvent.DONE if event.state == "done" else ReadEvent.FAILED,
            f"{event.state}: {event.message}",
            event,
        )
        return True

    def on_drained(self, tid: str, seconds: float) -> bool:
        """The engine reports a quarantined transfer drained; False when not ours."""
        with self._ctx.lock:
            read = self._reads.get(tid)
            if read is None:
                return False
            if read.machine.state is not ReadState.QUARANTINED:
                self._drained_early.add(tid)  # its undrained event is still queued
                return True
        self._end_read(
            read, ReadEvent.DRAINED, f"operations drained {seconds:.3g}s after the start"
        )
        return True

    def _quarantine_read(self, read: _Read, event: Any) -> None:
        """Dropping the peer closes the endpoint the in-flight operations use, which cancels
        them; the blocks stay unreported until the engine confirms the drain."""
        logger.warning(
            "request %s (transfer %s): READ %s with operations in flight (%s); its %d blocks "
            "are quarantined until they drain",
            read.task.req_id,
            read.task.transfer_id,
            event.state,
            event.message,
            len(read.task.local_block_ids),
        )
        peer = read.peer
        if peer is not None:
            self._ctx.directory.forget(peer)
            try:
                self._ctx.engine().remove_peer(peer.engine_peer)
            except MoriioError as exc:
                logger.debug("peer %s already gone: %s", peer.engine_peer, exc)

    def _read_failed(self, read: _Read, message: str) -> None:
        logger.error(
            "request %s (transfer %s): READ from %s %s",
            read.task.req_id,
            read.task.transfer_id,
            read.task.peer.host,
            message,
        )
        self._end_read(read, ReadEvent.FAILED, message)

    def _end_read(
        self, read: _Read, event: ReadEvent, message: str, engine_event: Any = None
    ) -> None:
        """The READ's terminal state, once: report it, and release the prefill."""
        ctx = self._ctx
        task = read.task
        with ctx.lock:
            if read.machine.state in READ_TERMINAL:
                return
            state = read.machine.advance(event)
            read.message = message
            ok = state is ReadState.DONE
            if ok and engine_event is not None:
                ctx.stats.record_transfer(engine_event)
            elif not ok:
                ctx.stats.record(ok=False)
                ctx.reports.invalid_blocks.update(task.local_block_ids)
            if not read.sync:
                self._reads.pop(task.transfer_id, None)
                if task.report_done:
                    ctx.reports.done_recving.add(task.req_id)
                    if not ok:
                        ctx.reports.failed_recving.add(task.req_id)
                        ctx.reports.failures[task.req_id] = f"READ {state.name.lower()}: {message}"
            ctx.cond.notify_all()
        if not ok:
            # The next request handshakes again: a prefill that restarted under the same
            # address is reached at its new transport address instead of failing forever.
            ctx.directory.forget(read.peer)
            logger.warning(
                "request %s (transfer %s): READ %s (%s); its %d blocks will be recomputed",
                task.req_id,
                task.transfer_id,
                state.name.lower(),
                message,
                len(task.local_block_ids),
            )
        self.send_release(task, read.peer)

    def wait_step_reads(self) -> None:
        """Synchronous READ only: wait until every READ started this step is terminal -- the
        caller runs its forward over (or recomputes into) these blocks once this returns, so
        a quarantined READ is waited for until the engine reports its drain. Past
        2 x transfer_timeout + quarantine_timeout it keeps waiting (logged), never raising into
        the caller's step: its blocks may still be written."""
        ctx = self._ctx
        with ctx.lock:
            ids, self._step_reads = self._step_reads, []
        for tid in ids:
            with ctx.lock:
                read = self._reads.get(tid)
                if read is None:
                    continue
                bound = read.started + 2 * ctx.cfg.transfer_timeout + ctx.cfg.quarantine_timeout
                warned = False
                while read.machine.state not in READ_TERMINAL and not ctx.stop.is_set():
                    ctx.cond.wait(0.1)
                    if not warned and time.monotonic() > bound:
                        warned = True
                        logger.error(
                            "request %s (transfer %s): the READ into blocks %s is not proven "
                            "drained after quarantine_timeout (%.0fs); still waiting, since "
                            "they may be written (asynchronous loading would keep the batch "
                            "running meanwhile)",
                            read.task.req_id,
                            tid,
                            list(read.task.local_block_ids),
                            ctx.cfg.quarantine_timeout,
                        )
                self._reads.pop(tid, None)

    # ---- WRITE await --------------------------------------------------------------------------

    def _start_await(self, task: RecvTask) -> None:
        ctx = self._ctx
        machine = Machine("WRITE-await", task.transfer_id, AWAIT_TRANSITIONS, AwaitState.CONNECTING)
        waiting = _Await(task, time.monotonic() + ctx.cfg.abort_timeout, machine)
        with ctx.lock:
            if task.transfer_id in self._awaits:
                return
            self._awaits[task.transfer_id] = waiting
        try:
            future = self._connect(task)
        except MoriioError as exc:
            self._announce_failed(waiting, None, exc)
            return
        future.add_done_callback(lambda f: self._announce(waiting, f))

    def _announce(self, waiting: _Await, future: Future[Peer]) -> None:
        """Handshake done: tell the prefill rank where to write."""
        ctx = self._ctx
        task = waiting.task
        peer = None
        try:
            peer = future.result()
            check_engine(peer, task.remote_engine_id)
            block_ids: tuple[tuple[int, ...], ...] = (task.local_block_ids,)
            num_tokens = 0
            if task.grouped is not None:
                # Refused here, before the prefill knows our blocks, when the groups differ.
                check_groups(ctx.cfg.groups, peer.response.kv_groups, peer.response.engine_id)
                block_ids, num_tokens = task.grouped.local, task.grouped.end
            with ctx.lock:
                if waiting.machine.state is not AwaitState.CONNECTING:
                    return  # given up before the prefill had our blocks (and released)
                waiting.machine.advance(AwaitEvent.ANNOUNCED)
                waiting.peer = peer  # from now on the prefill may write into the blocks
            ctx.sender.send(
                peer.host,
                peer.notify_port,
                RemoteBlocks(
                    transfer_id=task.transfer_id,
                    block_ids=block_ids,
                    decode_engine_id=ctx.cfg.engine_id,
                    decode_dp_rank=ctx.cfg.dp_rank,
                    req_id=task.req_id,
                    num_tokens=num_tokens,
                ),
            )
        except Exception as exc:
            self._announce_failed(waiting, peer, exc)

    def _announce_failed(self, waiting: _Await, peer: Peer | None, exc: Exception) -> None:
        task = waiting.task
        logger.error(
            "request %s (transfer %s): cannot announce blocks to %s: %s; computing locally",
            task.req_id,
            task.transfer_id,
            task.peer.host,
            exc,
        )
        self._ctx.directory.forget(peer)
        with self._ctx.lock:
            state = waiting.machine.state
        if state is AwaitState.ANNOUNCED:
            # The message may have left: the prefill could write. Quarantine as for an abort.
            self.give_up(task.transfer_id, f"the announcement failed ({exc})")
            return
        self._end_await(task.transfer_id, AwaitEvent.UNREACHABLE)
        # The prefill holds the blocks for our remote_blocks, which will not come.
        self.send_release(task, peer)

    def on_write_result(self, tid: str, ok: bool) -> None:
        """write_done (``ok``), write_failed or write_aborted from the prefill: each is sent
        only once none of its writes can land any more, so each also ends a quarantine."""
        self._end_await(tid, AwaitEvent.WRITE_DONE if ok else AwaitEvent.WRITE_FAILED)

    def give_up(self, tid: str, why: str) -> None:
        """Stop waiting for the prefill's writes. Announced blocks are quarantined
        (abort_write) until it confirms; others are recomputed now."""
        ctx = self._ctx
        with ctx.lock:
            waiting = self._awaits.get(tid)
            if waiting is None or not waiting.machine.allows(AwaitEvent.GIVE_UP):
                return
            state = waiting.machine.advance(AwaitEvent.GIVE_UP)
            if state is AwaitState.QUARANTINED:
                now = time.monotonic()
                waiting.quarantined = now
                waiting.next_probe = now + PROBE_WRITER_EVERY_S
                ctx.stats.record_quarantine(len(waiting.task.local_block_ids))
        if state is AwaitState.QUARANTINED:
            self._abort_write(waiting, why)
        else:
            self._report_await(waiting, ok=False)
            self.send_release(waiting.task, None)

    def _abort_write(self, waiting: _Await, why: str) -> None:
        ctx = self._ctx
        task, peer = waiting.task, waiting.peer
        assert peer is not None
        logger.warning(
            "request %s (transfer %s): %s; its %d blocks are quarantined until the prefill "
            "confirms its writes stopped (at most quarantine_timeout, %.0fs)",
            task.req_id,
            task.transfer_id,
            why,
            len(task.local_block_ids),
            ctx.cfg.quarantine_timeout,
        )
        try:
            ctx.sender.send(
                peer.host,
                peer.notify_port,
                AbortWrite(
                    task.transfer_id,
                    ctx.cfg.engine_id,
                    decode_host=ctx.cfg.host_ip,
                    decode_handshake_port=ctx.cfg.handshake_port,
                    decode_notify_port=ctx.cfg.notify_port,
                    decode_dp_rank=ctx.cfg.dp_rank,
                ),
            )
        except MoriioError as exc:
            logger.warning("transfer %s: abort_write not sent: %s", task.transfer_id, exc)

    def _end_await(self, tid: str, event: AwaitEvent) -> None:
        with self._ctx.lock:
            waiting = self._awaits.get(tid)
            if waiting is None or not waiting.machine.allows(event):
                return
            waiting.machine.advance(event)
        why = f"WRITE ended by {event.name.lower()}"
        self._report_await(waiting, ok=waiting.machine.state is AwaitState.DONE, why=why)

    def _report_await(self, waiting: _Await, ok: bool, why: str = "gave up") -> None:
        ctx = self._ctx
        task = waiting.task
        with ctx.lock:
            if self._awaits.pop(task.transfer_id, None) is None:
                return
            ctx.reports.done_recving.add(task.req_id)
            if not ok:
                # Both signals: failed_recving (request level) and the blocks (for callers
                # that only read get_finished) -- the caller recomputes either way.
                ctx.reports.failed_recving.add(task.req_id)
                ctx.reports.invalid_blocks.update(task.local_block_ids)
                ctx.reports.failures[task.req_id] = why
                ctx.stats.record(ok=False)
        ctx.mark_terminal(task.transfer_id)

    def check_timeouts(self, now: float) -> None:
        """Give up awaits past abort_timeout; free or probe quarantined ones."""
        ctx = self._ctx
        expired: list[str] = []
        gone: list[tuple[str, str]] = []
        to_probe: list[_Await] = []
        with ctx.lock:
            for tid, waiting in self._awaits.items():
                state = waiting.machine.state
                if state is AwaitState.QUARANTINED:
                    if now > waiting.quarantined + ctx.cfg.quarantine_timeout:
                        gone.append((tid, "no drain confirmation within quarantine_timeout"))
                    elif waiting.probe is None and now >= waiting.next_probe:
                        waiting.next_probe = now + PROBE_WRITER_EVERY_S
                        to_probe.append(waiting)
                elif now > waiting.deadline:
                    expired.append(tid)
        for tid in expired:
            self.give_up(
                tid, f"the KV did not arrive within abort_timeout ({ctx.cfg.abort_timeout:.0f}s)"
            )
        for tid, why in gone:
            logger.warning(
                "transfer %s: %s (%.0fs); freeing its blocks", tid, why, ctx.cfg.quarantine_timeout
            )
            self._end_await(tid, AwaitEvent.WRITER_GONE)
        for waiting in to_probe:
            assert waiting.peer is not None
            future = ctx.directory.probe(waiting.peer)
            with ctx.lock:
                waiting.probe = future
            future.add_done_callback(lambda f, w=waiting: self._probed(w, f))

    def _probed(self, waiting: _Await, future: Future[str]) -> None:
        """A quarantined WRITE's prefill answered a probe (or did not): another instance
        there is proof its writes ended; only several failures in a row are taken as death."""
        try:
            dead = future.result()
        except Exception as exc:
            dead = f"probe failed ({exc})"
        restarted = dead.startswith("it restarted")
        with self._ctx.lock:
            waiting.probe = None
            waiting.failed_probes = waiting.failed_probes + 1 if dead else 0
            failures = waiting.failed_probes
        if not dead or (not restarted and failures < PROBE_FAILURES_FOR_DEATH):
            return
        assert waiting.peer is not None
        logger.warning(
            "transfer %s: the prefill %s died: %s; freeing the quarantined blocks",
            waiting.task.transfer_id,
            waiting.peer.response.engine_id,
            dead if restarted else f"{dead}, {failures} probes in a row",
        )
        self._ctx.directory.forget(waiting.peer)
        self._end_await(waiting.task.transfer_id, AwaitEvent.WRITER_GONE)

    # ---- shared -------------------------------------------------------------------------------

    def _fail_unplanned(self, task: RecvTask) -> None:
        """A load the planner could not pair: its blocks are recomputed, the prefill freed."""
        ctx = self._ctx
        with ctx.lock:
            ctx.reports.invalid_blocks.update(task.local_block_ids)
            if task.report_done:
                ctx.reports.done_recving.add(task.req_id)
                ctx.reports.failed_recving.add(task.req_id)
            ctx.stats.record(ok=False)
        self.send_release(task, None)

    def send_release(self, task: RecvTask, peer: Peer | None) -> None:
        """Tell the prefill it may free the request's blocks: the rank we read from (at its
        handshaken address when we have one) and the unread ranks assigned to us when its TP
        size is larger than ours (moriio_native.pd.tp)."""
        ctx = self._ctx
        cfg = ctx.cfg
        if peer is not None:  # the TP size the prefill confirmed in the handshake
            tp_size, host = peer.response.tp_size, peer.host
        else:  # what the request said: bounded, since nothing confirmed it
            tp_size, host = task.remote_tp_size or cfg.tp_size, task.peer.host
        targets = release_targets(cfg.tp_rank, cfg.tp_size, tp_size)
        if peer is None and len(targets) > MAX_UNCONFIRMED_RELEASES:
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
            task.transfer_id, consumer_tp_size=cfg.tp_size, consumer_tp_rank=cfg.tp_rank
        )
        for i, rank in enumerate(targets):
            try:
                if i == 0 and peer is not None:
                    port = peer.notify_port
                else:
                    port = rank_port(task.peer.notify_port, task.remote_dp_rank, rank, tp_size)
                ctx.sender.send(host, port, release)
            except MoriioError as exc:
                logger.warning(
                    "request %s (transfer %s): release to prefill rank %d not sent (%s); it "
                    "frees its blocks after its abort_timeout",
                    task.req_id,
                    task.transfer_id,
                    rank,
                    exc,
                )


__all__ = [
    "AWAIT_TRANSITIONS",
    "READ_TRANSITIONS",
    "AwaitEvent",
    "AwaitState",
    "Puller",
    "ReadEvent",
    "ReadState",
]
