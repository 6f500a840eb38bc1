"""The peer directory: handshaken peer ranks, reached in the background.

:meth:`PeerDirectory.connect` never blocks its caller on the network: it returns a
:class:`~concurrent.futures.Future` of the :class:`Peer`, completed at once from the cache
(or from the failure cache), or later by a handshake on the directory's own small pool
(threads ``moriio-native-handshake-*``). What it guarantees:

* one handshake at a time per peer address: concurrent callers share its future, so two
  requests that race to a restarted prefill cannot both re-add it;
* what callers share is the :class:`Handshake` (who answers at the address, its engine peer);
  where a caller's messages to that rank go (its notify port) is each caller's own word, kept
  in its :class:`Peer` and never cached: a handshake does not prove a notify port (a port
  forwarder may stand in front of the listener), so a message naming a wrong one can
  misdirect only its own replies, never another request's;
* a failed handshake is remembered per address for a while (exponential backoff from
  ``retry_after`` up to ``max_backoff``): requests naming a dead peer fail fast instead of each
  waiting ``timeout`` again; :meth:`expire` drops entries past their time. The memory is of the
  instances asked for: a caller naming an incarnation that no failed attempt at the address was
  made for (a request computed by a prefill that restarted there since) is fresh evidence of a
  live instance, and gets a new attempt at once (shared; when it fails too, that incarnation is
  remembered and the backoff stands as it was: evidence buys one attempt, never a shorter wait
  for the callers the backoff holds), so the first request after a restart is not failed by
  the backoff its predecessor's death built up;
* a caller with no such evidence that asks for it (``connect(..., recover=True)``: a request,
  as a WRITE-mode decode's announcement, which names no prefill incarnation) fails at once
  too, but while such callers keep naming the address, one more attempt is made in the
  background, ``retry_after`` after the last one ended: on a thread of its own, one at a time
  for the whole directory (another address's turn may come first), so it makes no request
  wait and takes no thread from the handshakes requests wait for. Its failure leaves the
  backoff as it was (one that ended meanwhile counts it as the attempt at its end, doubled as
  any other), and callers that joined it (one naming a new incarnation shares it) are not
  remembered by it: such a caller may get one attempt of its own after it. Its success ends
  the failure, so a peer back after a restart is usually reached a few seconds after the next
  request, not only when a backoff built up while it was down (up to ``max_backoff``) ends;
* a peer that restarted under the same address (same engine id, new metadata) replaces the old
  connection through the engine's explicit ``add_peer(..., replace=True)``: the old instance's
  transfers end (failed), the new one is reachable. An engine id that is already connected at
  ANOTHER address is refused (an address cannot take over another peer's identity);
* a caller that knows which incarnation of the peer it needs (``connect(..., incarnation=)``)
  never gets a cached handshake of another one: the cache is dropped and the peer handshaken
  again, so a prefill restarted under the same address is reached before anything is read (the
  caller then checks that the fresh handshake names the incarnation it needs);
* :meth:`probe` re-handshakes a known peer to tell whether it is still the same live instance,
  on its OWN single thread (``moriio-native-probe``): probes never queue behind (or starve)
  the handshakes requests wait for;
* at most ``max_peers`` addresses are cached and at most ``max_peers`` peers connected in the
  engine: anyone who can make this rank handshake an address of theirs (an ``abort_write``
  naming it, a request's ``remote_host``) and answers with valid metadata under ever new engine
  ids would otherwise grow both without end. Before one more is connected, engine peers no
  cached address names go, then the least recently used addresses -- each only while no
  transfer of it is pending or quarantined (:meth:`Engine.remove_idle_peer`: nothing ends or
  is stranded), no job holds it (the caller's ``in_use``, asked afresh for each) and it is not
  one just connected whose callers have not had it yet. When none of the
  :data:`MAX_EVICTION_TRIES` least recently used can go, the handshake fails with
  :class:`PeerCapacityError`, tried again after :data:`CAPACITY_RETRY_S`. A peer that went is
  handshaken again when next named; a caller that took it from the cache just before it went,
  and had not registered its job yet, fails that transfer as for an unknown peer (recomputed),
  never anything worse.
* a handshake's metadata must name the engine the handshake answered as: checked by the
  engine before anything is connected or replaced, so an answer cannot take over another
  engine's connection.

Thread-safe (one lock, never held across a network call or an engine call; a second one,
``_admit``, serializes making room and connecting, so the bound holds under concurrent
handshakes; ``in_use`` is called under ``_admit`` only, never under the first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from moriio_native.control.channel import fetch_metadata
from moriio_native.control.messages import HandshakeResponse
from moriio_native.control.security import ControlSecurity
from moriio_native.errors import (
    FailedPreconditionError,
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    NotFoundError,
)
from moriio_native.pd.config import DEFAULT_MAX_PEERS
from moriio_native.pools import DaemonPool, when_cancelled

logger = logging.getLogger("moriio_native.pd.peers")

_T = TypeVar("_T")

HANDSHAKE_THREADS = 4
DEFAULT_RETRY_AFTER_S = 5.0
DEFAULT_MAX_BACKOFF_S = 60.0
# A handshake refused at max_peers is tried again after this long (not backed off: nothing is
# wrong with that peer, and room may free any moment).
CAPACITY_RETRY_S = 1.0
# The least recently used cached addresses one admission tries to evict, at most: past them
# it is refused (bounds its cost when nearly every peer is busy).
MAX_EVICTION_TRIES = 64
# Rival addresses one admission checks (a handshake each) before it connects an engine id that
# another address connected with other metadata: past them it is refused (a race that keeps
# bringing new rivals).
MAX_RIVAL_CHECKS = 4
# How much faster a peer's clock may run than ours (a quartz clock without NTP: up to 100 ppm):
# what Handshake.clock_at_most adds for each second since the handshake.
CLOCK_RATE_TOLERANCE = 1e-4
# A cached handshake older than this is made again before it is handed out: its bound on the
# peer's clock (Handshake.clock_at_most) loses CLOCK_RATE_TOLERANCE of every second since, 60 ms
# over this age, which a READ's hold check must not grow to seconds.
HANDSHAKE_MAX_AGE_S = 600.0


@dataclass(frozen=True)
class PeerKey:
    """Where a peer rank answers handshakes: its host and its rank's own handshake port."""

    host: str
    handshake_port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.handshake_port}"


@dataclass(frozen=True)
class Handshake:
    """A handshaken peer rank, connected in the engine: what the directory caches and every
    caller shares."""

    key: PeerKey
    engine_peer: str  # the native engine's peer id (for read / write_layer / seal)
    response: HandshakeResponse
    # When this side asked for the handshake (time.monotonic()): the peer's answered_ms was
    # stamped after it.
    asked_at: float

    @property
    def host(self) -> str:
        return self.key.host

    def clock_at_most(self, now: float) -> int:
        """The latest the peer's clock (ms since the Unix epoch) can read at ``now`` (this
        side's ``time.monotonic()``): it stamped its answer ``answered_ms`` after this side
        asked, so at most ``now - asked_at`` has passed there since, give or take the two
        clocks' rates (``CLOCK_RATE_TOLERANCE``). Needs no agreement between the two clocks."""
        elapsed_ms = (now - self.asked_at) * 1000 * (1 + CLOCK_RATE_TOLERANCE)
        return self.response.answered_ms + math.ceil(elapsed_ms)


@dataclass(frozen=True)
class Peer:
    """One caller's view of a handshaken peer rank: the shared :class:`Handshake`, and the
    notify port this caller's own request or message names for that rank. The port is never
    shared: a handshake does not prove it (a port forwarder may sit in front of the rank's
    listener), so another caller's word for it, true or not, never decides where this
    caller's messages go."""

    handshake: Handshake
    notify_port: int

    @property
    def key(self) -> PeerKey:
        return self.handshake.key

    @property
    def engine_peer(self) -> str:
        return self.handshake.engine_peer

    @property
    def response(self) -> HandshakeResponse:
        return self.handshake.response

    @property
    def host(self) -> str:
        return self.handshake.host

    def clock_at_most(self, now: float) -> int:
        return self.handshake.clock_at_most(now)


# Checks a handshake response for the key before the engine connects (raises to refuse).
Validator = Callable[[HandshakeResponse], None]


class PeerCapacityError(FailedPreconditionError):
    """A handshake refused because ``max_peers`` peers are connected and none may go."""


# The incarnations one remembered failure keeps (the most recent): an older one named again gets
# one more attempt, nothing worse; bounds what callers naming ever new ones can make it hold.
MAX_FAILED_INCARNATIONS = 8


@dataclass
class _Failure:
    until: float
    error: MoriioError
    attempts: int
    # The incarnations the failed attempts were made for ("" for callers that named none).
    incarnations: tuple[str, ...] = ()
    # When a background attempt may start, for a caller that asks for one (recover=True).
    recover_at: float = 0.0

    def covers(self, incarnation: str) -> bool:
        """Whether a caller naming ``incarnation`` is answered by this failure: it names none,
        or one a failed attempt was made for (else it is evidence of an instance never tried)."""
        return not incarnation or incarnation in self.incarnations


class _EngineLike(Protocol):
    """What the directory needs of the engine (the facade's Engine satisfies it)."""

    def add_peer(
        self, metadata: bytes, *, replace: bool = False, expected_engine_id: str = ""
    ) -> str: ...

    def remove_idle_peer(self, peer: str) -> bool: ...

    def peers(self) -> list[str]: ...


class PeerDirectory:
    """Handshaken peers of one engine rank, keyed by :class:`PeerKey`."""

    def __init__(
        self,
        engine: Callable[[], _EngineLike],
        security: ControlSecurity,
        requester_engine_id: str,
        *,
        timeout: float,
        retry_after: float = DEFAULT_RETRY_AFTER_S,
        max_backoff: float = DEFAULT_MAX_BACKOFF_S,
        max_peers: int = DEFAULT_MAX_PEERS,
        in_use: Callable[[], set[str]] = set,
        replacing: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        on_handshake: Callable[[Handshake], None] | None = None,
        on_bound: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        verify: bool = False,
        confirm_reads: bool = False,
    ) -> None:
        if max_peers < 1:
            raise InvalidArgumentError(f"max_peers must be >= 1, got {max_peers}")
        self._engine = engine
        self._max_peers = max_peers
        self._in_use = in_use  # engine peers the caller's jobs hold (never evicted)
        # Held while an engine peer is connected (or swapped for another instance) and recorded:
        # a caller that posts under it after check_current never posts with an old instance's
        # handshake to a new one (under _admit, as in_use).
        self._replacing = replacing
        # Engine peers connected and not yet handed to their callers (a count per engine peer:
        # two addresses of one engine may be admitted at once).
        self._pinned: Counter[str] = Counter()
        self._evicted = 0  # addresses and engine peers that went to make room
        self._refused = 0  # handshakes refused at the bound (PeerCapacityError)
        self._security = security
        self._requester = requester_engine_id
        self._timeout = timeout
        self._verify = verify
        self._confirm_reads = confirm_reads
        self._retry_after = retry_after
        self._max_backoff = max(max_backoff, retry_after)
        self._on_handshake = on_handshake
        self._on_bound = on_bound  # (evicted) per eviction (True) or refusal (False)
        self._clock = clock
        self._lock = threading.Lock()
        self._admit = threading.Lock()
        self._peers: OrderedDict[PeerKey, Handshake] = OrderedDict()  # least recently used first
        # The handshake that last connected each engine peer, kept while the engine has it
        # connected (at most one per connected peer), cached or not.
        self._connected_by: dict[str, Handshake] = {}
        self._inflight: dict[PeerKey, Future[Handshake]] = {}
        self._failures: dict[PeerKey, _Failure] = {}
        self._pool = DaemonPool(HANDSHAKE_THREADS, "moriio-native-handshake")
        self._probe_pool = DaemonPool(1, "moriio-native-probe")
        # The background attempts at addresses a remembered failure holds (recover=True), one
        # at a time for the directory (_recovering).
        self._recovery_pool = DaemonPool(1, "moriio-native-recover")
        self._recovering = False
        self._closed = False

    # ---- lookups ------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Cached peer addresses (at most ``max_peers``)."""
        with self._lock:
            return len(self._peers)

    def stats(self) -> dict[str, int]:
        """Cached addresses, and since the start: addresses or engine peers evicted to make
        room, handshakes refused at ``max_peers``."""
        with self._lock:
            return {
                "cached": len(self._peers),
                "evicted": self._evicted,
                "refused": self._refused,
            }

    def cached(self, key: PeerKey) -> Handshake | None:
        with self._lock:
            return self._peers.get(key)

    def find_engine(self, engine_id: str) -> Handshake | None:
        """The cached peer whose handshake named ``engine_id``, if any (now the most recently
        used)."""
        with self._lock:
            peer = next(
                (p for p in self._peers.values() if p.response.engine_id == engine_id), None
            )
            if peer is not None:
                self._peers.move_to_end(peer.key)
            return peer

    def connect(
        self,
        key: PeerKey,
        notify_port: int,
        validate: Validator,
        *,
        expect: Validator | None = None,
        incarnation: str = "",
        recover: bool = False,
    ) -> Future[Peer]:
        """The peer at ``key`` as this caller reaches it (its messages go to ``notify_port``,
        this caller's own word: never another caller's): its handshake cached, failed recently
        (the remembered error), or made in the background (one handshake per key at a time;
        ``validate`` of the first caller applies: it must check only what holds for every
        caller, its refusal is remembered for the key; a cached handshake older than
        ``HANDSHAKE_MAX_AGE_S`` is made again). ``expect``: what this caller alone expects of
        the answer (which rank answers there); checked on every caller's result, its refusal
        fails this caller only and is remembered nowhere, so that a caller misinformed about
        who answers at ``key`` cannot fail the others. With ``incarnation``, a cached handshake
        that names another one is stale (the peer restarted since): it is dropped and the peer
        handshaken again. ``recover``: when a remembered failure answers this caller, another
        attempt may start in the background (module docstring). Never blocks on the network."""
        shared = self._connect_shared(key, validate, incarnation, recover)
        return _for_caller(shared, notify_port, expect)

    def _connect_shared(
        self, key: PeerKey, validate: Validator, incarnation: str, recover: bool
    ) -> Future[Handshake]:
        with self._lock:
            answer, attempt, recovery = self._lookup(key, incarnation, recover)
        if recovery is not None:
            self._submit(self._recovery_pool, key, validate, recovery, "", recovery=True)
        if attempt is not None:
            self._submit(self._pool, key, validate, attempt, incarnation)
        return answer

    def _lookup(
        self, key: PeerKey, incarnation: str, recover: bool
    ) -> tuple[Future[Handshake], Future[Handshake] | None, Future[Handshake] | None]:
        """The caller's answer for ``key`` (lock held): its cached handshake, its remembered
        failure, the attempt in flight, or a new attempt; with the attempt the caller must start
        (None: none) and the background attempt it must start (recover; None: none)."""
        peer = self._peers.get(key)
        if peer is not None and time.monotonic() - peer.asked_at > HANDSHAKE_MAX_AGE_S:
            del self._peers[key]  # too old to bound its clock: handshaken again
            peer = None
        if peer is not None and incarnation and peer.response.incarnation != incarnation:
            logger.info(
                "cached handshake of %s at %s names incarnation %s, a request names %s: "
                "handshaking again",
                peer.response.engine_id,
                key,
                peer.response.incarnation or "(none)",
                incarnation,
            )
            del self._peers[key]
            peer = None
        if peer is not None:
            self._peers.move_to_end(key)
            return _done(peer), None, None
        failure = self._failures.get(key)
        if failure is not None and self._clock() < failure.until and failure.covers(incarnation):
            recovery = self._claim_recovery(key, failure) if recover else None
            return _failed(failure.error), None, recovery
        future = self._inflight.get(key)
        if future is not None:
            return future, None, None
        if self._closed:
            return _failed(MoriioError("the peer directory is shut down")), None, None
        future = Future()
        self._inflight[key] = future
        return future, future, None

    def _claim_recovery(self, key: PeerKey, failure: _Failure) -> Future[Handshake] | None:
        """A background attempt at ``key``, which ``failure`` holds (lock held), when none runs
        anywhere, none is in flight at ``key`` and its time came: its future (None: not now)."""
        now = self._clock()
        if self._recovering or self._closed or key in self._inflight or now < failure.recover_at:
            return None
        failure.recover_at = now + self._retry_after
        self._recovering = True
        future: Future[Handshake] = Future()
        self._inflight[key] = future
        return future

    def _submit(
        self,
        pool: DaemonPool,
        key: PeerKey,
        validate: Validator,
        future: Future[Handshake],
        incarnation: str,
        *,
        recovery: bool = False,
    ) -> None:
        """Run the attempt of ``future`` (in flight at ``key``) on ``pool``; one the pool never
        runs (shut down) fails, never left pending."""

        def not_made(why: str) -> None:
            with self._lock:
                self._attempt_ended(key, recovery)
            future.set_exception(MoriioError(f"peer {key}: not handshaken ({why})"))

        try:
            task = pool.submit(self._handshake, key, validate, future, incarnation, recovery)
        except RuntimeError as exc:  # shut down meanwhile
            not_made(str(exc))
            return
        when_cancelled(task, lambda: not_made("the peer directory is shut down"))

    def _attempt_ended(self, key: PeerKey, recovery: bool) -> None:
        """The attempt in flight at ``key`` ended, made, failed or never run (lock held): later
        callers find none to share, and a background one frees the directory's slot."""
        self._inflight.pop(key, None)
        if recovery:
            self._recovering = False

    # ---- changes ------------------------------------------------------------------------------

    def forget(self, peer: Peer | Handshake | None) -> None:
        """Drop ``peer``'s cached handshake (after a failure: it may have restarted); the next
        connect handshakes again. A newer entry for the same key is kept."""
        if peer is None:
            return
        handshake = peer.handshake if isinstance(peer, Peer) else peer
        with self._lock:
            if self._peers.get(handshake.key) is handshake:
                del self._peers[handshake.key]

    def check_current(self, peer: Peer | Handshake) -> None:
        """FailedPreconditionError when the engine's connection of ``peer``'s engine id is
        another instance's by now: the engine knows a peer by its engine id alone, so a
        transfer posted with a replaced instance's handshake would move the new process's
        bytes. Called where posts are made atomic with replacements: under _admit
        (:meth:`posting`) or under the caller's ``replacing`` guard."""
        handshake = peer.handshake if isinstance(peer, Peer) else peer
        with self._lock:
            last = self._connected_by.get(handshake.response.engine_id)
        if last is None or last is handshake:
            return
        if last.response.engine_metadata != handshake.response.engine_metadata:
            raise FailedPreconditionError(
                f"peer {handshake.response.engine_id} at {handshake.key} was replaced by "
                f"another instance (incarnation {last.response.incarnation or '(none)'}) "
                "since this handshake; not posting"
            )

    @contextlib.contextmanager
    def posting(self, peer: Peer | Handshake) -> Iterator[None]:
        """Post a transfer to ``peer``'s engine peer inside this block: no connection is made
        or replaced meanwhile (_admit), and :meth:`check_current` first."""
        with self._admit:
            self.check_current(peer)
            yield

    def expire(self) -> None:
        """Drop failure entries past their time (their backoff is forgotten too)."""
        now = self._clock()
        with self._lock:
            for key in [k for k, f in self._failures.items() if now >= f.until + self._max_backoff]:
                del self._failures[key]

    def probe(self, peer: Peer | Handshake) -> Future[str]:
        """Re-handshake ``peer`` on the probe thread: "" while it answers as the same instance,
        else why it is not (another instance now, or unreachable). One failed probe alone
        proves nothing about a writer (a busy peer may miss one): the caller decides."""
        future: Future[str] = Future()

        def run() -> None:
            try:
                response = self._fetch(peer.key)
            except MoriioError as exc:
                future.set_result(f"it is unreachable ({exc})")
                return
            except BaseException as exc:
                future.set_exception(exc)
                return
            if response.incarnation != peer.response.incarnation:
                future.set_result(
                    f"it restarted: incarnation {response.incarnation or '(none)'} answers, "
                    f"{peer.response.incarnation or '(none)'} was handshaken "
                    f"({response.engine_id})"
                )
            elif response.engine_metadata != peer.response.engine_metadata:
                future.set_result(f"it restarted as another engine ({response.engine_id})")
            else:
                future.set_result("")

        try:
            task = self._probe_pool.submit(run)
        except RuntimeError as exc:
            future.set_result(f"not probed ({exc})")
            return future
        when_cancelled(
            task, lambda: future.set_result("not probed (the peer directory is shut down)")
        )
        return future

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown()
        self._probe_pool.shutdown()
        self._recovery_pool.shutdown()

    # ---- the handshake (pool thread) ----------------------------------------------------------

    def _handshake(
        self,
        key: PeerKey,
        validate: Validator,
        future: Future[Handshake],
        incarnation: str,
        recovery: bool = False,
    ) -> None:
        """One attempt at ``key`` for ``future``'s callers (``recovery``: in the background,
        for none: its failure keeps the remembered one's backoff)."""
        try:
            peer = self._connect(key, validate)
        except BaseException as exc:
            error = exc if isinstance(exc, MoriioError) else MoriioError(f"peer {key}: {exc}")
            with self._lock:
                self._attempt_ended(key, recovery)
                previous = self._failures.get(key)
                now = self._clock()
                if recovery and previous is not None and now < previous.until:
                    # Within the backoff: it stands; the next one retry_after from this end.
                    recover_at = now + self._retry_after
                    failure = dataclasses.replace(previous, error=error, recover_at=recover_at)
                else:  # the backoff ended meanwhile: the attempt at its end, as any other
                    failure = self._failure_after(previous, error, incarnation)
                self._failures[key] = failure
            delay = max(0.0, failure.until - now)
            if recovery:
                logger.info(
                    "background handshake with %s failed (%s); requests fail at once for %.0fs "
                    "more, tried again in the background at most every %.0fs meanwhile",
                    key,
                    error,
                    delay,
                    self._retry_after,
                )
            else:
                logger.warning(
                    "handshake with %s failed (%s); retrying after %.0fs", key, error, delay
                )
            future.set_exception(error)
            return
        try:
            with self._lock:
                self._attempt_ended(key, recovery)
                self._failures.pop(key, None)
                for other in [
                    k
                    for k, p in self._peers.items()
                    if p.engine_peer == peer.engine_peer
                    and p.response.engine_metadata != peer.response.engine_metadata
                ]:
                    del self._peers[other]  # the same engine before its restart, at any address
            if self._on_handshake is not None:
                _tell(self._on_handshake, peer, f"handshake with {key}")
            logger.info("handshake with %s at %s done", peer.response.engine_id, key)
            future.set_result(peer)
        finally:
            with self._lock:  # its first callers have it now (or it failed on the way)
                self._pinned[peer.engine_peer] -= 1
                if not self._pinned[peer.engine_peer]:
                    del self._pinned[peer.engine_peer]

    def _failure_after(
        self, previous: _Failure | None, error: MoriioError, incarnation: str
    ) -> _Failure:
        """What is remembered once an attempt made for ``incarnation`` failed with ``error``
        (the key's ``previous`` failure, if any): the backoff doubles with each failure in a
        row. An attempt made on fresh evidence (an incarnation ``previous`` does not cover)
        adds its incarnation and leaves the backoff as it was, at least ``retry_after`` from
        now: one record serves every caller of the address, and anyone who can name ever new
        incarnations must not shorten the wait of the callers it holds."""
        now = self._clock()
        recover_at = now + self._retry_after
        known = previous.incarnations if previous is not None else ()
        if incarnation and incarnation not in known:
            known = (*known, incarnation)[-MAX_FAILED_INCARNATIONS:]
        if isinstance(error, PeerCapacityError):
            # Nothing is wrong with that peer: room may free any moment.
            until = now + min(CAPACITY_RETRY_S, self._retry_after)
            return _Failure(until, error, 0, known, recover_at)
        if previous is not None and not previous.covers(incarnation):
            until = max(previous.until, now + self._retry_after)
            return _Failure(until, error, previous.attempts, known, recover_at)
        attempts = previous.attempts + 1 if previous is not None else 1
        delay = min(self._retry_after * 2 ** (attempts - 1), self._max_backoff)
        return _Failure(now + delay, error, attempts, known, recover_at)

    def _fetch(self, key: PeerKey) -> HandshakeResponse:
        """One handshake with ``key`` under this directory's timeout and security (any thread)."""
        return fetch_metadata(
            key.host,
            key.handshake_port,
            timeout=self._timeout,
            security=self._security,
            requester_engine_id=self._requester,
            verify=self._verify,
            confirm_reads=self._confirm_reads,
        )

    def _check_replaced(
        self, key: PeerKey, elsewhere: Handshake, response: HandshakeResponse
    ) -> None:
        """``response`` at ``key`` names the engine connected at ``elsewhere`` with other
        metadata: a restart seen through another address when the instance there answers with
        the new metadata or not at all; refused while it still answers as it did (two
        instances claiming one engine id)."""
        try:
            there = self._fetch(elsewhere.key)
        except MoriioError:
            return  # gone: its cached handshake is stale
        if there.engine_metadata == elsewhere.response.engine_metadata:
            raise IncompatiblePeerError(
                f"peer at {key} answers as engine {response.engine_id!r} with other metadata "
                f"than the instance still answering at {elsewhere.key}; refusing to let one "
                "address replace another's peer"
            )

    def _connect(self, key: PeerKey, validate: Validator) -> Handshake:
        asked_at = time.monotonic()
        response = self._fetch(key)
        validate(response)
        # The same engine may be reachable under several addresses (host names, a forwarder):
        # with the same metadata it is one connection. Other metadata under an engine id that is
        # connected at another address replaces that connection only once the instance there
        # proved gone or restarted too. That proof is a handshake, made outside _admit; the
        # rival is looked up again under _admit, where connections are made, so a rival that
        # appeared meanwhile (an address being connected at the same time) is checked too.
        checked: list[Handshake] = []
        for _ in range(MAX_RIVAL_CHECKS):
            with self._admit:
                engine = self._engine()
                rival = self._rival(engine, key, response, checked)
                if rival is None:
                    return self._admit_connection(engine, key, response, asked_at)
            self._check_replaced(key, rival, response)
            checked.append(rival)
        raise IncompatiblePeerError(
            f"peer at {key} answers as engine {response.engine_id!r}, which other addresses kept "
            f"connecting with other metadata ({MAX_RIVAL_CHECKS} checks); refusing it for now"
        )

    def _rival(
        self,
        engine: _EngineLike,
        key: PeerKey,
        response: HandshakeResponse,
        checked: list[Handshake],
    ) -> Handshake | None:
        """A handshake at another address, not among ``checked``, that connected
        ``response``'s engine id with other metadata and may still hold that connection (under
        _admit): a cached one, or the last one that connected the engine peer while it stays
        connected, though its address was forgotten (after a failed READ) or evicted. Every
        such rival is checked, not only the first: one proved gone may stand before another
        address of the instance that still answers."""
        engine_id, metadata = response.engine_id, response.engine_metadata
        with self._lock:
            candidates = [p for p in self._peers.values() if p.response.engine_id == engine_id]
            last = self._connected_by.get(engine_id)
        if last is not None and engine_id in engine.peers():
            candidates.append(last)
        return next(
            (
                p
                for p in candidates
                if p.key != key
                and p.response.engine_metadata != metadata
                and not any(p is c for c in checked)
            ),
            None,
        )

    def _admit_connection(
        self, engine: _EngineLike, key: PeerKey, response: HandshakeResponse, asked_at: float
    ) -> Handshake:
        """Connect ``response``'s engine for ``key`` and cache the handshake (under _admit)."""
        before = set(engine.peers())
        # Same engine id with new metadata: that peer restarted under this address (the
        # handshake we just made proved who answers here), or another address proved the
        # instance it connected gone. The engine swaps the connection -- only when the
        # metadata names the engine the handshake answered as (refused before anything changes
        # otherwise: an answer cannot take another's connection).
        # Always under the guard: an engine id dropped from the engine (remove_peer) while a
        # job still holds its handshake is a replacement for that job too.
        with self._replacing():
            try:
                engine_peer = engine.add_peer(
                    response.engine_metadata, replace=True, expected_engine_id=response.engine_id
                )
            except MoriioError as exc:
                raise type(exc)(f"peer at {key}: {exc}") from None
            peer = Handshake(key=key, engine_peer=engine_peer, response=response, asked_at=asked_at)
            with self._lock:
                # Who connected each engine peer, for as long as it stays connected (_rival,
                # check_current).
                self._connected_by[response.engine_id] = peer
        # Room is made only for an answer the engine accepted: a refused one evicts nothing.
        try:
            self._make_room(engine, key, response.engine_id)
        except PeerCapacityError:
            if engine_peer not in before and _remove_idle(engine, engine_peer):
                with self._lock:
                    self._connected_by.pop(response.engine_id, None)
            raise
        connected = set(engine.peers())
        with self._lock:
            # Cached (as most recently used) before _admit is released, so that the next
            # admission counts it, and pinned until _handshake handed it to its callers.
            self._peers[key] = peer
            self._peers.move_to_end(key)
            self._pinned[engine_peer] += 1
            for gone in [e for e in self._connected_by if e not in connected]:
                del self._connected_by[gone]
        return peer

    # ---- the bound (pool thread, under _admit) ------------------------------------------------

    def _make_room(self, engine: _EngineLike, key: PeerKey, engine_id: str) -> None:
        """Before ``engine_id`` is connected for ``key``: evict until one more address and one
        more engine peer fit under ``max_peers`` -- engine peers no cached address names first,
        then cached addresses from the least recently used (at most :data:`MAX_EVICTION_TRIES`
        of them), each only while no transfer of it is pending or quarantined and no job holds
        it. Raises PeerCapacityError when what is left is busy."""
        connected = set(engine.peers())
        if not self._over(connected, key, engine_id):
            return
        with self._lock:
            cached = {p.engine_peer for p in self._peers.values()}
        for orphan in sorted(connected - cached - self._kept(engine_id)):
            if _remove_idle(engine, orphan):
                connected.discard(orphan)
                self._count_bound(evicted=True)
                logger.info("peer %s removed: no cached address names it (max_peers)", orphan)
            if not self._over(connected, key, engine_id):
                return
        kept = self._kept(engine_id)
        tried: set[PeerKey] = {key}
        refused: list[Handshake] = []  # taken out of the cache, then found busy: put back after
        try:
            while len(tried) <= MAX_EVICTION_TRIES and self._over(connected, key, engine_id):
                with self._lock:
                    victim = next(
                        (
                            p
                            for k, p in self._peers.items()
                            if k not in tried and p.engine_peer not in kept
                        ),
                        None,
                    )
                if victim is None:
                    break
                tried.add(victim.key)
                if not self._evict(engine, victim, connected, engine_id):
                    refused.append(victim)
        finally:
            self._put_back(refused)
        if self._over(connected, key, engine_id):
            self._count_bound(evicted=False)
            raise PeerCapacityError(
                f"peer {key}: not connected: {len(connected)} peers connected and "
                f"{len(self)} addresses cached (max_peers {self._max_peers}); none of "
                "the least recently used is idle (each has transfers pending or quarantined, "
                "or a job holds it)"
            )

    def _kept(self, engine_id: str) -> set[str]:
        """Engine peers never evicted now: the one being connected, those just connected and
        not yet handed out, and those the caller's jobs hold (asked afresh each time)."""
        with self._lock:
            pinned = set(self._pinned)
        return {engine_id, *pinned, *self._in_use()}

    def _over(self, connected: set[str], key: PeerKey, engine_id: str) -> bool:
        """Whether caching ``key`` and connecting ``engine_id`` would pass ``max_peers``."""
        with self._lock:
            keys = len(self._peers) + (key not in self._peers)
        peers = len(connected) + (engine_id not in connected)
        return keys > self._max_peers or peers > self._max_peers

    def _evict(
        self, engine: _EngineLike, victim: Handshake, connected: set[str], engine_id: str
    ) -> bool:
        """Drop ``victim``'s address, and its engine peer when no other cached address names
        it: True when it went; False when that peer is kept or has a transfer pending or
        quarantined (the address is then out of the cache until :meth:`_put_back`). The
        address leaves the cache first, so no caller takes it while the engine is asked; a
        job that took it just before is seen by the fresh ``in_use``."""
        with self._lock:
            if self._peers.get(victim.key) is not victim:
                return True  # replaced or forgotten meanwhile: not ours to put back
            del self._peers[victim.key]
            shared = any(p.engine_peer == victim.engine_peer for p in self._peers.values())
        if not shared:  # else the engine peer stays for the other address
            if victim.engine_peer in self._kept(engine_id):
                return False
            if not _remove_idle(engine, victim.engine_peer):
                return False
            connected.discard(victim.engine_peer)
        self._count_bound(evicted=True)
        logger.info(
            "peer %s at %s evicted: least recently used of max_peers %d",
            victim.engine_peer,
            victim.key,
            self._max_peers,
        )
        return True

    def _count_bound(self, *, evicted: bool) -> None:
        """One eviction or refusal at max_peers: counted here (stats) and told to the caller's
        ``on_bound`` (outside the directory's lock)."""
        with self._lock:
            if evicted:
                self._evicted += 1
            else:
                self._refused += 1
        if self._on_bound is not None:
            _tell(self._on_bound, evicted, "max_peers")

    def _put_back(self, refused: list[Handshake]) -> None:
        """Refused victims back at the least recently used end, in their order (unless their
        address was cached anew meanwhile)."""
        with self._lock:
            for victim in reversed(refused):
                if victim.key not in self._peers:
                    self._peers[victim.key] = victim
                    self._peers.move_to_end(victim.key, last=False)


def _tell(callback: Callable[[_T], None], value: _T, what: str) -> None:
    """Call one of the caller's statistics callbacks: one that raises is logged, and fails
    neither the handshake nor the eviction it reports."""
    try:
        callback(value)
    except Exception:
        logger.exception("%s: its callback failed", what)


def _remove_idle(engine: _EngineLike, peer: str) -> bool:
    """Whether ``peer`` is gone from the engine now: removed, or removed by another caller."""
    try:
        return engine.remove_idle_peer(peer)
    except NotFoundError:
        return True


def _for_caller(
    source: Future[Handshake], notify_port: int, expect: Validator | None
) -> Future[Peer]:
    """``source``'s handshake as this caller's :class:`Peer` (``notify_port``), once
    ``expect`` (if any) accepted its answer; else the refusal (or ``source``'s own error)."""
    out: Future[Peer] = Future()

    def check(done: Future[Handshake]) -> None:
        try:
            handshake = done.result()
            if expect is not None:
                expect(handshake.response)
        except BaseException as exc:  # handed to the caller as its result
            out.set_exception(exc)
            return
        out.set_result(Peer(handshake, notify_port))

    source.add_done_callback(check)
    return out


def _done(handshake: Handshake) -> Future[Handshake]:
    future: Future[Handshake] = Future()
    future.set_result(handshake)
    return future


def _failed(error: BaseException) -> Future[Handshake]:
    future: Future[Handshake] = Future()
    future.set_exception(error)
    return future


__all__ = [
    "HANDSHAKE_THREADS",
    "Handshake",
    "Peer",
    "PeerCapacityError",
    "PeerDirectory",
    "PeerKey",
    "Validator",
]
