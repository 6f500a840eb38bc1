"""A handshake requester that stops reading its replies must not make the server hold them without
bound. Before the fix the server held up to ZMQ's default send high-water mark (1000 messages)
of replies per connection, each carrying the engine metadata (HandshakeServer's ROUTER set no
SNDHWM). Any peer that reaches the port could do this without a secret (the server answers
everyone then), on as many connections as it opens: with 256 KiB of metadata, one connection
held about 250 MB of the prefill's memory in this test's probe. A genuine requester has at most
MAX_OUTSTANDING_PER_SERVER (8) requests outstanding on one connection, so the server needs to
hold no more than that many replies."""

from __future__ import annotations

import time

import zmq

from moriio_native.control.channel import MAX_OUTSTANDING_PER_SERVER, HandshakeServer
from moriio_native.control.messages import HandshakeRequest, HandshakeResponse, encode
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist

META_BYTES = 256 << 10
REQUESTS = 1200
WAIT = 20.0


def test_replies_a_requester_does_not_read_are_not_held_without_bound() -> None:
    sec = ControlSecurity(MessageAuth(None), PeerAllowlist([]))
    meta = b"m" * META_BYTES
    server = HandshakeServer(
        0,
        lambda _req: HandshakeResponse("prefill", meta),
        sec,
        bind_host="127.0.0.1",
        own_thread=True,
    )
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.RCVHWM, 1)  # a peer that reads (almost) nothing
        dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{server.port}")
        for _ in range(REQUESTS):
            dealer.send(encode(HandshakeRequest("stranger")))
        deadline = time.monotonic() + WAIT
        while server.stats()["answered"] < REQUESTS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["answered"] == REQUESTS, server.stats()
        time.sleep(0.5)  # whatever the server still holds reaches its ZMQ queue
        held = 0
        while dealer.poll(500):
            dealer.recv_multipart()
            held += 1
    finally:
        dealer.close(linger=0)
        server.close()
    # The kernel's socket buffers (4 MiB send side) hold about 16 such replies; the server
    # itself should hold a few more than a genuine requester's outstanding requests at most.
    bound = 2 * MAX_OUTSTANDING_PER_SERVER + (4 << 20) // META_BYTES + 32
    assert held <= bound, (
        f"the server held {held} replies ({held * META_BYTES >> 20} MiB) for a requester that "
        f"did not read them (bound {bound})"
    )
