"""PolledRequests (moriio_native.control.channel): requests to handshake servers waited for by
one thread, several outstanding on one connection per server and matched to their replies by
nonce. Against a bare ROUTER on 127.0.0.1 that answers when and how each test says: replies out
of order, a reply of another protocol version, a malformed reply, a request unanswered in time,
idle connections, a secret on one side only, and the requester's own end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from moriio_native.control.channel import SECRET_MISMATCH, PolledRequests, ask_checksums
from moriio_native.control.messages import (
    ChecksumRequest,
    ChecksumResponse,
    HandshakeResponse,
    decode,
    encode,
)
from moriio_native.control.security import (
    AuthenticationError,
    ControlSecurity,
    MessageAuth,
    PeerAllowlist,
    PeerNotAllowedError,
)
from moriio_native.errors import (
    FailedPreconditionError,
    IncompatiblePeerError,
    MoriioError,
    TransferTimeoutError,
    TransportError,
)

LOCAL = "127.0.0.1"
WAIT_S = 5.0  # upper bound for anything that should arrive; never reached when things work
SECRET = "test-secret-0123456789"


def _security(secret: str | None = None) -> ControlSecurity:
    return ControlSecurity(MessageAuth(secret), PeerAllowlist(["127.0.0.0/8"]))


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
        assert self.sock.poll(int(WAIT_S * 1000)), "no request came"
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
            assert self._cond.wait_for(lambda: all(t in self.got for t in tids), WAIT_S), self.got


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture
def requests() -> Iterator[PolledRequests]:
    r = PolledRequests(_security(), "test-polled")
    yield r
    r.close()


def _ask(
    requests: PolledRequests, port: int, tid: str, outcomes: Outcomes, timeout: float = WAIT_S
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
    assert 0.25 <= time.monotonic() - start < WAIT_S
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
    requests = PolledRequests(_security(), "test-polled", idle_s=0.5, max_idle=1)
    try:
        outcomes = Outcomes()
        for tid, srv in (("a", server), ("b", other)):
            _ask(requests, srv.port, tid, outcomes)
            server_identity, request = srv.take()
            srv.answer(server_identity, request)
            outcomes.wait(tid)
        assert requests.idle == 1  # a's went to keep b's
        deadline = time.monotonic() + WAIT_S
        while requests.idle and time.monotonic() < deadline:
            time.sleep(0.05)
        assert requests.idle == 0  # nobody called anything: its thread closed it
    finally:
        requests.close()
        other.close()


def test_a_secret_on_one_side_only_fails_at_once_naming_it() -> None:
    server = Server(SECRET)
    requests = PolledRequests(_security(), "test-polled")
    try:
        outcomes = Outcomes()
        start = time.monotonic()
        _ask(requests, server.port, "t", outcomes, timeout=30.0)
        outcomes.wait("t")
        got = outcomes.got["t"]
        assert isinstance(got, AuthenticationError) and SECRET_MISMATCH in str(got)
        assert time.monotonic() - start < WAIT_S
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
    ask_checksums(requests, LOCAL, server.port, request, timeout=WAIT_S, done=fails)
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
    ask_checksums(requests, LOCAL, server.port, request, timeout=WAIT_S, done=close_here)
    server.answer(*server.take())
    assert closed.wait(WAIT_S)
    with pytest.raises(FailedPreconditionError, match="the requester is closed"):
        _ask(requests, server.port, "after", outcomes)
