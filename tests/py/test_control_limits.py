"""Liveness and resource bounds of the control channel (control/channel.py): a flood pause
past FD_SETSIZE, ZMQ's own receive queue behind a held-back listener, sockets ZMQ refuses to
open, a checksum request at the schema's bounds, a deadline weeks away, and an answer's own
dict. Found by a review of the channel (2026-12-07); each test failed before its fix.

Real ZMQ on 127.0.0.1, random free ports, bounded waits; no timing in assertions."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time

import pytest
import zmq

from moriio_native.control.channel import NotifyListener, NotifySender
from moriio_native.control.messages import Release, WriteDone, encode
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.errors import TransportError

LOCAL = "127.0.0.1"
WAIT = 10.0
BAD = [b"\xc1", b"not msgpack", b"\x93\x01\x02\x03"]


def _security() -> ControlSecurity:
    return ControlSecurity(MessageAuth(None), PeerAllowlist([f"{LOCAL}/32"]))


@contextlib.contextmanager
def _fds_taken_up_to(n: int):
    """Hold descriptors until the lowest free one is at least ``n`` (so the next pipe gets
    numbers past select()'s FD_SETSIZE, as in a process with many sockets and devices)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 64:
        if hard != resource.RLIM_INFINITY and hard < n + 64:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {n + 64}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, hard))
    held = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            if fd >= n:
                os.close(fd)
                break
            held.append(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)


def test_a_flooded_listener_whose_hub_pipe_is_past_fd_setsize_pauses_without_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hub's flood pause waits on its wake pipe with select.select(), which refuses any
    descriptor >= FD_SETSIZE (1024) with ValueError. A hub made in a process that already holds
    1024 descriptors (a vLLM worker: devices, ZMQ sockets' eventfds, connections) gets such a
    pipe; then every flood pause raises, the hub logs a traceback per round (no rate limit) and
    sleeps 100 ms instead of 0.5 ms."""
    caplog.set_level(logging.ERROR, logger="moriio_native.control.channel")
    with _fds_taken_up_to(1100):
        # own_thread: a private hub, whose pipe is made now (as a checksum-answering server's is).
        listener = NotifyListener(0, _security(), bind_host=LOCAL, own_thread=True)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{LOCAL}:{listener.port}")
        for round_ in range(5):
            for i in range(300):
                dealer.send(BAD[i % len(BAD)])
            dealer.send(encode(Release(f"genuine-{round_}")))
        got = [listener.get(WAIT) for _ in range(5)]
        stats = listener.stats()
        dealer.close(0)
    finally:
        listener.close()
        ctx.term()
    assert got == [Release(f"genuine-{r}") for r in range(5)]
    assert stats["flood_pauses"] > 0
    errors = [r for r in caplog.records if "error in a round of reads" in r.getMessage()]
    assert errors == [], f"{len(errors)} tracebacks, first: {errors[0].exc_info!r}"


def test_a_held_back_listener_holds_no_more_than_its_byte_bound_in_zmqs_queue() -> None:
    """A notify listener held back by its byte bound stops reading its socket so that "ZMQ's
    own high-water marks then push back on senders". But the socket's receive high-water mark
    is ZMQ's default, 1000 messages per connection, each up to MAXMSGSIZE (16 MiB): ZMQ's I/O
    thread keeps taking messages off the connection into the process's memory while the
    listener holds back, up to ~16 GiB per sender. Here one sender sends 40 messages of 6 MB to
    a listener whose queue is full after one; every one of them is taken by the listener's
    process (the sender's context ends with all of them handed over), none pushed back."""
    n, size = 40, 6_000_000
    blob = bytes(size)
    messages = [WriteDone(f"tx-{i:02d}", checksums={"layer.0": blob}) for i in range(n)]
    listener = NotifyListener(0, _security(), bind_host=LOCAL, max_pending_bytes=1)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, 10_000)
        dealer.setsockopt(zmq.LINGER, 3000)  # flush what the peer takes, then give up
        dealer.connect(f"tcp://{LOCAL}:{listener.port}")
        for message in messages:
            dealer.send(encode(message))
        dealer.close()
        ctx.term()  # returns once everything was handed to the peer, or after the linger
        # The sender is gone: whatever arrives now was held by the listener's process (or by the
        # kernel's socket buffers: up to ~36 MB here, six of these messages).
        got = []
        while (message := listener.get(2.0)) is not None:
            got.append(message.transfer_id)
    finally:
        listener.close()
    held = len(got) * size
    # Slack: the one queued, ZMQ's few (a bounded count) and the kernel's buffers.
    assert len(got) <= 24, f"{len(got)} messages ({held / 2**20:.0f} MiB) held past a 1-byte bound"


def test_a_sender_that_cannot_open_a_socket_raises_a_transport_error_naming_the_peer() -> None:
    """NotifySender.send promises TransportError "when the peer's queue is full or ZMQ fails",
    and its callers (pusher._send, the puller's releases and abort_write) catch MoriioError
    only. But a socket ZMQ refuses to open (its context's socket limit reached -- each peer
    takes three: the DEALER and its monitor's pair -- or the context terminated) escapes as a
    raw zmq.ZMQError: the pusher's handler and the puller's release loop stop midway (the
    other ranks get no release and hold their blocks until abort_timeout)."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3)  # one peer's worth
    sender = NotifySender(_security(), context=ctx, linger_ms=0)
    try:
        sender.send(LOCAL, 5601, Release("tx-a"))
        with pytest.raises(TransportError, match="5602"):
            sender.send(LOCAL, 5602, Release("tx-b"))
    finally:
        sender.close()
        ctx.term()


def test_kv_transfer_params_survive_their_own_dict() -> None:
    """KvTransferParams.to_dict() is "the kv_transfer_params dict with vLLM's key names (None
    fields omitted ...)", but it leaves out remote_num_tokens and remote_prompt_digest even when
    set: parsed back, the answer differs, and so does what remote_answer_tag covers
    (answer_bytes), so a decode with the secret refuses the re-serialised answer."""
    from moriio_native.control.addressing import KvTransferParams, parse_kv_transfer_params

    params = KvTransferParams(
        transfer_id="tx-1",
        do_remote_prefill=True,
        remote_block_ids=((1, 2, 3),),
        remote_engine_id="p-0",
        remote_num_tokens=40,
        remote_prompt_digest="ab" * 32,
    )
    again = parse_kv_transfer_params(params.to_dict())
    assert again == params
    assert again.answer_bytes() == params.answer_bytes()


def test_a_checksum_request_the_schema_accepts_is_not_dropped_for_its_size() -> None:
    """A ChecksumRequest may carry MAX_BLOCK_IDS ids in block_ids and again in answer_ids
    (each id up to 5 bytes of msgpack): about 10 MB, which its constructor accepts. The
    handshake server drops anything over MAX_CHECKSUM_REQUEST_BYTES (8 MiB) without a word to
    the requester, who waits out its deadline and is told "no reply ... is the peer
    running?". The request should be answered (or refused at once, by its size)."""
    from moriio_native.control.channel import HandshakeServer, PolledRequests, ask_checksums
    from moriio_native.control.messages import ChecksumRequest, ChecksumResponse, HandshakeResponse
    from moriio_native.control.schema import MAX_BLOCK_IDS
    from moriio_native.errors import TransferTimeoutError

    ids = tuple(range(1 << 16, (1 << 16) + MAX_BLOCK_IDS))
    request = ChecksumRequest("d-0", "tx-big", ids, answer_ids=ids)
    outcome: list[object] = []
    with HandshakeServer(
        0,
        lambda _r: HandshakeResponse("p-0", b"meta"),
        _security(),
        bind_host=LOCAL,
        checksums=lambda r: ChecksumResponse(r.transfer_id, {}),
    ) as server:
        requests = PolledRequests(_security(), "big-check")
        try:
            ask_checksums(requests, LOCAL, server.port, request, timeout=3.0, done=outcome.append)
            deadline = time.monotonic() + WAIT
            while not outcome and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            requests.close()
        stats = server.stats()
    assert outcome, "no outcome"
    assert not isinstance(outcome[0], TransferTimeoutError), (outcome[0], stats)


def test_a_check_with_a_long_timeout_is_answered_and_kills_no_requester() -> None:
    """The vLLM config takes transfer_timeout up to a year (TransferSeconds), and the decode's
    hold checks and verify checks wait that long (PolledRequests, timeout=transfer_timeout).
    PolledRequests polls until the next deadline in milliseconds; past 2**31 ms (24.9 days)
    zmq's poll raises OverflowError, the requester's thread dies, every request outstanding on
    every server fails ("closed before the reply came") and every later ask raises "the
    requester is closed": each READ is recomputed for the rest of the process's life."""
    from moriio_native.control.channel import HandshakeServer, PolledRequests, ask_checksums
    from moriio_native.control.messages import ChecksumRequest, ChecksumResponse, HandshakeResponse

    thirty_days = 30 * 86400.0
    outcomes: list[object] = []
    with HandshakeServer(
        0,
        lambda _r: HandshakeResponse("p-0", b"meta"),
        _security(),
        bind_host=LOCAL,
        checksums=lambda r: ChecksumResponse(r.transfer_id, {}),
    ) as server:
        requests = PolledRequests(_security(), "long-timeout")
        try:
            for tid in ("tx-1", "tx-2"):
                ask_checksums(
                    requests,
                    LOCAL,
                    server.port,
                    ChecksumRequest("d-0", tid, (1,)),
                    timeout=thirty_days,
                    done=outcomes.append,
                )
                deadline = time.monotonic() + WAIT
                while len(outcomes) < (1 if tid == "tx-1" else 2) and time.monotonic() < deadline:
                    time.sleep(0.02)
        finally:
            requests.close()
    assert [type(o).__name__ for o in outcomes] == ["ChecksumResponse"] * 2, outcomes


def test_a_proxy_pinger_whose_socket_cannot_open_yet_pings_once_it_can() -> None:
    """ProxyPinger._run dials outside any try: a socket ZMQ refuses (its context's socket limit
    reached, say) raises in the thread, which dies with a traceback on stderr; the instance is
    never registered (or, on a redial, no longer pinged) and nothing tells its owner. "A missed
    ping is simply skipped": the pinger should dial again and ping once it can."""
    from moriio_native.control.addressing import ZmqAddress
    from moriio_native.control.channel import ProxyPinger
    from moriio_native.control.messages import ProxyRegistration

    registration = ProxyRegistration(
        "D", "127.0.0.1:8200", ZmqAddress(LOCAL, 7301, 7501), 1, 1, "READ"
    )
    proxy_ctx, ctx = zmq.Context(), zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3)  # a dial takes three: the DEALER and its monitor's pair
    blocker = ctx.socket(zmq.PAIR)  # ... and one is taken
    proxy = proxy_ctx.socket(zmq.ROUTER)
    proxy.setsockopt(zmq.LINGER, 0)
    port = proxy.bind_to_random_port(f"tcp://{LOCAL}")
    pinger = ProxyPinger(LOCAL, port, registration, interval=0.05, context=ctx)
    try:
        pinger.start()
        time.sleep(0.3)
        blocker.close(0)  # room again
        pinged = proxy.poll(5000)
    finally:
        pinger.stop()
        proxy.close(0)
        proxy_ctx.term()
        ctx.term()
    assert pinged, "the pinger never pinged once its socket could open"
