"""The decode side of the protocol: READ pulls and WRITE awaits (one rank).

A load takes its blocks from every prefill rank the TP plan names
(:class:`~moriio_native.pd.heads.TpPlan`: one rank with equal TP sizes; a head slice of one, or
head ranges of several, when they differ). Each source rank is one *part* with its own state
machine; the request's load ends once every part is terminal, and succeeds only when every part
did. The first part that fails stops the others (abort / ``abort_write``), so the request is
recomputed soon, but its blocks are reported only once no part can write them any more.

READ part (:class:`ReadState`): the prefill rank is handshaken in the background
(:class:`~moriio_native.pd.peers.PeerDirectory`), then one engine READ moves its share (whole
blocks, or ``read_segments`` with head windows). Its engine event ends it: ``done``; failed
(drained); ended with operations in flight -- QUARANTINED until the engine says they drained.
Every prefill rank assigned to us gets its release at the end, done or not.

WRITE await part (:class:`AwaitState`): the prefill rank is handshaken, then told our blocks
(``remote_blocks``); its ``write_done`` / ``write_failed`` ends the part. Giving up (abort, or
``abort_timeout``) after the announcement quarantines the part: ``abort_write`` asks the
prefill rank to stop, and the part ends on its ``write_aborted`` (or any final message), on its
proven death, or after ``quarantine_timeout``.

With ``verify`` on, a READ the engine completed, and a WRITE await whose ``write_done`` came,
pass through VERIFYING: the two sides' block checksums are compared
(:mod:`moriio_native.pd.verify`) and a mismatch ends the load FAILED (recomputed), before the
prefill gets its release. With ``confirm_reads`` (and ``verify`` off) a completed READ passes
through it too: the prefill confirms it still holds the blocks the READ took, else the load
fails (a READ of freed blocks, or of another request's, took whatever they held).

Every change of state goes through :meth:`Machine.advance` under the context lock; network
calls (releases, announcements) are made after the lock is released.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, TypeVar

from moriio_native.control.channel import RateLimitedWarnings
from moriio_native.control.messages import (
    AbortWrite,
    KvGroup,
    Misaddressed,
    Release,
    RemoteBlocks,
    now_ms,
)
from moriio_native.control.ports import rank_port
from moriio_native.control.schema import PART_SEPARATOR
from moriio_native.engine import BlockSegment
from moriio_native.errors import FailedPreconditionError, MoriioError
from moriio_native.pd.context import (
    Context,
    check_engine,
    check_held_until,
    check_hold,
    check_incarnation,
    expected_incarnation,
    plan_grouped,
)
from moriio_native.pd.fsm import Machine
from moriio_native.pd.groups import NULL_BLOCK, check_groups, engine_segments, post_read
from moriio_native.pd.heads import TpPlan, read_segments
from moriio_native.pd.peers import Peer
from moriio_native.pd.tasks import RecvTask
from moriio_native.pd.verify import whole_blocks_only

logger = logging.getLogger("moriio_native.pd.puller")

# Releases one decode rank sends to unread prefill ranks when no handshake confirmed the
# prefill's TP size (the request's number could name thousands of ranks).
MAX_UNCONFIRMED_RELEASES = 16
# Prefill answers (transfer id, stated hold) this rank released, kept at most this many (the
# oldest go first) until their hold may have ended: a release ends the hold at once, so a second
# READ of the same answer (a retried request) would load whatever the freed blocks hold by then.
MAX_RELEASED_ANSWERS = 65_536
# With no handshake of the prefill to bound its clock, how far behind this rank's clock it is
# taken to be when such an answer's hold ends.
RELEASED_CLOCK_SLACK_S = 60.0
# WRITE awaits this rank ended, kept at most this many (the oldest go first): the notify
# listener drops every later message of their transfer ids (mark_terminal, as many), so an await
# reusing one would never hear its prefill's write_done / write_failed / write_aborted.
MAX_ENDED_AWAITS = 65_536
# A quarantined WRITE's prefill is re-handshaken this often ...
PROBE_WRITER_EVERY_S = 5.0
# ... and taken as dead only after this many consecutive failed probes (one missed handshake
# of a busy prefill proves nothing) or at once when another instance answers.
PROBE_FAILURES_FOR_DEATH = 3


class ReadState(Enum):
    CONNECTING = auto()  # handshake (background) before the engine READ
    READING = auto()  # the engine READ is posted
    # done in the engine; comparing the two sides' checksums (verify) or waiting for the
    # prefill's hold check (confirm_reads)
    VERIFYING = auto()
    QUARANTINED = auto()  # ended with operations in flight: waiting for the drain
    DONE = auto()
    FAILED = auto()


class ReadEvent(Enum):
    POSTED = auto()  # the peer is known and the engine accepted the READ
    DONE = auto()  # engine event: done
    FAILED = auto()  # refused before posting, or an engine event that ended drained
    UNDRAINED = auto()  # engine event that ended with operations in flight
    DRAINED = auto()  # the engine reports the quarantined READ drained
    VERIFY = auto()  # engine event: done, and verify or confirm_reads is on
    VERIFIED = auto()  # both sides' checksums agree, or the prefill confirmed its hold
    MISMATCH = auto()  # they differ, or the prefill's answer could not be had


READ_TRANSITIONS: dict[tuple[ReadState, ReadEvent], ReadState] = {
    (ReadState.CONNECTING, ReadEvent.POSTED): ReadState.READING,
    (ReadState.CONNECTING, ReadEvent.FAILED): ReadState.FAILED,
    (ReadState.READING, ReadEvent.DONE): ReadState.DONE,
    (ReadState.READING, ReadEvent.FAILED): ReadState.FAILED,
    (ReadState.READING, ReadEvent.UNDRAINED): ReadState.QUARANTINED,
    (ReadState.QUARANTINED, ReadEvent.DRAINED): ReadState.FAILED,
    (ReadState.READING, ReadEvent.VERIFY): ReadState.VERIFYING,
    (ReadState.VERIFYING, ReadEvent.VERIFIED): ReadState.DONE,
    (ReadState.VERIFYING, ReadEvent.MISMATCH): ReadState.FAILED,
}
READ_TERMINAL = frozenset({ReadState.DONE, ReadState.FAILED})


class AwaitState(Enum):
    CONNECTING = auto()  # handshake, then remote_blocks (the prefill cannot write yet)
    ANNOUNCED = auto()  # the prefill knows our blocks: it may be writing them
    QUARANTINED = auto()  # we gave up after announcing: waiting for its writes to stop
    VERIFYING = auto()  # write_done came: comparing its checksums with ours (verify)
    DONE = auto()
    FAILED = auto()


class AwaitEvent(Enum):
    ANNOUNCED = auto()
    WRITE_DONE = auto()
    # write_failed, write_aborted, or a misaddressed we do not announce again: none of its
    # writes lands any more
    WRITE_FAILED = auto()
    GIVE_UP = auto()  # abort or abort_timeout
    UNREACHABLE = auto()  # the announcement could not be made
    WRITER_GONE = auto()  # the prefill died, or quarantine_timeout passed
    VERIFY = auto()  # write_done came and verify is on
    # misaddressed: the prefill rank restarted since our handshake and wrote nothing; handshake
    # the new process and announce to it
    READDRESS = auto()
    VERIFIED = auto()  # its checksums agree with ours
    MISMATCH = auto()  # they differ, or it carried none


AWAIT_TRANSITIONS: dict[tuple[AwaitState, AwaitEvent], AwaitState] = {
    (AwaitState.CONNECTING, AwaitEvent.ANNOUNCED): AwaitState.ANNOUNCED,
    (AwaitState.CONNECTING, AwaitEvent.GIVE_UP): AwaitState.FAILED,
    (AwaitState.CONNECTING, AwaitEvent.UNREACHABLE): AwaitState.FAILED,
    # No write_done can answer a part still CONNECTING (_announce moves it to ANNOUNCED before
    # remote_blocks leaves; after a misaddressed answer the new process wrote nothing): one
    # that comes is not about our blocks and is ignored. A write_failed ends it: the process
    # that answered misaddressed fails the job it keeps for our blocks.
    (AwaitState.CONNECTING, AwaitEvent.WRITE_FAILED): AwaitState.FAILED,
    (AwaitState.ANNOUNCED, AwaitEvent.WRITE_DONE): AwaitState.DONE,
    (AwaitState.ANNOUNCED, AwaitEvent.WRITE_FAILED): AwaitState.FAILED,
    (AwaitState.ANNOUNCED, AwaitEvent.GIVE_UP): AwaitState.QUARANTINED,
    # The sender refused remote_blocks before queuing it: the prefill cannot write.
    (AwaitState.ANNOUNCED, AwaitEvent.UNREACHABLE): AwaitState.FAILED,
    (AwaitState.ANNOUNCED, AwaitEvent.READDRESS): AwaitState.CONNECTING,
    (AwaitState.QUARANTINED, AwaitEvent.WRITE_DONE): AwaitState.DONE,
    (AwaitState.QUARANTINED, AwaitEvent.WRITE_FAILED): AwaitState.FAILED,
    (AwaitState.QUARANTINED, AwaitEvent.WRITER_GONE): AwaitState.FAILED,
    # Given up while remote_blocks was being sent, which the sender then refused: never sent.
    (AwaitState.QUARANTINED, AwaitEvent.UNREACHABLE): AwaitState.FAILED,
    # write_done with verify on: every write landed, so nothing is left to quarantine.
    **{
        (s, AwaitEvent.VERIFY): AwaitState.VERIFYING
        for s in (AwaitState.ANNOUNCED, AwaitState.QUARANTINED)
    },
    (AwaitState.VERIFYING, AwaitEvent.VERIFIED): AwaitState.DONE,
    (AwaitState.VERIFYING, AwaitEvent.MISMATCH): AwaitState.FAILED,
}
AWAIT_TERMINAL = frozenset({AwaitState.DONE, AwaitState.FAILED})
# Where a misaddressed answer applies: the prefill may have our announcement (ANNOUNCED), or we
# gave up after announcing and wait for its writes to stop (QUARANTINED).
_MISADDRESSABLE = frozenset({AwaitState.ANNOUNCED, AwaitState.QUARANTINED})


S = TypeVar("S", ReadState, AwaitState)


def _overall(states: list[S], live: tuple[S, ...], done: S, failed: S) -> S:
    """A load's state from its parts': the first of ``live`` a part is in; once every part is
    terminal, ``done`` when all are (``failed`` otherwise, or without parts)."""
    for state in live:
        if state in states:
            return state
    return done if states and all(s is done for s in states) else failed


@dataclass
class _ReadPart:
    """One source prefill rank's share of a READ: one engine transfer."""

    rank: int
    engine_tid: str
    machine: Machine[ReadState, ReadEvent]
    peer: Peer | None = None
    message: str = ""
    # The incarnation of the prefill rank that computed the request: the only one read from.
    incarnation: str = ""
    # The block pairs a whole-block check covers (verify), when the READ moves exactly them.
    verified_pairs: tuple[Sequence[int], Sequence[int]] | None = None
    groups: int = 1  # the KV-cache groups the READ moves (stats)
    posting: bool = False  # its READ is being posted (past the check of read.failing)


@dataclass
class _Read:
    task: RecvTask
    started: float
    parts: list[_ReadPart] = field(default_factory=list)
    plan: TpPlan | None = None
    sync: bool = False  # waited for in the caller's load hook (not reported as finished)
    failing: bool = False  # a part failed: the others are stopped, the load will fail
    ended: bool = False
    quarantine_counted: bool = False  # its blocks are in the stats' quarantined_blocks (once)

    def state(self) -> ReadState:
        return _overall(
            [p.machine.state for p in self.parts],
            (ReadState.QUARANTINED, ReadState.CONNECTING, ReadState.READING, ReadState.VERIFYING),
            ReadState.DONE,
            ReadState.FAILED,
        )

    def peers(self) -> dict[int, Peer]:
        return {p.rank: p.peer for p in self.parts if p.peer is not None}


def _answer_of(task: RecvTask) -> tuple[str, int] | None:
    """Which prefill answer ``task`` reads: its transfer id and the hold it states (None: it
    states none)."""
    hold = task.remote_hold_until_ms
    return None if hold is None else (task.transfer_id, hold)


class _ReleasedAnswers:
    """Prefill answers this rank released, each until its hold may have ended (bounded: at most
    :data:`MAX_RELEASED_ANSWERS`, the oldest go first). The context lock held by callers."""

    def __init__(self) -> None:
        self._until: OrderedDict[tuple[str, int], float] = OrderedDict()

    def add(self, answer: tuple[str, int], until: float, now: float) -> None:
        """Keeps ``answer`` until ``until`` at least (a later record never shortens one)."""
        until = max(until, self._until.pop(answer, until))
        self._until[answer] = until
        while self._until and (
            len(self._until) > MAX_RELEASED_ANSWERS or next(iter(self._until.values())) <= now
        ):
            self._until.popitem(last=False)

    def holds(self, answer: tuple[str, int] | None, now: float) -> bool:
        if answer is None:
            return False
        until = self._until.get(answer)
        return until is not None and until > now


@dataclass
class _AwaitPart:
    """One writing prefill rank of a WRITE await."""

    rank: int
    machine: Machine[AwaitState, AwaitEvent]
    peer: Peer | None = None
    quarantined: float = 0.0
    next_probe: float = 0.0
    failed_probes: int = 0
    probe: Future[str] | None = field(default=None, repr=False)
    # The incarnation a misaddressed answer named: announced to once more, only to it ("": not
    # yet; at most once per part).
    readdressed: str = ""


@dataclass
class _Await:
    task: RecvTask
    deadline: float
    parts: dict[int, _AwaitPart] = field(default_factory=dict)
    plan: TpPlan | None = None
    ended: bool = False
    quarantine_counted: bool = False  # its blocks are in the stats' quarantined_blocks (once)

    def state(self) -> AwaitState:
        return _overall(
            [p.machine.state for p in self.parts.values()],
            (
                AwaitState.QUARANTINED,
                AwaitState.CONNECTING,
                AwaitState.ANNOUNCED,
                AwaitState.VERIFYING,
            ),
            AwaitState.DONE,
            AwaitState.FAILED,
        )

    def peers(self) -> dict[int, Peer]:
        return {r: p.peer for r, p in self.parts.items() if p.peer is not None}


def _answer_ids(task: RecvTask) -> tuple[int, ...]:
    """The answer's block ids as this READ used them: every group's, flat, in order."""
    if task.grouped is None:
        return tuple(task.remote_block_ids)
    return tuple(b for ids in task.grouped.remote for b in ids)


def _answer_sizes(task: RecvTask) -> tuple[int, ...]:
    """How many of :func:`_answer_ids` each group's list holds (empty: ungrouped)."""
    return () if task.grouped is None else tuple(len(ids) for ids in task.grouped.remote)


def _read_remote_ids(task: RecvTask) -> tuple[int, ...]:
    """The prefill blocks a READ of ``task`` takes (every group's, without the null block)."""
    return task.remote_block_ids if task.grouped is None else task.grouped.remote_ids()


def _announced_ids(waiting: _Await, groups: Sequence[KvGroup] = ()) -> Sequence[int] | None:
    """The blocks a whole-block check of a WRITE covers, in the order announced (the
    writer's checksums come in that order); None when more than one prefill rank writes or
    the request has several KV-cache groups. A sliding-window group (``groups``: ours) is
    written only from the block of the first token the window needs (pd/groups.py's
    _attention_segments): the blocks announced before it are not written, nor checksummed."""
    task = waiting.task
    if len(waiting.parts) != 1:
        return None
    if task.grouped is None:
        return task.local_block_ids
    if len(task.grouped.local) != 1:
        return None
    first = 0
    if len(groups) == 1 and groups[0].kind == "sliding":
        bs, grouped = groups[0].block_size, task.grouped
        first = max(grouped.start, grouped.end - groups[0].sliding_window + 1) // bs
    return [b for i, b in enumerate(task.grouped.local[0]) if b != NULL_BLOCK and i >= first]


def _check_readdressed(peer: Peer, task: RecvTask, expect: str) -> None:
    """A part announced again after a misaddressed answer goes only to the process that asked
    for it (``expect``; "": not announced again): any other one never had the request's KV."""
    if expect and peer.response.incarnation != expect:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: prefill {peer.response.engine_id} at {peer.key} is "
            f"incarnation {peer.response.incarnation or '(none stated)'}, the blocks were asked "
            f"for again by incarnation {expect}: the prefill restarted once more; not announcing"
        )


def part_transfer_id(transfer_id: str, rank: int, parts: int) -> str:
    """The engine transfer id of one source rank's part: the request's own id when it has
    one part (equal TP sizes), else one id per source rank."""
    return transfer_id if parts == 1 else f"{transfer_id}{PART_SEPARATOR}p{rank}"


class Puller:
    """Decode-side transfers of one rank. Thread-safe through the context lock."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        # Anyone who reaches the notify port can send results of transfers we never had: a
        # line each would let them flood the log.
        self._stray_results = RateLimitedWarnings(logger, "write results of unknown transfers")
        self._reads: dict[str, _Read] = {}
        self._parts: dict[str, tuple[_Read, _ReadPart]] = {}  # by engine transfer id
        self._awaits: dict[str, _Await] = {}
        # Drain notices that overtook their undrained terminal event (separate engine queues):
        # the event, when it comes, is taken as drained.
        self._drained_early: set[str] = set()
        self._step_reads: list[str] = []
        self._released = _ReleasedAnswers()
        self._ended_awaits: OrderedDict[str, None] = OrderedDict()

    # ---- entry points (any thread) ------------------------------------------------------------

    def start(self, task: RecvTask) -> None:
        """Begin ``task``: never waits on the network."""
        cfg = self._ctx.cfg
        if task.aborted:
            if cfg.mode == "read":
                self.abandon_read(task.transfer_id, "the request was aborted")
            else:
                self.give_up(task.transfer_id, "the request was aborted")
        elif task.error:
            self._fail_unplanned(task)
        elif task.notify_only:
            self.send_release(task, {})
        elif cfg.mode == "read":
            self._start_read(task)
        else:
            self._start_await(task)

    def read_states(self) -> dict[str, ReadState]:
        with self._ctx.lock:
            return {tid: r.state() for tid, r in self._reads.items()}

    def await_states(self) -> dict[str, AwaitState]:
        with self._ctx.lock:
            return {tid: a.state() for tid, a in self._awaits.items()}

    # ---- READ ---------------------------------------------------------------------------------

    def _plan(self, task: RecvTask) -> TpPlan:
        return self._ctx.tp_plan(task.peer.host, task.remote_tp_size, prefill=False)

    def _connect(
        self, task: RecvTask, plan: TpPlan, rank: int, incarnation: str = ""
    ) -> Future[Peer]:
        """Prefill rank ``rank`` of the task's instance, never a cached handshake of another
        ``incarnation`` than the one given (raises before any network on a bad address). A
        request: when a remembered failure of the rank answers it, the rank is tried again in the
        background (a WRITE announcement names no incarnation that could buy an attempt)."""
        peer = task.peer
        return self._ctx.connect_rank(
            peer.host,
            peer.handshake_port,
            peer.notify_port,
            task.remote_dp_rank,
            plan.prefill_tp,
            rank,
            incarnation=incarnation,
            recover=True,
        )

    def _start_read(self, task: RecvTask) -> None:
        ctx = self._ctx
        tid = task.transfer_id
        read = _Read(task, time.monotonic(), sync=ctx.cfg.sync_read)
        with ctx.lock:
            duplicate = tid in self._reads
            released = not duplicate and self._released.holds(_answer_of(task), time.monotonic())
            if not duplicate and not released:
                self._reads[tid] = read
                if read.sync:
                    self._step_reads.append(tid)
        if duplicate:
            self._refuse_duplicate(task, "READ")
            return
        if released:
            self._refuse_released(task)
            return
        try:
            read.plan = plan = self._plan(task)
        except MoriioError as exc:
            self._read_not_planned(read, exc)
            return
        sources = plan.sources(ctx.cfg.tp_rank)
        with ctx.lock:
            for rank in sources:
                part_tid = part_transfer_id(tid, rank, len(sources))
                machine = Machine("READ", part_tid, READ_TRANSITIONS, ReadState.CONNECTING)
                part = _ReadPart(rank, part_tid, machine)
                read.parts.append(part)
                self._parts[part_tid] = (read, part)
        for part in list(read.parts):
            try:
                part.incarnation = expected_incarnation(ctx.cfg, task, plan, part.rank)
                future = self._connect(task, plan, part.rank, part.incarnation)
            except MoriioError as exc:
                self._part_failed(read, part, f"not started: {exc}")
                continue
            future.add_done_callback(lambda f, part=part: self._post_read(read, part, f))

    def _read_not_planned(self, read: _Read, exc: MoriioError) -> None:
        """No plan (the TP sizes cannot pair): the load fails at once, every prefill rank the
        request may name is released."""
        logger.error(
            "request %s (transfer %s): READ from %s not started: %s",
            read.task.req_id,
            read.task.transfer_id,
            read.task.peer.host,
            exc,
        )
        with self._ctx.lock:
            read.failing = True
        self._finish_read(read, str(exc))

    def _post_read(self, read: _Read, part: _ReadPart, future: Future[Peer]) -> None:
        """A part's handshake ended (a pool thread, or the caller's when cached): post its
        READ, unless another part failed meanwhile."""
        task = read.task
        peer: Peer | None = None
        try:
            peer = future.result()
            check_engine(peer, task.remote_engine_id)
            check_incarnation(peer, task, part.incarnation)
            check_hold(peer, task, self._ctx.cfg, time.monotonic())
            part.peer = peer
            with self._ctx.lock:
                failing = read.failing
                part.posting = not failing
            if failing:  # the prefill answered well: its handshake stays cached
                self._end_read_part(
                    read,
                    part,
                    ReadEvent.FAILED,
                    "not started: another source rank of the load failed",
                    peer_failed=False,
                )
                return
            assert read.plan is not None
            with self._ctx.directory.posting(peer):
                self._post_part(read, part, peer)
        except Exception as exc:  # any failure: recompute locally, free the prefill
            # The handshake the checks refused too (part.peer is set once they pass): one naming
            # another engine than the request's is stale (its prefill restarted as a new engine).
            self._ctx.directory.forget(peer)
            self._part_failed(read, part, f"not started: {exc}")
            return
        with self._ctx.lock:
            if part.machine.state is ReadState.CONNECTING:
                part.machine.advance(ReadEvent.POSTED)
            # Another part failed while this one was being posted: _stop_other_parts found it
            # CONNECTING and left it, so it is aborted here (exactly one of the two sees it).
            stop = read.failing and part.machine.state is ReadState.READING
        if stop:
            self._abort_part(part)
            return
        self._check_posted_within_hold(read, part, peer)

    def _check_posted_within_hold(self, read: _Read, part: _ReadPart, peer: Peer) -> None:
        """The engine's deadline started inside the post, after the check before it (the lock,
        planning or a pause of the process came between): checked again now, and a READ that
        may outlive the prefill's hold is aborted at once (the load fails, recomputed). One that
        already ended is judged at its completion (:func:`check_held_until`)."""
        try:
            check_hold(peer, read.task, self._ctx.cfg, time.monotonic())
        except FailedPreconditionError as exc:
            logger.error(
                "request %s: %s (posted %.1f s after the request started); aborting the READ "
                "posted",
                read.task.req_id,
                exc,
                time.monotonic() - read.started,
            )
            try:
                self._ctx.engine().abort(part.engine_tid)
            except MoriioError as abort_error:  # ended meanwhile: its completion is checked
                logger.info("transfer %s: not aborted: %s", part.engine_tid, abort_error)

    def _post_part(self, read: _Read, part: _ReadPart, peer: Peer) -> None:
        """Post one part's READ: the request's block pairs (per KV-cache group when grouped),
        cut to the part's head windows when the TP sizes differ. Remembers the pairs a check
        of whole blocks covers (verify), when the READ moves exactly those."""
        task, cfg, engine = read.task, self._ctx.cfg, self._ctx.engine()
        assert read.plan is not None
        grouped = None
        pairs = (task.local_block_ids, task.remote_block_ids)
        if task.grouped is not None:
            grouped = plan_grouped(cfg, peer, task.grouped, "local")
            part.groups = len({s.group for s in grouped})
            base = engine_segments(grouped)
            whole = len(grouped) == 1 and grouped[0].tokens is None
            pairs = (grouped[0].local_blocks, grouped[0].remote_blocks) if whole else None
        else:
            base = [BlockSegment(task.local_block_ids, task.remote_block_ids)]
        segments = read_segments(read.plan, cfg, part.rank, base)
        if segments is not None:
            part.verified_pairs = None
            engine.read_segments(part.engine_tid, peer.engine_peer, segments)
            return
        part.verified_pairs = pairs
        if grouped is not None:
            post_read(engine, part.engine_tid, peer.engine_peer, grouped)
        else:
            engine.read(part.engine_tid, peer.engine_peer, *pairs)

    def peers_in_use(self) -> set[str]:
        """Engine peers of READ parts and of WRITE waits (a prefill that may be writing into
        our blocks) not yet terminal (lock held)."""
        reads = {
            part.peer.engine_peer
            for _, part in self._parts.values()
            if part.peer is not None and part.machine.state not in READ_TERMINAL
        }
        writes = {
            part.peer.engine_peer
            for waiting in self._awaits.values()
            for part in waiting.parts.values()
            if part.peer is not None and part.machine.state not in AWAIT_TERMINAL
        }
        return reads | writes

    def on_event(self, event: Any) -> bool:
        """An engine terminal event; False when it is not one of our READs."""
        ctx = self._ctx
        tid = event.transfer_id
        with ctx.lock:
            found = self._parts.get(tid)
            if found is None:
                return False
            read, part = found
            if part.machine.state in READ_TERMINAL:
                return True
            if part.machine.state is ReadState.CONNECTING:
                # The engine answered before our own bookkeeping caught up with the post.
                part.machine.advance(ReadEvent.POSTED)
            drained = event.drained or tid in self._drained_early
            self._drained_early.discard(tid)
            if not drained:
                part.machine.advance(ReadEvent.UNDRAINED)
                part.message = f"{event.state}: {event.message}"
                if not read.quarantine_counted:  # once per block, whatever its parts
                    read.quarantine_counted = True
                    ctx.stats.record_quarantine(len(read.task.local_block_ids))
        if not drained:
            self._quarantine_read(read, part, event)
            self._stop_other_parts(read)
            return True
        outcome = f"{event.state}: {event.message}"
        done = event.state == "done"
        if done and part.peer is not None:
            try:
                check_held_until(part.peer, read.task, time.monotonic())
            except FailedPreconditionError as exc:
                done, outcome = False, str(exc)
        if done and (ctx.verifier is not None or ctx.confirmer is not None):
            self._verify_read(read, part, event)
            return True
        # Aborted by us for the load's sake (a sibling failed, the request ended): the prefill
        # did nothing wrong, its handshake stays cached. The lock only for an aborted event.
        stopped = False
        if event.state == "aborted":
            with ctx.lock:
                stopped = read.failing
        self._end_read_part(
            read,
            part,
            ReadEvent.DONE if done else ReadEvent.FAILED,
            outcome,
            event,
            peer_failed=not stopped,
        )
        return True

    def on_event_error(self, event: Any, why: str) -> bool:
        """Handling ``event`` of one of our READ parts raised (a defect of ours): the load must
        still end, or vLLM waits for it for good -- a READ has no deadline of its own after the
        engine's event. A part the error left live fails (its bytes are not trusted: the load
        is recomputed) unless it is quarantined, which its drain ends; a part that reached its
        terminal state keeps it. False when ``event`` is not one of our READs."""
        ctx = self._ctx
        with ctx.lock:
            found = self._parts.get(event.transfer_id)
            if found is None:
                return False
            read, part = found
            if read.ended or part.machine.state is ReadState.QUARANTINED:
                return True
            state = part.machine.state
            last = all(p.machine.state in READ_TERMINAL for p in read.parts)
        logger.error("transfer %s: %s", event.transfer_id, why)
        if state not in READ_TERMINAL:
            failure = ReadEvent.MISMATCH if state is ReadState.VERIFYING else ReadEvent.FAILED
            self._end_read_part(read, part, failure, why)  # stops the others, ends the load
        elif last:
            self._finish_read(read, "; ".join(p.message for p in read.parts if p.message))
        return True

    def _verify_read(self, read: _Read, part: _ReadPart, event: Any) -> None:
        """A part's engine READ is done: compare both sides' checksums (verify), or have the
        prefill confirm it still holds the blocks the READ took (confirm_reads), before it
        counts. Only whole blocks are verified: verify is refused with different TP sizes
        (peers.py)."""
        ctx = self._ctx
        task = read.task
        with ctx.lock:
            if part.machine.state is not ReadState.READING:
                return
            # Read in the lock section that moves it to VERIFYING: _stop_parts sets failing and
            # collects the VERIFYING parts in one section, so one of the two ends it unchecked.
            failing = read.failing
            if not failing:
                part.machine.advance(ReadEvent.VERIFY)
        if failing:  # drained, and its check's verdict could not count
            self._end_read_part(
                read, part, ReadEvent.FAILED, "not checked: the load failed", peer_failed=False
            )
            return
        if ctx.confirmer is not None:
            assert part.peer is not None
            ctx.confirmer.confirm(
                task.transfer_id,
                part.peer,
                _read_remote_ids(task),
                task.remote_hold_until_ms or 0,
                lambda why: self._read_checked(read, part, event, why, confirmed=True),
                _answer_ids(task),
                _answer_sizes(task),
            )
            return
        if part.verified_pairs is None:
            self._read_checked(read, part, event, whole_blocks_only("READ"), confirmed=False)
            return
        assert ctx.verifier is not None and part.peer is not None
        local, remote = part.verified_pairs
        ctx.verifier.check_read(
            task.transfer_id,
            part.peer,
            local,
            remote,
            lambda why: self._read_checked(read, part, event, why, confirmed=False),
            task.remote_hold_until_ms or 0,
            _answer_ids(task),
            _answer_sizes(task),
        )

    def _read_checked(
        self, read: _Read, part: _ReadPart, event: Any, why: str | None, *, confirmed: bool
    ) -> None:
        """The prefill's side of a READ is in: its checksums compared (verify), or its hold
        confirmed (confirm_reads); ``why`` None when they agree. Runs on a checker's thread,
        where nothing would end the load if it raised: an error ends it as one handling the
        engine's event does (on_event_error: failed, recomputed)."""
        try:
            self._end_checked_read(read, part, event, why, confirmed=confirmed)
        except Exception as exc:
            logger.exception("transfer %s: error handling its check", event.transfer_id)
            self.on_event_error(
                event, f"internal error handling its check ({type(exc).__name__}: {exc})"
            )

    def _end_checked_read(
        self, read: _Read, part: _ReadPart, event: Any, why: str | None, *, confirmed: bool
    ) -> None:
        with self._ctx.lock:
            late = part.machine.state is not ReadState.VERIFYING
            if not late:
                stats = self._ctx.stats
                (stats.record_confirm if confirmed else stats.record_verify)(ok=why is None)
        if late:  # ended unchecked (the load failed or was aborted): the verdict is moot
            logger.info(
                "transfer %s: check verdict after its part ended: %s",
                part.engine_tid,
                why or "agreed",
            )
            return
        if why is None:
            checked = "confirmed" if confirmed else "verified"
            self._end_read_part(
                read, part, ReadEvent.VERIFIED, f"done, {checked}: {event.message}", event
            )
            return
        logger.error("request %s (transfer %s): %s", read.task.req_id, read.task.transfer_id, why)
        self._end_read_part(read, part, ReadEvent.MISMATCH, why)

    def on_drained(self, tid: str, seconds: float) -> bool:
        """The engine reports a quarantined transfer drained; False when not ours."""
        with self._ctx.lock:
            found = self._parts.get(tid)
            if found is None:
                return False
            read, part = found
            if part.machine.state is not ReadState.QUARANTINED:
                self._drained_early.add(tid)  # its undrained event is still queued
                return True
        self._end_read_part(
            read, part, ReadEvent.DRAINED, f"operations drained {seconds:.3g}s after the start"
        )
        return True

    def _quarantine_read(self, read: _Read, part: _ReadPart, event: Any) -> None:
        """Dropping the peer closes the endpoint the in-flight operations use, which cancels
        them; the blocks stay unreported until the engine confirms the drain."""
        logger.warning(
            "request %s (transfer %s): READ from prefill rank %d %s with operations in flight "
            "(%s); its %d blocks are quarantined until they drain",
            read.task.req_id,
            part.engine_tid,
            part.rank,
            event.state,
            event.message,
            len(read.task.local_block_ids),
        )
        peer = part.peer
        if peer is not None:
            self._ctx.directory.forget(peer)
            try:
                self._ctx.engine().remove_peer(peer.engine_peer)
            except MoriioError as exc:
                logger.debug("peer %s already gone: %s", peer.engine_peer, exc)

    def _part_failed(self, read: _Read, part: _ReadPart, message: str) -> None:
        logger.error(
            "request %s (transfer %s): READ from %s (prefill rank %d) %s",
            read.task.req_id,
            part.engine_tid,
            read.task.peer.host,
            part.rank,
            message,
        )
        self._end_read_part(read, part, ReadEvent.FAILED, message)

    def abandon_read(self, tid: str, why: str) -> None:
        """The request of READ ``tid`` ended: its load fails, and parts whose READ is not being
        posted end now too (nothing of them can land)."""
        with self._ctx.lock:
            read = self._reads.get(tid)
            if read is None or read.ended:
                return
        self._stop_parts(read, f"not checked: {why}", not_started=f"not started: {why}")

    def _stop_other_parts(self, read: _Read) -> None:
        """A part failed: the load fails; parts not posted yet will not be (_post_read sees
        read.failing)."""
        self._stop_parts(read, "not checked: another source rank failed")

    def _stop_parts(self, read: _Read, unchecked: str, not_started: str | None = None) -> None:
        """The load fails: its posted parts are aborted in the engine (their events end them)
        and parts being checked end now, ``unchecked`` (drained: the verdict no longer counts);
        with ``not_started``, parts whose READ is not being posted end now too (one being
        posted is aborted by _post_read, which sees read.failing). Without it, once a load."""
        with self._ctx.lock:
            if read.failing and not_started is None:
                return
            read.failing = True
            posted = [p for p in read.parts if p.machine.state is ReadState.READING]
            checking = [p for p in read.parts if p.machine.state is ReadState.VERIFYING]
            idle = [
                p for p in read.parts if p.machine.state is ReadState.CONNECTING and not p.posting
            ]
        for part in posted:
            self._abort_part(part)
        if not_started is not None:
            for part in idle:
                self._end_read_part(read, part, ReadEvent.FAILED, not_started, peer_failed=False)
        for part in checking:
            self._end_read_part(read, part, ReadEvent.MISMATCH, unchecked, peer_failed=False)

    def _abort_part(self, part: _ReadPart) -> None:
        """Abort a posted part in the engine (its event ends it)."""
        try:
            self._ctx.engine().abort(part.engine_tid)
        except MoriioError as exc:
            logger.debug("transfer %s: not aborted (%s)", part.engine_tid, exc)

    def _end_read_part(
        self,
        read: _Read,
        part: _ReadPart,
        event: ReadEvent,
        message: str,
        engine_event: Any = None,
        peer_failed: bool = True,
    ) -> None:
        """A part's terminal state, once; the load's end once every part is terminal.
        ``peer_failed`` False: ended for the load's sake, its prefill did nothing wrong."""
        ctx = self._ctx
        with ctx.lock:
            if part.machine.state in READ_TERMINAL:
                return
            state = part.machine.advance(event)
            part.message = message
            ok = state is ReadState.DONE
            if ok and engine_event is not None:
                ctx.stats.record_transfer(engine_event, part.groups)
            last = all(p.machine.state in READ_TERMINAL for p in read.parts)
        if not ok:
            # The next request handshakes again: a prefill that restarted under the same
            # address is reached at its new transport address instead of failing forever.
            if peer_failed:
                ctx.directory.forget(part.peer)
            self._stop_other_parts(read)
        if last:
            self._finish_read(read, "; ".join(p.message for p in read.parts if p.message))

    def _finish_read(self, read: _Read, message: str) -> None:
        """Every part is terminal: report the load, once, and release the prefill."""
        ctx = self._ctx
        task = read.task
        with ctx.lock:
            if read.ended:
                return
            read.ended = True
            # Before the READ leaves _reads: no load of the same answer may start in between.
            self._remember_released(task, next(iter(read.peers().values()), None))
            for part in read.parts:
                self._parts.pop(part.engine_tid, None)
            state = read.state()
            ok = state is ReadState.DONE
            if not ok:
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
            logger.warning(
                "request %s (transfer %s): READ %s (%s); its %d blocks will be recomputed",
                task.req_id,
                task.transfer_id,
                state.name.lower(),
                message,
                len(task.local_block_ids),
            )
        self.send_release(task, read.peers(), read.plan)

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
                while not read.ended and not ctx.stop.is_set():
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
        waiting = _Await(task, time.monotonic() + ctx.cfg.abort_timeout)
        with ctx.lock:
            duplicate = task.transfer_id in self._awaits
            reused = not duplicate and task.transfer_id in self._ended_awaits
            if not duplicate and not reused:
                self._awaits[task.transfer_id] = waiting
        if duplicate:
            self._refuse_duplicate(task, "WRITE")
            return
        if reused:
            self._refuse_reused_write(task)
            return
        try:
            waiting.plan = plan = self._plan(task)
        except MoriioError as exc:
            self._announce_failed(waiting, None, exc)
            return
        with ctx.lock:
            for rank in plan.sources(ctx.cfg.tp_rank):
                machine = Machine(
                    "WRITE-await", task.transfer_id, AWAIT_TRANSITIONS, AwaitState.CONNECTING
                )
                waiting.parts[rank] = _AwaitPart(rank, machine)
        for part in list(waiting.parts.values()):
            try:
                future = self._connect(task, plan, part.rank)
            except MoriioError as exc:
                self._announce_failed(waiting, part, exc)
                continue
            future.add_done_callback(lambda f, part=part: self._announce(waiting, part, f))

    def _announce(self, waiting: _Await, part: _AwaitPart, future: Future[Peer]) -> None:
        """Handshake done: tell the prefill rank where to write."""
        ctx = self._ctx
        task = waiting.task
        peer = None
        try:
            peer = future.result()
            check_engine(peer, task.remote_engine_id)
            _check_readdressed(peer, task, part.readdressed)
            block_ids: tuple[tuple[int, ...], ...] = (task.local_block_ids,)
            num_tokens = 0
            if task.grouped is not None:
                # Refused here, before the prefill knows our blocks, when the groups differ.
                check_groups(ctx.cfg.groups, peer.response.kv_groups, peer.response.engine_id)
                block_ids, num_tokens = task.grouped.local, task.grouped.end
            announcement = RemoteBlocks(
                transfer_id=task.transfer_id,
                block_ids=block_ids,
                decode_engine_id=ctx.cfg.engine_id,
                decode_dp_rank=ctx.cfg.dp_rank,
                req_id=task.req_id,
                decode_tp_rank=ctx.cfg.tp_rank,
                num_tokens=num_tokens,
                decode_incarnation=ctx.incarnation,
                prefill_incarnation=peer.response.incarnation,
            )
            with ctx.lock:
                if part.machine.state is not AwaitState.CONNECTING:
                    return  # given up before the prefill had our blocks (and released)
                part.machine.advance(AwaitEvent.ANNOUNCED)
                part.peer = peer  # from now on the prefill may write into the blocks
        except Exception as exc:
            self._announce_failed(waiting, part, exc, peer)
            return
        try:
            ctx.sender.send(peer.host, peer.notify_port, announcement)
        except MoriioError as exc:
            # The sender refuses before queuing anything (queue full, allowlist, closed): the
            # prefill never had our blocks, so there is nothing to quarantine.
            self._announce_failed(waiting, part, exc, peer, unsent=True)
        except Exception as exc:
            self._announce_failed(waiting, part, exc, peer)

    def _announce_failed(
        self,
        waiting: _Await,
        part: _AwaitPart | None,
        exc: Exception,
        peer: Peer | None = None,
        unsent: bool = False,
    ) -> None:
        """The announcement to ``part`` (None: to any, there is no plan) failed: the load
        fails, the other parts are given up. ``unsent``: the sender refused the announcement
        before queuing it, so a part already ANNOUNCED ends without a quarantine."""
        task = waiting.task
        logger.error(
            "request %s (transfer %s): cannot announce blocks to %s%s: %s; computing locally",
            task.req_id,
            task.transfer_id,
            task.peer.host,
            "" if part is None else f" (prefill rank {part.rank})",
            exc,
        )
        self._ctx.directory.forget(peer)
        if part is None:
            self._report_await(waiting, ok=False, why=f"not planned: {exc}")
            self.send_release(task, {}, None)
            return
        with self._ctx.lock:
            state = part.machine.state
        if state in (AwaitState.ANNOUNCED, AwaitState.QUARANTINED) and not unsent:
            # The message may have left: the prefill could write. Quarantine as for an abort
            # (one a give_up that raced the send made already is kept).
            self.give_up(task.transfer_id, f"the announcement failed ({exc})")
            return
        if not self._end_await_part(waiting, part, AwaitEvent.UNREACHABLE):
            return  # given up meanwhile: that released the prefill rank already
        # The prefill holds the blocks for our remote_blocks, which will not come.
        peers = {} if peer is None else {part.rank: peer}
        self._release_ranks(task, peers, waiting.plan, [part.rank])

    def on_write_result(
        self,
        tid: str,
        ok: bool,
        writer_rank: int = 0,
        checksums: dict[str, bytes] | None = None,
        writer_incarnation: str = "",
    ) -> None:
        """write_done (``ok``, with the prefill's ``checksums`` when it verifies), write_failed
        or write_aborted from prefill rank ``writer_rank``: each is sent only once none of its
        writes can land any more, so each also ends a quarantine. With verify on, a write_done
        is checked first (VERIFYING). A write_failed from another ``writer_incarnation`` than
        the part's handshake names (the rank restarted since, and refused an announcement
        addressed to its predecessor) drops that handshake: the next request handshakes the
        rank again."""
        ctx = self._ctx
        with ctx.lock:
            waiting = self._awaits.get(tid)
            part = None if waiting is None else waiting.parts.get(writer_rank)
        if waiting is None or part is None:
            self._stray_results.warn(
                "transfer %s: ignoring a write result from prefill rank %d, which does not "
                "write it",
                tid,
                writer_rank,
            )
            return
        peer = part.peer
        if peer is not None and writer_incarnation not in ("", peer.response.incarnation):
            ctx.directory.forget(peer)
        if not ok or ctx.verifier is None:
            self._end_await_part(
                waiting, part, AwaitEvent.WRITE_DONE if ok else AwaitEvent.WRITE_FAILED
            )
            return
        with ctx.lock:
            if not part.machine.allows(AwaitEvent.VERIFY):
                return
            part.machine.advance(AwaitEvent.VERIFY)
        local = _announced_ids(waiting, ctx.cfg.groups)
        if local is None:
            self._write_verified(
                waiting,
                part,
                whole_blocks_only("WRITE"),
            )
            return
        ctx.verifier.check_write(
            tid, checksums, local, lambda why: self._write_verified(waiting, part, why)
        )

    def on_misaddressed(self, message: Misaddressed) -> None:
        """Our announcement reached a successor of the prefill process we handshook (our cached
        handshake predates its restart): it wrote nothing. An announced part handshakes the new
        process and announces its blocks to it, once. A part that did so already fails and
        releases the rank (the process that answered now keeps its job for an announcement we
        will not make; a give_up racing this may have sent it abort_write too, which it
        acknowledges, and the release then finds nothing); a quarantined one (we gave up
        meanwhile, abort_write went out) fails: nothing of it landed or will. A message that
        does not name the incarnation we announced to, or comes in any other state, is not
        about a live announcement and is ignored."""
        ctx = self._ctx
        tid, rank = message.transfer_id, message.writer_rank
        with ctx.lock:
            waiting = self._awaits.get(tid)
            part = None if waiting is None else waiting.parts.get(rank)
            old = None if part is None else part.peer
            state = None
            if old is not None and old.response.incarnation == message.addressed_incarnation:
                assert part is not None
                state = part.machine.state
            again = state is AwaitState.ANNOUNCED and part is not None and not part.readdressed
            if again and part is not None:
                part.machine.advance(AwaitEvent.READDRESS)
                part.peer = None
                part.readdressed = message.writer_incarnation
        if waiting is None or part is None or state not in _MISADDRESSABLE:
            self._stray_results.warn(
                "transfer %s: ignoring misaddressed from prefill rank %d: no live announcement "
                "of ours went to its incarnation %s",
                tid,
                rank,
                message.addressed_incarnation,
            )
            return
        ctx.directory.forget(old)  # that process is gone: its address serves another one
        if again:
            self._readdress(waiting, part, message)
            return
        why = (
            f"prefill rank {rank} restarted again (now incarnation "
            f"{message.writer_incarnation}) and wrote nothing"
        )
        ended = self._end_await_part(waiting, part, AwaitEvent.WRITE_FAILED, why)
        if ended and state is AwaitState.ANNOUNCED and old is not None:
            self._release_ranks(waiting.task, {rank: old}, waiting.plan, [rank])

    def _readdress(self, waiting: _Await, part: _AwaitPart, message: Misaddressed) -> None:
        """Handshake the process that answered misaddressed (``part`` back in CONNECTING) and
        announce the part's blocks to it; :meth:`_announce` checks that it answers as the
        incarnation the message named."""
        task, plan = waiting.task, waiting.plan
        assert plan is not None  # an announced part was planned
        with self._ctx.lock:
            if part.machine.state is not AwaitState.CONNECTING:
                return  # given up meanwhile, which released the rank
        logger.warning(
            "request %s (transfer %s): prefill rank %d restarted since our handshake "
            "(incarnation %s, now %s) and wrote nothing; announcing the blocks to the new process",
            task.req_id,
            task.transfer_id,
            part.rank,
            message.addressed_incarnation,
            message.writer_incarnation,
        )
        try:
            future = self._connect(task, plan, part.rank, message.writer_incarnation)
        except MoriioError as exc:
            self._announce_failed(waiting, part, exc)
            return
        future.add_done_callback(lambda f: self._announce(waiting, part, f))

    def _write_verified(self, waiting: _Await, part: _AwaitPart, why: str | None) -> None:
        """The integrity check of a written part is done (``why`` None: it agreed). Runs on the
        verifier's thread, where nothing would end the load if it raised, and a part being
        verified has no deadline (its writes ended): an error fails the part (recomputed)."""
        task = waiting.task
        try:
            with self._ctx.lock:
                self._ctx.stats.record_verify(ok=why is None)
            if why is not None:
                logger.error("request %s (transfer %s): %s", task.req_id, task.transfer_id, why)
            self._end_await_part(
                waiting,
                part,
                AwaitEvent.VERIFIED if why is None else AwaitEvent.MISMATCH,
                why or "",
            )
        except Exception as exc:
            logger.exception("transfer %s: error handling its integrity check", task.transfer_id)
            self._end_await_part(
                waiting,
                part,
                AwaitEvent.MISMATCH,
                f"internal error handling its integrity check ({type(exc).__name__}: {exc})",
            )

    def give_up(self, tid: str, why: str) -> None:
        """Stop waiting for the prefill's writes. Announced parts are quarantined
        (abort_write) until their prefill rank confirms; the others end now."""
        ctx = self._ctx
        with ctx.lock:
            waiting = self._awaits.get(tid)
            if waiting is None:
                return
            quarantined, ended = [], []
            for part in waiting.parts.values():
                if not part.machine.allows(AwaitEvent.GIVE_UP):
                    continue
                if part.machine.advance(AwaitEvent.GIVE_UP) is AwaitState.QUARANTINED:
                    now = time.monotonic()
                    part.quarantined = now
                    part.next_probe = now + PROBE_WRITER_EVERY_S
                    if not waiting.quarantine_counted:  # once per block, whatever its parts
                        waiting.quarantine_counted = True
                        ctx.stats.record_quarantine(len(waiting.task.local_block_ids))
                    quarantined.append(part)
                else:
                    ended.append(part)
            done = not waiting.ended and all(
                p.machine.state in AWAIT_TERMINAL for p in waiting.parts.values()
            )
        for part in quarantined:
            self._abort_write(waiting, part, why)
        if ended:
            self._release_ranks(waiting.task, {}, waiting.plan, [p.rank for p in ended])
        if done:
            self._report_await(waiting, ok=False, why=why)

    def _abort_write(self, waiting: _Await, part: _AwaitPart, why: str) -> None:
        ctx = self._ctx
        task, peer = waiting.task, part.peer
        assert peer is not None
        logger.warning(
            "request %s (transfer %s): %s; its %d blocks are quarantined until prefill rank %d "
            "confirms its writes stopped (at most quarantine_timeout, %.0fs)",
            task.req_id,
            task.transfer_id,
            why,
            len(task.local_block_ids),
            part.rank,
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
                    decode_tp_rank=ctx.cfg.tp_rank,
                    decode_tp_size=ctx.cfg.tp_size,
                ),
            )
        except MoriioError as exc:
            logger.warning("transfer %s: abort_write not sent: %s", task.transfer_id, exc)

    def _end_await_part(
        self, waiting: _Await, part: _AwaitPart, event: AwaitEvent, why: str = ""
    ) -> bool:
        """A part's end; a failed one gives up the others, the last one reports the load.
        False when ``event`` does not apply (the part ended, or moved on, before it)."""
        with self._ctx.lock:
            if not part.machine.allows(event):
                return False
            part.machine.advance(event)
            failed = part.machine.state is not AwaitState.DONE
            done = not waiting.ended and all(
                p.machine.state in AWAIT_TERMINAL for p in waiting.parts.values()
            )
        why = why or f"WRITE ended by {event.name.lower()} of prefill rank {part.rank}"
        if failed and not done:
            self.give_up(waiting.task.transfer_id, why)
            return True
        if done:
            ok = waiting.state() is AwaitState.DONE
            self._report_await(waiting, ok=ok, why=why)
        return True

    def _report_await(self, waiting: _Await, ok: bool, why: str = "gave up") -> None:
        ctx = self._ctx
        task = waiting.task
        with ctx.lock:
            if waiting.ended or self._awaits.pop(task.transfer_id, None) is None:
                return
            waiting.ended = True
            # The listener drops this id's messages from now on (mark_terminal below).
            self._ended_awaits[task.transfer_id] = None
            self._ended_awaits.move_to_end(task.transfer_id)
            while len(self._ended_awaits) > MAX_ENDED_AWAITS:
                self._ended_awaits.popitem(last=False)
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
        """Give up awaits past abort_timeout; free or probe quarantined parts."""
        ctx = self._ctx
        expired: list[str] = []
        gone: list[tuple[_Await, _AwaitPart]] = []
        to_probe: list[tuple[_Await, _AwaitPart]] = []
        with ctx.lock:
            for tid, waiting in self._awaits.items():
                live = [p for p in waiting.parts.values() if p.machine.state not in AWAIT_TERMINAL]
                waiting_for_writes = any(
                    p.machine.state is not AwaitState.QUARANTINED for p in live
                )
                if waiting_for_writes and now > waiting.deadline:
                    expired.append(tid)
                for part in live:
                    if part.machine.state is not AwaitState.QUARANTINED:
                        continue
                    if now > part.quarantined + ctx.cfg.quarantine_timeout:
                        gone.append((waiting, part))
                    elif part.probe is None and now >= part.next_probe:
                        part.next_probe = now + PROBE_WRITER_EVERY_S
                        to_probe.append((waiting, part))
        for tid in expired:
            self.give_up(
                tid, f"the KV did not arrive within abort_timeout ({ctx.cfg.abort_timeout:.0f}s)"
            )
        for waiting, part in gone:
            logger.warning(
                "transfer %s: no drain confirmation from prefill rank %d within "
                "quarantine_timeout (%.0fs); freeing its blocks",
                waiting.task.transfer_id,
                part.rank,
                ctx.cfg.quarantine_timeout,
            )
            # Given up on as dead: a prefill restarted since refuses what names its predecessor.
            ctx.directory.forget(part.peer)
            self._end_await_part(waiting, part, AwaitEvent.WRITER_GONE)
        for waiting, part in to_probe:
            assert part.peer is not None
            future = ctx.directory.probe(part.peer)
            with ctx.lock:
                part.probe = future
            future.add_done_callback(lambda f, w=waiting, p=part: self._probed(w, p, f))

    def _probed(self, waiting: _Await, part: _AwaitPart, future: Future[str]) -> None:
        """A quarantined part's prefill rank answered a probe (or did not): another instance
        there is proof its writes ended; only several failures in a row are taken as death."""
        try:
            dead = future.result()
        except Exception as exc:
            dead = f"probe failed ({exc})"
        restarted = dead.startswith("it restarted")
        with self._ctx.lock:
            part.probe = None
            part.failed_probes = part.failed_probes + 1 if dead else 0
            failures = part.failed_probes
        if not dead or (not restarted and failures < PROBE_FAILURES_FOR_DEATH):
            return
        assert part.peer is not None
        logger.warning(
            "transfer %s: the prefill %s died: %s; freeing the quarantined blocks",
            waiting.task.transfer_id,
            part.peer.response.engine_id,
            dead if restarted else f"{dead}, {failures} probes in a row",
        )
        self._ctx.directory.forget(part.peer)
        self._end_await_part(waiting, part, AwaitEvent.WRITER_GONE)

    # ---- shared -------------------------------------------------------------------------------

    def _refuse_duplicate(self, task: RecvTask, what: str) -> None:
        """A load for a transfer id another live load holds (two requests carrying one
        transfer_id; the scheduler side refuses the second, so a request that came after the
        first ended on the scheduler side while its load still runs): its blocks are
        recomputed. No release goes to the prefill: what it holds under that id is the first
        load's."""
        logger.warning(
            "request %s (transfer %s): another %s of this transfer is still live; this "
            "request's blocks are recomputed",
            task.req_id,
            task.transfer_id,
            what,
        )
        self._report_load_failed(task)

    def _refuse_reused_write(self, task: RecvTask) -> None:
        """A WRITE load of a transfer id a WRITE await of this rank ended with already (a
        retried request, a client's own params): the notify listener drops every message of
        that id now, so none of the prefill's answers (write_done, write_failed, write_aborted)
        would reach this load, which would wait abort_timeout and then its quarantine for
        nothing. Refused at once (its blocks recomputed). No release goes out, as for a
        duplicate: the prefill keys its jobs by transfer id and decode rank alone, so a release
        could end another decode's job of the same id; a prefill job of this one that waits for
        our blocks ends at its own deadline."""
        logger.error(
            "request %s (transfer %s): this rank ended a WRITE of that transfer id already; "
            "transfer ids must be fresh per request (the prefill's answers to a second one "
            "cannot be told from the first's); its blocks are recomputed",
            task.req_id,
            task.transfer_id,
        )
        self._report_load_failed(task)

    def _refuse_released(self, task: RecvTask) -> None:
        """A load of a prefill answer this rank released already (a retried request carrying
        it): a release lets the prefill free the blocks at once, so they may hold another
        request's KV by now. Its blocks are recomputed; no release goes out again (one did)."""
        logger.error(
            "request %s (transfer %s): this rank released that prefill answer (holding until "
            "%d by the prefill's clock) already: an answer is read once, the release let the "
            "prefill free its blocks; its blocks are recomputed",
            task.req_id,
            task.transfer_id,
            task.remote_hold_until_ms,
        )
        self._report_load_failed(task)

    def _fail_unplanned(self, task: RecvTask) -> None:
        """A load the planner could not pair: its blocks are recomputed, the prefill freed."""
        logger.error(
            "request %s (transfer %s): load not started: %s; its %d blocks are recomputed",
            task.req_id,
            task.transfer_id,
            task.error,
            len(task.local_block_ids),
        )
        self._report_load_failed(task, f"not planned: {task.error}")
        self.send_release(task, {})

    def _report_load_failed(self, task: RecvTask, why: str = "") -> None:
        """The task's blocks are load errors (recomputed), and the load ended failed (``why``,
        when given, is the failure reason reported for it)."""
        ctx = self._ctx
        with ctx.lock:
            ctx.reports.invalid_blocks.update(task.local_block_ids)
            if task.report_done:
                ctx.reports.done_recving.add(task.req_id)
                ctx.reports.failed_recving.add(task.req_id)
                if why:
                    ctx.reports.failures[task.req_id] = why
            ctx.stats.record(ok=False)

    def _remember_released(self, task: RecvTask, confirmed: Peer | None) -> None:
        """``task``'s answer is released (the prefill may free its blocks now): kept until its
        hold may have ended, by the prefill's clock as ``confirmed``'s handshake bounds it (from
        then on check_hold refuses a READ of it anyway: any handshake's bound is late by less
        than the READ's own margin), else by this rank's clock taken
        :data:`RELEASED_CLOCK_SLACK_S` ahead of the prefill's. An answer stating no hold is
        not kept."""
        answer = _answer_of(task)
        if answer is None:
            return
        now = time.monotonic()
        if confirmed is not None:
            prefill_now = confirmed.clock_at_most(now)
        else:
            prefill_now = now_ms() - round(RELEASED_CLOCK_SLACK_S * 1000)
        with self._ctx.lock:
            self._released.add(answer, now + max(0.0, (answer[1] - prefill_now) / 1000), now)

    def send_release(
        self, task: RecvTask, peers: dict[int, Peer], plan: TpPlan | None = None
    ) -> None:
        """Tell the prefill it may free the request's blocks: every prefill rank the plan has
        us release (the ranks we read from, at their handshaken addresses when we have them,
        and the unused ranks assigned to us, :mod:`moriio_native.pd.heads`)."""
        self._release_ranks(task, peers, plan, None)

    def _release_ranks(
        self,
        task: RecvTask,
        peers: dict[int, Peer],
        plan: TpPlan | None,
        only: list[int] | None,
    ) -> None:
        """Releases to the ranks of :meth:`send_release` (``only``: to those alone)."""
        ctx = self._ctx
        cfg = ctx.cfg
        confirmed = next(iter(peers.values()), None)
        self._remember_released(task, confirmed)
        if confirmed is not None:  # the TP size the prefill confirmed in the handshake
            tp_size, host = confirmed.response.tp_size, confirmed.host
        else:  # what the request said: bounded, since nothing confirmed it
            tp_size, host = task.remote_tp_size or cfg.tp_size, task.peer.host
        if plan is None or plan.prefill_tp != tp_size:
            try:
                plan = ctx.tp_plan(host, tp_size, prefill=False)
            except MoriioError:
                plan = None
        if plan is not None:
            targets = list(plan.release_targets(cfg.tp_rank))
        else:
            # No plan for these sizes (nothing was read): every prefill rank, whichever plan
            # it counts releases by (it ignores those it does not wait for).
            targets = list(range(tp_size))
        if only is not None:
            targets = [r for r in targets if r in only]
        if confirmed is None and len(targets) > MAX_UNCONFIRMED_RELEASES:
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
        for rank in targets:
            try:
                peer = peers.get(rank)
                if peer is not None:
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
    "part_transfer_id",
]
