"""Control-plane sockets over real ZMQ on 127.0.0.1 (random free ports, bounded waits)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import zmq

from moriio_native.control import channel
from moriio_native.control.addressing import (
    ZmqAddress,
    format_request_id,
    parse_kv_transfer_params,
    peer_address_from_request_id,
)
from moriio_native.control.channel import (
    HandshakeServer,
    NotifyListener,
    NotifySender,
    PolledRequests,
    ProxyPinger,
    ask_checksums,
    fetch_metadata,
)
from moriio_native.control.messages import (
    PROTOCOL_VERSION,
    AbortWrite,
    ChecksumRequest,
    ChecksumResponse,
    HandshakeRejected,
    HandshakeRequest,
    HandshakeResponse,
    Misaddressed,
    ProxyRegistration,
    Release,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
    decode,
    encode,
    now_ms,
)
from moriio_native.control.ports import PortPlan, rank_port
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
    InvalidArgumentError,
    MoriioError,
    TransferTimeoutError,
    TransportError,
)
from net_support import free_port, free_ports
from process_support import run_exiting

WAIT = 5.0  # upper bound for anything that should arrive; never reached when things work
SECRET = "test-secret-0123456789"
LOCAL = "127.0.0.1"


def security(secret=None, allowed=("127.0.0.0/8",)):
    return ControlSecurity(MessageAuth(secret), PeerAllowlist(list(allowed)))


class CountingContext:
    """A zmq context wrapper that records every socket created through it."""

    def __init__(self):
        self.created = []

    def socket(self, socket_type):
        sock = zmq.Context.instance().socket(socket_type)
        self.created.append(socket_type)
        return sock


@pytest.fixture
def raw_dealer():
    socks = []

    def connect(port, secret=None):
        """A DEALER connected to ``port``; with ``secret``, past the listener's CURVE (as a
        holder of the secret), so that what it sends reaches the message checks."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        MessageAuth(secret).secure_dialer(sock)
        sock.connect(f"tcp://{LOCAL}:{port}")
        socks.append(sock)
        return sock

    yield connect
    for sock in socks:
        sock.close(linger=0)


def wait_until(predicate):
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ---- notify channel ---------------------------------------------------------------------------

NOTIFIES = [
    RemoteBlocks("tx-1", ((1, 2, 3), (9,)), "decode-0", decode_dp_rank=1, req_id="r"),
    WriteDone("tx-1", writer_rank=2, num_writers=4),
    WriteFailed("tx-2", reason="deferred write expired"),
    Release("tx-3", consumer_tp_size=2, consumer_tp_rank=1),
]


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
def test_every_notify_message_arrives_intact(secret):
    sec = security(secret)
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        for message in NOTIFIES:
            sender.send(LOCAL, listener.port, message)
        received = [listener.get(WAIT) for _ in NOTIFIES]
    assert received == NOTIFIES


def test_listener_survives_bad_messages_and_keeps_delivering(raw_dealer, caplog):
    sec = security(SECRET)
    auth = sec.auth
    good = Release("tx-ok")
    bad_frames = [
        [b"\xc1not msgpack"],  # no tag at all
        [b"\x00" * 100],  # no tag
        auth.seal(b"\xc1not msgpack"),  # tagged garbage
        auth.seal(msgpack.packb({"type": "nope", "transfer_id": "x"})),  # unknown type
        auth.seal(msgpack.packb({"type": "release"})),  # missing key
        auth.seal(msgpack.packb({"type": "release", "transfer_id": "x", "evil": 1})),
        auth.seal(b"\x91" * 5000 + b"\x00"),  # deeply nested
        auth.seal(b"x" * 3000),  # oversized for this listener (max 2048)
        [*auth.seal(encode(good)), b"third frame"],
        [encode(good), b"\x00" * 32],  # forged tag
        [encode(good), auth.seal(encode(Release("other")))[1]],  # tag of another message
    ]
    caplog.set_level(logging.WARNING, logger="moriio_native.control")
    with NotifyListener(0, sec, bind_host=LOCAL, max_message_bytes=2048) as listener:
        dealer = raw_dealer(listener.port, SECRET)
        for frames in bad_frames:
            dealer.send_multipart(frames)
        dealer.send_multipart(auth.seal(encode(good)))
        assert listener.get(WAIT) == good
        assert listener.drain() == []
        stats = listener.stats()
    assert stats["delivered"] == 1
    assert stats["dropped_auth"] == 4
    assert stats["dropped_malformed"] == len(bad_frames) - 4
    assert stats["received"] == len(bad_frames) + 1
    dropped_lines = [r.getMessage() for r in caplog.records if "dropped message" in r.getMessage()]
    assert len(dropped_lines) == len(bad_frames)
    assert all(LOCAL in line for line in dropped_lines)  # the sender is named


FLOOD = 200
# {"type": "handshake_request", "x": [[[...1,000 deep...]]]}: 1 KB no decoder can follow.
NESTED = b"\x82\xa4type\xb1handshake_request\xa1x" + b"\x91" * 1000 + b"\xc0"


def _warnings_for_a_flood(listener, payload, caplog, raw_dealer):
    """The warning lines ``listener`` logs for FLOOD copies of ``payload`` (all read)."""
    caplog.set_level(logging.WARNING, logger="moriio_native.control")
    dealer = raw_dealer(listener.port)
    for _ in range(FLOOD):
        dealer.send(payload)
    wait_until(lambda: listener.stats()["received"] == FLOOD)
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("server", [False, True], ids=["notify", "handshake"])
def test_a_flood_of_deeply_nested_messages_is_dropped_with_few_log_lines(
    server, raw_dealer, caplog
):
    """Each is a malformed drop, logged through the listener's rate limit (20 lines per 10 s:
    two windows at most while the flood is read), never a traceback per message."""
    sec = security()
    listener = (
        HandshakeServer(0, provider_for(), sec, bind_host=LOCAL, own_thread=True)
        if server
        else NotifyListener(0, sec, bind_host=LOCAL, own_thread=True)
    )
    with listener:
        lines = _warnings_for_a_flood(listener, NESTED, caplog, raw_dealer)
        assert listener.stats()["dropped_malformed"] == FLOOD
    assert len(lines) < FLOOD // 4
    assert "nested too deeply" in lines[0].getMessage()
    assert not any(r.exc_info for r in lines)


def test_a_flood_of_requests_of_another_version_is_refused_with_few_log_lines(raw_dealer, caplog):
    """Each gets the version error (so a genuine peer of another release learns why), but the
    log gets at most the rate limit's lines, not one per request (it was one per request)."""
    old = msgpack.packb({**msgpack.unpackb(encode(HandshakeRequest("d"))), "protocol_version": 2})
    with HandshakeServer(0, provider_for(), security(), bind_host=LOCAL, own_thread=True) as srv:
        lines = _warnings_for_a_flood(srv, old, caplog, raw_dealer)
        wait_until(lambda: srv.stats()["rejected"] == FLOOD)
    assert len(lines) < FLOOD // 4
    assert "protocol version 2 is not supported" in lines[0].getMessage()


def test_a_bug_reached_by_every_message_logs_through_the_rate_limit(
    raw_dealer, caplog, monkeypatch
):
    """An unexpected error handling a message drops it; its traceback is logged, but within
    the drop log's rate limit: a stranger may send whatever reaches the bug in a loop."""

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug in the listener")

    monkeypatch.setattr(channel, "decode", bug)
    with NotifyListener(0, security(), bind_host=LOCAL, own_thread=True) as listener:
        lines = _warnings_for_a_flood(listener, encode(Release("tx")), caplog, raw_dealer)
        assert listener.stats()["dropped_malformed"] == FLOOD
        monkeypatch.undo()
        raw_dealer(listener.port).send(encode(Release("tx-after")))
        assert listener.get(WAIT) == Release("tx-after")
    assert len(lines) < FLOOD // 4
    assert "a bug in the listener" in lines[0].getMessage()
    assert lines[0].exc_info is not None


def test_plain_listener_drops_tagged_messages(raw_dealer):
    with NotifyListener(0, security(None), bind_host=LOCAL) as listener:
        dealer = raw_dealer(listener.port)
        dealer.send_multipart(MessageAuth(SECRET).seal(encode(Release("tagged"))))
        dealer.send(encode(Release("plain")))
        assert listener.get(WAIT) == Release("plain")
        assert listener.stats()["dropped_auth"] == 1


def delivered(listener: NotifyListener, sender: NotifySender, messages: list[Any]) -> list[Any]:
    """Send ``messages``, then a marker: what ``listener`` delivered before the marker."""
    marker = Release("marker")
    for message in (*messages, marker):
        sender.send(LOCAL, listener.port, message)
    got = []
    while (message := listener.get(WAIT)) != marker:
        assert message is not None
        got.append(message)
    return got


def test_duplicates_are_delivered_once_but_fan_in_is_kept():
    sec = security()
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        got = delivered(
            listener,
            sender,
            [
                Release("tx-1", 2, 0),
                Release("tx-1", 2, 0),  # duplicate
                Release("tx-1", 2, 1),  # second consumer rank: a distinct ack
                RemoteBlocks("tx-2", ((1,),), "d"),
                RemoteBlocks("tx-2", ((1,),), "d"),  # duplicate
                WriteDone("tx-3", 0, 2),
                WriteDone("tx-3", 1, 2),
                WriteDone("tx-3", 1, 2),  # duplicate
            ],
        )
        assert got == [
            Release("tx-1", 2, 0),
            Release("tx-1", 2, 1),
            RemoteBlocks("tx-2", ((1,),), "d"),
            WriteDone("tx-3", 0, 2),
            WriteDone("tx-3", 1, 2),
        ]
        assert listener.stats()["dropped_duplicate"] == 3


def test_an_announcement_again_and_each_misaddressed_answer_are_not_copies():
    """After misaddressed the decode announces the same blocks to the new prefill process, and
    a process restarted once more answers that one misaddressed too: each is delivered (before,
    the second announcement was dropped as a copy of the first), and copies of each are not."""
    old, new, newer = "ab" * 16, "cd" * 16, "ef" * 16
    first = RemoteBlocks("tx-1", ((1,),), "d", prefill_incarnation=old)
    again = RemoteBlocks("tx-1", ((1,),), "d", prefill_incarnation=new)
    answered, answered_again = Misaddressed("tx-1", new, old), Misaddressed("tx-1", newer, new)
    sec = security()
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        sent = [first, again, again, answered, answered_again, answered]
        assert delivered(listener, sender, sent) == [first, again, answered, answered_again]
        assert listener.stats()["dropped_duplicate"] == 2


def test_messages_of_terminal_transfers_are_not_delivered():
    sec = security()
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        sender.send(LOCAL, listener.port, RemoteBlocks("tx-late", ((1,),), "d"))
        sender.send(LOCAL, listener.port, Release("sync-1"))
        assert listener.get(WAIT) == RemoteBlocks("tx-late", ((1,),), "d")
        assert listener.get(WAIT) == Release("sync-1")
        sender.send(LOCAL, listener.port, Release("tx-queued"))
        sender.send(LOCAL, listener.port, Release("sync-2"))
        # Wait until both are queued, then end tx-queued before anyone drained it.
        wait_until(lambda: listener.stats()["delivered"] == 4)
        listener.mark_terminal("tx-queued")
        listener.mark_terminal("tx-late")
        sender.send(LOCAL, listener.port, WriteDone("tx-late"))  # after the transfer ended
        sender.send(LOCAL, listener.port, Release("sync-3"))
        assert listener.get(WAIT) == Release("sync-2")
        assert listener.get(WAIT) == Release("sync-3")
        assert listener.drain() == []
        assert listener.stats()["dropped_late"] == 2
        # An abort_write is answered even for a finished transfer (the decode waits for it).
        abort = AbortWrite("tx-late", "d0", LOCAL, 7301, 7401)
        sender.send(LOCAL, listener.port, abort)
        assert listener.get(WAIT) == abort
        # So is another decode rank's first remote_blocks (the writer ended before it came:
        # the rank waits for its write_failed); a copy of one seen before is still a duplicate.
        announced = RemoteBlocks("tx-late", ((2,),), "d1")
        sender.send(LOCAL, listener.port, RemoteBlocks("tx-late", ((1,),), "d"))
        sender.send(LOCAL, listener.port, announced)
        assert listener.get(WAIT) == announced
        assert listener.stats()["dropped_duplicate"] == 1


def test_signed_replays_and_moved_tags_are_rejected(raw_dealer):
    """With a secret: a genuinely signed message sent again is delivered once (a copy of it
    while the transfer runs is a duplicate, after the transfer ended it is late); its tag on
    another transfer's payload fails authentication; a message signed with another secret fails
    too. None of them reaches the protocol core. (Sent over a connection that holds the
    secret's CURVE keys: without them nothing is read at all, test_control_flood.py.)"""
    sec = security(SECRET)
    auth = MessageAuth(SECRET)
    genuine = Release("tx-a", consumer_tp_size=2, consumer_tp_rank=1)
    payload, tag = auth.seal(encode(genuine))
    moved = encode(Release("tx-b", consumer_tp_size=2, consumer_tp_rank=1))
    with NotifyListener(0, sec, bind_host=LOCAL) as listener:
        wire = raw_dealer(listener.port, SECRET)
        wire.send_multipart([payload, tag])
        assert listener.get(WAIT) == genuine
        wire.send_multipart([payload, tag])  # replayed while the transfer runs
        wire.send_multipart([moved, tag])  # cross-request: the tag of tx-a on tx-b
        wire.send_multipart(list(MessageAuth("another secret, 0123456789").seal(moved)))
        wait_until(lambda: listener.stats()["received"] == 4)
        listener.mark_terminal("tx-a")
        wire.send_multipart([payload, tag])  # replayed after the transfer ended
        wait_until(lambda: listener.stats()["received"] == 5)
        stats = listener.stats()
        counted = ("delivered", "dropped_duplicate", "dropped_late", "dropped_auth")
        assert tuple(stats[k] for k in counted) == (1, 1, 1, 2)
        assert listener.drain() == []


def test_refused_peer_gets_no_socket_and_no_message():
    ctx = CountingContext()
    refusing = security(allowed=["10.0.0.0/8"])
    with NotifyListener(0, security(), bind_host=LOCAL) as listener:
        sender = NotifySender(refusing, context=ctx)
        with pytest.raises(PeerNotAllowedError, match=r"127\.0\.0\.1.*release of transfer tx-1"):
            sender.send(LOCAL, listener.port, Release("tx-1"))
        assert ctx.created == []
        sender.close()
        # The listener saw nothing from the refused sender: the first message it ever
        # receives is one sent afterwards by an allowed sender.
        with NotifySender(security()) as allowed:
            allowed.send(LOCAL, listener.port, Release("tx-2"))
            assert listener.get(WAIT) == Release("tx-2")
        assert listener.stats()["received"] == 1


def test_full_listener_pushes_back_instead_of_dropping():
    sec = security()
    n = 50
    with (
        NotifyListener(0, sec, bind_host=LOCAL, max_pending=2) as listener,
        NotifySender(sec) as sender,
    ):
        for i in range(n):
            sender.send(LOCAL, listener.port, Release(f"tx-{i}"))
        got = [listener.get(WAIT) for _ in range(n)]
    assert got == [Release(f"tx-{i}") for i in range(n)]


def test_a_listener_stops_reading_past_its_byte_bound_until_drained():
    """Before: the queue was bounded by count only (65,536 messages, each up to 8 MiB), so a
    consumer that fell behind let it hold up to 512 GiB of payloads. Now the listener stops
    reading while its queued payloads are over ``max_pending_bytes`` (the message that passes
    the bound is queued), and reads on once the consumer drains: nothing is lost."""
    sec = security()
    messages = [RemoteBlocks(f"tx-{i:02d}", (tuple(range(1000, 1500)),), "d-0") for i in range(12)]
    size = len(encode(messages[0]))  # each the same
    with (
        NotifyListener(0, sec, bind_host=LOCAL, max_pending_bytes=3 * size) as listener,
        NotifySender(sec) as sender,
    ):
        for message in messages:
            sender.send(LOCAL, listener.port, message)
        wait_until(lambda: listener.stats()["queued_bytes"] > 3 * size)
        time.sleep(0.3)  # three of the listener's poll slices: time to read on, which it must not
        stats = listener.stats()
        assert (stats["received"], stats["queued"], stats["queued_bytes"]) == (4, 4, 4 * size)
        got = [listener.get(WAIT) for _ in messages]
        assert listener.stats()["queued_bytes"] == 0
    assert got == messages


def test_evicted_sender_sockets_still_flush_their_messages():
    sec = security()
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as a,
        NotifyListener(0, sec, bind_host=LOCAL) as b,
        NotifySender(sec, max_peers=1) as sender,
    ):
        for i in range(10):
            sender.send(LOCAL, a.port, Release(f"a-{i}"))
            sender.send(LOCAL, b.port, Release(f"b-{i}"))
        got_a = sorted(m.transfer_id for m in (a.get(WAIT) for _ in range(10)) if m)
        got_b = sorted(m.transfer_id for m in (b.get(WAIT) for _ in range(10)) if m)
    assert got_a == sorted(f"a-{i}" for i in range(10))
    assert got_b == sorted(f"b-{i}" for i in range(10))


def test_sender_reports_a_full_queue_instead_of_blocking():
    port = free_port()  # nobody listens there, so messages pile up in the socket's queue
    with (
        NotifySender(security(), send_hwm=1) as sender,
        pytest.raises(TransportError, match="queue full"),
    ):
        for i in range(100_000):
            sender.send(LOCAL, port, Release(f"tx-{i}"))


def test_sender_after_close_and_bad_input():
    sender = NotifySender(security())
    with pytest.raises(Exception, match="notify port"):
        sender.send(LOCAL, 0, Release("t"))
    with pytest.raises(Exception, match="not a notify message"):
        sender.send(LOCAL, 5555, HandshakeRequest("x"))  # type: ignore[arg-type]
    sender.close()
    with pytest.raises(FailedPreconditionError):
        sender.send(LOCAL, 5555, Release("t"))


def test_close_frees_the_port_and_the_last_close_ends_the_reading_thread():
    listener = NotifyListener(0, security(), bind_host=LOCAL)
    port = listener.port
    thread = listener.reader
    assert thread is not None and thread.is_alive()
    listener.close()
    listener.close()  # idempotent
    with NotifyListener(port, security(), bind_host=LOCAL) as again:
        assert again.port == port
    # Nothing else in this test process is attached: the hub's thread ends.
    wait_until(lambda: not thread.is_alive())


# ---- the listeners' hub ------------------------------------------------------------------------


def test_the_listeners_of_a_process_are_read_by_one_thread():
    """One thread reads every listener of the process (a flood on several ports wakes one
    thread, not one per port); each still delivers or answers what it gets."""
    sec = security()
    threads_before = threading.active_count()
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as a,
        NotifyListener(0, sec, bind_host=LOCAL) as b,
        HandshakeServer(0, provider_for(), sec, bind_host=LOCAL) as server,
        NotifySender(sec) as sender,
    ):
        assert a.reader is b.reader is server.reader
        assert threading.active_count() <= threads_before + 1
        sender.send(LOCAL, a.port, Release("t-a"))
        sender.send(LOCAL, b.port, Release("t-b"))
        assert (a.get(WAIT), b.get(WAIT)) == (Release("t-a"), Release("t-b"))
        reply = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=sec, requester_engine_id="d0"
        )
        assert reply.engine_id == "prefill-0"


def test_a_listener_held_back_by_its_full_queue_holds_back_no_other():
    sec = security()
    with (
        NotifyListener(0, sec, bind_host=LOCAL, max_pending=1) as full,
        NotifyListener(0, sec, bind_host=LOCAL) as other,
        NotifySender(sec) as sender,
    ):
        for i in range(5):
            sender.send(LOCAL, full.port, Release(f"f-{i}"))
        wait_until(lambda: full.stats()["queued"] == 1)
        sender.send(LOCAL, other.port, Release("o"))
        assert other.get(WAIT) == Release("o")
        # The consumer's room wakes the hub: the held-back messages follow, in order.
        assert [full.get(WAIT) for _ in range(5)] == [Release(f"f-{i}") for i in range(5)]


def test_a_slow_checksum_answer_delays_no_notification():
    """A checksum answer reads the transfer's blocks (seconds for a long prompt on a host):
    the server computes it on its answering pool, and reads on a thread of its own (its
    at-once answers take the core's lock), so notifications go on meanwhile."""
    sec = security()
    answer = threading.Event()

    def slow_checksums(request: ChecksumRequest) -> ChecksumResponse:
        answer.wait(WAIT)
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={"L0": b"\0" * 8})

    with (
        HandshakeServer(
            0, provider_for(), sec, bind_host=LOCAL, checksums=slow_checksums
        ) as server,
        NotifyListener(0, sec, bind_host=LOCAL) as listener,
        NotifySender(sec) as sender,
        ThreadPoolExecutor(1) as pool,
    ):
        assert server.reader is not listener.reader
        asked = pool.submit(_fetch, server.port, "t1", sec)
        wait_until(lambda: server.stats()["received"] == 1)
        sender.send(LOCAL, listener.port, Release("t2"))
        try:
            assert listener.get(WAIT / 2) == Release("t2")
            assert not asked.done()
        finally:
            answer.set()
        assert asked.result(WAIT).transfer_id == "t1"


def test_a_waiting_checksum_answer_holds_up_no_handshake_and_no_other_check():
    """A checksum answer may wait long (a hold check for a send task vLLM hands over late, up
    to SEND_TASK_WAIT_S; checksums of a long prompt's blocks): the server answers handshakes
    and other checks meanwhile. It once answered on its reading thread, so a handshake to a
    prefill waited behind every such answer."""
    sec = security()
    release = threading.Event()

    def answer(request: ChecksumRequest) -> ChecksumResponse:
        if request.transfer_id == "waits":
            release.wait(WAIT)
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    with (
        HandshakeServer(0, provider_for(), sec, bind_host=LOCAL, checksums=answer) as server,
        ThreadPoolExecutor(1) as pool,
    ):
        waiting = pool.submit(_fetch, server.port, "waits", sec)
        wait_until(lambda: server.stats()["received"] == 1)
        try:
            reply = fetch_metadata(
                LOCAL, server.port, timeout=WAIT / 2, security=sec, requester_engine_id="d0"
            )
            assert reply.engine_id == "prefill-0"
            assert _fetch(server.port, "other", sec, WAIT / 2).transfer_id == "other"
            assert not waiting.done()
        finally:
            release.set()
        assert waiting.result(WAIT).transfer_id == "waits"
    assert server.stats()["answered"] == 3


@pytest.mark.parametrize("deferred", [False, True], ids=["no-when-ready", "when-ready"])
def test_an_answer_given_at_once_skips_the_pool_and_the_rest_go_to_it(deferred):
    """``at_once`` answers what needs no wait (a prefill's hold check of a transfer it knows)
    on the reading thread, saving the hop to the pool; what it leaves (None) the pool answers,
    and what it refuses is refused. With ``when_ready``, a request it let go is asked of
    ``at_once`` again on the reading thread (a hold check whose send task came meanwhile: no
    hop to the pool either), and goes to the pool only if it still has no answer."""
    sec = security()
    answered_on: dict[str, str] = {}
    asked_at_once: list[str] = []

    def record(request: ChecksumRequest) -> ChecksumResponse:
        answered_on[request.transfer_id] = threading.current_thread().name
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    def at_once(request: ChecksumRequest) -> ChecksumResponse | None:
        tid = request.transfer_id
        first_ask = tid not in asked_at_once
        asked_at_once.append(tid)
        if tid == "refused":
            raise FailedPreconditionError("hold check of transfer refused: no longer held")
        if tid == "later" or (tid == "known-late" and first_ask):
            return None
        return record(request)

    def when_ready(_request: ChecksumRequest, go: Any) -> None:
        go()  # its send task came at once

    with HandshakeServer(
        0,
        provider_for(),
        sec,
        bind_host=LOCAL,
        checksums=record,
        at_once=at_once,
        when_ready=when_ready if deferred else None,
    ) as server:
        for tid in ("now", "later", "known-late"):
            assert _fetch(server.port, tid, sec).transfer_id == tid
        with pytest.raises(FailedPreconditionError, match="no longer held"):
            _fetch(server.port, "refused", sec)
        assert answered_on["now"] == server.reader.name
        assert answered_on["later"].startswith("moriio-native-checksum-answer")
        if deferred:
            assert answered_on["known-late"] == server.reader.name
            assert asked_at_once.count("later") == asked_at_once.count("known-late") == 2
        else:
            assert answered_on["known-late"].startswith("moriio-native-checksum-answer")


def test_requests_waiting_to_be_ready_hold_no_thread_and_go_when_told():
    """A prefill's check that came before its transfer's send task waits for it (``when_ready``)
    without holding a pool thread: more of them than the pool has threads wait at once, the
    server answers others meanwhile, and each is answered once told it may go."""
    sec = security()
    waiting: dict[str, Any] = {}
    ready = threading.Condition()

    def when_ready(request: ChecksumRequest, go: Any) -> None:
        if request.transfer_id.startswith("late"):
            with ready:
                waiting[request.transfer_id] = go
                ready.notify_all()
        else:
            go()

    many = 3 * channel.CHECKSUM_ANSWER_THREADS
    late = [f"late-{i}" for i in range(many)]
    with (
        HandshakeServer(
            0,
            provider_for(),
            sec,
            bind_host=LOCAL,
            checksums=_echo_checksums,
            when_ready=when_ready,
        ) as server,
        ThreadPoolExecutor(many) as pool,
    ):
        asked = [pool.submit(_fetch, server.port, tid, sec) for tid in late]
        with ready:
            assert ready.wait_for(lambda: len(waiting) == many, WAIT)
        assert _fetch(server.port, "known", sec, WAIT / 2).transfer_id == "known"
        assert not any(f.done() for f in asked)
        for tid in late:
            waiting[tid]()
        assert [f.result(WAIT).transfer_id for f in asked] == late


def test_a_checksum_answer_never_ending_does_not_hold_up_the_process_exit(tmp_path):
    """The answering pool's threads are daemons: a process whose answer never ends (a block
    read stuck, a wait nothing ends) still exits, once the pool's exit wait is over (made
    0.5 s here; 10 s by default, for a checksum being computed). A ThreadPoolExecutor's
    workers are joined at exit: the process hung."""
    done = run_exiting(
        tmp_path / "exits.py",
        """
            import threading
            from moriio_native.control import channel
            from moriio_native.control.channel import HandshakeServer, PolledRequests
            from moriio_native.control.channel import ask_checksums
            from moriio_native.control.messages import ChecksumRequest, HandshakeResponse
            from moriio_native.control.security import ControlSecurity, MessageAuth
            from moriio_native.control.security import PeerAllowlist

            sec = ControlSecurity(MessageAuth(None), PeerAllowlist(["127.0.0.0/8"]))
            asked = threading.Event()

            def stuck(request):
                asked.set()
                threading.Event().wait()

            def metadata(request):
                return HandshakeResponse("p", b"m", 0, 0, 1, 1, "READ")

            channel.COMPUTING_EXIT_WAIT_S = 0.5
            server = HandshakeServer(0, metadata, sec, bind_host="127.0.0.1", checksums=stuck)
            request = ChecksumRequest(requester_engine_id="d", transfer_id="t", block_ids=(1,))
            requests = PolledRequests(sec, "asker")
            ask_checksums(
                requests, "127.0.0.1", server.port, request, timeout=60.0, done=print
            )
            assert asked.wait(10)
            print("exiting", flush=True)
            """,
    )
    assert "exiting" in done.stdout


def test_a_request_cut_by_its_context_terminating_leaves_the_context_free_to_end():
    """A request in flight when its ZMQ context is terminated (an exit handler ending the
    shared context while a pool thread still asks a peer that never answers) fails, and
    closes its socket and its handshake monitor: the monitor's close raised once the context
    was terminated, the socket stayed open, and term() waited for ever."""
    own = zmq.Context()
    silent = socket.socket()
    silent.bind((LOCAL, 0))
    silent.listen(4)
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            fetch_metadata(
                LOCAL,
                silent.getsockname()[1],
                timeout=WAIT,
                security=security(),
                requester_engine_id="d0",
                context=own,
            )
        except BaseException as exc:
            failed.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    try:
        asking.start()
        silent.settimeout(WAIT)
        accepted, _ = silent.accept()  # the request is in flight: connected, never answered
        terminating = threading.Thread(target=own.term, daemon=True)
        terminating.start()
        terminating.join(WAIT)
        assert not terminating.is_alive(), "term() waits on a socket the request left open"
        asking.join(WAIT)
        assert failed and isinstance(failed[0], zmq.ContextTerminated | MoriioError)
        accepted.close()
    finally:
        silent.close()


def test_checksum_requests_past_the_pending_bound_are_refused_at_once_by_name(monkeypatch):
    """Checksum answers waiting at once are bounded (each holds a queue slot, most a thread):
    past the bound a request is refused at once, naming the transfer and why, and the ones
    waiting are answered when they can."""
    monkeypatch.setattr(channel, "MAX_PENDING_CHECKSUM_ANSWERS", 2)
    sec = security()
    release = threading.Event()

    def answer(request: ChecksumRequest) -> ChecksumResponse:
        release.wait(WAIT)
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    with (
        HandshakeServer(0, provider_for(), sec, bind_host=LOCAL, checksums=answer) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        waiting = [pool.submit(_fetch, server.port, t, sec) for t in ("w1", "w2")]
        wait_until(lambda: server.stats()["received"] == 2)
        try:
            with pytest.raises(FailedPreconditionError, match=r"transfer t3 not answered: .*busy"):
                _fetch(server.port, "t3", sec, WAIT / 2)
        finally:
            release.set()
        assert sorted(f.result(WAIT).transfer_id for f in waiting) == ["w1", "w2"]
        assert server.stats()["rejected"] == 1


def _checksum_request(tid: str) -> ChecksumRequest:
    return ChecksumRequest(requester_engine_id="d0", transfer_id=tid, block_ids=(1,))


def _echo_checksums(request: ChecksumRequest) -> ChecksumResponse:
    return ChecksumResponse(transfer_id=request.transfer_id, checksums={})


def _fetch(port, tid, sec, timeout=WAIT):
    """``tid``'s checksums from the server at ``port``, waited for here; raises the error."""
    requests = PolledRequests(sec, "test-checksums")
    outcome = []
    came = threading.Event()

    def done(got):
        outcome.append(got)
        came.set()

    try:
        ask_checksums(requests, LOCAL, port, _checksum_request(tid), timeout=timeout, done=done)
        assert came.wait(timeout + WAIT)
    finally:
        requests.close()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def test_a_listener_closed_by_a_handler_on_the_hubs_thread_frees_its_port(caplog):
    caplog.set_level(logging.ERROR, logger="moriio_native.control")
    sec = security()
    other = NotifyListener(0, sec, bind_host=LOCAL)
    answer = provider_for()

    def closing_provider(request: HandshakeRequest) -> HandshakeResponse:
        other.close()  # on the hub's thread, which reads `other` too
        return answer(request)

    with HandshakeServer(0, closing_provider, sec, bind_host=LOCAL) as server:
        reply = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=sec, requester_engine_id="d0"
        )
        assert reply.engine_id == "prefill-0"
        with NotifyListener(other.port, sec, bind_host=LOCAL) as again, NotifySender(sec) as sender:
            sender.send(LOCAL, again.port, Release("t"))
            assert again.get(WAIT) == Release("t")
    assert not caplog.records  # the closed socket was not read after its close


def test_a_forked_child_reads_its_listeners_on_its_own_thread_and_pipe():
    """Before: the child kept the parent's wake pipe, so each process read the other's
    wake-ups (an attach or close then waited for the poll's timeout)."""
    sec = security()
    with NotifyListener(0, sec, bind_host=LOCAL) as parent, NotifySender(sec) as sender:
        parent_pipe = os.fstat(parent._hub._wake_read).st_ino
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if all is well
            ok = False
            try:
                with NotifyListener(0, sec, bind_host=LOCAL) as child:
                    own_pipe = os.fstat(child._hub._wake_read).st_ino != parent_pipe
                    with NotifySender(sec) as child_sender:
                        child_sender.send(LOCAL, child.port, Release("in the child"))
                        ok = own_pipe and child.get(WAIT) == Release("in the child")
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        sender.send(LOCAL, parent.port, Release("in the parent"))
        assert parent.get(WAIT) == Release("in the parent")


def test_a_listener_of_its_own_drained_after_its_close_touches_no_closed_pipe():
    """Review: the private hub's pipe was closed with the listener, and a consumer that made
    room in the held-back queue afterwards woke the hub through it (EBADF, or a write into
    whatever descriptor took its number)."""
    sec = security()
    listener = NotifyListener(0, sec, bind_host=LOCAL, max_pending=1, own_thread=True)
    with NotifySender(sec) as sender:
        for i in range(3):
            sender.send(LOCAL, listener.port, Release(f"t-{i}"))
        wait_until(lambda: listener.stats()["queued"] == 1)
        listener.close()
    assert listener.drain() == [Release("t-0")]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_handler_that_ends_the_reading_thread_gets_it_replaced():
    """Review: a provider that raised SystemExit ended the hub's thread, and nothing of the
    process was read again (every close then waited its timeout)."""
    sec = security()
    calls = []
    answer = provider_for()

    def exiting_once(request: HandshakeRequest) -> HandshakeResponse:
        calls.append(request)
        if len(calls) == 1:
            raise SystemExit("a handler that exits")
        return answer(request)

    with (
        HandshakeServer(0, exiting_once, sec, bind_host=LOCAL) as server,
        NotifyListener(0, sec, bind_host=LOCAL) as listener,
        NotifySender(sec) as sender,
    ):
        with pytest.raises(TransferTimeoutError):
            fetch_metadata(LOCAL, server.port, timeout=0.5, security=sec, requester_engine_id="d")
        reply = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=sec, requester_engine_id="d"
        )
        assert reply.engine_id == "prefill-0"
        sender.send(LOCAL, listener.port, Release("t"))
        assert listener.get(WAIT) == Release("t")


def test_a_terminated_context_stops_only_its_own_listener():
    """Review: a poll that failed on one socket (its context terminated) failed every round,
    so no listener was read again and the context's term() waited for ever."""
    sec = security()
    own = zmq.Context()
    doomed = NotifyListener(0, sec, bind_host=LOCAL, context=own)
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        terminating = threading.Thread(target=own.term, daemon=True)
        terminating.start()
        terminating.join(WAIT)
        assert not terminating.is_alive()  # the hub released the doomed socket
        sender.send(LOCAL, listener.port, Release("t"))
        assert listener.get(WAIT) == Release("t")
    doomed.close()


def test_checksum_servers_leave_no_descriptors_or_threads_behind():
    """A server that answered checksums leaves nothing behind once closed: its answering
    pool's threads and its own reading thread end, and that hub's wake pipe is closed."""
    sec = security()

    def open_ask_and_close() -> None:
        with HandshakeServer(
            0, provider_for(), sec, bind_host=LOCAL, checksums=_echo_checksums
        ) as server:
            assert _fetch(server.port, "t", sec).transfer_id == "t"

    open_ask_and_close()  # ZMQ's own descriptors, opened once per context
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(10):
        open_ask_and_close()
    # ZMQ's I/O thread closes a closed socket's connection after close() returned: a loaded
    # machine (CI) saw the last round's still open when counted at once.
    wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds + 2)
    wait_until(lambda: threading.active_count() <= threads)


def test_port_in_use_is_a_transport_error():
    with (
        NotifyListener(0, security(), bind_host=LOCAL) as listener,
        pytest.raises(TransportError, match="cannot bind"),
    ):
        NotifyListener(listener.port, security(), bind_host=LOCAL)


# ---- handshake --------------------------------------------------------------------------------


def provider_for(engine_id="prefill-0", metadata=b"\x01native-metadata\x00" * 100):
    def provide(request):
        return HandshakeResponse(engine_id, metadata, 1, 3, 2, 4, "READ")

    return provide


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
def test_fetch_metadata_round_trip(secret):
    server_sec = security(secret, allowed=())
    with HandshakeServer(0, provider_for(), server_sec, bind_host=LOCAL) as server:
        assert not server_sec.allowlist.check(LOCAL)
        reply = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=security(secret), requester_engine_id="d0"
        )
        assert reply.engine_id == "prefill-0"
        assert reply.engine_metadata == b"\x01native-metadata\x00" * 100
        assert (reply.dp_rank, reply.tp_rank, reply.dp_size, reply.tp_size) == (1, 3, 2, 4)
        # The server learned the requester: it may now notify it.
        assert server_sec.allowlist.check(LOCAL)
        assert server.stats()["answered"] == 1


def test_a_handshake_answer_states_when_the_server_answered():
    """``answered_ms`` is the server's clock when it answered (the provider's answer says 0):
    between the requester's clock before and after the request, on one host."""
    with HandshakeServer(0, provider_for(), security(), bind_host=LOCAL) as server:
        before = now_ms()
        reply = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=security(), requester_engine_id="d0"
        )
        assert before <= reply.answered_ms <= now_ms()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, 10**400, "1"])
def test_a_fetch_with_a_bad_timeout_is_refused_naming_it(timeout):
    """An int beyond any float raised OverflowError instead (found by a review)."""
    with pytest.raises(InvalidArgumentError, match="timeout"):
        fetch_metadata(LOCAL, 1, timeout=timeout, security=security(), requester_engine_id="d0")


def test_fetch_from_dead_port_times_out():
    with pytest.raises(TransferTimeoutError, match="no reply within"):
        fetch_metadata(
            LOCAL, free_port(), timeout=0.3, security=security(), requester_engine_id="d0"
        )


def test_fetch_to_refused_host_opens_no_socket():
    ctx = CountingContext()
    with pytest.raises(PeerNotAllowedError, match="handshake"):
        fetch_metadata(
            "203.0.113.9",
            6301,
            timeout=1.0,
            security=security(allowed=["10.0.0.0/8"]),
            requester_engine_id="d0",
            context=ctx,
        )
    assert ctx.created == []


def test_wrong_secret_gets_no_answer_and_server_keeps_serving(raw_dealer):
    with HandshakeServer(0, provider_for(), security(SECRET), bind_host=LOCAL) as server:
        # Another secret: every connection fails ZMQ's CURVE handshake, which the error names.
        with pytest.raises(TransferTimeoutError, match=r"ZMQ's handshake failed .* auth_secret"):
            fetch_metadata(
                LOCAL,
                server.port,
                timeout=0.5,
                security=security("another-secret-0123456789"),
                requester_engine_id="intruder",
            )
        # Over one connection past CURVE (so in order): untagged, wrongly tagged, then a good
        # request.
        dealer = raw_dealer(server.port, SECRET)
        untagged, wrong, good = (HandshakeRequest(n) for n in ("a", "b", "c"))
        dealer.send(encode(untagged))
        dealer.send_multipart(MessageAuth("another-secret-0123456789").seal(encode(wrong)))
        dealer.send_multipart(MessageAuth(SECRET).seal(encode(good)))
        assert dealer.poll(int(WAIT * 1000))
        frames = dealer.recv_multipart()
        reply = decode(
            MessageAuth(SECRET).open(frames[1:]), (HandshakeResponse,), max_bytes=1 << 20
        )
        assert reply.nonce == good.nonce  # only the good request was answered
        assert not dealer.poll(200)  # and nothing else
        stats = server.stats()
    assert stats["answered"] == 1 and stats["dropped_auth"] >= 2


@pytest.mark.parametrize(("server_secret", "client_secret"), [(SECRET, None), (None, SECRET)])
def test_a_secret_on_one_side_only_fails_the_handshake_at_once_naming_it(
    server_secret, client_secret
):
    """A secret on one side only: ZMQ's handshake finds different security mechanisms (CURVE
    and NULL), and nothing can ever pass. Before: the requester waited out its timeout and got
    "no reply"; now it gets an AuthenticationError naming the cause as soon as ZMQ reports
    it (here the timeout is a minute, so a timeout would fail the test)."""
    with HandshakeServer(0, provider_for(), security(server_secret), bind_host=LOCAL) as server:
        with pytest.raises(AuthenticationError, match="one side has an auth_secret"):
            fetch_metadata(
                LOCAL,
                server.port,
                timeout=60,
                security=security(client_secret),
                requester_engine_id="d",
            )
        assert server.stats()["received"] == 0


def test_a_proxy_pinger_whose_handshakes_fail_says_why(caplog):
    """A proxy with a secret and an instance that does not sign its pings (or the reverse):
    every ping fails ZMQ's handshake, so the proxy never lists the instance and its listener
    sees nothing to log. Before: nothing was logged on either side (found by a review); now the
    pinger warns, naming the cause, and does so once for a run of failures."""
    proxy = zmq.Context.instance().socket(zmq.ROUTER)
    proxy.setsockopt(zmq.LINGER, 0)
    MessageAuth(SECRET).secure_listener(proxy)
    port = proxy.bind_to_random_port(f"tcp://{LOCAL}")
    caplog.set_level(logging.WARNING, logger="moriio_native.control")
    try:
        with ProxyPinger(LOCAL, port, REGISTRATION, interval=0.05):
            wait_until(lambda: "proxy registration to" in caplog.text)
            time.sleep(0.5)  # more failures: no more lines
    finally:
        proxy.close(linger=0)
    lines = [r.getMessage() for r in caplog.records if "proxy registration to" in r.getMessage()]
    assert len(lines) == 1 and "one side has an auth_secret" in lines[0], lines


def _router(secret, port=0):
    """A bare ROUTER on 127.0.0.1 (``port`` 0: any), CURVE with ``secret``'s keys when given."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    MessageAuth(secret).secure_listener(sock)
    if port:
        sock.bind(f"tcp://{LOCAL}:{port}")
        return sock, port
    return sock, sock.bind_to_random_port(f"tcp://{LOCAL}")


def test_a_proxy_pinger_dials_again_once_a_misconfigured_proxy_is_fixed():
    """A signing pinger meets a proxy without the secret (different security mechanisms):
    ZMQ ends that connection for good, with no reconnect. Before: the pinger never reached the
    proxy again, even after it was restarted with the secret on the same port, and logged
    nothing more (found by a review). Now it dials again a second after such a failure."""
    wrong, port = _router(None)
    with ProxyPinger(LOCAL, port, REGISTRATION, interval=0.1, auth=MessageAuth(SECRET)):
        time.sleep(1.0)  # the mismatch happened
        wrong.close(linger=0)
        time.sleep(0.2)
        right, _ = _router(SECRET, port)
        try:
            assert right.poll(int(WAIT * 1000)), "no ping after the proxy was fixed"
        finally:
            right.close(linger=0)


def test_a_notify_sender_dials_again_once_a_misconfigured_peer_is_fixed(caplog):
    """The same for notify messages: a sender with a secret whose peer listener had none kept
    its dead connection (ZMQ does not reconnect after a protocol failure), so every later
    message to that peer queued until the send queue was full, even once the peer was
    restarted with the secret. Now a send that finds its connection given up dials again (and
    says why, within the log's rate limit)."""
    caplog.set_level(logging.WARNING, logger="moriio_native.control")
    wrong, port = _router(None)
    failed = wrong.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    with NotifySender(security(SECRET)) as sender:
        sender.send(LOCAL, port, Release("tx-1"))
        assert failed.poll(int(WAIT * 1000)), "the mismatch never happened"
        wrong.disable_monitor()
        failed.close(linger=0)
        wrong.close(linger=0)
        time.sleep(0.2)
        with NotifyListener(port, security(SECRET), bind_host=LOCAL) as listener:
            sender.send(LOCAL, port, Release("tx-2"))
            assert listener.get(WAIT) == Release("tx-2")
    assert "dialling again" in caplog.text and "one side has an auth_secret" in caplog.text


def _dealer_from(source, port, secret=None):
    """A DEALER connected to ``port`` from the local address ``source`` (``secret``: with its
    CURVE keys)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    MessageAuth(secret).secure_dialer(sock)
    sock.connect(f"tcp://{source}:0;{LOCAL}:{port}")
    return sock


def test_a_replayed_or_stale_signed_handshake_request_is_dropped_and_not_learned(
    raw_dealer, caplog
):
    """A genuine request replayed, or an old one, from another address: neither is answered
    (no signed metadata for it) nor is that address learned into the allowlist. (Sent past
    CURVE: an eavesdropper without the secret can neither read a request off the wire nor
    connect to replay it.)"""
    caplog.set_level(logging.WARNING, logger="moriio_native.control")
    auth = MessageAuth(SECRET)
    captured = auth.seal(encode(HandshakeRequest("decode-0")))
    an_hour_ago = int(time.time() * 1000) - 3_600_000
    old = auth.seal(encode(HandshakeRequest("decode-0", sent_ms=an_hour_ago)))
    server_sec = security(SECRET, allowed=())
    with HandshakeServer(0, provider_for(), server_sec, bind_host=LOCAL) as server:
        genuine = raw_dealer(server.port, SECRET)
        genuine.send_multipart(captured)
        assert genuine.poll(int(WAIT * 1000))  # the genuine exchange is answered
        replayer = _dealer_from("127.0.0.2", server.port, SECRET)
        try:
            replayer.send_multipart(captured)
            replayer.send_multipart(old)
            replayer.send_multipart(auth.seal(b"\xc1"))  # tagged but malformed: a marker
            wait_until(lambda: server.stats()["dropped_malformed"] == 1)
        finally:
            replayer.close()
        stats = server.stats()
    assert stats["answered"] == 1 and stats["dropped_auth"] == 2
    assert not server_sec.allowlist.check("127.0.0.2")
    assert "replayed" in caplog.text and "old" in caplog.text


def test_a_replayed_or_stale_signed_checksum_request_is_dropped_unread():
    """A captured checksum request replayed, or an old one: neither is answered, and the
    provider (which reads the transfer's blocks) is not even asked."""
    auth = MessageAuth(SECRET)
    request = ChecksumRequest(requester_engine_id="d", transfer_id="tx", block_ids=(1, 2))
    captured = auth.seal(encode(request))
    an_hour_ago = int(time.time() * 1000) - 3_600_000
    old = auth.seal(encode(request.replace(nonce=b"o" * 16, sent_ms=an_hour_ago)))
    asked: list[ChecksumRequest] = []

    def checksums(req: ChecksumRequest) -> ChecksumResponse:
        asked.append(req)
        return ChecksumResponse(transfer_id=req.transfer_id, checksums={"L0": b"\0" * 16})

    server_sec = security(SECRET)
    with (
        HandshakeServer(0, provider_for(), server_sec, bind_host=LOCAL, checksums=checksums) as srv,
        contextlib.closing(_dealer_from(LOCAL, srv.port, SECRET)) as dealer,
    ):
        for frames in (captured, captured, old):
            dealer.send_multipart(frames)
        wait_until(lambda: srv.stats()["dropped_auth"] == 2)
        stats = srv.stats()
    assert stats["answered"] == 1 and len(asked) == 1


def test_without_a_secret_a_handshake_request_is_answered_whatever_its_clock():
    """Unsigned deployments authenticate nothing: clocks apart must not break them."""
    an_hour_ago = int(time.time() * 1000) - 3_600_000
    with (
        HandshakeServer(0, provider_for(), security(), bind_host=LOCAL) as server,
        contextlib.closing(_dealer_from(LOCAL, server.port)) as dealer,
    ):
        for _ in range(2):  # twice: no nonce memory either
            dealer.send(encode(HandshakeRequest("d", nonce=b"n" * 16, sent_ms=an_hour_ago)))
            assert dealer.poll(int(WAIT * 1000))
            _empty, payload = dealer.recv_multipart()
            assert decode(payload, (HandshakeResponse,), max_bytes=1 << 20).nonce == b"n" * 16


def test_unauthenticated_requester_is_not_learned(raw_dealer):
    server_sec = security(SECRET, allowed=())
    with HandshakeServer(0, provider_for(), server_sec, bind_host=LOCAL) as server:
        dealer = raw_dealer(server.port, SECRET)
        dealer.send(encode(HandshakeRequest("intruder")))  # no tag
        dealer.send_multipart(server_sec.auth.seal(b"\xc1"))  # tagged but malformed: a marker
        wait_until(lambda: server.stats()["dropped_malformed"] == 1)
        assert server.stats()["dropped_auth"] == 1
        assert not server_sec.allowlist.check(LOCAL)


def test_server_survives_garbage_then_answers(raw_dealer):
    with HandshakeServer(0, provider_for(), security(), bind_host=LOCAL) as server:
        dealer = raw_dealer(server.port)
        dealer.send(b"get_meta_msg")  # vLLM's raw command is not our protocol
        dealer.send(b"\xc1")
        dealer.send_multipart([b"a", b"b", b"c"])
        dealer.send(b"x" * 10_000)
        dealer.send(encode(Release("wrong channel")))
        request = HandshakeRequest("d0")
        dealer.send(encode(request))  # same connection: processed after all the garbage
        assert dealer.poll(int(WAIT * 1000))
        _empty, payload = dealer.recv_multipart()
        reply = decode(payload, (HandshakeResponse,), max_bytes=1 << 20)
        assert reply.engine_id == "prefill-0" and reply.nonce == request.nonce
        assert server.stats()["dropped_malformed"] == 5
        # And a regular client is still served.
        assert (
            fetch_metadata(
                LOCAL, server.port, timeout=WAIT, security=security(), requester_engine_id="d1"
            ).engine_id
            == "prefill-0"
        )


def test_provider_errors_reach_the_requester():
    def not_ready(request):
        raise FailedPreconditionError("KV caches are not registered yet")

    def broken(request):
        raise ZeroDivisionError("bug")

    for provider, needle in ((not_ready, "not registered yet"), (broken, "internal error")):
        with (
            HandshakeServer(0, provider, security(), bind_host=LOCAL) as server,
            pytest.raises(FailedPreconditionError, match=needle),
        ):
            fetch_metadata(
                LOCAL, server.port, timeout=WAIT, security=security(), requester_engine_id="d"
            )


def _ask_raw(dealer, request: dict) -> HandshakeRejected:
    dealer.send(msgpack.packb(request))
    assert dealer.poll(int(WAIT * 1000))
    empty, payload = dealer.recv_multipart()
    reply = decode(payload, (HandshakeResponse, HandshakeRejected), max_bytes=1 << 20)
    assert empty == b"" and isinstance(reply, HandshakeRejected)
    return reply


def test_a_request_of_an_older_version_is_refused_by_its_version(raw_dealer):
    """A peer of protocol version 1 (the release before the incarnation and tokens_per_state
    fields), 2 (before the request's sent_ms), 3 (before the response's answered_ms and the
    READ hold), 4 (before write_aborted named its decode rank), 5 (before confirm_reads and
    hold checks), 6 (before remote_blocks named the prefill incarnation), 7 (before
    misaddressed), 8 (before checksum requests stated the answer's block order), 9 (before
    KV-cache groups named their element types) or 10 (before checksum requests stated each
    group's count of answer ids) gets the version
    error, with its nonce, and so does a newer one whose request carries a key this version
    does not know (its keys are not checked at all)."""
    with HandshakeServer(0, provider_for(), security(), bind_host=LOCAL) as server:
        dealer = raw_dealer(server.port)
        v1 = msgpack.unpackb(encode(HandshakeRequest("d", protocol_version=1)))
        del v1["sent_ms"]
        reply = _ask_raw(dealer, v1)
        assert reply.reason == "protocol version 1 is not supported (this side speaks 11)"
        assert reply.nonce == v1["nonce"]
        for older in (2, 3, 4, 5, 6, 7, 8, 9, 10):
            reply = _ask_raw(dealer, {**v1, "protocol_version": older})
            assert (
                reply.reason == f"protocol version {older} is not supported (this side speaks 11)"
            )
        v12 = {**v1, "protocol_version": 12, "field_of_version_12": [1, 2]}
        reply = _ask_raw(dealer, v12)
        assert reply.reason == "protocol version 12 is not supported (this side speaks 11)"
        assert server.stats()["rejected"] == 11


def test_protocol_version_is_11():
    assert PROTOCOL_VERSION == 11
    assert HandshakeRequest("d").protocol_version == 11


def _fake_server_reply(make_reply, secret=None):
    """Run fetch_metadata against a raw ROUTER that answers with make_reply(request) (the
    request opened with ``secret``, as the requester signs it)."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    MessageAuth(secret).secure_listener(router)
    port = router.bind_to_random_port(f"tcp://{LOCAL}")
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(
                fetch_metadata,
                LOCAL,
                port,
                timeout=WAIT,
                security=security(secret),
                requester_engine_id="d0",
            )
            assert router.poll(int(WAIT * 1000))
            identity, *frames = router.recv_multipart()
            payload = MessageAuth(secret).open(frames)
            request = decode(payload, (HandshakeRequest,), max_bytes=4096)
            router.send_multipart([identity, *make_reply(request)])
            return future.result(timeout=WAIT)
    finally:
        router.close(linger=0)


def test_reply_to_another_request_is_refused():
    stale = HandshakeResponse("p", b"m", nonce=b"z" * 16)
    with pytest.raises(AuthenticationError, match="nonce"):
        _fake_server_reply(lambda req: [b"", encode(stale)])


def test_a_signed_handshake_reply_replayed_to_another_request_is_refused():
    """A reply genuinely signed with the shared secret, captured for one request, replayed as
    the answer to another: its nonce is the first request's, so the requester refuses it."""
    auth = MessageAuth(SECRET)
    captured = HandshakeResponse("p", b"m", nonce=b"q" * 16)  # answered another request

    def replay(request):
        assert request.nonce != captured.nonce
        return [b"", *auth.seal(encode(captured))]

    with pytest.raises(AuthenticationError, match="nonce"):
        _fake_server_reply(replay, SECRET)


def test_a_version_1_reply_is_refused_by_its_version():
    """A version-1 response lacks the incarnation this version's schema knows and has a key
    (here a made-up one) this version does not: the requester names the version, not a key."""

    def version_1(request):
        wire = msgpack.unpackb(encode(HandshakeResponse("p", b"m", nonce=request.nonce)))
        del wire["incarnation"]
        wire.update(protocol_version=1, field_of_version_1=True)
        return [b"", msgpack.packb(wire)]

    with pytest.raises(IncompatiblePeerError) as caught:
        _fake_server_reply(version_1)
    assert str(caught.value).endswith("protocol version 1 is not supported (this side speaks 11)")


@pytest.mark.parametrize(
    "frames",
    [
        [b"not-empty", b"x"],
        [b"", b"\xc1"],
        [b"", msgpack.packb({"type": "handshake_response", "engine_id": "p"})],
    ],
)
def test_malformed_reply_is_a_transport_error(frames):
    with pytest.raises(TransportError):
        _fake_server_reply(lambda req: frames)


# ---- proxy ping -------------------------------------------------------------------------------

REGISTRATION = ProxyRegistration(
    "D", "127.0.0.1:8200", ZmqAddress("127.0.0.1", 7301, 7501), 1, 4, "READ"
)


def test_proxy_pinger_sends_vllm_registration_until_stopped():
    ctx = zmq.Context.instance()
    proxy = ctx.socket(zmq.ROUTER)
    proxy.setsockopt(zmq.LINGER, 0)
    port = proxy.bind_to_random_port(f"tcp://{LOCAL}")
    try:
        pinger = ProxyPinger(LOCAL, port, REGISTRATION, interval=0.05).start()
        received = []
        for _ in range(2):
            assert proxy.poll(int(WAIT * 1000))
            _identity, payload = proxy.recv_multipart()  # exactly one payload frame, no tag
            received.append(msgpack.unpackb(payload))
        pinger.stop()
        assert pinger._thread is not None and not pinger._thread.is_alive()
        assert pinger.pings_sent >= 2
    finally:
        proxy.close(linger=0)
    assert (
        received[0]
        == received[1]
        == {
            "type": "D",
            "http_address": "127.0.0.1:8200",
            "zmq_address": "host:127.0.0.1,handshake:7301,notify:7501",
            "dp_size": 1,
            "tp_size": 4,
            "transfer_mode": "READ",
        }
    )


def test_proxy_pinger_without_proxy_stops_cleanly():
    pinger = ProxyPinger(LOCAL, free_port(), REGISTRATION, interval=0.02).start()
    pinger.stop()
    assert pinger._thread is not None and not pinger._thread.is_alive()


def test_proxy_pinger_checks_allowlist_and_arguments():
    with pytest.raises(PeerNotAllowedError):
        ProxyPinger("203.0.113.1", 36367, REGISTRATION, allowlist=PeerAllowlist(["10.0.0.0/8"]))
    with pytest.raises(Exception, match="interval"):
        ProxyPinger(LOCAL, 36367, REGISTRATION, interval=0)
    with pytest.raises(Exception, match="proxy_ping_port"):
        ProxyPinger(LOCAL, 0, REGISTRATION)


# ---- end to end: what the connector does with these pieces ------------------------------------


def free_bases(count, n):
    """``count`` base ports, each followed by n-1 more free ports, the blocks not overlapping."""
    bases = []
    while len(bases) < count:
        base = free_ports(n, LOCAL)
        if all(abs(base - other) >= n for other in bases):
            bases.append(base)
    return bases


def test_read_mode_flow_across_tp_ranks():
    tp = 2
    hs_base, nf_base = free_bases(2, tp)
    p_plan = PortPlan(hs_base, nf_base, dp_size=1, tp_size=tp)
    p_sec = security(SECRET, allowed=())  # prefill dials nobody in READ mode
    d_sec = security(SECRET)

    def provider(rank):
        return lambda req: HandshakeResponse(f"p-tp{rank}", b"meta%d" % rank, 0, rank, 1, tp)

    servers = [
        HandshakeServer(p_plan.handshake_port(0, t), provider(t), p_sec, bind_host=LOCAL)
        for t in range(tp)
    ]
    listeners = [
        NotifyListener(p_plan.notify_port(0, t), p_sec, bind_host=LOCAL) for t in range(tp)
    ]
    try:
        # The router embeds P's base ports (and D's) in the request id.
        rid = (
            "cmpl-"
            + format_request_id(
                ZmqAddress(LOCAL, p_plan.handshake_base, p_plan.notify_base),
                ZmqAddress(LOCAL, 7301, 7501),
            )
            + "-0-deadbeef"
        )
        params = parse_kv_transfer_params(
            {
                "transfer_id": "tx-7",
                "do_remote_prefill": True,
                "remote_block_ids": [3, 4],
                "remote_engine_id": "p",
                "remote_tp_size": tp,
                "remote_dp_size": 1,
                "remote_dp_rank": 0,
            }
        )
        peer = params.peer_address(rid, is_producer=False)
        assert not p_sec.allowlist.check(peer.host)  # nothing configured, nothing learned yet
        remote = PortPlan(peer.handshake_port, peer.notify_port, params.remote_dp_size, tp)
        with NotifySender(d_sec) as sender:
            for t in range(tp):  # each decode rank talks to its prefill counterpart
                meta = fetch_metadata(
                    peer.host,
                    remote.handshake_port(params.remote_dp_rank, t),
                    timeout=WAIT,
                    security=d_sec,
                    requester_engine_id=f"d-tp{t}",
                )
                assert (meta.engine_id, meta.tp_rank, meta.engine_metadata) == (
                    f"p-tp{t}",
                    t,
                    b"meta%d" % t,
                )
                sender.send(
                    peer.host,
                    remote.notify_port(params.remote_dp_rank, t),
                    Release(params.transfer_id, consumer_tp_size=tp, consumer_tp_rank=t),
                )
        for t, listener in enumerate(listeners):
            assert listener.get(WAIT) == Release("tx-7", tp, t)
        # Every prefill rank learned the decode host from its handshake.
        assert p_sec.allowlist.check(LOCAL)
    finally:
        for item in (*servers, *listeners):
            item.close()


def test_write_mode_flow_blocks_then_done():
    bases = free_bases(4, 1)
    p_plan = PortPlan(bases[0], bases[1])
    d_plan = PortPlan(bases[2], bases[3])
    rid = format_request_id(
        ZmqAddress(LOCAL, p_plan.handshake_base, p_plan.notify_base),
        ZmqAddress(LOCAL, d_plan.handshake_base, d_plan.notify_base),
    )
    sec = security(SECRET)
    with (
        NotifyListener(p_plan.notify_port(0, 0), sec, bind_host=LOCAL) as p_listener,
        NotifyListener(d_plan.notify_port(0, 0), sec, bind_host=LOCAL) as d_listener,
        NotifySender(sec) as d_sender,
        NotifySender(sec) as p_sender,
    ):
        # D allocates and tells P where to write.
        p_addr = peer_address_from_request_id(rid, is_producer=False)
        assert p_addr is not None
        d_sender.send(
            p_addr.host, p_addr.notify_port, RemoteBlocks("tx-w", ((5, 6),), "d0", req_id=rid)
        )
        blocks = p_listener.get(WAIT)
        assert blocks == RemoteBlocks("tx-w", ((5, 6),), "d0", req_id=rid)
        # P writes, then reports to the decode rank found in the request id.
        d_addr = peer_address_from_request_id(blocks.req_id, is_producer=True)
        assert d_addr is not None
        p_sender.send(
            d_addr.host,
            rank_port(d_addr.notify_port, blocks.decode_dp_rank, 0, tp_size=1),
            WriteDone("tx-w"),
        )
        assert d_listener.get(WAIT) == WriteDone("tx-w")
