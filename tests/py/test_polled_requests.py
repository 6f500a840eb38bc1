"""PolledRequests (moriio_native.control.channel): requests to handshake servers waited for by
one thread, several outstanding on one connection per server and matched to their replies by
nonce. Against a bare ROUTER on 127.0.0.1 that answers when and how each test says: replies out
of order, a reply of another protocol version, a malformed reply, a request unanswered in time,
idle connections, a secret on one side only, and the requester's own end."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import zmq

from moriio_native.control.channel import (
    _CONNECTION_EVENTS,
    SECRET_MISMATCH,
    HandshakeServer,
    PolledRequests,
    _dial_asker,
    _named_by_handshake,
    _send_request,
    ask_checksums,
)
from moriio_native.control.messages import (
    ChecksumRequest,
    ChecksumResponse,
    HandshakeResponse,
    decode,
    encode,
)
from moriio_native.control.security import (
    AuthenticationError,
    MessageAuth,
    PeerNotAllowedError,
)
from moriio_native.errors import (
    FailedPreconditionError,
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    TransferTimeoutError,
    TransportError,
)
from net_support import free_port
from test_control_channel import (
    LOCAL,
    SECRET,
    WAIT,
    CountingContext,
    _echo_checksums,
    provider_for,
    security,
)


class Server:
    """A bare ROUTER: the test reads each request (with the connection it came on) and answers
    with whatever frames it likes."""

    def __init__(self, secret: str | None = None) -> None:
        self._auth = MessageAuth(secret)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._auth.secure_listener(self.sock)
        self.port = self.sock.bind_to_random_port(f"tcp://{LOCAL}")

    def take(self) -> tuple[bytes, ChecksumRequest]:
        """The next request and the identity of the connection it came on."""
        assert self.sock.poll(int(WAIT * 1000)), "no request came"
        identity, *frames = self.sock.recv_multipart()
        request = decode(self._auth.open(frames), (ChecksumRequest,), max_bytes=1 << 16)
        assert isinstance(request, ChecksumRequest)
        return identity, request

    def answer(self, identity: bytes, request: ChecksumRequest) -> None:
        reply = ChecksumResponse(transfer_id=request.transfer_id, checksums={}, nonce=request.nonce)
        self.send(identity, [b"", *self._auth.seal(encode(reply))])

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)


class Outcomes:
    """What each request's callback got, by transfer id."""

    def __init__(self) -> None:
        self.got: dict[str, ChecksumResponse | MoriioError] = {}
        self._cond = threading.Condition()

    def done(self, tid: str) -> Any:
        def record(outcome: ChecksumResponse | MoriioError) -> None:
            with self._cond:
                assert tid not in self.got, f"{tid} ended twice"
                self.got[tid] = outcome
                self._cond.notify_all()

        return record

    def wait(self, *tids: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: all(t in self.got for t in tids), WAIT), self.got


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture
def requests() -> Iterator[PolledRequests]:
    r = PolledRequests(security(), "test-polled")
    yield r
    r.close()


def _ask(
    requests: PolledRequests, port: int, tid: str, outcomes: Outcomes, timeout: float = WAIT
) -> None:
    request = ChecksumRequest(requester_engine_id="d", transfer_id=tid, block_ids=(1,))
    ask_checksums(requests, LOCAL, port, request, timeout=timeout, done=outcomes.done(tid))


def test_requests_outstanding_on_one_connection_get_their_own_replies_in_any_order(
    server: Server, requests: PolledRequests
) -> None:
    outcomes = Outcomes()
    for tid in ("a", "b", "c"):
        _ask(requests, server.port, tid, outcomes)
    taken = [server.take() for _ in range(3)]
    assert len({identity for identity, _ in taken}) == 1  # one connection carried all three
    for identity, request in reversed(taken):
        server.answer(identity, request)
    outcomes.wait("a", "b", "c")
    for tid in ("a", "b", "c"):
        got = outcomes.got[tid]
        assert isinstance(got, ChecksumResponse) and got.transfer_id == tid
    assert requests.idle == 1


def test_a_reply_of_another_version_fails_only_the_request_it_names(
    server: Server, requests: PolledRequests
) -> None:
    outcomes = Outcomes()
    _ask(requests, server.port, "old", outcomes)
    _ask(requests, server.port, "new", outcomes)
    (identity, old), (_, new) = server.take(), server.take()
    # A handshake answer (the kind that carries a version) of version 1, naming old's nonce.
    wire = msgpack.unpackb(encode(HandshakeResponse("p", b"m", nonce=old.nonce)))
    wire["protocol_version"] = 1
    server.send(identity, [b"", msgpack.packb(wire)])
    outcomes.wait("old")
    got = outcomes.got["old"]
    assert isinstance(got, IncompatiblePeerError)
    assert str(got).startswith(f"checksums of transfer old from {LOCAL}:{server.port}: ")
    assert "protocol version 1 is not supported" in str(got)
    assert "new" not in outcomes.got
    server.answer(identity, new)
    outcomes.wait("new")
    assert isinstance(outcomes.got["new"], ChecksumResponse)


def test_a_malformed_reply_fails_every_request_on_its_connection_and_the_next_dials_anew(
    server: Server, requests: PolledRequests
) -> None:
    outcomes = Outcomes()
    _ask(requests, server.port, "a", outcomes)
    _ask(requests, server.port, "b", outcomes)
    (identity, _), _ = server.take(), server.take()
    server.send(identity, [b"", b"\xc1"])
    outcomes.wait("a", "b")
    for tid in ("a", "b"):
        got = outcomes.got[tid]
        assert isinstance(got, TransportError) and "bad reply" in str(got)
        assert str(got).startswith(f"checksums of transfer {tid} from")
    _ask(requests, server.port, "c", outcomes)
    again, request = server.take()
    assert again != identity
    server.answer(again, request)
    outcomes.wait("c")
    assert isinstance(outcomes.got["c"], ChecksumResponse)


def test_a_request_unanswered_in_time_retires_its_connection_which_serves_the_others(
    server: Server, requests: PolledRequests
) -> None:
    """``short`` gets no reply within its 0.3 s: it fails then; ``long``, outstanding on the
    same connection, still gets its reply there, while the next request goes on a new one."""
    outcomes = Outcomes()
    start = time.monotonic()
    _ask(requests, server.port, "short", outcomes, timeout=0.3)
    _ask(requests, server.port, "long", outcomes)
    (first, short), (_, long) = server.take(), server.take()
    outcomes.wait("short")
    got = outcomes.got["short"]
    assert isinstance(got, TransferTimeoutError) and "no reply within 0.3s" in str(got)
    assert 0.25 <= time.monotonic() - start < WAIT
    _ask(requests, server.port, "next", outcomes)
    second, following = server.take()
    assert second != first
    server.answer(first, short)  # late: answers nothing any more, and is dropped
    server.answer(first, long)
    server.answer(second, following)
    outcomes.wait("long", "next")
    assert isinstance(outcomes.got["long"], ChecksumResponse)
    assert isinstance(outcomes.got["next"], ChecksumResponse)


def test_an_idle_connection_closes_by_itself_and_at_most_max_idle_are_kept(
    server: Server,
) -> None:
    other = Server()
    requests = PolledRequests(security(), "test-polled", idle_s=0.5, max_idle=1)
    try:
        outcomes = Outcomes()
        for tid, srv in (("a", server), ("b", other)):
            _ask(requests, srv.port, tid, outcomes)
            server_identity, request = srv.take()
            srv.answer(server_identity, request)
            outcomes.wait(tid)
        assert requests.idle == 1  # a's went to keep b's
        deadline = time.monotonic() + WAIT
        while requests.idle and time.monotonic() < deadline:
            time.sleep(0.05)
        assert requests.idle == 0  # nobody called anything: its thread closed it
    finally:
        requests.close()
        other.close()


def test_a_secret_on_one_side_only_fails_at_once_naming_it() -> None:
    server = Server(SECRET)
    requests = PolledRequests(security(), "test-polled")
    try:
        outcomes = Outcomes()
        start = time.monotonic()
        _ask(requests, server.port, "t", outcomes, timeout=30.0)
        outcomes.wait("t")
        got = outcomes.got["t"]
        assert isinstance(got, AuthenticationError) and SECRET_MISMATCH in str(got)
        assert time.monotonic() - start < WAIT
    finally:
        requests.close()
        server.close()


def test_a_host_not_allowlisted_raises_at_once_and_calls_nothing(
    requests: PolledRequests,
) -> None:
    outcomes = Outcomes()
    request = ChecksumRequest(requester_engine_id="d", transfer_id="t", block_ids=(1,))
    with pytest.raises(PeerNotAllowedError):
        ask_checksums(requests, "10.9.9.9", 7000, request, timeout=1.0, done=outcomes.done("t"))
    time.sleep(0.1)
    assert outcomes.got == {}


def test_a_failing_callback_stops_nothing_and_close_from_a_callback_returns(
    server: Server, requests: PolledRequests
) -> None:
    outcomes = Outcomes()

    def fails(_outcome: object) -> None:
        raise RuntimeError("a callback's bug")

    request = ChecksumRequest(requester_engine_id="d", transfer_id="bad", block_ids=(1,))
    ask_checksums(requests, LOCAL, server.port, request, timeout=WAIT, done=fails)
    server.answer(*server.take())
    _ask(requests, server.port, "good", outcomes)
    server.answer(*server.take())
    outcomes.wait("good")
    assert isinstance(outcomes.got["good"], ChecksumResponse)

    closed = threading.Event()

    def close_here(_outcome: object) -> None:
        requests.close()
        closed.set()

    request = ChecksumRequest(requester_engine_id="d", transfer_id="last", block_ids=(1,))
    ask_checksums(requests, LOCAL, server.port, request, timeout=WAIT, done=close_here)
    server.answer(*server.take())
    assert closed.wait(WAIT)
    with pytest.raises(FailedPreconditionError, match="the requester is closed"):
        _ask(requests, server.port, "after", outcomes)


def _answer_server(
    port: int = 0, secret: str | None = None, checksums: Any = _echo_checksums
) -> HandshakeServer:
    return HandshakeServer(
        port, provider_for(), security(secret), bind_host=LOCAL, checksums=checksums
    )


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "curve"])
def test_requests_one_after_another_go_on_one_connection(secret: str | None) -> None:
    """The connection to a server is kept: requests after the first make no new socket (with a
    secret: no new CURVE key exchange), and each gets its own answer."""
    counting = CountingContext()
    requests = PolledRequests(security(secret), "test-polled", context=counting)
    try:
        with _answer_server(secret=secret) as server:
            for i in range(5):
                outcomes = Outcomes()
                _ask(requests, server.port, f"t{i}", outcomes)
                outcomes.wait(f"t{i}")
                got = outcomes.got[f"t{i}"]
                assert isinstance(got, ChecksumResponse) and got.transfer_id == f"t{i}"
        assert counting.created.count(zmq.DEALER) == 1
    finally:
        requests.close()


def test_many_threads_asking_at_once_share_one_connection() -> None:
    """200 requests from 8 threads at once: all on one connection, each its own answer."""
    counting = CountingContext()
    requests = PolledRequests(security(), "test-polled", context=counting)
    outcomes = Outcomes()
    tids = [f"t{i}" for i in range(200)]
    try:
        with _answer_server() as server, ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda tid: _ask(requests, server.port, tid, outcomes), tids))
            outcomes.wait(*tids)
        for tid in tids:
            got = outcomes.got[tid]
            assert isinstance(got, ChecksumResponse) and got.transfer_id == tid
        assert counting.created.count(zmq.DEALER) == 1
    finally:
        requests.close()


def test_a_rejection_keeps_the_connection_it_came_on() -> None:
    """The server's rejection is its reply: the request fails with its reason, and the next
    request goes on the same connection."""

    def reject_first(request: ChecksumRequest) -> ChecksumResponse:
        if request.transfer_id == "refused":
            raise FailedPreconditionError("its blocks are no longer held: released")
        return _echo_checksums(request)

    counting = CountingContext()
    requests = PolledRequests(security(), "test-polled", context=counting)
    outcomes = Outcomes()
    try:
        with _answer_server(checksums=reject_first) as server:
            _ask(requests, server.port, "refused", outcomes)
            outcomes.wait("refused")
            _ask(requests, server.port, "next", outcomes)
            outcomes.wait("next")
        refused = outcomes.got["refused"]
        assert isinstance(refused, FailedPreconditionError)
        assert "rejected by the peer: its blocks are no longer held: released" in str(refused)
        assert isinstance(outcomes.got["next"], ChecksumResponse)
        assert counting.created.count(zmq.DEALER) == 1
    finally:
        requests.close()


@pytest.mark.parametrize(
    ("ours", "theirs"), [(SECRET, None), (None, SECRET)], ids=["lost-secret", "gained-secret"]
)
def test_a_server_restarted_with_another_secret_setting_is_named_at_once_on_the_kept_one(
    ours: str | None, theirs: str | None
) -> None:
    """A prefill restarted under the same port without the secret, or with one this side
    lacks: the request on the connection kept from before fails at once naming the mismatch
    (ZMQ's reconnection fails its handshake, which the kept connection's watch reports; a
    send ZMQ refuses retires the connection), not after its whole wait; the next request
    dials anew and is named the same."""
    port = free_port()
    requests = PolledRequests(security(ours), "test-polled")
    outcomes = Outcomes()
    try:
        with _answer_server(port, ours):
            _ask(requests, port, "t0", outcomes)
            outcomes.wait("t0")
        assert isinstance(outcomes.got["t0"], ChecksumResponse)
        assert requests.idle == 1
        with _answer_server(port, theirs):
            start = time.monotonic()
            for tid in ("t1", "t2", "t3"):
                _ask(requests, port, tid, outcomes, timeout=30.0)
                outcomes.wait(tid)
                time.sleep(0.2)
            assert time.monotonic() - start < WAIT
            for tid in ("t2", "t3"):  # t1 may meet the connection before ZMQ tried it again
                got = outcomes.got[tid]
                assert isinstance(got, AuthenticationError) and SECRET_MISMATCH in str(got), got
    finally:
        requests.close()


def test_a_terminated_context_ends_the_requests_and_lets_term_return() -> None:
    """The process ends the ZMQ context the requester uses while a request waits on a peer
    that never answers: the request fails, its socket and monitor are closed, so term()
    returns (an open socket would keep it waiting for ever)."""
    own = zmq.Context()
    silent = socket.socket()
    silent.bind((LOCAL, 0))
    silent.listen(4)
    requests = PolledRequests(security(), "test-polled", context=own)
    outcomes = Outcomes()
    try:
        _ask(requests, silent.getsockname()[1], "t", outcomes, timeout=60.0)
        silent.settimeout(WAIT)
        accepted, _ = silent.accept()  # connected, never answered
        terminating = threading.Thread(target=own.term, daemon=True)
        terminating.start()
        terminating.join(WAIT)
        assert not terminating.is_alive(), "term() waits on a socket left open"
        outcomes.wait("t")
        assert isinstance(outcomes.got["t"], FailedPreconditionError)
        accepted.close()
    finally:
        silent.close()
        requests.close()


def test_at_most_max_outstanding_requests_wait_on_a_server_and_the_rest_take_turns(
    server: Server,
) -> None:
    """With two outstanding on the server, the third and fourth wait for their turn (the
    server sees nothing of them) and go as answers free room, oldest first; one whose deadline
    comes before its turn fails unsent, naming why."""
    requests = PolledRequests(security(), "test-polled", max_outstanding=2)
    outcomes = Outcomes()
    try:
        for tid in ("a", "b", "c"):
            _ask(requests, server.port, tid, outcomes)
        _ask(requests, server.port, "short", outcomes, timeout=0.3)
        first, second = server.take(), server.take()
        assert [r.transfer_id for _, r in (first, second)] == ["a", "b"]
        outcomes.wait("short")
        got = outcomes.got["short"]
        assert isinstance(got, TransferTimeoutError)
        assert "not sent, 2 earlier requests to it still unanswered" in str(got)
        assert not server.sock.poll(200), "a third request went out while two were outstanding"
        server.answer(*first)
        identity, third = server.take()
        assert third.transfer_id == "c"
        server.answer(*second)
        server.answer(identity, third)
        outcomes.wait("a", "b", "c")
        assert all(isinstance(outcomes.got[t], ChecksumResponse) for t in ("a", "b", "c"))
    finally:
        requests.close()


def test_a_request_that_fails_inside_the_thread_still_ends_and_the_others_go_on(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect while sending one request (here: dialling its server raises) ends that request
    with an error at once; the thread lives on and serves the next. Before, the thread stopped
    and the request taken from the queue never got its callback, not even at close: a READ
    waiting for its check would have waited for ever."""
    broken = Server()
    dial = PolledRequests._dial

    def dial_or_break(self: PolledRequests, key: tuple[str, int], what: str) -> Any:
        if key[1] == broken.port:
            raise ValueError("a defect, injected")
        return dial(self, key, what)

    monkeypatch.setattr(PolledRequests, "_dial", dial_or_break)
    requests = PolledRequests(security(), "test-polled")
    outcomes = Outcomes()
    try:
        _ask(requests, broken.port, "broken", outcomes)
        outcomes.wait("broken")
        got = outcomes.got["broken"]
        assert isinstance(got, TransportError) and "a defect, injected" in str(got)
        _ask(requests, server.port, "next", outcomes)
        server.answer(*server.take())
        outcomes.wait("next")
        assert isinstance(outcomes.got["next"], ChecksumResponse)
    finally:
        requests.close()
        broken.close()


def test_a_request_reusing_an_outstanding_nonce_ends_at_once_and_the_first_still_does(
    server: Server, requests: PolledRequests
) -> None:
    """Two requests with one nonce to one server: the second ends at once (its reply could not
    be told from the first's); the first still gets its own. Before, the second replaced the
    first, whose callback was never called."""
    outcomes = Outcomes()
    request = ChecksumRequest(requester_engine_id="d", transfer_id="t", block_ids=(1,))
    for name in ("first", "second"):
        ask_checksums(requests, LOCAL, server.port, request, timeout=WAIT, done=outcomes.done(name))
    outcomes.wait("second")
    second = outcomes.got["second"]
    assert isinstance(second, InvalidArgumentError) and "nonce is outstanding" in str(second)
    server.answer(*server.take())
    outcomes.wait("first")
    assert isinstance(outcomes.got["first"], ChecksumResponse)


def _rebound(port: int) -> Server:
    """A bare ROUTER on ``port`` again (a server restarted under its address)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            server = Server.__new__(Server)
            server._auth = MessageAuth(None)
            server.sock = zmq.Context.instance().socket(zmq.ROUTER)
            server.sock.setsockopt(zmq.LINGER, 0)
            server.sock.bind(f"tcp://{LOCAL}:{port}")
            server.port = port
            return server
        except zmq.ZMQError:
            server.sock.close(linger=0)
            assert time.monotonic() < deadline, f"port {port} not free again"
            time.sleep(0.02)


def test_requests_lost_with_a_dropped_connection_end_at_once_and_free_their_turns(
    server: Server, requests: PolledRequests
) -> None:
    """The server restarts under its address while 8 requests are outstanding on the kept
    connection: ZMQ dials it again, and the 8 (whose replies could only go to the old
    connection) end at once, so a new request goes out at once. Before, they counted as
    outstanding until their deadlines and every new request to that server waited behind
    them (found by a review: 2.7-3.7 s with 3-4 s deadlines)."""
    outcomes = Outcomes()
    lost = [f"lost-{i}" for i in range(8)]
    for tid in lost:
        _ask(requests, server.port, tid, outcomes, timeout=30.0)
    for _ in lost:
        server.take()  # taken, never answered
    port = server.port
    server.close()
    restarted = _rebound(port)
    try:
        outcomes.wait(*lost)
        for tid in lost:
            got = outcomes.got[tid]
            assert isinstance(got, TransportError), got
            assert "the connection dropped before the reply came" in str(got)
        _ask(requests, port, "new", outcomes, timeout=30.0)
        restarted.answer(*restarted.take())
        outcomes.wait("new")
        assert isinstance(outcomes.got["new"], ChecksumResponse)
    finally:
        restarted.close()


# A ZMTP 3.0 greeting of the NULL mechanism, as a server, then a command that mechanism never
# sends: ZMQ fails the handshake with a protocol error and gives the connection up for good.
_NULL_GREETING = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
_UNEXPECTED_COMMAND = b"\x04\x06\x05HELLO"


@contextlib.contextmanager
def protocol_breaker() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 that answers every connection with a ZMQ greeting and then a
    command ZMQ's handshake refuses (a protocol error); yields its port."""
    listening = socket.socket()
    listening.bind((LOCAL, 0))
    listening.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listening.accept()
            except OSError:
                return
            conn.sendall(_NULL_GREETING + _UNEXPECTED_COMMAND)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listening.getsockname()[1]
    finally:
        listening.close()


def test_a_connection_zmq_gave_up_on_ends_its_requests_at_once_naming_why() -> None:
    """A peer whose handshake fails on the protocol (not a secret on one side): ZMQ will never
    send nor answer on that connection, so its request ends at once, named so. Before (a
    review found it), it waited its whole deadline and then blamed a peer that closed the
    connection."""
    requests = PolledRequests(security(), "test-polled")
    outcomes = Outcomes()
    try:
        with protocol_breaker() as port:
            start = time.monotonic()
            _ask(requests, port, "t", outcomes, timeout=30.0)
            outcomes.wait("t")
            assert time.monotonic() - start < WAIT
            got = outcomes.got["t"]
            assert isinstance(got, TransportError) and "failed with a protocol error" in str(got)
    finally:
        requests.close()


def test_a_send_after_the_handshake_failed_is_named_by_the_failure() -> None:
    """The same failure reached before the request is sent (a loaded host: the connection
    failed between its dial and the send): ZMQ then refuses the send (no connection left), and
    the request ended "cannot send: Resource temporarily unavailable", naming nothing (seen
    once in a clean-clone CI). The refusal is now named by the connection's failure."""
    with protocol_breaker() as port:
        dialed = _dial_asker(None, LOCAL, port, security(), 1 << 20, "t", _CONNECTION_EVENTS)
        try:
            deadline = time.monotonic() + WAIT
            while dialed.sock.poll(0, zmq.POLLOUT) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # connecting: the send would be queued
            while dialed.sock.poll(0, zmq.POLLOUT) != 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # connected, its handshake not failed yet
            request = ChecksumRequest(requester_engine_id="d", transfer_id="t", block_ids=(1,))
            with pytest.raises(TransportError) as refused:
                _send_request(dialed.sock, request, "t", security())
            named = _named_by_handshake(refused.value, dialed.watch, "t")
            assert isinstance(named, TransportError)
            assert "failed with a protocol error" in str(named), named
        finally:
            dialed.close(0)
