"""The prefill side of the protocol: blocks held for READs, WRITE pushes (one rank).

Held READ (:class:`SendState`): a finished request's blocks stay until every decode rank that
reads from this rank (or is assigned to release it) released them
(:class:`~moriio_native.pd.heads.TpPlan`), or ``abort_timeout`` passes.

WRITE job (:class:`JobState`), one per request and decode rank this rank writes to (one with
equal TP sizes; with different sizes each gets its head range, :mod:`moriio_native.pd.heads`,
and the request's blocks are freed once every job ended; past :data:`MAX_UNCONFIRMED_JOBS`
decode ranks the others' jobs wait for a handshake that confirms the decode's TP size, and
when the request ends before one does, those ranks are owed a ``write_failed`` as a job's
would be): it
needs the request's prompt blocks (:class:`~moriio_native.pd.tasks.SaveTask`) and the decode's
``remote_blocks``, in either order; then the decode rank is handshaken in the background, each
layer's write is queued for the writer thread as its layer is computed, and once the forward
ended the seal carries the number of writes queued, so the engine cannot call the transfer done
before every one of them completed. Its engine event ends it: exactly one ``write_done`` /
``write_failed`` goes to the decode (or, after the decode's ``abort_write``, one
``write_aborted`` once nothing of it can land), and the blocks are reported free once the
request finished. A job that ends before its decode rank was handshaken (the handshake failed,
or had not answered) posted nothing to the engine: its ``write_failed`` goes at once to the
notify port that rank has at the request's decode address, so the decode need not wait out its
``abort_timeout``. So does the ``write_failed`` of a job that ended before its decode rank
announced (also one of a request that ended, or one that ended before its prompt was computed:
an ``unsaved`` send task), once the announcement comes, and the ``write_aborted`` of a job
never handshaken: each where the job writes or would write (an ``abort_write`` of a transfer
never known here is answered only where a handshake proved the rank it names, at the ports its
own fields give that rank: one made for it, the peer directory's cached one, or that of a
decode rank this rank wrote to). With ``verify`` on, a job the engine completed first computes
its blocks' checksums (CHECKSUMMING), which its ``write_done`` carries
(:mod:`moriio_native.pd.verify`); the blocks are held until then. A job the engine ended with
writes in flight waits (DRAINING) for their drain before any of that.

Messages for transfers we do not know yet (releases, ``remote_blocks``, ``abort_write`` that
overtake the scheduler), and what late messages of ended jobs need, are kept in bounded
records, so unauthenticated peers cannot make this side hold unbounded state.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Generic, TypeVar

import numpy as np

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.channel import RateLimitedWarnings
from moriio_native.control.messages import (
    MAX_NOTIFY_BYTES,
    AbortWrite,
    Misaddressed,
    NotifyMessage,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    decode,
    encode,
    reason_text,
)
from moriio_native.control.ports import rank_port
from moriio_native.control.schema import PART_SEPARATOR
from moriio_native.engine import BlockSegment
from moriio_native.errors import (
    FailedPreconditionError,
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    TransferTimeoutError,
    TransportError,
)
from moriio_native.pd.acks import RankKey, WaitingAcks
from moriio_native.pd.context import Context, plan_grouped
from moriio_native.pd.fsm import Machine
from moriio_native.pd.groups import (
    GroupedBlocks,
    Segment,
    engine_segments,
    group_of_layer,
    holds_running_state,
    post_write_layer,
)
from moriio_native.pd.heads import TpPlan, write_segments
from moriio_native.pd.peers import HANDSHAKE_THREADS, Peer
from moriio_native.pd.tasks import SaveTask, SendTask
from moriio_native.pd.verify import whole_blocks_only

logger = logging.getLogger("moriio_native.pd.pusher")

# Records kept for transfers not known yet (early releases; jobs a message created before the
# scheduler's save task): beyond this many the oldest is dropped.
MAX_EARLY_MESSAGES = 65536
# READ holds that ended (released, expired, or never held), remembered so that a checksum
# request for one is refused at once; past this many the oldest is forgotten, and a request
# for it waits for a hold that never comes before being refused (refused all the same).
MAX_ENDED_HOLDS = 65536
# How long a checksum request for a READ transfer not known yet waits for its send task: vLLM
# hands it over in the first step that starts after the request finished, but a decode may ask
# first, and that step may start only after a long forward of other requests (over a second
# for a TP-2 prefill on a loaded host, seen in CI). Counted from the request's arrival and
# waited without a thread (when_hold_known), shorter than the decode's wait for its answer (its
# transfer_timeout, 30 s by default) by more than a timeout pass, so the decode hears why (with
# transfer_timeout under about 8.5 s it times out first); a send task that comes later fails
# that load (recomputed), never passes it.
SEND_TASK_WAIT_S = 8.0
# Decode ranks one request may have this rank write before a handshake confirmed the decode's
# TP size: the request's remote_tp_size is the client's word (up to 65,536), and a job for each
# rank it names cost the prefill that many jobs per request, each checked at every timeout pass
# (one request of 16,384 held vLLM's engine step 34 s). The others' jobs are made once a job's
# handshake proves a decode rank of that TP size at the request's decode address; a request
# whose size none confirms ends at its abort_timeout (MAX_UNCONFIRMED_RELEASES on the decode),
# and each held-back rank that announces blocks is told write_failed (MAX_HELD_BACK_REQUESTS).
MAX_UNCONFIRMED_JOBS = 16
# Requests that ended with decode ranks held back for that confirmation, remembered (for
# abort_timeout) so that those ranks' announcements are told write_failed: past it the oldest
# are forgotten (their ranks then wait for their own timeout). Up to 16 KiB each.
MAX_HELD_BACK_REQUESTS = 1024
# Block ids the orphan jobs' announcements hold in all (one remote_blocks may carry 1,048,576,
# MAX_BLOCK_IDS): past it the oldest orphans are dropped too. An orphan keeps its announcement
# as wire bytes, at most 5 a block id, so they hold at most about 20 MB (as Python ints, before
# they were kept so, 1 million ids took 40 MB).
MAX_ORPHAN_BLOCK_IDS = 1 << 22
WRITER_QUEUE = 65536
WAIT_SLICE_S = 0.1
# The acknowledgement of an abort_write that needs a handshake (a transfer never known here)
# and did not get one (a timeout, a refused connection: often passing, as a busy or restarting
# decode, or the peer directory's remembered failure of a moment ago) is tried again at most this
# often, for abort_timeout after its first try (a try within the directory's backoff of a failed
# handshake, 5 s doubling to 60 s, fails at once, so real handshakes come at about 0, 5, 15, 35,
# 75 s): unanswered, the decode holds the blocks, and its request with them, for its
# quarantine_timeout (300 s by default).
ACK_RETRY_EVERY_S = 5.0
# Acknowledgements waiting to be tried again: past this many (any sender may name an address
# that does not answer) the oldest are given up.
MAX_ACK_RETRIES = 1024
# Handshakes those acknowledgements may have in flight at once: any sender may name a new address
# that never answers in each abort, and each such handshake holds one of the peer directory's
# threads for transfer_timeout. Without a bound they queued for those threads faster than they
# timed out, and a genuine transfer's handshake waited behind them all. Past it an
# acknowledgement waits for its next try (ACK_RETRY_EVERY_S); the other threads stay free.
MAX_ACK_HANDSHAKES = HANDSHAKE_THREADS // 2
# Handshakes those acknowledgements may start per second (and at once, after a quiet spell). An
# address that answers as a new engine each time costs a handshake, a connection in the engine
# and, at max_peers, an eviction, unbounded in rate without this: 1,000 such aborts a second
# cost 614-687 ms of the instance's CPU per 1,000 and made genuine rounds 2.0-3.5x slower
# (375-444 ms, 1.3-1.7x with it; docs/reliability.md).
ACK_HANDSHAKES_PER_S = 20.0
# Decode ranks this rank wrote to, remembered (engine id -> where its handshake proved it) past
# the peer directory's cache, whose entries go at max_peers (a flood of aborts naming addresses
# that answer evicts them as it goes): an abort_write of one of them for a request this rank
# never had is acknowledged there with no handshake, so it never waits behind a flood's for the
# acknowledgement handshakes' budget. Only the handshake of a job this rank writes enters it:
# an address a request names as its decode's (the router's word, not a notify message's); a few
# hundred bytes each.
MAX_WRITTEN_DECODE_RANKS = 4096


class _HandshakeBudget:
    """A token bucket: ``rate`` handshakes a second, at most ``rate`` saved up. Not
    thread-safe (the pusher's lock)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._clock = clock
        self._tokens = rate
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now

    def available(self) -> int:
        self._refill()
        return int(self._tokens)

    def take(self) -> bool:
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def give_back(self) -> None:
        """A taken handshake that did not start (a cached answer or failure)."""
        self._tokens = min(self._rate, self._tokens + 1)


@dataclass(frozen=True, slots=True)
class _RankAddress:
    """Where a decode rank's handshake proved it: its notify port, and which rank of which TP
    size it is."""

    host: str
    notify_port: int
    dp_rank: int
    tp_rank: int
    tp_size: int

    @classmethod
    def of(cls, peer: Peer) -> _RankAddress:
        response = peer.response
        return cls(
            peer.host, peer.notify_port, response.dp_rank, response.tp_rank, response.tp_size
        )

    def named_by(self, request: AbortWrite) -> bool:
        """Whether ``request`` names this rank: the same DP rank, TP rank and TP size, and this
        notify port where its own fields put that rank (a decode restarted under its address
        with another TP size keeps its engine ids, but its ranks' ports move)."""
        return self.key(request.decode_engine_id) == _named_rank(request)

    def key(self, engine_id: str) -> RankKey:
        """This rank of engine ``engine_id`` as :class:`~moriio_native.pd.acks.WaitingAcks`
        indexes it."""
        return (engine_id, self.dp_rank, self.tp_rank, self.tp_size, self.notify_port)


def _named_rank(request: AbortWrite) -> RankKey:
    """The decode rank ``request`` names, with the notify port its own fields put it at (-1
    where they cannot give one: no handshake proves such a rank)."""
    try:
        port = rank_port(
            request.decode_notify_port,
            request.decode_dp_rank,
            request.decode_tp_rank,
            request.decode_tp_size,
        )
    except InvalidArgumentError:
        port = -1
    return (
        request.decode_engine_id,
        request.decode_dp_rank,
        request.decode_tp_rank,
        request.decode_tp_size,
        port,
    )


class SendState(Enum):
    HELD = auto()
    RELEASED = auto()
    EXPIRED = auto()


class SendEvent(Enum):
    RELEASED = auto()  # every decode rank that pairs with us released
    EXPIRED = auto()  # abort_timeout


SEND_TRANSITIONS: dict[tuple[SendState, SendEvent], SendState] = {
    (SendState.HELD, SendEvent.RELEASED): SendState.RELEASED,
    (SendState.HELD, SendEvent.EXPIRED): SendState.EXPIRED,
}


class JobState(Enum):
    PENDING = auto()  # waiting for the save task and/or remote_blocks
    CONNECTING = auto()  # both known: handshaking the decode rank
    WRITING = auto()  # writes are queued as layers finish
    SEALED = auto()  # the seal (number of writes) is queued
    ABORTING = auto()  # failed with writes in the engine: waiting for its aborted event
    DRAINING = auto()  # the engine ended it with writes in flight: waiting for their drain
    CHECKSUMMING = auto()  # done in the engine (verify): computing write_done's checksums
    DONE = auto()
    FAILED = auto()


class JobEvent(Enum):
    READY = auto()  # save task and remote_blocks both known, blocks paired
    CONNECTED = auto()  # the decode rank is handshaken
    # remote_blocks named a predecessor of this process: nothing written, the announcement is
    # asked for again (misaddressed)
    MISADDRESSED = auto()
    SEAL = auto()  # the forward ended: seal with the writes queued
    FAIL = auto()  # failure with nothing in the engine
    ABORT = auto()  # failure with writes in the engine (engine.abort called)
    ENGINE_DONE = auto()  # engine event: done (drained)
    ENGINE_FAILED = auto()  # engine event: failed / aborted / timed out, drained
    ENGINE_UNDRAINED = auto()  # engine event with writes still in flight
    DRAINED = auto()  # the engine reports the DRAINING transfer drained
    CHECKSUM = auto()  # engine event: done, and verify is on
    CHECKSUMMED = auto()  # the checksums for write_done are ready


_IN_ENGINE = (JobState.WRITING, JobState.SEALED, JobState.ABORTING)
JOB_TRANSITIONS: dict[tuple[JobState, JobEvent], JobState] = {
    (JobState.PENDING, JobEvent.READY): JobState.CONNECTING,
    (JobState.CONNECTING, JobEvent.CONNECTED): JobState.WRITING,
    (JobState.CONNECTING, JobEvent.MISADDRESSED): JobState.PENDING,
    (JobState.WRITING, JobEvent.SEAL): JobState.SEALED,
    **{(s, JobEvent.FAIL): JobState.FAILED for s in (JobState.PENDING, JobState.CONNECTING)},
    **{(s, JobEvent.FAIL): JobState.FAILED for s in (JobState.WRITING, JobState.SEALED)},
    (JobState.WRITING, JobEvent.ABORT): JobState.ABORTING,
    (JobState.SEALED, JobEvent.ABORT): JobState.ABORTING,
    (JobState.SEALED, JobEvent.ENGINE_DONE): JobState.DONE,
    # Aborted after the engine finished it: the abort wins (the decode was told to give up).
    (JobState.ABORTING, JobEvent.ENGINE_DONE): JobState.FAILED,
    **{(s, JobEvent.ENGINE_FAILED): JobState.FAILED for s in _IN_ENGINE},
    **{(s, JobEvent.ENGINE_UNDRAINED): JobState.DRAINING for s in _IN_ENGINE},
    (JobState.DRAINING, JobEvent.DRAINED): JobState.FAILED,
    (JobState.SEALED, JobEvent.CHECKSUM): JobState.CHECKSUMMING,
    (JobState.CHECKSUMMING, JobEvent.CHECKSUMMED): JobState.DONE,
    # The checksums could not be made or sent, or the decode gave up meanwhile (abort_write,
    # release): nothing is in the engine any more.
    (JobState.CHECKSUMMING, JobEvent.FAIL): JobState.FAILED,
}
JOB_TERMINAL = frozenset({JobState.DONE, JobState.FAILED})


@dataclass
class _Releases:
    """The decode ranks that released one transfer on this prefill rank so far."""

    consumer_tp_size: int = 0  # the decode's TP size, from its first release (0: none yet)
    ranks: set[int] = field(default_factory=set)


# What releases that came before their send task left, per transfer: (first seen, monotonic
# seconds; the decode TP size of the first release; a bitmap of the decode ranks that released
# with that size). A float, an int and a bytearray on purpose: CPython's cyclic garbage
# collector tracks none of them and stops tracking the tuple the first time it sees it, so a
# flood that fills this memory adds nothing to the collector's work (a tuple, a _Releases and
# its set per record did: 196,608 tracked objects at the bound, and filling it made CPython run
# a full collection, hundreds of ms with vLLM loaded). The ranks are checked against the TP plan
# only when the send task comes: a plan costs O(TP size) to work out, and a stranger's release
# may name any size up to 65,536. The bitmap costs a bit per rank of that size: all records'
# bitmaps together stay under MAX_EARLY_RELEASE_BYTES.
_EarlyRelease = tuple[float, int, bytearray]
MAX_EARLY_RELEASE_BYTES = 32 << 20  # 4,096 records of TP 65,536; 65,536 of TP 4,096


def _bits(byte: int) -> list[int]:
    """The set bits of ``byte``, lowest first."""
    return [b for b in range(8) if byte >> b & 1] if byte else []


_R = TypeVar("_R", bound=tuple[Any, ...])


class _OldestFirst(Generic[_R]):
    """Records of transfers by id (the pusher's lock held), oldest first, each of a weight
    (``_weigh``) that counts towards a bound: past ``_bounds()`` (records, weight in all), or
    past their lifetime (:meth:`expire`), the oldest go first. A record's first field is when
    it was first seen (monotonic seconds)."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, _R] = OrderedDict()
        self._weight = 0

    def __len__(self) -> int:
        return len(self._records)

    @staticmethod
    def _weigh(record: _R) -> int:
        raise NotImplementedError

    @staticmethod
    def _bounds() -> tuple[int, int]:
        """(records, weight) at most; the module's constants, read when they apply."""
        raise NotImplementedError

    def _put(self, tid: str, record: _R) -> None:
        """``record`` as ``tid``'s (in its place when it replaces one); then the bounds."""
        old = self._records.get(tid)
        self._weight += self._weigh(record) - (self._weigh(old) if old is not None else 0)
        self._records[tid] = record
        self._trim()

    def _trim(self) -> None:
        max_records, max_weight = self._bounds()
        while len(self._records) > max_records or self._weight > max_weight:
            self._forget_oldest()

    def _take(self, tid: str) -> _R | None:
        """``tid``'s record, forgotten here."""
        record = self._records.pop(tid, None)
        if record is not None:
            self._weight -= self._weigh(record)
        return record

    def expire(self, now: float, lifetime: float) -> None:
        """Forgets the records first seen more than ``lifetime`` seconds before ``now``."""
        while self._records and now - next(iter(self._records.values()))[_SEEN] > lifetime:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, record = self._records.popitem(last=False)
        self._weight -= self._weigh(record)


class _EarlyReleases(_OldestFirst[_EarlyRelease]):
    """Releases of transfers whose send task has not come yet, at most MAX_EARLY_MESSAGES
    records and MAX_EARLY_RELEASE_BYTES of bitmaps."""

    @staticmethod
    def _weigh(record: _EarlyRelease) -> int:
        return len(record[2])

    @staticmethod
    def _bounds() -> tuple[int, int]:
        return MAX_EARLY_MESSAGES, MAX_EARLY_RELEASE_BYTES

    @staticmethod
    def _key(tid: str, size: int | None) -> str:
        """READ (``size`` None): one record per transfer, the first release's TP size; WRITE:
        one per transfer and TP size (the request's size picks one at its send task)."""
        return tid if size is None else f"{tid}\x00{size}"

    def record(self, release: Release, *, per_size: bool = False) -> bool:
        """Keeps ``release``'s rank for its transfer; False (nothing kept) when an earlier
        release of the transfer named another decode TP size (READ: ``per_size`` off)."""
        tid = self._key(release.transfer_id, release.consumer_tp_size if per_size else None)
        record = self._records.get(tid)
        if record is None:
            size = release.consumer_tp_size
            record = (time.monotonic(), size, bytearray((size + 7) // 8))
        _, size, ranks = record
        if release.consumer_tp_size != size:
            return False
        rank = release.consumer_tp_rank  # below its size (the message's schema)
        ranks[rank >> 3] |= 1 << (rank & 7)
        self._put(tid, record)
        return True

    def pop(self, tid: str, size: int | None = None) -> list[Release]:
        """The releases of ``tid`` kept so far (one per rank, the first's TP size; ``size``:
        those of that decode TP size, kept per size), forgotten here."""
        record = self._take(self._key(tid, size))
        if record is None:
            return []
        _, size, ranks = record
        return [
            Release(tid, consumer_tp_size=size, consumer_tp_rank=8 * i + b)
            for i, bits in enumerate(ranks)
            for b in _bits(bits)
        ]


@dataclass
class _Send:
    task: SendTask
    deadline: float
    machine: Machine[SendState, SendEvent]
    released: _Releases = field(default_factory=_Releases)
    answered: frozenset[int] = frozenset()  # the blocks the answer named (task.block_ids)


# (local, remote) block ids of a whole-block write, int64 arrays.
WholeBlocks = tuple[np.ndarray, np.ndarray]


@dataclass(eq=False)
class _Request:
    """A WRITE request's jobs on this rank, from its save (or send) task until every one of
    them is terminal and the request finished."""

    jobs: list[_Job]
    # Its jobs not terminal yet: the request ends when none is, so a job's end costs O(1)
    # (checking every job of the request at each end cost O(jobs^2)).
    live: int = 0
    save: SaveTask | None = None
    plan: TpPlan | None = None
    send: SendTask | None = None
    deadline: float = 0.0
    # The decode ranks at the end of the plan's consumers that have no job until a handshake
    # confirms the decode's TP size (MAX_UNCONFIRMED_JOBS); for their jobs, what the forward
    # saved so far ((layer, event) in order) and whether it ended (kept only while any wait).
    unconfirmed: int = 0
    layers: list[tuple[str, Any]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    forward_done: bool = False

    def add(self, job: _Job) -> None:
        """``job`` is one of the request's (one an orphan's messages ended may be terminal)."""
        self.jobs.append(job)
        self.live += job.state not in JOB_TERMINAL

    def saved(self, layer: str, event: Any) -> None:
        """The forward saved ``layer`` (its event), for the jobs still to be made."""
        if layer not in self.seen:
            self.seen.add(layer)
            self.layers.append((layer, event))


@dataclass
class _Job:
    transfer_id: str  # the engine transfer's (see job_transfer_id)
    machine: Machine[JobState, JobEvent]
    request: str  # the request's transfer id (what messages carry)
    decode_rank: int
    plan: TpPlan | None = None
    save: SaveTask | None = None
    remote: RemoteBlocks | None = None
    peer: Peer | None = None
    pending: list[tuple[str, Any]] = field(default_factory=list)  # (layer, event | None)
    seen: set[str] = field(default_factory=set)
    submitted: int = 0
    engine_took: bool = False  # the engine took one of its writes (False: nothing in it)
    seal_posted: bool = False  # its seal went to the engine (the writer; lock held)
    forward_done: bool = False
    # (local, remote) block ids, int64 arrays: every layer's write passes them as they are.
    block_ids: WholeBlocks | None = None
    # Grouped jobs (KV-cache groups): each layer's segments, planned once the decode's groups
    # are known from its handshake; a layer without any is not written.
    segments: dict[str, list[Segment]] | None = None
    send: SendTask | None = None
    deadline: float = 0.0
    reason: str = ""
    released: bool = False  # the decode said it needs nothing: no write_failed to it
    # The decode process that announced the blocks restarted since: nobody waits for a final
    # message (the one at its address never knew the transfer).
    announcer_gone: bool = False
    # An announcement addressed to a predecessor of this process was answered misaddressed:
    # the next one that is not addressed to this process fails the job.
    misaddressed: bool = False
    abort_requested: AbortWrite | None = None  # the decode gave up: answer once drained
    # Ended without the engine confirming its writes stopped (given up at the quarantine): no
    # message may tell the decode its blocks are free; it frees them at its quarantine_timeout.
    undrained: bool = False
    checksums: dict[str, bytes] | None = None  # verify: what write_done carries
    # The CUDA events whose handles the engine's copies wait for (on the GPU or in its progress
    # thread): the backend may wait for one until the transfer drained, so they live until the
    # job completes.
    device_events: list[Any] = field(default_factory=list)

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def written(self) -> str | None:
        """The engine id of the decode rank the job writes into: the one that announced its
        blocks (None: none announced yet)."""
        return self.remote.decode_engine_id if self.remote is not None else None

    @property
    def settled(self) -> bool:
        """Whether the decode rank needs no write_failed for a late announcement: it announced
        already (its final message went out at the end), released, gave up (abort_write: it
        gets write_aborted), or is a process that restarted since."""
        return (
            self.remote is not None
            or self.released
            or self.announcer_gone
            or self.abort_requested is not None
        )


@dataclass
class _Ended:
    """What a job of an ended request leaves for its late messages (bounded, kept for
    ``abort_timeout``): nothing of the job can land any more, so a late ``remote_blocks`` is
    told ``write_failed`` and a late ``abort_write`` acknowledged at once, each at most once,
    at the notify port of the job's decode rank at the request's decode address."""

    request: str
    decode_rank: int
    decode_tp: int
    address: ZmqAddress | None  # the request's decode address (None: it named none)
    dp_rank: int | None  # the decode DP rank its announcement named (None: it never announced)
    written: str | None  # the decode rank's engine id its announcement named (None: as above)
    reason: str
    ended: float
    settled: bool  # no write_failed owed (see _Job.settled), or it went out
    acked: bool  # its abort_write came (and was answered)
    undrained: bool  # see _Job.undrained: a late abort_write is not acknowledged either


class _RankBits:
    """One bit per decode rank (a request may name 65,536 ranks: 8 KiB, not a set of them)."""

    __slots__ = ("_bits",)

    def __init__(self, ranks: int) -> None:
        self._bits = bytearray((ranks + 7) // 8)

    def first(self, rank: int) -> bool:
        """Marks ``rank`` (within the size); whether it was not marked before."""
        byte, bit = divmod(rank, 8)
        if self._bits[byte] >> bit & 1:
            return False
        self._bits[byte] |= 1 << bit
        return True


@dataclass
class _HeldBack:
    """What a request that ended with decode ranks held back for the TP confirmation
    (MAX_UNCONFIRMED_JOBS) leaves for those ranks' messages (bounded, kept for
    ``abort_timeout``): none of them was or will be written, so each that announces blocks is
    told ``write_failed`` and each ``abort_write`` acknowledged, once, at the rank's notify port
    at the request's decode address. The ranks are kept as the plan that names them, not a set:
    a request may name 65,536."""

    plan: TpPlan
    made: frozenset[int]  # the decode ranks whose jobs were made (they have _Ended records)
    address: ZmqAddress | None
    reason: str
    ended: float
    answered: _RankBits = field(init=False)  # ranks told write_failed
    acked: _RankBits = field(init=False)  # ranks whose abort_write was acknowledged

    def __post_init__(self) -> None:
        self.answered = _RankBits(self.plan.decode_tp)
        self.acked = _RankBits(self.plan.decode_tp)

    def covers(self, rank: int, prefill_rank: int) -> bool:
        """Whether decode rank ``rank`` was one held back (a rank prefill rank
        ``prefill_rank`` writes, whose job was never made)."""
        return (
            0 <= rank < self.plan.decode_tp
            and rank not in self.made
            and prefill_rank in self.plan.sources(rank)
        )


# An orphan job: one a decode rank's remote_blocks or abort_write made for a request whose save
# (or send) task has not come, kept until that task continues it as a _Job: (first seen,
# monotonic seconds; the request's transfer id; the decode rank; the block ids its announcement
# holds; the announcement and the abort_write as their wire bytes, None until they came; the
# decode TP sizes its releases named, one character each (_released_sizes), or _NEEDS_NOTHING
# for an announcement of no blocks; why it failed, "" while it waits for its save task). A
# release of another size than the request's is not the rank's, as for a made job
# (_released_for). A PENDING job without a save task can only fail (the decode released or
# aborted it, or needs no blocks), so this is all of its state. Numbers, strings and bytes on
# purpose, as _EarlyRelease: CPython's cyclic garbage collector tracks none of them and stops
# tracking the tuple the first time it sees it, so a flood that fills the orphans adds nothing
# to the collector's work (a _Job with its machine, lists, set, dict and message did: 20,579
# tracked objects for 4,096 orphans).
_Orphan = tuple[float, str, int, int, bytes | None, bytes | None, str, str]
_RELEASED = "the decode released the transfer"
# An orphan's releases as a string, not a tuple of sizes: a str is never tracked by the garbage
# collector, while an orphan holding a tuple stayed tracked after a collection.
_UNRELEASED = ""
_NEEDS_NOTHING = "\0"  # no TP size is 0: released whatever the request's size
MAX_ORPHAN_RELEASE_SIZES = 8  # more distinct sizes: taken as released, conservatively


def _released_sizes(released: str, size: int) -> str:
    """``released`` with a release naming decode TP ``size`` added."""
    if chr(size) in released:
        return released
    if len(released) >= MAX_ORPHAN_RELEASE_SIZES:
        return _NEEDS_NOTHING
    return released + chr(size)


def _released_for(released: str, decode_tp: int) -> bool:
    """Whether an orphan's releases end its job in a request of decode TP size ``decode_tp``."""
    return _NEEDS_NOTHING in released or chr(decode_tp) in released


# The fields an _Orphan's bookkeeping reads by position (the rest are unpacked whole); _SEEN,
# first seen, is the first field of an _EarlyRelease too.
_SEEN, _REQUEST, _RANK, _IDS, _REASON = 0, 1, 2, 3, 7


def _new_orphan(
    message: RemoteBlocks | AbortWrite,
    *,
    ids: int = 0,
    announced: bytes | None = None,
    released: str = _UNRELEASED,
    reason: str = "",
) -> _Orphan:
    """The orphan ``message`` makes of a job not known yet (by default waiting and holding
    nothing)."""
    return (
        time.monotonic(),
        message.transfer_id,
        message.decode_tp_rank,
        ids,
        announced,
        None,
        released,
        reason,
    )


class _Orphans(_OldestFirst[_Orphan]):
    """Orphan jobs by engine transfer id: at most MAX_EARLY_MESSAGES of them and
    MAX_ORPHAN_BLOCK_IDS block ids in their announcements."""

    @staticmethod
    def _weigh(record: _Orphan) -> int:
        return record[_IDS]

    @staticmethod
    def _bounds() -> tuple[int, int]:
        return MAX_EARLY_MESSAGES, MAX_ORPHAN_BLOCK_IDS

    def get(self, jid: str) -> _Orphan | None:
        return self._records.get(jid)

    def keep(self, jid: str, orphan: _Orphan) -> None:
        """Keeps ``orphan`` as ``jid``'s (in its place when it replaces one); past the bounds
        the oldest are dropped, ``orphan`` too when its announcement alone passes them."""
        self._put(jid, orphan)

    def pop(self, jid: str, decode_tp: int | None = None) -> _Job | None:
        """``jid``'s orphan as a job, for its save or send task to continue; forgotten here.
        A release of another decode TP size than ``decode_tp`` (the request's) is not its
        rank's: ignored, as for a made job."""
        orphan = self._take(jid)
        if orphan is None:
            return None
        _, request, rank, _, announced, aborted, released, reason = orphan
        if released and decode_tp is not None and not _released_for(released, decode_tp):
            released = _UNRELEASED
            if reason == _RELEASED and aborted is None:
                reason = ""
        state = JobState.FAILED if reason else JobState.PENDING
        return _Job(
            jid,
            Machine("WRITE", jid, JOB_TRANSITIONS, state),
            request,
            rank,
            remote=_load(RemoteBlocks, announced),
            reason=reason,
            released=bool(released),
            abort_requested=_load(AbortWrite, aborted),
        )

    def take(self, jid: str) -> _Orphan | None:
        """``jid``'s orphan, forgotten here (its request ended without making its job)."""
        return self._take(jid)

    def of_request(self, tid: str) -> list[str]:
        """The orphans of request ``tid`` (a pass over every orphan)."""
        return [jid for jid, orphan in self._records.items() if orphan[_REQUEST] == tid]

    def states(self) -> dict[str, JobState]:
        failed, waiting = JobState.FAILED, JobState.PENDING
        return {jid: failed if o[_REASON] else waiting for jid, o in self._records.items()}


_M = TypeVar("_M", RemoteBlocks, AbortWrite)


def _load(cls: type[_M], wire: bytes | None) -> _M | None:
    """The message an orphan kept as ``wire`` (None: none came); its own bytes, so their length
    is their bound."""
    return None if wire is None else decode(wire, (cls,), max_bytes=len(wire))


def rank_ports(address: ZmqAddress, dp_rank: int, rank: int, tp_size: int) -> tuple[str, int, int]:
    """(host, handshake port, notify port) of rank ``rank`` (DP rank ``dp_rank``, ``tp_size``
    ranks per DP group) of the instance at base ``address``, by the port formula
    (InvalidArgumentError for a rank or port out of range)."""
    return (
        address.host,
        rank_port(address.handshake_port, dp_rank, rank, tp_size),
        rank_port(address.notify_port, dp_rank, rank, tp_size),
    )


def job_transfer_id(transfer_id: str, decode_rank: int, tp_rank: int) -> str:
    """The engine transfer id of prefill rank ``tp_rank``'s job writing ``transfer_id`` into
    decode rank ``decode_rank``: the request's own id for the decode rank of our index (the
    only one with equal TP sizes), one id per decode rank otherwise."""
    return transfer_id if decode_rank == tp_rank else f"{transfer_id}{PART_SEPARATOR}d{decode_rank}"


# ("write", job, layer, (event or None, segments or None)), ("writes", job, "", ((local ids,
# remote ids), [(layer, event or None), ...])) for several layers moving the same whole blocks,
# or ("seal", job, "", writes queued).
WriterOp = tuple[str, _Job, str, Any]


class Pusher:
    """Prefill-side transfers of one rank. Thread-safe through the context lock; the writer
    thread (:meth:`writer_loop`) posts writes in order."""

    def __init__(self, ctx: Context, writer_queue: int = WRITER_QUEUE) -> None:
        self._ctx = ctx
        # WRITE-mode messages any sender may send a READ-mode prefill: rate limited, not a line
        # each.
        self._stray = RateLimitedWarnings(logger, "WRITE-mode messages in READ mode")
        # Releases before their send task that contradict the first one's TP size: any sender
        # may send them, so rate limited too.
        self._other_size = RateLimitedWarnings(logger, "releases of another decode TP size")
        # Orphans any sender may end (an abort_write, a release or an empty announcement naming
        # any transfer), and aborts of transfers never known that cannot be acknowledged (any
        # sender may name any address): rate limited too.
        self._orphan_failed = RateLimitedWarnings(logger, "WRITE jobs of requests not seen failed")
        self._unacked = RateLimitedWarnings(logger, "aborts not acknowledged")
        self._ack_retries = WaitingAcks(MAX_ACK_RETRIES)
        self._ack_handshakes = 0  # their handshakes in flight (MAX_ACK_HANDSHAKES)
        self._ack_budget = _HandshakeBudget(ACK_HANDSHAKES_PER_S)
        # Decode ranks written to, least recently first (MAX_WRITTEN_DECODE_RANKS).
        self._written_ranks: OrderedDict[str, _RankAddress] = OrderedDict()
        self._sends: dict[str, _Send] = {}
        # Why each READ hold ended, oldest first (MAX_ENDED_HOLDS): see held_for_checksums.
        self._ended_holds: OrderedDict[str, str] = OrderedDict()
        # Checksum requests waiting for their transfer's hold to be known: by transfer id, each
        # with its deadline and what to call then (when_hold_known).
        self._hold_waiters: dict[str, list[tuple[float, Callable[[], None]]]] = {}
        self._jobs: dict[str, _Job] = {}  # by engine transfer id
        self._requests: dict[str, _Request] = {}  # once its save (or send) task came
        self._unwritten: set[str] = set()  # requests whose blocks no decode rank needs of us
        self._step_jobs: list[_Job] = []
        self._step_requests: list[_Request] = []  # of the step, with ranks not confirmed
        self._early_releases = _EarlyReleases()
        self._orphans = _Orphans()  # jobs no save or send task named yet
        self._ended: OrderedDict[str, _Ended] = OrderedDict()  # jobs of ended requests
        # Ended requests' ranks whose jobs were never made (MAX_UNCONFIRMED_JOBS), by request.
        self._held_back: OrderedDict[str, _HeldBack] = OrderedDict()
        self._writer_q: queue.Queue[WriterOp] = queue.Queue(writer_queue)
        self._staged: list[WriterOp] = []  # guarded by the lock, moved by feed_writer
        # Serialises feeding so staged ops enter the queue in order; the writer never takes it.
        self._feed = threading.Lock()

    def job_states(self) -> dict[str, JobState]:
        with self._ctx.lock:
            return {**{tid: j.state for tid, j in self._jobs.items()}, **self._orphans.states()}

    # ---- scheduler tasks (caller thread) ------------------------------------------------------

    def peers_in_use(self) -> set[str]:
        """Engine peers of jobs not yet terminal (lock held)."""
        return {
            j.peer.engine_peer
            for j in self._jobs.values()
            if j.peer is not None and j.state not in JOB_TERMINAL
        }

    def begin_step(self, saves: list[SaveTask], sends: list[SendTask]) -> None:
        now = time.monotonic()
        if saves and self._ctx.cfg.mode != "write":
            logger.warning(
                "ignoring save tasks of transfers %s: this instance runs %s mode (save tasks "
                "are WRITE mode's)",
                [save.transfer_id for save in saves[:8]],
                self._ctx.cfg.mode.upper(),
            )
            saves = []
        with self._ctx.lock:
            self._step_jobs = []
            self._step_requests = []
            for save in saves:
                jobs = self._plan_jobs(save)
                # Listed before any job advances: one that connects at once (its decode rank
                # handshaken already) may confirm the decode's TP size here, and the jobs that
                # makes must be the step's too (_confirm_decode_tp), or they get no layer.
                request = self._requests.get(save.transfer_id)
                if request is not None and request.unconfirmed:
                    self._step_requests.append(request)
                for job in jobs:
                    self._step_jobs.append(job)
                    self._advance(job)
            for send in sends:
                self._on_send_task(send, now)
        self.feed_writer()

    def layer_saved(self, layer: str, event: Any) -> None:
        with self._ctx.lock:
            for request in self._step_requests:
                request.saved(layer, event)
            for job in self._step_jobs:
                if layer not in job.seen:
                    job.seen.add(layer)
                    job.pending.append((layer, event))
                    self._advance(job)
        self.feed_writer()

    def has_step_jobs(self) -> bool:
        with self._ctx.lock:
            return bool(self._step_jobs)

    def forward_done(self, layers: list[str], event: Any) -> None:
        """Queue every layer whose save hook did not run, then seal."""
        with self._ctx.lock:
            for request in self._step_requests:
                for name in layers:
                    request.saved(name, event)
                request.forward_done = True
            for job in self._step_jobs:
                for name in layers:
                    if name not in job.seen:
                        job.seen.add(name)
                        job.pending.append((name, event))
                job.forward_done = True
                self._advance(job)
            self._step_jobs = []
            self._step_requests = []
        self.feed_writer()

    def _plan_jobs(self, save: SaveTask) -> list[_Job]:
        """The request's jobs, one per decode rank the plan has us write, at most
        MAX_UNCONFIRMED_JOBS of them until a handshake confirms the decode's TP size (lock
        held); none when no decode rank needs this rank's heads (its blocks are free once it
        finished)."""
        ctx = self._ctx
        tid = save.transfer_id
        host = save.peer.host if save.peer is not None else "(no decode address)"
        try:
            plan = ctx.tp_plan(host, save.remote_tp_size, prefill=True)
        except MoriioError as exc:
            job = self._job(tid, ctx.cfg.tp_rank)
            job.save = save
            request = self._requests[tid] = _Request([], save=save)
            request.add(job)
            self._fail(job, str(exc))
            return [job]
        ranks = plan.consumers(ctx.cfg.tp_rank)
        if not ranks:
            self._unwritten.add(tid)
            return []
        request = self._requests[tid] = _Request([], save=save, plan=plan)
        if len(ranks) > MAX_UNCONFIRMED_JOBS:
            request.unconfirmed = len(ranks) - MAX_UNCONFIRMED_JOBS
            ranks = ranks[:MAX_UNCONFIRMED_JOBS]
            logger.warning(
                "transfer %s: the request names a decode TP size of %d (remote_tp_size), %d "
                "decode ranks for prefill rank %d to write, which no handshake confirmed; "
                "writing the first %d until one does",
                tid,
                plan.decode_tp,
                len(ranks) + request.unconfirmed,
                ctx.cfg.tp_rank,
                len(ranks),
            )
        return [self._add_job(request, tid, rank) for rank in ranks]

    def _add_job(self, request: _Request, tid: str, rank: int) -> _Job:
        """The job of ``request`` (transfer ``tid``) for decode rank ``rank``, made one of its
        jobs (lock held)."""
        job = self._job(tid, rank, request.plan.decode_tp if request.plan is not None else None)
        job.save, job.plan = request.save, request.plan
        request.add(job)
        return job

    def _confirm_decode_tp(self, job: _Job, peer: Peer) -> None:
        """``job``'s handshake answered (lock held): when it proved a decode rank of the TP
        size its request names, the jobs of the ranks kept back until then
        (MAX_UNCONFIRMED_JOBS) are made, with the layers the forward saved so far, and go on
        as the first ones (their announcements that came meanwhile were kept as orphans)."""
        request = self._requests.get(job.request)
        if request is None or not request.unconfirmed:
            return
        if peer.response.tp_size != self._decode_tp(job):
            return
        assert request.plan is not None
        ranks = request.plan.consumers(self._rank)[-request.unconfirmed :]
        request.unconfirmed = 0
        logger.info(
            "transfer %s: decode rank %d confirmed the decode TP size %d; writing its other %d "
            "ranks too",
            job.request,
            job.decode_rank,
            peer.response.tp_size,
            len(ranks),
        )
        # (Not aborted: an abort failed every job, this one's handshake included.)
        in_step = request in self._step_requests
        jobs = [self._add_job(request, job.request, rank) for rank in ranks]
        for new in jobs:
            new.seen, new.pending = set(request.seen), list(request.layers)
            new.forward_done = request.forward_done
            new.send, new.deadline = request.send, request.deadline
            if in_step:  # the forward goes on: its next layers reach these jobs too
                self._step_jobs.append(new)
        request.layers, request.seen = [], set()
        for new in jobs:
            self._advance(new)

    def _job(self, tid: str, decode_rank: int, decode_tp: int | None = None) -> _Job:
        """The job of request ``tid`` for ``decode_rank`` (lock held), the scheduler's task at
        hand: the orphan the decode rank's messages made, continued, or a new one."""
        jid = job_transfer_id(tid, decode_rank, self._ctx.cfg.tp_rank)
        job = self._jobs.get(jid)
        if job is None:
            job = self._orphans.pop(jid, decode_tp) or _Job(
                jid,
                Machine("WRITE", jid, JOB_TRANSITIONS, JobState.PENDING),
                request=tid,
                decode_rank=decode_rank,
            )
            self._jobs[jid] = job
        return job

    def _on_send_task(self, send: SendTask, now: float) -> None:
        """The request finished and its blocks are held for us (lock held)."""
        ctx = self._ctx
        tid = send.transfer_id
        deadline = now + ctx.cfg.abort_timeout
        released = _Releases()
        size = None
        if ctx.cfg.mode == "write":  # the request's decode TP size picks its releases
            known = self._requests.get(tid)
            plan = known.plan if known is not None else None
            size = plan.decode_tp if plan is not None else (send.remote_tp_size or ctx.cfg.tp_size)
        for early in self._early_releases.pop(tid, size):
            self._record_release(released, early)
        if send.preempted:
            if ctx.cfg.mode == "write":
                self._drop_preempted(send, deadline)
            return
        if send.unsaved:
            if ctx.cfg.mode == "write":
                self._end_unsaved(
                    send, "the request ended at the prefill before its prompt was computed"
                )
            return
        if ctx.cfg.mode == "read":
            machine = Machine("READ-hold", tid, SEND_TRANSITIONS, SendState.HELD)
            held = _Send(send, deadline, machine, released, frozenset(send.block_ids))
            if send.aborted or self._fully_released(held.released):
                ctx.reports.done_sending.add(send.req_id)
                self._end_hold(tid, "aborted" if send.aborted else "released")
                return
            self._sends[tid] = held
            self._hold_known(tid)
            return
        if tid in self._unwritten:
            self._unwritten.discard(tid)
            ctx.reports.done_sending.add(send.req_id)
            return
        request = self._requests.get(tid)
        if request is None:  # no save task: the request ended before its last prompt chunk
            self._end_unsaved(
                send, "the request finished before its prompt's blocks were handed over"
            )
            return
        request.send, request.deadline = send, deadline
        jobs = request.jobs
        for job in jobs:
            job.send, job.deadline = send, deadline
        if self._request_ended(request):
            return
        for job in jobs:
            if send.aborted:
                self._fail(job, "the request was aborted")
            elif job.decode_rank in released.ranks and (
                released.consumer_tp_size == self._decode_tp(job)
            ):
                # The decode gave up before we had the request (its release came first).
                job.released = True
                self._fail(job, "the decode released the transfer")
        for rank in released.ranks:  # those of ranks whose jobs are not made yet
            self._release_unconfirmed(tid, released.consumer_tp_size, rank)

    def _release_unconfirmed(self, tid: str, size: int, rank: int) -> bool:
        """A release from decode rank ``rank`` (of TP ``size``) whose job waits for a handshake
        to confirm the request's decode TP size (MAX_UNCONFIRMED_JOBS; lock held): kept as a
        released orphan, so that job, made then, fails at once, owing the rank no message.
        Whether it was one."""
        request = self._requests.get(tid)
        plan = request.plan if request is not None else None
        if request is None or not request.unconfirmed or plan is None or size != plan.decode_tp:
            return False
        jid = job_transfer_id(tid, rank, self._rank)
        if jid in self._jobs or self._rank not in plan.sources(rank):
            return False
        waiting: _Orphan = (time.monotonic(), tid, rank, 0, None, None, _UNRELEASED, "")
        self._orphan_released(jid, self._orphans.get(jid) or waiting, size)
        return True

    def _end_unsaved(self, send: SendTask, reason: str) -> None:
        """A request none of whose blocks were handed to us (lock held): it ended before its
        prompt was computed (``send.unsaved``), or finished with no save task. Its jobs, one
        per decode rank the plan has us write (announcements that came first included), end
        failed for ``reason`` with nothing written; the ranks that announced are told
        write_failed now, the others when they announce (their ended records). Blocks vLLM
        still holds for it (a send task not ``unsaved``) are reported free at once."""
        # What its save task would have said: the decode it names, and no blocks computed.
        save = SaveTask(send.req_id, send.transfer_id, (), 0, send.peer, send.remote_tp_size)
        jobs = self._plan_jobs(save)
        self._unwritten.discard(send.transfer_id)
        request = self._requests.get(send.transfer_id)
        if request is None:  # no decode rank needs this rank's heads
            if not send.unsaved:
                self._ctx.reports.done_sending.add(send.req_id)
            return
        self._fail_request(request, jobs, send, reason)

    def drop_preempted(self, sends: Sequence[SendTask]) -> None:
        """vLLM's ``handle_preemptions``, called before the step's GPU work may overwrite the
        blocks of requests it preempted: the preempted send tasks among ``sends`` take effect
        now (their ``begin_step`` later finds them done)."""
        if self._ctx.cfg.mode != "write":
            return
        deadline = time.monotonic() + self._ctx.cfg.abort_timeout
        with self._ctx.lock:
            for send in sends:
                if send.preempted:
                    self._drop_preempted(send, deadline)

    def _drop_preempted(self, send: SendTask, deadline: float) -> None:
        """vLLM preempted a saved request and freed its blocks (lock held): every job of it
        fails (posted writes aborted in the engine; each decode rank told write_failed once
        they stopped, or when it announces); nothing is reported, vLLM holds no block of it.
        ``deadline``: as a finished request's, from which a job still draining is given up
        (quarantine_timeout past it). Idempotent."""
        tid = send.transfer_id
        self._unwritten.discard(tid)
        request = self._requests.get(tid)
        if request is None or request.send is not None:
            return  # ended, or dropped already
        request.deadline = deadline
        for job in request.jobs:
            job.deadline = deadline
        self._fail_request(
            request,
            request.jobs,
            send,
            "vLLM preempted the request and freed its blocks; it recomputes it",
        )

    def _fail_request(
        self, request: _Request, jobs: list[_Job], send: SendTask, reason: str
    ) -> None:
        """``request`` ends under ``send`` with every one of ``jobs`` failed for ``reason``
        (lock held): the last job to fail ends it, or it ends here when each had ended
        already."""
        request.send = send
        for job in jobs:
            job.send = send
        for job in jobs:
            self._fail(job, reason)
        if send.transfer_id in self._requests:
            self._request_ended(request)

    def _request_ended(self, request: _Request) -> bool:
        """Once every job of a finished request is terminal: its blocks are free, late
        messages for it are dropped (lock held). Whether it ended."""
        send = request.send
        if request.live or send is None:
            return False
        if request.unconfirmed and not send.unsaved:  # (an unsaved one writes no rank)
            assert request.plan is not None
            logger.warning(
                "transfer %s: %d decode ranks the request's remote_tp_size (%d) names were not "
                "written: no handshake confirmed that decode TP size",
                send.transfer_id,
                request.unconfirmed,
                request.plan.decode_tp,
            )
        if not (send.unsaved or send.preempted):  # (vLLM freed those blocks already)
            self._ctx.reports.done_sending.add(send.req_id)
        self._ctx.mark_terminal(send.transfer_id)
        self._requests.pop(send.transfer_id, None)
        now = time.monotonic()
        for job in request.jobs:
            self._jobs.pop(job.transfer_id, None)
            self._ended[job.transfer_id] = _Ended(
                request=job.request,
                decode_rank=job.decode_rank,
                decode_tp=self._decode_tp(job),
                address=job.save.peer if job.save is not None else None,
                dp_rank=job.remote.decode_dp_rank if job.remote is not None else None,
                written=job.written,
                reason=job.reason,
                ended=now,
                settled=job.settled,
                acked=job.abort_requested is not None,
                undrained=job.undrained,
            )
            while len(self._ended) > MAX_EARLY_MESSAGES:
                self._ended.popitem(last=False)
        if request.unconfirmed:
            self._end_held_back(request, send.transfer_id, now)
        return True

    def _end_held_back(self, request: _Request, tid: str, now: float) -> None:
        """The decode ranks ``request`` (transfer ``tid``) held back for the TP confirmation,
        at its end (lock held): nothing was or will be written into them, so those that
        announced blocks already (orphans) are told write_failed now, the others when they
        announce (a _HeldBack record)."""
        plan = request.plan
        assert plan is not None
        cause = next((job.reason for job in request.jobs if job.reason), "the request ended")
        held = _HeldBack(
            plan,
            frozenset(job.decode_rank for job in request.jobs),
            request.save.peer if request.save is not None else None,
            f"not written: no handshake confirmed the decode TP size {plan.decode_tp} the "
            f"request named ({cause})",
            now,
        )
        self._held_back[tid] = held
        while len(self._held_back) > MAX_HELD_BACK_REQUESTS:
            self._held_back.popitem(last=False)
        ranks = plan.consumers(self._rank)[-request.unconfirmed :]
        # Whichever is fewer: the held-back ranks' orphan ids, or a pass over the orphans.
        if len(ranks) <= len(self._orphans):
            jids = [job_transfer_id(tid, rank, self._rank) for rank in ranks]
        else:
            jids = self._orphans.of_request(tid)
        for jid in jids:
            orphan = self._orphans.get(jid)
            if orphan is None or not held.covers(orphan[_RANK], self._rank):
                continue
            self._orphans.take(jid)
            _, _, rank, _, announced, aborted, released, _ = orphan
            if aborted is not None:
                # Acknowledged when it came (_orphan_aborted): that is the rank's one answer, as
                # a made job's abort settles it (no write_failed after a write_aborted).
                held.acked.first(rank)
                continue
            announcement = _load(RemoteBlocks, announced)
            if announcement is not None and not _released_for(released, plan.decode_tp):
                self._tell_held_back(held, announcement)

    def _tell_held_back(self, held: _HeldBack, message: RemoteBlocks) -> None:
        """A held-back rank's announcement, its request ended (lock held): write_failed, once."""
        if held.answered.first(message.decode_tp_rank):
            rank, tp_size = message.decode_tp_rank, held.plan.decode_tp
            self._tell_unwritten(held.address, rank, tp_size, held.reason, message)

    # ---- the job machine (lock held) ----------------------------------------------------------

    def _advance(self, job: _Job) -> None:
        """Move a job as far as its inputs allow. Writes and the seal are staged for the
        writer thread, in order; the caller feeds them after releasing the lock."""
        state = job.state
        if state is JobState.PENDING:
            if job.remote is None or job.save is None:
                return
            if job.save.peer is None:
                self._fail(job, "the request names no decode address")
                return
            if job.save.groups:
                self._ready_grouped(job)
                return
            groups = job.remote.block_ids
            wanted = groups[0] if len(groups) == 1 else None
            have = job.save.block_ids
            if wanted is None or len(wanted) > len(have) or not wanted:
                self._fail(
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
            job.machine.advance(JobEvent.READY)
            self._connect(job)
            return
        if state is not JobState.WRITING:
            return
        try:
            self._stage_writes(job)
        except MoriioError as exc:
            # A layer's write cannot be planned for this decode rank (windows of a TP change
            # that meet those of a block-size change): the job fails here, never raising into
            # the hook that called (vLLM's forward, a handshake's completion).
            self._fail(job, f"its writes cannot be planned: {exc}")
            return
        job.pending = []
        if job.forward_done:
            job.machine.advance(JobEvent.SEAL)
            self._staged.append(("seal", job, "", job.submitted))

    def _stage_writes(self, job: _Job) -> None:
        """Stage the writes of the job's pending layers (lock held). Layers that move the same
        whole blocks go as one "writes" op when there are several of them (their forward ran
        before the decode's blocks arrived), so the writer posts them in one engine call."""
        local, remote = job.block_ids or (np.empty(0, np.int64), np.empty(0, np.int64))
        whole: dict[int, tuple[WholeBlocks, list[tuple[str, Any]]]] = {}
        for layer, event in job.pending:
            if job.segments is not None and not job.segments.get(layer):
                continue  # nothing of this layer's group is written
            segments = None
            if job.plan is not None:
                base = (
                    engine_segments(job.segments[layer], with_layers=False)
                    if job.segments is not None
                    else [BlockSegment(local, remote)]
                )
                segments = write_segments(job.plan, self._ctx.cfg, job.decode_rank, layer, base)
                if segments == []:
                    continue  # a whole layer another prefill rank writes to this decode rank
            ids = None if segments is not None else self._whole_blocks(job, layer)
            if ids is None:
                self._staged.append(("write", job, layer, (event, segments)))
            else:
                whole.setdefault(id(ids[0]), (ids, []))[1].append((layer, event))
            job.submitted += 1
        for ids, layers in whole.values():
            if len(layers) > 1:
                named = f"{layers[0][0]}..{layers[-1][0]} ({len(layers)} layers)"
                self._staged.append(("writes", job, named, (ids, layers)))
            else:
                [(layer, event)] = layers
                self._staged.append(("write", job, layer, (event, None)))

    @staticmethod
    def _whole_blocks(job: _Job, layer: str) -> WholeBlocks | None:
        """The (local, remote) block ids ``layer`` moves as whole blocks, one array object per
        group of layers that move the same ones; None when its write is cut into windows (or
        the job has no whole-block ids)."""
        if job.segments is None:
            return job.block_ids
        segments = job.segments[layer]
        if len(segments) != 1 or segments[0].tokens is not None:
            return None
        return segments[0].block_arrays

    def _ready_grouped(self, job: _Job) -> None:
        """A grouped job has both sides' blocks (lock held): the decode must need no more
        tokens than the prompt computed here; the pairing waits for its handshake."""
        assert job.save is not None and job.remote is not None
        needed, computed = job.remote.num_tokens, job.save.num_tokens
        if not needed:
            self._fail(
                job,
                "the decode announced its blocks without a token count (a decode without "
                "KV-cache groups); run the same connector version on both instances",
            )
            return
        if needed > computed:
            self._fail(
                job, f"the decode needs the KV of {needed} tokens, the prompt computed {computed}"
            )
            return
        if needed != computed and holds_running_state(self._ctx.cfg.groups):
            self._fail(
                job,
                f"the decode takes {needed} tokens as computed, but a Mamba state holds "
                f"exactly the {computed} the prompt computed here",
            )
            return
        job.machine.advance(JobEvent.READY)
        self._connect(job)

    def _plan_grouped(self, job: _Job, peer: Peer) -> dict[str, list[Segment]]:
        """Each layer's segments into the decode's announced blocks (raises on a group
        structure or ids that do not pair)."""
        assert job.save is not None and job.remote is not None
        cfg = self._ctx.cfg
        blocks = GroupedBlocks(
            job.save.groups, tuple(job.remote.block_ids), 0, job.remote.num_tokens
        )
        by_group: dict[int, list[Segment]] = {}
        for segment in plan_grouped(cfg, peer, blocks, "remote"):
            by_group.setdefault(segment.group, []).append(segment)
        return {layer: by_group.get(g, []) for layer, g in group_of_layer(cfg.groups).items()}

    def _decode_tp(self, job: _Job) -> int:
        """The TP size of the decode instance ``job`` writes to (the request's, also when no
        plan was made; 0 in a request: ours)."""
        if job.plan is not None:
            return job.plan.decode_tp
        stated = job.save.remote_tp_size if job.save is not None else 0
        return stated or self._ctx.cfg.tp_size

    def _decode_rank_ports(self, job: _Job) -> tuple[str, int, int]:
        """(host, handshake port, notify port) of the decode rank that announced ``job``'s
        blocks, at the request's decode address by the port formula (InvalidArgumentError for
        a rank or port out of range)."""
        assert job.save is not None and job.save.peer is not None and job.remote is not None
        return rank_ports(
            job.save.peer, job.remote.decode_dp_rank, job.decode_rank, self._decode_tp(job)
        )

    def _connect(self, job: _Job) -> None:
        assert job.save is not None and job.save.peer is not None and job.remote is not None
        address = job.save.peer
        decode_tp = self._decode_tp(job)
        try:
            future = self._ctx.connect_rank(
                address.host,
                address.handshake_port,
                address.notify_port,
                job.remote.decode_dp_rank,
                decode_tp,
                job.decode_rank,
                incarnation=job.remote.decode_incarnation,
            )
        except MoriioError as exc:
            self._fail(job, f"cannot reach decode rank {job.decode_rank}: {exc}")
            return
        # A handshaken peer's future is done already, and the callback then runs here, under
        # the caller's lock: the caller feeds the writer once it released it (feeding under the
        # lock would take the feed lock after the context lock, which a step's feed takes the
        # other way round). Every other run feeds, even on this same thread later: a handshake
        # pool thread that asked for this one (held-back ranks confirmed) may complete it next.
        caller = threading.get_ident()
        adding = [True]  # while add_done_callback runs: a callback now is under our lock
        future.add_done_callback(
            lambda f: self._connected(
                job, f, feed=not (adding[0] and threading.get_ident() == caller)
            )
        )
        adding[0] = False

    def _connected(self, job: _Job, future: Future[Peer], *, feed: bool) -> None:
        assert job.remote is not None
        ctx = self._ctx
        try:
            peer = future.result()
        except Exception as exc:
            host, port, _ = self._decode_rank_ports(job)  # computed by the connect already
            why = f"decode rank {job.decode_rank} at {host}:{port} cannot be handshaken: {exc}"
            logger.error("transfer %s: %s", job.transfer_id, why)
            with ctx.lock:
                self._fail(job, why)
            return
        try:
            if peer.response.engine_id != job.remote.decode_engine_id:
                with ctx.lock:
                    job.peer = peer  # it answers there: tell it we failed
                raise IncompatiblePeerError(
                    f"remote_blocks came from engine {job.remote.decode_engine_id!r}, but the "
                    f"decode address of the request serves {peer.response.engine_id!r}"
                )
            announced = job.remote.decode_incarnation
            if announced and peer.response.incarnation != announced:
                # Not the process whose blocks were announced: it restarted since, and its
                # blocks of those ids hold something else. Nobody waits for this transfer.
                with ctx.lock:
                    job.announcer_gone = True
                raise FailedPreconditionError(
                    f"decode {peer.response.engine_id} at {peer.key} is incarnation "
                    f"{peer.response.incarnation or '(none stated)'}, remote_blocks came from "
                    f"incarnation {announced}: the decode restarted since; not writing"
                )
            addressed = job.remote.prefill_incarnation
            if addressed and addressed != ctx.incarnation:
                with ctx.lock:
                    if self._ask_announcement_again(job, peer, addressed):
                        return
                    job.peer = peer  # it answers there: tell it we failed
                raise FailedPreconditionError(
                    f"remote_blocks was addressed to prefill incarnation {addressed}, this "
                    f"process is {ctx.incarnation}: the decode handshook this rank before it "
                    "restarted (and judges its writer by that process); not writing"
                )
            segments = None
            if job.save is not None and job.save.groups:
                with ctx.lock:
                    job.peer = peer  # it answers there: tell it we failed
                segments = self._plan_grouped(job, peer)
        except Exception as exc:
            logger.error("transfer %s: cannot write to the decode rank: %s", job.transfer_id, exc)
            with ctx.lock:
                self._fail(job, str(exc))
            return
        with ctx.lock:
            if job.state is not JobState.CONNECTING:
                return  # failed meanwhile
            job.peer = peer
            job.segments = segments
            job.machine.advance(JobEvent.CONNECTED)
            self._remember_written(peer)
            self._advance(job)
            self._confirm_decode_tp(job, peer)
        if feed:
            self.feed_writer()

    def _ask_announcement_again(self, job: _Job, peer: Peer, addressed: str) -> bool:
        """``job``'s announcement from ``peer`` was addressed to incarnation ``addressed`` of
        this rank, a predecessor (lock held). The first time, nothing was written: the job waits
        for the blocks again and the decode is told ``misaddressed``, so it can handshake this
        process and announce them to it within the request (False: not the first time, or the
        job moved on meanwhile; the caller fails it)."""
        if job.misaddressed or job.state is not JobState.CONNECTING:
            return False
        assert job.remote is not None
        job.misaddressed = True
        job.remote = None
        job.machine.advance(JobEvent.MISADDRESSED)
        logger.warning(
            "transfer %s: remote_blocks from decode %s was addressed to prefill incarnation %s, "
            "this process is %s (the decode's handshake predates this process); nothing "
            "written, asking the decode to announce its blocks again",
            job.transfer_id,
            peer.response.engine_id,
            addressed,
            self._ctx.incarnation,
        )
        self._send(
            peer.host,
            peer.notify_port,
            Misaddressed(
                job.request,
                writer_incarnation=self._ctx.incarnation,
                addressed_incarnation=addressed,
                writer_rank=self._rank,
            ),
        )
        return True

    def _fail(self, job: _Job, reason: str) -> None:
        """End a job as failed (lock held): with a write or its seal in the engine it is
        aborted there and its terminal event completes it; otherwise it completes now (the
        writer posts nothing of a job no longer live). Never an abort for nothing posted: the
        engine answers one for an id it remembers ended with OK and no event, so a job of a
        reused id would wait for it for good."""
        state = job.state
        if state in JOB_TERMINAL or state in (JobState.ABORTING, JobState.DRAINING):
            return
        job.reason = reason
        logger.warning("transfer %s: WRITE failed: %s", job.transfer_id, reason)
        if state in (JobState.WRITING, JobState.SEALED) and (job.engine_took or job.seal_posted):
            try:
                self._ctx.engine().abort(job.transfer_id)
                job.machine.advance(JobEvent.ABORT)
                return  # the aborted event completes the job
            except MoriioError:
                pass  # nothing of it reached the engine
        job.machine.advance(JobEvent.FAIL)
        self._complete(job)

    def _complete(self, job: _Job, event: Any = None) -> None:
        """Terminal job (lock held): one final message to the decode, then the blocks are
        reported free once the request finished -- also when the message or the stats raise
        (a defect of ours), or the request would hold its blocks for good."""
        try:
            self._tell_ended(job, event)
        finally:
            request = self._requests.get(job.request)
            if request is not None:
                request.live -= 1
                self._request_ended(request)

    def _tell_ended(self, job: _Job, event: Any) -> None:
        """``job``'s one final message to the decode, then its end in the stats (lock held):
        the decode waits for the message, nobody for the stats. An undrained job sends none:
        its writes may still land, and the decode keeps its blocks until its quarantine ends."""
        ctx = self._ctx
        job.device_events.clear()  # drained: no copy of the job waits for any of them
        ok = job.state is JobState.DONE
        if job.abort_requested is not None and not job.undrained:
            self._send_write_aborted(job)
        elif not job.released and not job.announcer_gone and not job.undrained:
            writers = len(job.plan.sources(job.decode_rank)) if job.plan is not None else 1
            message: NotifyMessage = (
                WriteDone(
                    job.request,
                    writer_rank=ctx.cfg.tp_rank,
                    num_writers=writers,
                    checksums=job.checksums,
                )
                if ok
                else self._write_failed(job.request, job.reason)
            )
            self._send_final(job, message)
        if ok and event is not None:
            ctx.stats.record_transfer(event, self._groups_moved(job))
        elif not ok and not job.released and not (job.send is not None and job.send.unsaved):
            ctx.stats.record(ok=False)  # (a request aborted before any write is no transfer)

    def _write_failed(self, request: str, reason: str) -> WriteFailed:
        return WriteFailed(
            request,
            writer_rank=self._rank,
            reason=reason_text(reason) or "failed",
            writer_incarnation=self._ctx.incarnation,
        )

    def _send_final(self, job: _Job, message: NotifyMessage) -> None:
        """``job``'s final message (lock held), to its handshaken decode rank; without a
        handshake (it failed, or the job ended before it answered: nothing was posted to the
        engine, so nothing can land) to the notify port of the rank that announced the blocks
        at the request's decode address. A decode rank that never announced waits for nothing
        from this rank. The allowlist decides as for any message; a refusal is logged."""
        if job.peer is not None:
            self._send(job.peer.host, job.peer.notify_port, message)
            return
        if job.remote is None or job.save is None or job.save.peer is None:
            return
        self._send_to_rank(
            job.save.peer,
            job.remote.decode_dp_rank,
            job.decode_rank,
            self._decode_tp(job),
            job.remote,
            message,
        )

    def _send(self, host: str, port: int, message: NotifyMessage) -> None:
        """Never waits (NotifySender.send: zmq NOBLOCK); a message that cannot go (a host the
        allowlist refuses, a full queue) is logged, not raised."""
        try:
            self._ctx.sender.send(host, port, message)
        except MoriioError as exc:
            logger.warning("transfer %s: %s not sent: %s", message.transfer_id, message.TYPE, exc)

    def _send_write_aborted(self, job: _Job) -> None:
        """The ack of abort_write (lock held; nothing of the job writes any more), to where
        the job writes: its handshaken decode rank, or, unhandshaken, that rank's notify port
        at the request's decode address (where a handshake would have gone). Only a job of a
        request this rank never had is answered where a handshake proved the rank the abort
        names (:meth:`_ack_by_handshake`); so is one whose request named no decode address."""
        request = job.abort_requested
        assert request is not None
        # The rank the job wrote into, where known (the abort's own word otherwise): the ack
        # is true of it, whichever message asked.
        ack = self._ack(request, job.written)
        if job.peer is not None:
            self._send(job.peer.host, job.peer.notify_port, ack)
        elif job.save is not None and job.save.peer is not None:
            dp_rank = job.remote.decode_dp_rank if job.remote is not None else None
            self._send_to_rank(
                job.save.peer, dp_rank, job.decode_rank, self._decode_tp(job), request, ack
            )
        else:
            self._ack_by_handshake(request, ack)

    def _send_to_rank(
        self,
        address: ZmqAddress,
        dp_rank: int | None,
        rank: int,
        tp_size: int,
        cause: RemoteBlocks | AbortWrite,
        message: NotifyMessage,
    ) -> None:
        """``message`` to the notify port of decode rank ``rank`` at the request's decode
        ``address`` (lock held): DP rank ``dp_rank``, the one the rank announced; None (it
        never announced, so nothing was written to it) takes the one ``cause`` names."""
        dp_rank = cause.decode_dp_rank if dp_rank is None else dp_rank
        try:
            host, _, notify_port = rank_ports(address, dp_rank, rank, tp_size)
        except MoriioError as exc:
            logger.warning("transfer %s: %s not sent: %s", message.transfer_id, message.TYPE, exc)
            return
        self._send(host, notify_port, message)

    def _ack_by_handshake(
        self, request: AbortWrite, ack: WriteAborted, since: float | None = None
    ) -> None:
        """Acknowledge an abort_write whose decode address this rank does not know (it never
        had the request, or the request named none; lock held): only at the rank it names,
        proven by a handshake at its address (allowlist; the rank, its TP size and
        ``decode_engine_id`` must match), or an earlier handshake of that engine id and rank
        (:meth:`_proven_rank`: the directory's cache, or a decode rank this rank wrote to). An
        ack tells its receiver that this rank's writes of the transfer into it stopped, so it
        must reach no other rank: one this rank may still write into later, should the request
        come. A handshake that fails, or that would be one more than
        :data:`MAX_ACK_HANDSHAKES` in flight or :data:`ACK_HANDSHAKES_PER_S` a second, is tried
        again (:data:`ACK_RETRY_EVERY_S`);
        ``since``: the first try's time, when this is a later one."""
        since = time.monotonic() if since is None else since
        proven = self._proven_rank(request)
        if proven is not None:
            self._send(proven.host, proven.notify_port, ack)
            return
        if self._ack_handshakes >= MAX_ACK_HANDSHAKES:
            busy = f"{self._ack_handshakes} handshakes of other acknowledgements in flight"
            self._ack_failed(request, TransportError(busy), since)
            return
        if not self._ack_budget.take():
            busy = f"{ACK_HANDSHAKES_PER_S:.0f} acknowledgement handshakes a second started"
            self._ack_failed(request, TransportError(busy), since)
            return
        try:
            # The message's own fields, checked when it was decoded (its decode_address builds
            # and checks a ZmqAddress per call: most of this path's CPU under a flood).
            future = self._ctx.connect_rank(
                request.decode_host,
                request.decode_handshake_port,
                request.decode_notify_port,
                request.decode_dp_rank,
                request.decode_tp_size,
                request.decode_tp_rank,
            )
        except MoriioError as exc:
            self._ack_budget.give_back()
            self._ack_failed(request, exc, since)
            return
        # A future done already (a cached failure) held no thread and started no handshake.
        counted = not future.done()
        self._ack_handshakes += counted
        if not counted:
            self._ack_budget.give_back()

        def acked(f: Future[Peer]) -> None:
            if counted:
                with self._ctx.lock:
                    self._ack_handshakes -= 1
            try:
                peer = f.result()
                if peer.response.engine_id != request.decode_engine_id:
                    raise IncompatiblePeerError(
                        f"abort_write came from engine {request.decode_engine_id!r}, but its "
                        f"address serves {peer.response.engine_id!r}"
                    )
            except Exception as exc:
                self._ack_failed(request, exc, since)
                return
            self._send(peer.host, peer.notify_port, ack)
            with self._ctx.lock:
                self._send_proven_acks(request.decode_engine_id, _RankAddress.of(peer))

        future.add_done_callback(acked)

    def _remember_written(self, peer: Peer) -> None:
        """``peer`` is a decode rank this rank writes to (lock held): kept, the most recent."""
        engine_id = peer.response.engine_id
        proven = _RankAddress.of(peer)
        self._written_ranks.pop(engine_id, None)
        self._written_ranks[engine_id] = proven
        if len(self._written_ranks) > MAX_WRITTEN_DECODE_RANKS:
            self._written_ranks.popitem(last=False)
        self._send_proven_acks(engine_id, proven)

    def _send_proven_acks(self, engine_id: str, proven: _RankAddress) -> None:
        """The acknowledgements waiting for a handshake that name rank ``proven`` of decode
        engine ``engine_id``, which a handshake just proved (lock held): sent there at once,
        without waiting for the budget. Found by the rank each names (none is decoded); those
        naming another rank or port keep waiting."""
        for transfer_id in self._ack_retries.take_naming(proven.key(engine_id)):
            ack = WriteAborted(transfer_id, engine_id, writer_rank=self._rank)
            self._send(proven.host, proven.notify_port, ack)

    def _proven_rank(self, request: AbortWrite) -> _RankAddress | None:
        """Where a handshake proved the rank ``request`` names, with the engine id it names:
        the peer directory's cached handshake (at the notify port the request names), else a
        decode rank this rank wrote to (at its request's notify port; lock held). None: only a
        new handshake can prove it."""
        handshake = self._ctx.directory.find_engine(request.decode_engine_id)
        if handshake is not None:
            # A handshake proves who answers at its address, not a notify port: the rank's
            # port is the one the abort names (-1 for none), as for a handshake made for it.
            named_port = _named_rank(request)[-1]
            proven: _RankAddress | None = _RankAddress.of(Peer(handshake, named_port))
        else:
            proven = self._written_ranks.get(request.decode_engine_id)
        if proven is None or proven.notify_port < 0 or not proven.named_by(request):
            return None
        return proven

    def _ack_failed(self, request: AbortWrite, exc: Exception, since: float) -> None:
        """No acknowledgement for ``request`` (any thread): kept to be tried again when its
        handshake failed, which may pass; not when the rank's address answered as another
        engine or rank, or the allowlist refused it."""
        if isinstance(exc, (TransportError, TransferTimeoutError)):
            with self._ctx.lock:
                due = time.monotonic() + ACK_RETRY_EVERY_S
                wire = encode(request)
                rank = _named_rank(request)
                for dropped in self._ack_retries.put(wire, rank, request.transfer_id, since, due):
                    self._give_up_ack(dropped, "too many waiting")
            self._unacked.warn(
                "transfer %s: cannot acknowledge the decode's abort yet (%s); trying again "
                "every %.0f s for abort_timeout",
                request.transfer_id,
                exc,
                ACK_RETRY_EVERY_S,
            )
            return
        self._unacked.warn(
            "transfer %s: cannot acknowledge the decode's abort (%s); it frees the blocks "
            "after its quarantine_timeout",
            request.transfer_id,
            exc,
        )

    def _give_up_ack(self, wire: bytes, why: str) -> None:
        """An acknowledgement no longer tried (lock held): said, rate limited, for the operator
        of a decode that now waits out its quarantine_timeout."""
        request = decode(wire, (AbortWrite,), max_bytes=len(wire))
        self._unacked.warn(
            "transfer %s: gave up acknowledging the decode's abort (%s); decode rank %d frees "
            "the blocks after its quarantine_timeout",
            request.transfer_id,
            why,
            request.decode_tp_rank,
        )

    def _retry_acks(self, now: float, abort_timeout: float) -> None:
        """Try the acknowledgements that are due again (lock held), only as many as
        handshakes may start (:data:`MAX_ACK_HANDSHAKES` in flight, :data:`ACK_HANDSHAKES_PER_S`
        a second): the others stay due, tried in later
        passes (trying each, to fail at once for want of a handshake, held the lock 23 ms per
        1,024 of them under a flood). Those first tried more than ``abort_timeout`` before
        ``now`` are given up (their decode frees the blocks at its quarantine_timeout)."""
        free = min(MAX_ACK_HANDSHAKES - self._ack_handshakes, self._ack_budget.available())
        for due in self._ack_retries.take_due(now, abort_timeout, free):
            if due.expired:
                self._give_up_ack(due.wire, f"no handshake for {abort_timeout:.0f} s")
                continue
            request = decode(due.wire, (AbortWrite,), max_bytes=len(due.wire))
            self._ack_by_handshake(request, self._ack(request), due.since)

    # ---- engine events (events thread) --------------------------------------------------------

    def on_event_error(self, event: Any, drained: bool, why: str) -> bool:
        """Handling ``event`` of one of our WRITE jobs raised (a defect of ours) before the job
        reached its end: it must still end, or its request holds the prefill's blocks for good
        (a job whose engine transfer ended has no deadline left: the engine has nothing to
        abort). It fails now, or once its writes drained when the event says some are still in
        flight; a job at its end (or waiting for a drain or checksums) keeps its course. False
        when ``event`` is not one of our jobs."""
        with self._ctx.lock:
            job = self._jobs.get(event.transfer_id)
            if job is None:
                return False
            engine_event = JobEvent.ENGINE_FAILED if drained else JobEvent.ENGINE_UNDRAINED
            if not job.machine.allows(engine_event):
                return True
            logger.error("transfer %s: %s", event.transfer_id, why)
            job.reason = job.reason or why
            job.machine.advance(engine_event)
            if job.state in JOB_TERMINAL:
                self._complete(job)
        return True

    def on_event(self, event: Any, drained: bool) -> bool:
        with self._ctx.lock:
            job = self._jobs.get(event.transfer_id)
            if job is None or job.state in JOB_TERMINAL:
                return job is not None
            if job.state is JobState.DRAINING:
                return True
            if event.state not in ("done", "aborted"):
                # The connection may be what failed (UCX: the endpoint errored): the next job
                # handshakes the decode again, and the engine reconnects the same metadata.
                self._ctx.directory.forget(job.peer)
            if not drained:
                # Writes may still land in the decode's blocks (and read ours): nothing is
                # reported, nothing freed, until the engine says they drained.
                job.reason = job.reason or f"{event.state}: {event.message}"
                job.machine.advance(JobEvent.ENGINE_UNDRAINED)
                logger.warning(
                    "transfer %s: WRITE ended with writes in flight (%s); holding it until "
                    "they drain",
                    event.transfer_id,
                    event.message,
                )
                return True
            ok = event.state == "done"
            if not ok:
                job.reason = job.reason or f"{event.state}: {event.message}"
            next_event = JobEvent.ENGINE_DONE if ok else JobEvent.ENGINE_FAILED
            if not job.machine.allows(next_event):
                logger.error(
                    "transfer %s: unexpected engine event %s in %s",
                    event.transfer_id,
                    event.state,
                    job.state.name,
                )
                return True
            verifier = self._ctx.verifier
            if ok and verifier is not None and job.machine.allows(JobEvent.CHECKSUM):
                job.machine.advance(JobEvent.CHECKSUM)
                local = self._verified_ids(job)
                if local is None:
                    job.reason = whole_blocks_only("WRITE")
                    logger.warning("transfer %s: WRITE failed: %s", job.transfer_id, job.reason)
                    job.machine.advance(JobEvent.FAIL)
                    self._complete(job)
                    return True
                verifier.for_write_done(
                    job.transfer_id,
                    local,
                    lambda sums, why: self._checksummed(job, event, sums, why),
                )
                return True
            job.machine.advance(next_event)
            self._complete(job, event)
        return True

    @staticmethod
    def _groups_moved(job: _Job) -> int:
        """The KV-cache groups the job wrote (stats): 1 unless grouped."""
        if job.segments is None:
            return 1
        return len({s.group for layer in job.segments.values() for s in layer})

    @staticmethod
    def _verified_ids(job: _Job) -> list[int] | None:
        """Our blocks a whole-block check of this job covers, in the decode's announced order;
        None when the job writes windows or several groups."""
        if job.plan is not None and not job.plan.identity:
            return None
        if job.segments is None:
            return None if job.block_ids is None else job.block_ids[0].tolist()
        moved = {tuple(s) for s in job.segments.values() if s}
        if len(moved) != 1:
            return None
        (only,) = moved
        if len(only) != 1 or only[0].tokens is not None:
            return None
        return list(only[0].local_blocks)

    def _checksummed(
        self, job: _Job, event: Any, checksums: dict[str, bytes] | None, why: str
    ) -> None:
        """write_done's checksums are ready (the verify thread): send it, or fail the job."""
        size = sum(len(k) + len(v) + 16 for k, v in (checksums or {}).items())
        if checksums is not None and size > MAX_NOTIFY_BYTES - 4096:
            checksums, why = (
                None,
                (
                    f"the checksums of {len(checksums)} layers ({size} bytes) do not fit one "
                    f"write_done message ({MAX_NOTIFY_BYTES} bytes)"
                ),
            )
        with self._ctx.lock:
            if job.state is not JobState.CHECKSUMMING:
                return  # failed meanwhile (abort_write, release, abort_timeout)
            if checksums is None:
                job.reason = why
                logger.warning("transfer %s: WRITE failed: %s", job.transfer_id, why)
                job.machine.advance(JobEvent.FAIL)
                self._complete(job)
                return
            job.checksums = checksums
            job.machine.advance(JobEvent.CHECKSUMMED)
            self._complete(job, event)

    def on_drained(self, tid: str) -> str:
        """'done' when a DRAINING job completed, 'early' when the job's undrained event is
        still to come, '' when the id is not a job of ours."""
        with self._ctx.lock:
            job = self._jobs.get(tid)
            if job is None:
                return ""
            if job.state is JobState.DRAINING:
                job.machine.advance(JobEvent.DRAINED)
                self._complete(job)
                return "done"
            return "" if job.state in JOB_TERMINAL else "early"

    # ---- READ holds (verify) -------------------------------------------------------------------

    def held_for_checksums(
        self,
        tid: str,
        block_ids: Sequence[int],
        hold_until_ms: int = 0,
        answer_ids: Sequence[int] = (),
        answer_sizes: Sequence[int] = (),
    ) -> str | None:
        """None while this rank holds the blocks of READ transfer ``tid`` for its decode under
        the answer that stated ``hold_until_ms`` (0: the asker names none) and ``block_ids``
        are among those that answer named, else why not: a decode's checksums of a READ (or
        its hold check) are worth comparing only with blocks still held, since freed ones may
        already hold another request's KV (and, read again, match what the READ took from
        them); only under the answer the READ used (a later request reusing the transfer id
        may hold the same blocks again, refilled); and only with the transfer's own blocks (a
        READ of other blocks, through an answer changed on its way, matches them too). Never
        waits: a transfer not known yet is refused as not come within SEND_TASK_WAIT_S, so ask
        once :meth:`when_hold_known` said so (the decode may ask before the step that hands us
        its send task). Called without the context lock (the handshake server's threads)."""
        if self._ctx.cfg.mode != "read":
            return "this prefill runs WRITE mode (its checksums go in write_done)"
        with self._ctx.lock:
            send = self._sends.get(tid)
            if send is None:
                ended = self._ended_holds.get(tid)
                if ended is not None:
                    return f"its blocks are no longer held: {ended}"
                if self._ctx.stop.is_set():
                    return "this rank is shutting down"
                return f"this rank holds no blocks of it (none within {SEND_TASK_WAIT_S:g}s)"
            answered = send.answered
            stated = send.task.hold_until_ms
            given = tuple(send.task.block_ids)
            sizes = tuple(send.task.group_sizes)
        if hold_until_ms and stated and hold_until_ms != stated:
            return (
                f"its blocks are held for another answer under that transfer id (stating a hold "
                f"until {stated}, the READ's answer {hold_until_ms})"
            )
        strangers = [b for b in block_ids if b not in answered]
        if strangers:
            return (
                f"blocks {strangers[:8]} ({len(strangers)} in all) are not among the "
                f"{len(answered)} its answer named"
            )
        if tuple(answer_ids) != given:
            # The decode loads block i of the prompt from the answer's i-th block: an answer
            # reordered on its way names only blocks held here, and each block's checksum
            # matches, while every position holds another's KV.
            return (
                "the READ used an answer naming other blocks than the one this rank gave, or "
                "these in another order, or stated none"
            )
        if sizes and tuple(answer_sizes) != sizes:
            # The same ids in the same flat order, split into groups otherwise: a group's
            # position i then loads another group's (or another position's) block.
            return (
                f"the READ used an answer whose KV-cache groups hold {list(answer_sizes)} of its "
                f"blocks, this rank's answer {list(sizes)}"
            )
        return None

    def hold_known(self, tid: str) -> bool:
        """Whether READ transfer ``tid`` is held here or its hold ended (remembered), so that
        :meth:`held_for_checksums` has its answer."""
        with self._ctx.lock:
            return self._knows_hold(tid)

    def when_hold_known(self, tid: str, go: Callable[[], None]) -> None:
        """Call ``go`` once READ transfer ``tid`` is held here or its hold ended, or once
        SEND_TASK_WAIT_S passed without either (found by the timeout pass, every
        TIMEOUT_CHECK_EVERY_S), or once the core stops: at once when already so. A request
        waits so without a thread, from its arrival. ``go`` is called under the context lock,
        on whichever thread learns it: it must not block nor take that lock (it queues the
        answer)."""
        ctx = self._ctx
        with ctx.lock:
            if self._knows_hold(tid) or ctx.cfg.mode != "read" or ctx.stop.is_set():
                go()  # (WRITE mode holds nothing to wait for: refused as such)
                return
            deadline = time.monotonic() + SEND_TASK_WAIT_S
            self._hold_waiters.setdefault(tid, []).append((deadline, go))

    def _knows_hold(self, tid: str) -> bool:
        """Whether ``tid`` is held here or its hold ended (lock held)."""
        return tid in self._sends or tid in self._ended_holds

    def stop_hold_waits(self) -> None:
        """Let every request waiting in :meth:`when_hold_known` go now (the core is stopping:
        they are refused as such)."""
        with self._ctx.lock:
            for tid in list(self._hold_waiters):
                self._hold_known(tid)

    def _expire_hold_waits(self, now: float) -> None:
        """Let go the requests that waited SEND_TASK_WAIT_S for their transfer (lock held)."""
        for tid, waiters in list(self._hold_waiters.items()):
            for waiter in [w for w in waiters if w[0] <= now]:
                waiters.remove(waiter)
                waiter[1]()
            if not waiters:
                del self._hold_waiters[tid]

    def _hold_known(self, tid: str) -> None:
        """Let go the requests waiting for ``tid``'s hold (lock held)."""
        for _, go in self._hold_waiters.pop(tid, ()):
            go()

    def _end_hold(self, tid: str, why: str) -> None:
        """READ transfer ``tid`` holds no blocks any more (lock held). Its id is marked
        terminal: a late release of it must not be kept as an early one of a later request
        reusing the id (which it would free at once)."""
        self._ended_holds[tid] = why
        self._ended_holds.move_to_end(tid)
        if len(self._ended_holds) > MAX_ENDED_HOLDS:
            self._ended_holds.popitem(last=False)
        self._hold_known(tid)
        self._ctx.mark_terminal(tid)

    # ---- control messages (notify thread) -----------------------------------------------------

    def on_release(self, message: Release) -> None:
        ctx = self._ctx
        tid = message.transfer_id
        with ctx.lock:
            send = self._sends.get(tid)
            jid = job_transfer_id(tid, message.consumer_tp_rank, ctx.cfg.tp_rank)
            job = self._jobs.get(jid)
            orphan = self._orphans.get(jid)
            if send is not None:
                self._record_release(send.released, message)
                if not self._fully_released(send.released):
                    return  # other decode ranks read this rank's blocks too
                send.machine.advance(SendEvent.RELEASED)
                del self._sends[tid]
                ctx.reports.done_sending.add(send.task.req_id)
                self._end_hold(tid, "released")
            elif job is not None:
                # Not the rank this job writes (READ counts releases the same way): it must not
                # end a live job whose decode rank then hears nothing.
                if self._of_another_size(message, self._decode_tp(job)):
                    return
                job.released = True
                self._fail(job, "the decode released the transfer")
                return
            elif orphan is not None:
                request = self._requests.get(tid)
                plan = request.plan if request is not None else None
                if plan is not None and self._of_another_size(message, plan.decode_tp):
                    return
                self._orphan_released(jid, orphan, message.consumer_tp_size)
                return
            elif self._release_unconfirmed(tid, message.consumer_tp_size, message.consumer_tp_rank):
                return
            elif tid in self._requests or tid in self._unwritten:
                logger.info(
                    "transfer %s: release from decode rank %d, which this rank does not write",
                    tid,
                    message.consumer_tp_rank,
                )
                return
            else:
                if not self._early_releases.record(message, per_size=ctx.cfg.mode == "write"):
                    self._other_size.warn(
                        "ignoring a release of transfer %s by decode rank %d of TP size %d: an "
                        "earlier one named another TP size",
                        tid,
                        message.consumer_tp_rank,
                        message.consumer_tp_size,
                    )
                return

    def on_remote_blocks(self, message: RemoteBlocks) -> None:
        """A decode rank's blocks for a job: the job goes on, or, when it ended already (also
        when its request did), the rank is told write_failed at once (once)."""
        tid = message.transfer_id
        if self._ctx.cfg.mode != "write":
            self._stray.warn(
                "ignoring remote_blocks for transfer %s: this instance runs READ mode", tid
            )
            return
        with self._ctx.lock:
            jid = job_transfer_id(tid, message.decode_tp_rank, self._rank)
            ended = self._ended.get(jid)
            if ended is not None:
                self._late_announcement(ended, message)
                return
            held = self._held_back.get(tid)
            if held is not None and held.covers(message.decode_tp_rank, self._rank):
                self._tell_held_back(held, message)
                return
            job = self._jobs.get(jid)
            if job is None:
                self._orphan_announced(jid, message)
                return
            if job.state in JOB_TERMINAL and not job.settled:
                # It ended before the decode rank announced (aborted, its deadline, a request
                # that cannot be written): nothing was or will be written into the rank.
                job.remote = message
                self._send_final(job, self._write_failed(job.request, job.reason))
                return
            if job.remote is not None or job.state is not JobState.PENDING:
                return
            job.remote = message
            if not any(message.block_ids):
                job.released = True
                self._fail(job, "the decode needs no blocks")
                return
            self._advance(job)
        self.feed_writer()

    def on_abort_write(self, message: AbortWrite) -> None:
        """The decode gave up on a WRITE and holds its blocks quarantined: stop the transfer,
        and once none of its writes can land, answer write_aborted."""
        if self._ctx.cfg.mode != "write":
            self._stray.warn(
                "ignoring abort_write for transfer %s: this instance runs READ mode",
                message.transfer_id,
            )
            return
        with self._ctx.lock:
            jid = job_transfer_id(message.transfer_id, message.decode_tp_rank, self._rank)
            ended = self._ended.get(jid)
            if ended is not None:
                if not ended.acked and not ended.undrained:  # one answer per transfer
                    ended.acked = True
                    rank, tp_size = ended.decode_rank, ended.decode_tp
                    self._ack_unwritten(
                        ended.address, ended.dp_rank, rank, tp_size, message, ended.written
                    )
                return
            held = self._held_back.get(message.transfer_id)
            if held is not None and held.covers(message.decode_tp_rank, self._rank):
                rank, tp_size = message.decode_tp_rank, held.plan.decode_tp
                if held.acked.first(rank):  # one answer per transfer
                    self._ack_unwritten(held.address, None, rank, tp_size, message)
                return
            job = self._jobs.get(jid)
            if job is None:
                self._orphan_aborted(jid, message)
                return
            if job.abort_requested is not None:
                return  # one answer per transfer
            job.abort_requested = message
            if job.state in JOB_TERMINAL:
                if not job.undrained:  # it ended drained: nothing of it can land
                    self._send_write_aborted(job)
                return
            self._fail(job, "the decode aborted the transfer")

    @property
    def _rank(self) -> int:
        return self._ctx.cfg.tp_rank

    def _ack(self, request: AbortWrite, written: str | None = None) -> WriteAborted:
        """This rank's acknowledgement of ``request``, naming the decode rank whose writes
        stopped: ``written``, the one a job of it wrote into, else the one ``request`` names
        (what a handshake proves before an acknowledgement of a transfer this rank never had
        goes out)."""
        named = request.decode_engine_id if written is None else written
        return WriteAborted(request.transfer_id, named, writer_rank=self._rank)

    # ---- orphans: messages of requests without a save task yet (lock held) --------------------
    # What _fail and _complete do to a job without a save or send task, on its flat record.

    def _orphan_announced(self, jid: str, message: RemoteBlocks) -> None:
        """remote_blocks: the orphan waits for its save task; one whose decode needs no blocks
        fails (and sends nothing: the decode released it). An orphan kept already has its
        announcement or failed (released, aborted), so it takes none."""
        if self._orphans.get(jid) is not None:
            return
        ids = sum(len(group) for group in message.block_ids)
        reason = "" if ids else "the decode needs no blocks"
        if reason:
            self._orphan_failed.warn("transfer %s: WRITE failed: %s", jid, reason)
        orphan = _new_orphan(
            message,
            ids=ids,
            announced=encode(message),
            released=_UNRELEASED if ids else _NEEDS_NOTHING,
            reason=reason,
        )
        self._orphans.keep(jid, orphan)

    def _of_another_size(self, message: Release, decode_tp: int) -> bool:
        """Whether ``message`` names another decode TP size than the request's
        ``decode_tp`` (logged, rate limited): not the release of the rank it names."""
        if message.consumer_tp_size == decode_tp:
            return False
        self._other_size.warn(
            "ignoring a release of transfer %s by decode rank %d of TP size %d: the request's "
            "decode TP size is %d",
            message.transfer_id,
            message.consumer_tp_rank,
            message.consumer_tp_size,
            decode_tp,
        )
        return True

    def _orphan_released(self, jid: str, orphan: _Orphan, size: int) -> None:
        """A release: the orphan fails, with no final message owed."""
        created, request, rank, ids, announced, aborted, released, reason = orphan
        if not reason:
            reason = _RELEASED
            self._orphan_failed.warn("transfer %s: WRITE failed: %s", jid, reason)
        released = _released_sizes(released, size)
        self._orphans.keep(jid, (created, request, rank, ids, announced, aborted, released, reason))

    def _orphan_aborted(self, jid: str, message: AbortWrite) -> None:
        """abort_write: the orphan fails (nothing of it was written), and the abort is
        acknowledged, once, at the rank it names (:meth:`_ack_by_handshake`)."""
        orphan = self._orphans.get(jid) or _new_orphan(message)
        created, request, rank, ids, announced, aborted, released, reason = orphan
        if aborted is not None:
            return  # one answer per transfer
        if not reason:
            reason = "the decode aborted the transfer"
            self._orphan_failed.warn("transfer %s: WRITE failed: %s", jid, reason)
            self._ctx.stats.record(ok=False)
        aborted = encode(message)
        self._orphans.keep(jid, (created, request, rank, ids, announced, aborted, released, reason))
        self._ack_by_handshake(message, self._ack(message))

    def _late_announcement(self, ended: _Ended, message: RemoteBlocks) -> None:
        """remote_blocks for a job of an ended request (lock held): it never wrote (it had no
        blocks to write), so the announcing rank is told write_failed, once."""
        if ended.settled:
            return
        ended.settled = True
        rank, tp_size = ended.decode_rank, ended.decode_tp
        self._tell_unwritten(ended.address, rank, tp_size, ended.reason, message)

    def _tell_unwritten(
        self,
        address: ZmqAddress | None,
        rank: int,
        tp_size: int,
        reason: str,
        message: RemoteBlocks,
    ) -> None:
        """write_failed (``reason``) to decode rank ``rank`` of ``tp_size``, which announced
        ``message`` for blocks nothing was or will be written into (lock held), at the
        request's decode ``address`` (logged instead when the request named none)."""
        failed = self._write_failed(message.transfer_id, reason)
        if address is None:
            logger.warning(
                "transfer %s: write_failed not sent: the request named no decode address",
                message.transfer_id,
            )
            return
        self._send_to_rank(address, None, rank, tp_size, message, failed)

    def _ack_unwritten(
        self,
        address: ZmqAddress | None,
        dp_rank: int | None,
        rank: int,
        tp_size: int,
        request: AbortWrite,
        written: str | None = None,
    ) -> None:
        """abort_write from decode rank ``rank`` of ``tp_size`` for a job of an ended request,
        or one never made (lock held): nothing of it can land any more, so the ack goes at once
        to where the job wrote or would have (DP rank ``dp_rank``, None: the one ``request``
        names; ``written``: the engine id of the rank it wrote into, None: it never wrote), or,
        when the request named no decode address, where a handshake proves the rank."""
        ack = self._ack(request, written)
        if address is None:
            self._ack_by_handshake(request, ack)
            return
        self._send_to_rank(address, dp_rank, rank, tp_size, request, ack)

    # ---- timeouts -----------------------------------------------------------------------------

    def check_timeouts(self, now: float) -> None:
        ctx = self._ctx
        abort_timeout = ctx.cfg.abort_timeout
        with ctx.lock:
            self._expire_hold_waits(now)
            for tid, send in list(self._sends.items()):
                if now > send.deadline:
                    send.machine.advance(SendEvent.EXPIRED)
                    del self._sends[tid]
                    ctx.reports.done_sending.add(send.task.req_id)
                    self._end_hold(tid, f"expired (no release within {abort_timeout:.0f}s)")
                    logger.warning(
                        "request %s (transfer %s): no release within abort_timeout (%.0fs); "
                        "freeing",
                        send.task.req_id,
                        tid,
                        abort_timeout,
                    )
            while self._ended and now - next(iter(self._ended.values())).ended > abort_timeout:
                self._ended.popitem(last=False)
            held_back = self._held_back
            while held_back and now - next(iter(held_back.values())).ended > abort_timeout:
                held_back.popitem(last=False)
            # Each job has its save or send task: the scheduler's send task ends it, or its
            # deadline (_fail does nothing to one that ended or drains).
            quarantine = ctx.cfg.quarantine_timeout
            for job in list(self._jobs.values()):
                if job.send is None or now <= job.deadline:
                    continue
                if job.state is JobState.DRAINING and now > job.deadline + quarantine:
                    self._give_up_drain(job, quarantine)
                else:
                    self._fail(job, f"not finished within abort_timeout ({abort_timeout:.0f}s)")
            self._orphans.expire(now, abort_timeout)  # messages of requests we never saw
            self._retry_acks(now, abort_timeout)
            self._early_releases.expire(now, abort_timeout)

    def _give_up_drain(self, job: _Job, quarantine: float) -> None:
        """A job whose writes the engine never reported drained (writes its transport could
        not confirm are never reported), ``quarantine`` past its deadline: it ends, so that the
        request's blocks here are freed (our side of its writes ended long ago), but it tells
        the decode nothing, now or on a late abort_write: its writes may still land, and the
        decode keeps its blocks until its own quarantine_timeout (lock held)."""
        logger.warning(
            "transfer %s: its writes were not reported drained within quarantine_timeout "
            "(%.0fs) past its deadline; ending it without a final message (the decode frees "
            "its blocks at its own quarantine_timeout)",
            job.transfer_id,
            quarantine,
        )
        job.undrained = True
        job.machine.advance(JobEvent.DRAINED)
        self._complete(job)

    # ---- releases bookkeeping (lock held) -----------------------------------------------------

    def _record_release(self, released: _Releases, release: Release) -> None:
        """Count ``release`` when it is one of the releases this rank waits for: the decode TP
        size of the first release, from a decode rank that reads this rank or was assigned to
        release it. Others are logged and ignored, so no message can free blocks a decode rank
        may still be reading."""
        cfg = self._ctx.cfg
        size, rank = release.consumer_tp_size, release.consumer_tp_rank
        released.consumer_tp_size = released.consumer_tp_size or size
        expected_size = released.consumer_tp_size
        plan = self._release_plan(expected_size)
        if size != expected_size or (plan is not None and not plan.releases(rank, cfg.tp_rank)):
            logger.warning(
                "transfer %s: ignoring a release from decode rank %d of %d (expected releases "
                "from the decode ranks of %d that pair with prefill rank %d of %d)",
                release.transfer_id,
                rank,
                size,
                expected_size,
                cfg.tp_rank,
                cfg.tp_size,
            )
            return
        released.ranks.add(rank)

    def _release_plan(self, consumer_tp_size: int) -> TpPlan | None:
        """The plan releases are counted by; None when no decode rank of that TP size can
        pair with us (the decode refuses the handshake, reads nothing, and every one of its
        ranks releases every prefill rank)."""
        try:
            return self._ctx.tp_plan("decode", consumer_tp_size, prefill=True)
        except MoriioError:
            return None

    def _fully_released(self, released: _Releases) -> bool:
        if not released.consumer_tp_size:
            return False
        plan = self._release_plan(released.consumer_tp_size)
        if plan is None:  # nobody could read us: any release frees
            return bool(released.ranks)
        return len(released.ranks) >= plan.expected_releases(self._ctx.cfg.tp_rank)

    # ---- the writer thread --------------------------------------------------------------------

    def feed_writer(self) -> None:
        """Move staged writer work into the bounded writer queue, waiting for room when it is
        full (backpressure). Called WITHOUT the context lock: the writer takes it after each
        get, so it could never make room for a producer that held it."""
        ctx = self._ctx
        with self._feed:
            with ctx.lock:
                ops, self._staged = self._staged, []
            for op in ops:
                while not ctx.stop.is_set():
                    try:
                        self._writer_q.put(op, timeout=WAIT_SLICE_S)
                        break
                    except queue.Full:
                        continue

    def _layer_event_handle(self, event: Any, peer: Peer) -> int:
        """The handle of the CUDA event after a layer's compute for its copy to ``peer`` to
        wait on when the engine can for that peer (on the GPU, or in its progress thread for a
        peer on another node: the writer never waits and the copy starts the moment the layer
        is computed); otherwise 0, after waiting for the event here (its KV is computed). No
        event: a CPU forward, already finished."""
        if event is None:
            return 0
        if self._ctx.engine().waits_for_device_events(peer.engine_peer):
            return int(event.cuda_event)
        event.synchronize()
        return 0

    def _split_computed(
        self, layers: list[tuple[str, Any]], peer: Peer
    ) -> tuple[list[str], dict[int, tuple[Any, list[str]]]]:
        """``layers`` (name, event or None) split into those whose KV is computed now, which
        go in one ``write_layers`` call without an event, and the rest by their event (the
        layers whose save hook did not run share the one recorded after the forward), each
        event's layers in one call whose copies wait for it in the engine. Computed: no event (a
        CPU forward), an event that already completed, or, for a peer whose copies cannot
        wait for events, an event waited for here."""
        computed: list[str] = []
        waiting: dict[int, tuple[Any, list[str]]] = {}
        device_waits: bool | None = None
        for layer, event in layers:
            if event is None:
                computed.append(layer)
                continue
            if device_waits is None:
                device_waits = self._ctx.engine().waits_for_device_events(peer.engine_peer)
            if device_waits and not event.query():
                waiting.setdefault(id(event), (event, []))[1].append(layer)
                continue
            if not device_waits:
                event.synchronize()
            computed.append(layer)
        return computed, waiting

    def _post_layers(
        self,
        job: _Job,
        peer: Peer,
        ids: WholeBlocks,
        computed: list[str],
        waiting: dict[int, tuple[Any, list[str]]],
    ) -> bool | None:
        """Post a "writes" op (lock held): the computed layers in one call, then the layers
        still computing, one call per event with its handle (the event held until the job
        drained). Whether the engine took any (None: there was none to post). The job records
        each call the engine took as it is taken: a later call that raises must find the job
        with writes in the engine, so that it is aborted there and waits for their end."""
        local_ids, remote_ids = ids
        engine = self._ctx.engine()
        taken = False
        if computed:
            taken = engine.write_layers(
                job.transfer_id, computed, peer.engine_peer, local_ids, remote_ids
            )
            job.engine_took |= taken
        for event, layers in waiting.values():
            job.device_events.append(event)
            took = engine.write_layers(
                job.transfer_id,
                layers,
                peer.engine_peer,
                local_ids,
                remote_ids,
                int(event.cuda_event),
            )
            job.engine_took |= took
            taken |= took
        return taken if computed or waiting else None

    def _post_layer(
        self, job: _Job, peer: Peer, layer: str, arg: tuple[Any, Any], handle: int
    ) -> bool:
        """Post a "write" op (lock held): one layer, its copy waiting in the engine for the
        event of ``handle`` when not 0 (the event is then held until the job drained). Whether
        the engine took it."""
        event, segments = arg
        engine = self._ctx.engine()
        if handle:
            job.device_events.append(event)
        if segments is not None:
            return engine.write_layer(
                job.transfer_id, layer, peer.engine_peer, cuda_event=handle, segments=segments
            )
        if job.segments is not None:
            return post_write_layer(
                engine, job.transfer_id, layer, peer.engine_peer, job.segments[layer], handle
            )
        assert job.block_ids is not None
        local_ids, remote_ids = job.block_ids
        return engine.write_layer(
            job.transfer_id, layer, peer.engine_peer, local_ids, remote_ids, handle
        )

    def writer_loop(self) -> None:
        ctx = self._ctx
        live = (JobState.WRITING, JobState.SEALED)
        while not ctx.stop.is_set():
            try:
                op, job, layer, arg = self._writer_q.get(timeout=WAIT_SLICE_S)
            except queue.Empty:
                continue
            with ctx.lock:
                if job.state not in live:
                    continue
                peer = job.peer  # set before WRITING, never changed after
                assert peer is not None
            try:
                handle = self._layer_event_handle(arg[0], peer) if op == "write" else 0
                split = self._split_computed(arg[1], peer) if op == "writes" else ([], {})
                # Posted under the lock (it never waits for the transfer): a job failed
                # meanwhile (an abort_write already acknowledged) must not start writing.
                with ctx.lock:
                    if job.state not in live:
                        continue
                    # The decode's engine id may be connected to another instance by now (a
                    # restart under a fixed engine id): its blocks of these ids are not ours.
                    ctx.directory.check_current(peer)
                    if op == "seal":
                        # The seal carries the number of layers queued for the job, so it
                        # cannot end the transfer before every one of them was written.
                        job.seal_posted = True
                        sealed = ctx.engine().seal(
                            job.transfer_id, peer.engine_peer, expected_writes=arg
                        )
                        if not sealed and not job.engine_took:
                            self._end_spent(job)
                        continue
                    if op == "writes":
                        taken = self._post_layers(job, peer, arg[0], *split)
                    else:
                        taken = self._post_layer(job, peer, layer, arg, handle)
                    if taken:
                        job.engine_took = True
                    elif taken is False and not job.engine_took:
                        self._end_spent(job)
            except Exception as exc:
                if isinstance(exc, TransportError):  # the connection failed: handshake again
                    ctx.directory.forget(peer)
                self._fail_guarded(job, f"{op} {layer}: {exc}".strip())

    def _fail_guarded(self, job: _Job, reason: str) -> None:
        """_fail from the writer thread, which must outlive a defect there: it posts every
        other job's writes."""
        try:
            with self._ctx.lock:
                self._fail(job, reason)
        except Exception:
            logger.exception(
                "transfer %s: the writer could not fail it (%s)", job.transfer_id, reason
            )

    def _end_spent(self, job: _Job) -> None:
        """The engine refused ``job``'s first write, or ignored the seal of a job with nothing
        to post (lock held): it already ended a transfer of this id (it remembers the last
        ones, and drops their late calls), so nothing of this job is in it and no event will
        come. The job fails now. Transfer ids must be fresh per request; a reused one gets
        here."""
        job.reason = (
            f"the engine already ended a transfer {job.transfer_id}: transfer ids must be "
            "fresh per request (a retry must draw a new one)"
        )
        logger.error("transfer %s: WRITE failed: %s", job.transfer_id, job.reason)
        job.machine.advance(JobEvent.FAIL)
        self._complete(job)


__all__ = [
    "JOB_TRANSITIONS",
    "SEND_TRANSITIONS",
    "JobEvent",
    "JobState",
    "Pusher",
    "SendEvent",
    "SendState",
]
