"""The peer directory with loopback engines and real handshake servers on 127.0.0.1:
handshakes run in the background, one per peer at a time, failures are cached with backoff,
and a peer restarted under the same address replaces the old connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import moriio_native as mn
from fault_proxy import FaultProxy
from moriio_native import kvcache as kc
from moriio_native.control.channel import HandshakeServer
from moriio_native.control.messages import HandshakeResponse
from moriio_native.control.schema import new_incarnation
from moriio_native.control.security import ControlSecurity
from moriio_native.errors import (
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    TransferTimeoutError,
)
from moriio_native.pd import peers as peers_module
from moriio_native.pd.peers import CAPACITY_RETRY_S, PeerCapacityError, PeerDirectory, PeerKey
from net_support import free_port
from process_support import wait_for

LOCAL = "127.0.0.1"


def security() -> ControlSecurity:
    return ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})


def engine(
    name: str, salt: int, options: dict[str, str] | None = None
) -> tuple[mn.Engine, kc.KvCacheSet]:
    side = "decode" if name.startswith("decode") else "prefill"
    caches = kc.build_caches(kc.mixed_model(side), num_blocks=8)
    kc.fill_random(caches, seed=salt)
    e = mn.Engine(name, "loopback", options)
    e.register_kv_caches(caches.registrations())
    return e, caches


class Prefill:
    """A loopback engine behind a handshake server; ``gate`` holds its answers."""

    def __init__(self, engine_id: str, port: int, salt: int, claims: str = "") -> None:
        self.engine, self.caches = engine(engine_id, salt)
        self.claims = claims or engine_id  # the engine id it answers as
        self.gate = threading.Event()
        self.gate.set()
        self.answered = 0
        self.arrived = 0  # requests that reached the answer, held at the gate or not
        self.incarnation = new_incarnation()
        # Its own thread: a stand-in for another process, whose held answers hold no other's.
        self.server = HandshakeServer(
            port, self._answer, security(), bind_host=LOCAL, own_thread=True
        )

    def _answer(self, request: object) -> HandshakeResponse:
        self.arrived += 1
        self.gate.wait(30)
        self.answered += 1
        return HandshakeResponse(
            self.claims,
            self.engine.local_metadata(),
            0,
            0,
            1,
            1,
            "READ",
            incarnation=self.incarnation,
        )

    def close(self) -> None:
        self.gate.set()
        self.server.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def made() -> Iterator[list]:
    things: list = []
    yield things
    for thing in reversed(things):
        thing.close()


def directory(decode: mn.Engine, made: list, **kw: object) -> PeerDirectory:
    d = PeerDirectory(lambda: decode, security(), "decode/dp0/tp0", timeout=5.0, **kw)  # type: ignore[arg-type]
    made.append(d)
    return d


def accept(response: HandshakeResponse) -> None:
    pass


def slow_prefill(made: list) -> tuple[mn.Engine, Prefill, PeerDirectory, PeerKey]:
    """A decode engine, its peer directory, and a prefill at ``key`` that answers handshakes
    only once its gate is set (a prefill slow to answer)."""
    decode, _ = engine("decode", 1)
    port = free_port()
    prefill = Prefill("prefill", port, 2)
    made.append(prefill)
    prefill.gate.clear()
    return decode, prefill, directory(decode, made), PeerKey(LOCAL, port)


def test_handshake_runs_in_the_background_and_is_cached(made: list) -> None:
    decode, prefill, peers, key = slow_prefill(made)
    future = peers.connect(key, 1234, accept)
    # The caller got its future back while the handshake waits on the peer.
    assert not future.done()
    again = peers.connect(key, 1234, accept)
    prefill.gate.set()
    peer = future.result(timeout=30)
    assert peer.engine_peer == "prefill" and peer.notify_port == 1234
    assert again.result(timeout=30).handshake is peer.handshake  # one handshake at a time
    assert decode.peers() == ["prefill"]
    assert prefill.answered == 1
    cached = peers.connect(key, 1234, accept)
    assert cached.done() and cached.result().handshake is peer.handshake  # no second handshake
    assert prefill.answered == 1


def test_a_cached_handshake_of_another_incarnation_is_handshaken_again(made: list) -> None:
    """A request that names the incarnation that computed it never gets a cached handshake of
    another one: the prefill restarted under the same address unnoticed (nothing failed yet),
    and the directory handshakes again before anything is read."""
    decode, decode_caches = engine("decode", 1)
    port = free_port()
    old = Prefill("prefill", port, 2)
    peers = directory(decode, made)
    key = PeerKey(LOCAL, port)
    first = peers.connect(key, 1, accept, incarnation=old.incarnation).result(timeout=30)
    assert first.response.incarnation == old.incarnation
    assert peers.connect(key, 1, accept, incarnation=old.incarnation).result() == first
    old.close()
    restarted = Prefill("prefill", port, 3)
    made.append(restarted)
    # Without an incarnation the stale cache is all the directory knows ...
    assert peers.connect(key, 1, accept).result() == first
    # ... with the request's, the cached one is stale: handshaken again.
    second = peers.connect(key, 1, accept, incarnation=restarted.incarnation).result(timeout=30)
    assert second != first and second.response.incarnation == restarted.incarnation
    assert restarted.answered == 1
    expected = kc.expected_after_copy(decode_caches, restarted.caches, [0, 1], [2, 3])
    decode.read("fresh", "prefill", [0, 1], [2, 3])
    assert decode.wait(["fresh"], timeout=30)["fresh"].state == "done"
    assert np.array_equal(decode_caches.backing, expected)
    # A request computed by the old process: handshaken again too (the caller then refuses it,
    # pd.context.check_incarnation), and the live instance's handshake stays cached.
    third = peers.connect(key, 1, accept, incarnation=old.incarnation).result(timeout=30)
    assert third.response.incarnation == restarted.incarnation
    assert peers.cached(key) is third.handshake


def test_each_caller_reaches_the_rank_at_its_own_notify_port(made: list) -> None:
    """Found by a review: the cached handshake kept the notify port its first caller named and
    handed it to every later caller, so a message naming a wrong one (an abort_write with the
    rank's handshake address) redirected the rank's messages of genuine requests while the
    handshake stayed cached. A handshake does not prove a notify port: each caller keeps the
    one it named, in flight and from the cache alike."""
    _, prefill, peers, key = slow_prefill(made)
    wrong = peers.connect(key, 9999, accept)
    joined = peers.connect(key, 1234, accept)  # shares the handshake in flight
    prefill.gate.set()
    first = wrong.result(timeout=30)
    assert first.notify_port == 9999
    assert joined.result(timeout=30).notify_port == 1234
    cached = peers.connect(key, 1235, accept).result(timeout=0)
    assert cached.notify_port == 1235 and cached.handshake is first.handshake
    assert prefill.answered == 1


def test_failed_handshake_is_cached_with_backoff(made: list) -> None:
    decode, _ = engine("decode", 1)
    clock = Clock()
    peers = directory(decode, made, retry_after=5.0, max_backoff=60.0, clock=clock)
    peers._timeout = 0.3  # nothing listens there: the handshake times out
    key = PeerKey(LOCAL, free_port())
    first = peers.connect(key, 1, accept)
    with pytest.raises(TransferTimeoutError):
        first.result(timeout=30)
    # Within the backoff every caller fails at once with the same error, without dialling.
    cached = peers.connect(key, 1, accept)
    assert cached.done()
    assert cached.exception() is first.exception()
    clock.now += 5.1  # past the first backoff: tried again, and failing, backs off twice as long
    second = peers.connect(key, 1, accept)
    assert second is not first
    with pytest.raises(TransferTimeoutError):
        second.result(timeout=30)
    clock.now += 5.1
    assert peers.connect(key, 1, accept).done()  # still inside the 10 s backoff
    clock.now += 5.0
    retry = peers.connect(key, 1, accept)
    assert retry.exception(timeout=30) is not second.exception()
    # A peer that comes up is reached once its backoff passed (a failure does not stick).
    prefill = Prefill("prefill", key.handshake_port, 2)
    made.append(prefill)
    clock.now += 100
    peers.expire()
    assert peers.connect(key, 1, accept).result(timeout=30).engine_peer == "prefill"


def _fail_three_times(
    peers: PeerDirectory, clock: Clock, key: PeerKey, incarnation: str = ""
) -> None:
    """Three failed handshakes with ``key`` (nothing listens there), each past the backoff of
    the one before: the address backs off 20 s from now."""
    for wait in (15.1, 15.1, 0.0):  # 5 s, 10 s, then a 20 s backoff
        with pytest.raises(TransferTimeoutError):
            peers.connect(key, 1, accept, incarnation=incarnation).result(timeout=30)
        clock.now += wait


def backed_off(made: list) -> tuple[PeerDirectory, Clock, PeerKey]:
    """A directory whose handshakes with an address where nothing listens failed three times:
    requests naming it fail at once for 20 s from the fake clock's now (attempts time out in
    0.3 s)."""
    decode, _ = engine("decode", 1)
    clock = Clock()
    peers = directory(decode, made, retry_after=5.0, max_backoff=60.0, clock=clock)
    peers._timeout = 0.3
    key = PeerKey(LOCAL, free_port())
    _fail_three_times(peers, clock, key)
    return peers, clock, key


def test_a_request_naming_a_new_incarnation_is_not_failed_by_the_old_ones_backoff(
    made: list,
) -> None:
    """A prefill killed and restarted under its address: the handshakes made while it was down
    built up a backoff (5 s doubling), and the first requests its new process computed failed
    at once from that memory (recomputed) although the docs promised the first request after a
    restart is loaded. A request naming an incarnation no failed attempt was made for is
    evidence of a new instance: it is handshaken at once."""
    decode, _ = engine("decode", 1)
    clock = Clock()
    peers = directory(decode, made, retry_after=5.0, max_backoff=60.0, clock=clock)
    peers._timeout = 0.3  # nothing listens there while the prefill is down
    key = PeerKey(LOCAL, free_port())
    died = new_incarnation()
    _fail_three_times(peers, clock, key, died)
    remembered = peers.connect(key, 1, accept, incarnation=died)
    assert remembered.done() and isinstance(remembered.exception(), TransferTimeoutError)
    assert peers.connect(key, 1, accept).done()  # naming none: no evidence, fails at once
    restarted = Prefill("prefill", key.handshake_port, 2)
    made.append(restarted)
    peer = peers.connect(key, 1, accept, incarnation=restarted.incarnation).result(timeout=30)
    assert peer.response.incarnation == restarted.incarnation
    assert restarted.answered == 1
    assert peers.connect(key, 1, accept).result(timeout=0).handshake is peer.handshake


def test_a_new_incarnations_failed_attempt_never_shortens_the_backoff(made: list) -> None:
    """Evidence buys one attempt: a caller naming an incarnation whose attempt failed fails at
    once, and so does a caller naming none, until the backoff the dead instance built up (20 s
    here) ends; the failed attempt never shortened it (found by a review: it had restarted the
    doubling from 5 s for every caller, so anyone naming ever new incarnations without a
    secret kept a dead peer's backoff short). Another new incarnation is tried once."""
    peers, clock, key = backed_off(made)
    claimed = new_incarnation()
    first = peers.connect(key, 1, accept, incarnation=claimed)
    with pytest.raises(TransferTimeoutError):
        first.result(timeout=30)
    again = peers.connect(key, 1, accept, incarnation=claimed)
    assert again.done() and again.exception() is first.exception()
    other = peers.connect(key, 1, accept, incarnation=new_incarnation())
    with pytest.raises(TransferTimeoutError):
        other.result(timeout=30)
    assert other.exception() is not first.exception()
    clock.now += 5.1
    for named in ("", claimed):  # 5 s on: the 20 s backoff still holds them
        held = peers.connect(key, 1, accept, incarnation=named)
        assert held.done() and held.exception() is other.exception()
    clock.now += 15.0  # past the 20 s: tried again
    retried = peers.connect(key, 1, accept)
    assert retried is not held
    with pytest.raises(TransferTimeoutError):
        retried.result(timeout=30)


def silent_prefill(made: list, key: PeerKey) -> Prefill:
    """A prefill at ``key`` that holds every answer (past the 0.3 s timeout) until released."""
    silent = Prefill("prefill", key.handshake_port, 2)
    made.append(silent)
    silent.gate.clear()
    return silent


def attempt_timed_out(silent: Prefill, peers: PeerDirectory, key: PeerKey, n: int) -> None:
    """Wait for ``silent``'s ``n``-th handshake request and for it to time out at ``peers``,
    then let the held answer go (freeing its server for the next)."""
    wait_for(lambda: silent.arrived == n, f"attempt {n}")
    wait_for(lambda: key not in peers._inflight, f"attempt {n} to time out")
    silent.gate.set()
    silent.gate.clear()


def test_a_peer_back_is_reached_in_the_background_before_its_backoff_ends(made: list) -> None:
    """Before: a WRITE-mode decode's announcements name no prefill incarnation, so once the
    handshakes made while a prefill was down built up a backoff (5 s doubling to 60 s), every
    request for its address failed at once until the backoff ended, though the prefill was back
    (up to a minute of recomputed requests). A request that asks for it (recover) still fails
    at once, but starts an attempt in the background; its success serves the next request."""
    peers, clock, key = backed_off(made)
    peers._timeout = 5.0  # the answer below must not miss it on a loaded machine
    restarted = Prefill("prefill", key.handshake_port, 2)
    made.append(restarted)
    clock.now += 5.1
    plain = peers.connect(key, 1, accept)
    assert plain.done() and key not in peers._inflight  # no evidence, no attempt
    asked = peers.connect(key, 1, accept, recover=True)
    assert asked.done() and isinstance(asked.exception(), TransferTimeoutError)
    wait_for(lambda: peers.cached(key) is not None, "the background handshake")
    peer = peers.connect(key, 1, accept).result(timeout=0)
    assert peer.response.incarnation == restarted.incarnation and restarted.answered == 1


def test_background_attempts_are_spaced_and_never_lengthen_the_backoff(made: list) -> None:
    """A peer that still does not answer: one background attempt, the next only retry_after
    after it ended, however many requests ask; its failure leaves the remembered backoff as it
    was (neither doubled nor renewed): a caller that asks for none is tried when the 20 s end,
    and that failure doubles from the three before (40 s), as before the change."""
    peers, clock, key = backed_off(made)
    silent = silent_prefill(made, key)
    assert peers.connect(key, 1, accept, recover=True).done()
    assert key not in peers._inflight  # within retry_after of the last failure: none yet
    clock.now += 5.1
    first = peers.connect(key, 1, accept, recover=True)
    wait_for(lambda: silent.arrived == 1, "the background attempt")
    clock.now += 5.0  # the attempt lasted retry_after
    attempt_timed_out(silent, peers, key, 1)
    again = peers.connect(key, 1, accept, recover=True)
    assert again.done() and again.exception() is not first.exception()  # the attempt's error
    assert key not in peers._inflight  # the next one only retry_after after this one ended
    clock.now += 9.8  # 19.9 s into the 20 s backoff: a caller asking for no attempt is held
    held = peers.connect(key, 1, accept)
    assert held.done() and held.exception() is again.exception()
    clock.now += 0.2  # past the 20 s: tried again, as before the background attempts
    tried = peers.connect(key, 1, accept)
    attempt_timed_out(silent, peers, key, 2)
    assert isinstance(tried.exception(timeout=30), TransferTimeoutError)
    assert peers._failures[key].attempts == 4  # 40 s: the background attempt did not count


def test_a_backoff_that_ends_during_a_background_attempt_counts_it(made: list) -> None:
    """Found by a review: the 20 s ended while a background attempt ran (the usual case with
    a 30 s handshake timeout) and a caller joined it; its failure kept the ended backoff, so
    the next caller started yet another attempt at once. It is the attempt at the backoff's
    end: doubled, callers fail at once again."""
    peers, clock, key = backed_off(made)
    silent = silent_prefill(made, key)
    clock.now += 5.1
    assert peers.connect(key, 1, accept, recover=True).done()
    wait_for(lambda: silent.arrived == 1, "the background attempt")
    clock.now += 15.0  # 20.1 s: the backoff ended while the attempt runs
    joined = peers.connect(key, 1, accept)
    attempt_timed_out(silent, peers, key, 1)
    assert isinstance(joined.exception(timeout=30), TransferTimeoutError)
    after = peers.connect(key, 1, accept)
    assert after.done() and after.exception() is joined.exception()
    assert peers._failures[key].attempts == 4


def test_one_background_attempt_at_a_time_for_the_directory(made: list) -> None:
    """Two addresses held by their backoffs: the second one's request starts no attempt while
    the first one's runs, and does once it ended; the first gets its next retry_after later."""
    peers, clock, a = backed_off(made)
    b = PeerKey(LOCAL, free_port())
    clock.now -= 30.2  # b's three failures at the same fake times as a's
    _fail_three_times(peers, clock, b)
    silent = silent_prefill(made, a)
    clock.now += 5.1
    peers.connect(a, 1, accept, recover=True)
    assert a in peers._inflight
    peers.connect(b, 1, accept, recover=True)
    assert b not in peers._inflight
    attempt_timed_out(silent, peers, a, 1)
    peers.connect(b, 1, accept, recover=True)
    assert b in peers._inflight
    wait_for(lambda: b not in peers._inflight, "b's attempt to time out")
    clock.now += 5.1
    peers.connect(a, 1, accept, recover=True)
    assert a in peers._inflight
    attempt_timed_out(silent, peers, a, 2)


def test_a_background_attempt_never_run_or_broken_leaves_nothing_behind(made: list) -> None:
    """One the pool never runs (shut down) and one whose handshake raises an error of no
    kind we know each end: nothing in flight, the next may start, the error remembered as
    ours."""
    peers, clock, key = backed_off(made)
    clock.now += 5.1

    def broken(key: PeerKey, validate: object) -> None:
        raise ValueError("broken")

    peers._connect = broken  # type: ignore[method-assign,assignment]
    peers.connect(key, 1, accept, recover=True)
    wait_for(lambda: key not in peers._inflight, "the attempt")
    assert not peers._recovering and isinstance(peers._failures[key].error, MoriioError)
    clock.now += 5.1
    peers._recovery_pool.shutdown()
    assert peers.connect(key, 1, accept, recover=True).done()
    assert not peers._recovering and key not in peers._inflight


def test_a_refused_handshake_leaves_no_peer(made: list) -> None:
    decode, _ = engine("decode", 1)
    port = free_port()
    made.append(Prefill("prefill", port, 2))
    peers = directory(decode, made)

    def refuse(response: HandshakeResponse) -> None:
        raise IncompatiblePeerError(f"peer {response.engine_id}: wrong rank")

    with pytest.raises(IncompatiblePeerError, match="wrong rank"):
        peers.connect(PeerKey(LOCAL, port), 1, refuse).result(timeout=30)
    assert decode.peers() == []


def test_a_caller_expecting_another_rank_fails_alone(made: list) -> None:
    """What one caller expects of the answer (which rank answers there: a request's or a
    message's word) is checked for it alone: a caller joining a handshake in flight, or taking
    a cached one, gets the peer when the answer is what it expects, whatever another caller
    expected; a refusal is remembered for nobody (before, the first caller's check applied to
    every joiner, and its refusal failed every caller for the backoff)."""
    _, prefill, peers, key = slow_prefill(made)

    def another_rank(response: HandshakeResponse) -> None:
        raise IncompatiblePeerError(f"peer at {key} is not the rank this caller expects")

    misinformed = peers.connect(key, 1, accept, expect=another_rank)
    joined = peers.connect(key, 1, accept, expect=accept)  # in flight: shares the handshake
    prefill.gate.set()
    with pytest.raises(IncompatiblePeerError, match="not the rank this caller expects"):
        misinformed.result(timeout=30)
    assert joined.result(timeout=30).engine_peer == "prefill"
    assert peers.connect(key, 1, accept).result(timeout=0).engine_peer == "prefill"  # cached
    with pytest.raises(IncompatiblePeerError):
        peers.connect(key, 1, accept, expect=another_rank).result(timeout=0)
    assert prefill.answered == 1


def test_a_cached_handshake_past_its_age_is_made_again(
    made: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a cached handshake bounds the peer's clock less tightly with every
    second (the clocks' rate tolerance), and nothing made it again, so days later every READ's
    hold check refused it (recomputed). Past HANDSHAKE_MAX_AGE_S the next caller gets a fresh
    one: the same engine peer, a new bound."""
    decode, _ = engine("decode", 1)
    port = free_port()
    prefill = Prefill("prefill", port, 2)
    made.append(prefill)
    peers = directory(decode, made)
    key = PeerKey(LOCAL, port)
    first = peers.connect(key, 1, accept).result(timeout=30)
    assert peers.connect(key, 1, accept).result(timeout=0) == first  # young: cached
    monkeypatch.setattr(peers_module, "HANDSHAKE_MAX_AGE_S", 0.0)
    again = peers.connect(key, 1, accept).result(timeout=30)
    assert again != first and again.handshake.asked_at > first.handshake.asked_at
    assert again.engine_peer == first.engine_peer and prefill.answered == 2
    assert decode.peers() == ["prefill"]


def test_a_peer_restarted_under_the_same_address_replaces_the_old_one(made: list) -> None:
    decode, decode_caches = engine("decode", 1)
    port = free_port()
    old = Prefill("prefill", port, 2)
    peers = directory(decode, made)
    key = PeerKey(LOCAL, port)
    first = peers.connect(key, 1, accept).result(timeout=30)
    old.close()
    restarted = Prefill("prefill", port, 3)  # same id and address, new memory
    made.append(restarted)
    peers.forget(first)  # a failed transfer drops the cached handshake
    second = peers.connect(key, 1, accept).result(timeout=30)
    assert second != first and second.response.engine_metadata != first.response.engine_metadata
    assert decode.peers() == ["prefill"]
    # The engine reaches the NEW instance: its bytes arrive.
    expected = kc.expected_after_copy(decode_caches, restarted.caches, [0, 1], [2, 3])
    decode.read("after-restart", "prefill", [0, 1], [2, 3])
    assert decode.wait(["after-restart"], timeout=30)["after-restart"].state == "done"
    assert np.array_equal(decode_caches.backing, expected)


def test_an_address_cannot_take_over_another_address_peer(made: list) -> None:
    decode, _ = engine("decode", 1)
    port_a, port_b = free_port(), free_port()
    made.append(Prefill("prefill", port_a, 2))
    made.append(Prefill("prefill", port_b, 3))  # claims the same engine id elsewhere
    peers = directory(decode, made)
    peers.connect(PeerKey(LOCAL, port_a), 1, accept).result(timeout=30)
    with pytest.raises(IncompatiblePeerError, match="still answering at"):
        peers.connect(PeerKey(LOCAL, port_b), 1, accept).result(timeout=30)
    assert peers.cached(PeerKey(LOCAL, port_a)) is not None


def test_two_addresses_handshaken_at_once_cannot_both_claim_one_engine(made: list) -> None:
    """Addresses A and B both answer as engine "prefill", with other memory. B's handshake
    comes while A's connection is being made (not cached yet): B must be checked against A
    once A is connected, and refused while A still answers. Before, the check for another
    address ran before connections were serialized and saw cached handshakes only: B replaced
    A's connection, and a READ through A's handshake took B's bytes. (Found by a review,
    2026-12-07.)"""
    decode, decode_caches = engine("decode", 1)
    first_add = threading.Event()

    class SlowFirstAdd:
        """The decode engine, whose first add_peer takes a while (a real backend's
        connection setup): the other handshake meanwhile passes its checks."""

        def add_peer(self, *args: object, **kwargs: object) -> str:
            if not first_add.is_set():
                first_add.set()
                time.sleep(1.0)
            return decode.add_peer(*args, **kwargs)  # type: ignore[arg-type]

        def __getattr__(self, name: str) -> object:
            return getattr(decode, name)

    slow = SlowFirstAdd()
    port_a, port_b = free_port(), free_port()
    genuine = Prefill("prefill", port_a, 2)
    made.append(genuine)
    made.append(Prefill("prefill", port_b, 3))  # claims the same engine id, other memory
    peers = PeerDirectory(lambda: slow, security(), "decode/dp0/tp0", timeout=5.0)  # type: ignore[arg-type,return-value]
    made.append(peers)
    via_a = peers.connect(PeerKey(LOCAL, port_a), 1, accept)
    assert first_add.wait(10)  # A is being connected
    via_b = peers.connect(PeerKey(LOCAL, port_b), 1, accept)
    peer_a = via_a.result(timeout=30)
    with pytest.raises(IncompatiblePeerError, match="still answering at"):
        via_b.result(timeout=30)
    expected = kc.expected_after_copy(decode_caches, genuine.caches, [0, 1], [2, 3])
    decode.read("via-a", peer_a.engine_peer, [0, 1], [2, 3])
    assert decode.wait(["via-a"], timeout=30)["via-a"].state == "done"
    assert np.array_equal(decode_caches.backing, expected)


def test_a_forgotten_handshake_does_not_let_another_address_take_the_engine(made: list) -> None:
    """After ``forget`` (a decode's failed READ) the engine peer stays connected to A's
    memory: another address answering as the same engine id with other memory is refused
    while A still answers. Before, only cached handshakes were checked: B replaced the
    connection, and from then on A was the one refused. (Found by a review, 2026-12-07.)"""
    decode, _ = engine("decode", 1)
    port_a, port_b = free_port(), free_port()
    made.append(Prefill("prefill", port_a, 2))
    made.append(Prefill("prefill", port_b, 3))  # the same engine id, other memory
    peers = directory(decode, made)
    peer_a = peers.connect(PeerKey(LOCAL, port_a), 1, accept).result(timeout=30)
    peers.forget(peer_a)
    assert decode.peers() == ["prefill"]  # still connected to A's memory
    with pytest.raises(IncompatiblePeerError, match="still answering at"):
        peers.connect(PeerKey(LOCAL, port_b), 1, accept).result(timeout=30)
    again = peers.connect(PeerKey(LOCAL, port_a), 1, accept).result(timeout=30)
    assert again.response.engine_metadata == peer_a.response.engine_metadata


def test_every_rival_address_is_checked_not_only_the_first(made: list) -> None:
    """The instance answers at A and, through a second server of the same answers (a forwarder
    gone later), at A2; both connected the engine id with the same metadata. A2 goes away, and
    B claims the engine id with other memory: A2, proved gone, must not end the check while A
    still answers. Before, only the first rival was checked, and B's connection replaced the
    live one. (Found by a review of the fix above, 2026-12-07.)"""
    decode, _ = engine("decode", 1)
    port_a, port_a2, port_b = free_port(), free_port(), free_port()
    genuine = Prefill("prefill", port_a, 2)
    made.append(genuine)
    alias = HandshakeServer(port_a2, genuine._answer, security(), bind_host=LOCAL, own_thread=True)
    peers = directory(decode, made)
    peers.connect(PeerKey(LOCAL, port_a2), 1, accept).result(timeout=30)
    peers.connect(PeerKey(LOCAL, port_a), 1, accept).result(timeout=30)
    alias.close()
    made.append(Prefill("prefill", port_b, 3))  # the same engine id, other memory
    with pytest.raises(IncompatiblePeerError, match="still answering at"):
        peers.connect(PeerKey(LOCAL, port_b), 1, accept).result(timeout=30)


def test_an_engine_restarted_at_another_address_replaces_the_dead_one(made: list) -> None:
    """The instance at the first address is gone; the same engine id answers elsewhere with
    new metadata: a restart, so the new connection replaces the stale one, whose cached
    handshake is dropped."""
    decode, _ = engine("decode", 1)
    port_a, port_b = free_port(), free_port()
    old = Prefill("prefill", port_a, 2)
    peers = directory(decode, made)
    first = peers.connect(PeerKey(LOCAL, port_a), 1, accept).result(timeout=30)
    old.close()
    made.append(Prefill("prefill", port_b, 3))
    second = peers.connect(PeerKey(LOCAL, port_b), 1, accept).result(timeout=30)
    assert second.response.engine_metadata != first.response.engine_metadata
    assert decode.peers() == ["prefill"]
    assert peers.cached(PeerKey(LOCAL, port_a)) is None


def test_one_engine_under_two_addresses_is_one_connection(made: list) -> None:
    """The same instance behind another address (a forwarder here) answers with the same
    metadata: both addresses reach it, through one engine peer."""
    decode, _ = engine("decode", 1)
    port = free_port()
    made.append(Prefill("prefill", port, 2))
    forwarder = FaultProxy(LOCAL, port)
    peers = directory(decode, made)
    try:
        direct = peers.connect(PeerKey(LOCAL, port), 1, accept).result(timeout=30)
        forwarded = peers.connect(PeerKey(LOCAL, forwarder.port), 1, accept).result(timeout=30)
    finally:
        forwarder.close()
    assert direct.engine_peer == forwarded.engine_peer == "prefill"
    assert decode.peers() == ["prefill"]


def test_probes_run_on_their_own_thread(made: list) -> None:
    """A probe waiting on an unresponsive peer does not hold up handshakes requests need."""
    decode, _ = engine("decode", 1)
    slow_port, port = free_port(), free_port()
    slow = Prefill("slow", slow_port, 2)
    made.append(slow)
    made.append(Prefill("prefill", port, 3))
    peers = directory(decode, made)
    slow_peer = peers.connect(PeerKey(LOCAL, slow_port), 1, accept).result(timeout=30)
    slow.gate.clear()
    probes = [peers.probe(slow_peer) for _ in range(8)]  # more than the handshake threads
    peer = peers.connect(PeerKey(LOCAL, port), 1, accept).result(timeout=30)
    assert peer.engine_peer == "prefill"
    assert not any(p.done() for p in probes)
    slow.gate.set()
    assert all(p.result(timeout=60) == "" for p in probes)  # the same instance answered


def test_connect_after_close_fails_without_dialling(made: list) -> None:
    decode, _ = engine("decode", 1)
    peers = directory(decode, made)
    peers.close()
    with pytest.raises(MoriioError, match="shut down"):
        peers.connect(PeerKey(LOCAL, free_port()), 1, accept).result(timeout=5)


def test_close_ends_the_handshakes_and_probes_it_drops(made: list) -> None:
    """Handshakes and probes still queued when the directory closes end at once, named as not
    made; their callers' callbacks run. Before, their futures stayed pending for good."""
    decode, _ = engine("decode", 1)
    slow = []
    for i in range(peers_module.HANDSHAKE_THREADS + 3):  # a connection, and two queued
        prefill = Prefill(f"prefill{i}", free_port(), 2 + i)
        made.append(prefill)
        slow.append(prefill)
    peers = directory(decode, made)
    probed_peer = peers.connect(PeerKey(LOCAL, slow[0].server.port), 1, accept).result(timeout=30)
    for prefill in slow:
        prefill.gate.clear()
    handshakes = [peers.connect(PeerKey(LOCAL, p.server.port), 1, accept) for p in slow[1:]]
    probes = [peers.probe(probed_peer) for _ in range(2)]  # one runs, one is queued
    called = threading.Event()
    handshakes[-1].add_done_callback(lambda _: called.set())
    running = handshakes[: peers_module.HANDSHAKE_THREADS]
    wait_for(
        lambda: slow[0].arrived == 2 and all(p.arrived for p in slow[1 : len(running) + 1]),
        "the probe and the first handshakes held at their prefills' gates",
    )
    peers.close()
    queued = handshakes[peers_module.HANDSHAKE_THREADS :]
    assert queued and all(f.done() for f in queued)
    for future in queued:
        with pytest.raises(MoriioError, match=r"not handshaken.*shut down"):
            future.result(timeout=0)
    assert called.is_set()
    assert probes[1].result(timeout=0).startswith("not probed")
    for prefill in slow:
        prefill.gate.set()
    assert all(f.result(timeout=30).engine_peer.startswith("prefill") for f in running)
    assert probes[0].result(timeout=30) == ""


def prefills(made: list, names: list[str]) -> dict[str, PeerKey]:
    """One prefill engine of each name behind its own handshake server."""
    keys = {}
    for salt, name in enumerate(names, start=2):
        port = free_port()
        made.append(Prefill(name, port, salt))
        keys[name] = PeerKey(LOCAL, port)
    return keys


def test_max_peers_evicts_the_least_recently_used_idle_peer(made: list) -> None:
    """Addresses that answer with ever new engine ids (anyone an abort_write or a request can
    point this rank at) cannot grow its peers past max_peers: the least recently used goes."""
    decode, _ = engine("decode", 1)
    keys = prefills(made, ["prefill-a", "prefill-b", "prefill-c"])
    bound: list[bool] = []
    peers = directory(decode, made, max_peers=2, on_bound=bound.append)
    for name in ("prefill-a", "prefill-b"):
        peers.connect(keys[name], 1, accept).result(timeout=30)
    assert peers.connect(keys["prefill-a"], 1, accept).done()  # a cache hit: a is used now
    assert peers.connect(keys["prefill-c"], 1, accept).result(timeout=30).engine_peer == "prefill-c"
    assert sorted(decode.peers()) == ["prefill-a", "prefill-c"]
    assert peers.cached(keys["prefill-b"]) is None
    assert peers.stats() == {"cached": 2, "evicted": 1, "refused": 0}
    assert bound == [True]  # told to the caller (the connector's stats)
    assert peers.find_engine("prefill-c") is not None  # c is used now, a the oldest
    again = peers.connect(keys["prefill-b"], 1, accept).result(timeout=30)  # handshaken again
    assert again.engine_peer == "prefill-b"
    assert sorted(decode.peers()) == ["prefill-b", "prefill-c"]
    assert peers.cached(keys["prefill-a"]) is None


def test_a_failing_bound_callback_fails_no_handshake(made: list) -> None:
    """``on_bound`` is a statistic, as ``on_handshake`` is: when it raises, the eviction it
    reports still happens and the handshake that needed the room still succeeds."""
    decode, _ = engine("decode", 1)
    keys = prefills(made, ["prefill-a", "prefill-b"])

    def broken(evicted: bool) -> None:
        raise RuntimeError("stats are broken")

    peers = directory(decode, made, max_peers=1, on_bound=broken)
    peers.connect(keys["prefill-a"], 1, accept).result(timeout=30)
    assert peers.connect(keys["prefill-b"], 1, accept).result(timeout=30).engine_peer == "prefill-b"
    assert decode.peers() == ["prefill-b"]
    assert peers.stats() == {"cached": 1, "evicted": 1, "refused": 0}


def test_a_peer_with_a_transfer_pending_is_never_evicted(made: list) -> None:
    """Eviction ends nothing: a peer with a transfer pending stays, and the new address is
    refused naming the bound until the transfer ended."""
    decode, _caches = engine("decode", 1, {"loopback_delay_ms": "500"})
    keys = prefills(made, ["prefill-a", "prefill-b"])
    clock = Clock()
    peers = directory(decode, made, max_peers=1, clock=clock)
    peers.connect(keys["prefill-a"], 1, accept).result(timeout=30)
    decode.read("busy", "prefill-a", [0, 1], [2, 3])
    with pytest.raises(PeerCapacityError, match=r"max_peers 1\); none of the least recently"):
        peers.connect(keys["prefill-b"], 1, accept).result(timeout=30)
    assert peers.stats() == {"cached": 1, "evicted": 0, "refused": 1}
    assert decode.peers() == ["prefill-a"]
    assert decode.wait(["busy"], timeout=30)["busy"].state == "done"
    assert peers.connect(keys["prefill-b"], 1, accept).done()  # refused, not asked again yet
    clock.now += CAPACITY_RETRY_S  # a refusal at the bound is not backed off
    assert peers.connect(keys["prefill-b"], 1, accept).result(timeout=30).engine_peer == "prefill-b"
    assert decode.peers() == ["prefill-b"]


def test_a_peer_a_job_holds_is_never_evicted(made: list) -> None:
    """A job that holds a peer before it posted anything (a WRITE waiting for the forward) has
    no transfer in the engine yet: the caller's in_use keeps its peer."""
    decode, _ = engine("decode", 1)
    keys = prefills(made, ["prefill-a", "prefill-b", "prefill-c"])
    held = {"prefill-a"}
    peers = directory(decode, made, max_peers=2, in_use=lambda: set(held))
    for name in ("prefill-a", "prefill-b", "prefill-c"):
        peers.connect(keys[name], 1, accept).result(timeout=30)
    assert sorted(decode.peers()) == ["prefill-a", "prefill-c"]  # b went, not the older a
    held.add("prefill-c")
    with pytest.raises(PeerCapacityError, match="or a job holds it"):
        peers.connect(keys["prefill-b"], 1, accept).result(timeout=30)
    assert sorted(decode.peers()) == ["prefill-a", "prefill-c"]


def test_busy_peers_keep_their_place_in_the_eviction_order(made: list) -> None:
    """Peers found busy when room was made go back where they were: the least recently used
    stays first in line once it is idle."""
    decode, _ = engine("decode", 1, {"loopback_delay_ms": "300"})
    names = ["prefill-a", "prefill-b", "prefill-c", "prefill-d", "prefill-e"]
    keys = prefills(made, names)
    peers = directory(decode, made, max_peers=3)
    for name in names[:3]:
        peers.connect(keys[name], 1, accept).result(timeout=30)
    decode.read("on-a", "prefill-a", [0], [2])
    decode.read("on-b", "prefill-b", [1], [3])
    peers.connect(keys["prefill-d"], 1, accept).result(timeout=30)  # a, b busy: c goes
    assert sorted(decode.peers()) == ["prefill-a", "prefill-b", "prefill-d"]
    assert all(e.state == "done" for e in decode.wait(["on-a", "on-b"], timeout=30).values())
    peers.connect(keys["prefill-e"], 1, accept).result(timeout=30)
    assert sorted(decode.peers()) == ["prefill-b", "prefill-d", "prefill-e"]  # a was first


def test_engine_peers_no_cached_address_names_go_first(made: list) -> None:
    """A peer the directory forgot (after a failure) but the engine still holds is the first to
    go: it cannot be found again without a handshake anyway."""
    decode, _ = engine("decode", 1)
    keys = prefills(made, ["prefill-a", "prefill-b", "prefill-c"])
    peers = directory(decode, made, max_peers=2)
    a = peers.connect(keys["prefill-a"], 1, accept).result(timeout=30)
    peers.connect(keys["prefill-b"], 1, accept).result(timeout=30)
    peers.connect(keys["prefill-a"], 1, accept)  # a is used now, b the least recently used
    peers.forget(a)
    peers.connect(keys["prefill-c"], 1, accept).result(timeout=30)
    assert sorted(decode.peers()) == ["prefill-b", "prefill-c"]
    assert peers.cached(keys["prefill-b"]) is not None


def test_max_peers_must_be_positive() -> None:
    decode, _ = engine("decode", 1)
    with pytest.raises(InvalidArgumentError, match="max_peers must be >= 1, got 0"):
        PeerDirectory(lambda: decode, security(), "decode/dp0/tp0", timeout=5.0, max_peers=0)  # type: ignore[arg-type]


def test_addresses_answering_under_ever_new_engine_ids_cannot_grow_the_peers(made: list) -> None:
    """What a stranger who can point this rank at addresses of theirs (abort_write, a
    request's remote_host) and answers every handshake with valid metadata under a new engine
    id does: 40 such addresses named in turn, 3 times over. The engine never holds more than
    max_peers, the genuine peer (used between them, a transfer of it pending at times) is never
    evicted, and its reads stay byte-exact."""
    decode, decode_caches = engine("decode", 1, {"loopback_delay_ms": "20"})
    genuine_port = free_port()
    genuine = Prefill("prefill", genuine_port, 2)
    made.append(genuine)
    strangers = prefills(made, [f"prefill-stranger-{i}" for i in range(40)])
    peers = directory(decode, made, max_peers=4)
    genuine_key = PeerKey(LOCAL, genuine_port)
    peers.connect(genuine_key, 1, accept).result(timeout=30)
    most = 0
    for n, key in enumerate(list(strangers.values()) * 3):
        peer = peers.connect(genuine_key, 1, accept).result(timeout=30)  # used between them
        if n % 10 == 0:  # a genuine read now and then, pending while strangers are connected
            tid = f"genuine-{n}"
            expected = kc.expected_after_copy(decode_caches, genuine.caches, [0, 1], [2, 3])
            decode.read(tid, peer.engine_peer, [0, 1], [2, 3])
        peers.connect(key, 1, accept).result(timeout=30)
        most = max(most, len(decode.peers()), len(peers))
        if n % 10 == 9:
            assert decode.wait([tid], timeout=30)[tid].state == "done"
            assert np.array_equal(decode_caches.backing, expected)
    assert most == 4
    assert "prefill" in decode.peers() and peers.cached(genuine_key) is not None
    assert genuine.answered == 1  # never evicted, so never handshaken again


def test_an_answer_cannot_take_over_another_engines_connection(made: list) -> None:
    """A stranger answers as a new engine id with metadata naming the connected genuine engine
    (its own memory behind it): refused before anything changes, so the genuine peer's read in
    flight completes and the genuine bytes arrive (before, the engine swapped that peer's
    connection to the stranger's memory and ended its transfers)."""
    decode, decode_caches = engine("decode", 1, {"loopback_delay_ms": "200"})
    genuine_port, stranger_port = free_port(), free_port()
    genuine = Prefill("prefill", genuine_port, 2)
    made.append(genuine)
    made.append(Prefill("prefill", stranger_port, 3, claims="prefill-stranger"))
    peers = directory(decode, made)
    peer = peers.connect(PeerKey(LOCAL, genuine_port), 1, accept).result(timeout=30)
    expected = kc.expected_after_copy(decode_caches, genuine.caches, [0, 1], [2, 3])
    decode.read("genuine", peer.engine_peer, [0, 1], [2, 3])
    with pytest.raises(
        IncompatiblePeerError, match="names engine 'prefill', not the expected 'prefill-stranger'"
    ):
        peers.connect(PeerKey(LOCAL, stranger_port), 1, accept).result(timeout=30)
    assert decode.wait(["genuine"], timeout=30)["genuine"].state == "done"
    assert np.array_equal(decode_caches.backing, expected)
    assert decode.peers() == ["prefill"] and len(peers) == 1
