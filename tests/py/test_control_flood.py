"""What a flood of bad or stray messages costs a listener and the protocol core: a bounded
number of log lines (rate limited, the rest counted and summarised), no error text built for
drops nobody will see, and every message still read and counted."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from moriio_native.control import channel, messages
from moriio_native.control.channel import (
    HandshakeServer,
    NotifyListener,
    RateLimitedWarnings,
    fetch_metadata,
)
from moriio_native.control.messages import (
    MAX_NOTIFY_BYTES,
    NOTIFY_TYPES,
    AbortWrite,
    HandshakeResponse,
    InvalidMessageError,
    Misaddressed,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    decode,
    encode,
)
from moriio_native.control.security import (
    DEFAULT_LISTENER_HANDSHAKE_TIMEOUT,
    ControlSecurity,
    MessageAuth,
)
from moriio_native.errors import InvalidArgumentError
from moriio_native.pd.core import PdCore
from moriio_native.pd.puller import Puller
from moriio_native.pd.pusher import Pusher
from test_pd_peers import Clock
from test_pd_protocol import context
from zmtp_support import greeted, send_endless_message, stalled_handshake

LOCAL = "127.0.0.1"
WAIT = 10.0
FLOOD = 300
BURST = 20  # RateLimitedWarnings' default, which every flooded warning uses

LOGGER = logging.getLogger("moriio_native.tests.control_flood")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(channel.time, "monotonic", fake)
    return fake


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_warnings_past_the_burst_are_counted_then_summarised(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER.name)
    limit = RateLimitedWarnings(LOGGER, "stray things", burst=3, window_s=10.0)
    for i in range(10):
        assert limit.allows() == (i < 3)
        limit.warn("stray %d", i)
    assert _lines(caplog, "stray") == ["stray 0", "stray 1", "stray 2"]
    assert limit.suppressed == 7
    clock.now += 10.0  # the next window: the count first, then the warning
    assert limit.allows()
    limit.warn("stray %d", 10)
    assert _lines(caplog, "stray")[3:] == [
        "stray things: 7 more like this in the last 10 s were not logged",
        "stray 10",
    ]
    assert limit.suppressed == 0


@pytest.mark.parametrize(("burst", "window_s"), [(0, 1.0), (1, 0.0), (1, float("nan"))])
def test_a_warning_limit_needs_a_positive_burst_and_window(burst: int, window_s: float) -> None:
    with pytest.raises(InvalidArgumentError, match="burst >= 1 and window_s > 0"):
        RateLimitedWarnings(LOGGER, "x", burst=burst, window_s=window_s)


BAD_PAYLOADS = [
    msgpack.packb({"type": "release"}),  # missing key
    msgpack.packb({"type": "no_such_type", "transfer_id": "x"}),
    msgpack.packb({"type": "release", "transfer_id": "x", "evil": 1}),
    msgpack.packb([1, 2]),  # not a map
    msgpack.packb({"type": "write_done", "transfer_id": "x", "writer_rank": -1}),
]


@pytest.mark.parametrize("payload", BAD_PAYLOADS)
def test_decode_without_explanation_refuses_the_same_input(
    payload: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(InvalidMessageError) as explained:
        decode(payload, NOTIFY_TYPES, max_bytes=MAX_NOTIFY_BYTES)

    def no_second_parse(*args: object) -> str:
        raise AssertionError("the explanation was built")

    monkeypatch.setattr(messages, "_message_error", no_second_parse)
    with pytest.raises(InvalidMessageError, match="fails the schema") as short:
        decode(payload, NOTIFY_TYPES, max_bytes=MAX_NOTIFY_BYTES, explain=False)
    assert str(short.value) != str(explained.value)
    good = Release("tx-1")
    assert decode(encode(good), NOTIFY_TYPES, max_bytes=MAX_NOTIFY_BYTES, explain=False) == good


def test_a_flooded_listener_logs_a_burst_and_explains_only_what_it_logs(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every schema failure was explained (the payload parsed a second time to name
    its type and field) though the log showed only the first 20 of them."""
    explained = []
    explain = messages._message_error

    def counting(*args: object) -> str:
        explained.append(1)
        return explain(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(messages, "_message_error", counting)
    caplog.set_level(logging.WARNING, logger="moriio_native.control")
    sec = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as listener,
        contextlib.closing(zmq.Context.instance().socket(zmq.DEALER)) as dealer,
    ):
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{LOCAL}:{listener.port}")
        for i in range(FLOOD):
            dealer.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)])
        dealer.send(encode(Release("genuine")))
        assert listener.get(WAIT) == Release("genuine")
        stats = listener.stats()
    assert stats["received"] == FLOOD + 1 and stats["dropped_malformed"] == FLOOD
    assert len(_lines(caplog, "dropped message from")) == BURST
    assert len(explained) == BURST


def test_stray_write_results_log_a_burst_not_a_line_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a line per write_done/write_failed of a transfer the decode never had."""
    caplog.set_level(logging.WARNING, logger="moriio_native.pd")
    ctx, _, _ = context("read", producer=False)
    puller = Puller(ctx)
    for i in range(FLOOD):
        puller.on_write_result(f"stray-{i}", ok=i % 2 == 0)
    assert len(_lines(caplog, "ignoring a write result")) == BURST


def test_stray_misaddressed_messages_log_a_burst_and_change_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """misaddressed of transfers the decode never announced (stray, or forged without a
    secret): a burst of lines, no await, no handshake, nothing reported."""
    caplog.set_level(logging.WARNING, logger="moriio_native.pd")
    ctx, directory, sender = context("write", producer=False)
    puller = Puller(ctx)
    for i in range(FLOOD):
        puller.on_misaddressed(Misaddressed(f"stray-{i}", "ab" * 16, "cd" * 16, writer_rank=i % 4))
    assert len(_lines(caplog, "ignoring misaddressed")) == BURST
    assert not directory.pending and not sender.sent and not puller.await_states()
    assert not ctx.reports.failed_recving


def test_write_mode_messages_to_a_read_mode_prefill_log_a_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="moriio_native.pd")
    ctx, _, _ = context("read", producer=True)
    pusher = Pusher(ctx)
    for i in range(FLOOD):
        if i % 2:
            pusher.on_abort_write(AbortWrite(f"stray-{i}", "d:1/dp0/tp0", LOCAL, 8000, 8100))
        else:
            pusher.on_remote_blocks(RemoteBlocks(f"stray-{i}", ((1,),), "d:1/dp0/tp0"))
    assert len(_lines(caplog, "this instance runs READ mode")) == BURST


def test_the_notify_loop_logs_a_burst_of_stray_failures_and_misdirected_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The connector's notify loop (PdCore._on_message) on a decode rank: write_failed of
    unknown transfers and releases (a prefill's message) each logged a line before."""
    caplog.set_level(logging.WARNING, logger="moriio_native.pd")
    ctx, _, _ = context("read", producer=False)
    core = SimpleNamespace(
        cfg=ctx.cfg,
        puller=Puller(ctx),
        _stray=RateLimitedWarnings(logging.getLogger("moriio_native.pd.core"), "notify"),
    )
    for i in range(FLOOD):
        message = (WriteFailed(f"s-{i}", reason="flood"), Release(f"s-{i}"), WriteDone(f"s-{i}"))
        PdCore._on_message(core, message[i % 3])  # type: ignore[arg-type]
        PdCore._on_message(core, WriteAborted(f"s-{i}", ctx.cfg.engine_id))  # type: ignore[arg-type]
    core_lines = [r for r in caplog.records if r.name == "moriio_native.pd.core"]
    assert len(core_lines) == BURST


# ---- wake-up moderation: a flooded listener pauses between bursts ------------------------------


def _dealer(
    port: int, *, source: str | None = None, host: str = LOCAL, secret: str | None = None
) -> zmq.Socket:
    """A DEALER connected to ``port`` of ``host``, from the loopback address ``source``; with
    ``secret``, a CURVE client with that secret's keys, as an instance dials."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    MessageAuth(secret).secure_dialer(dealer)
    if ":" in host:
        dealer.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    dealer.connect(f"tcp://{f'{source}:0;' if source else ''}{host}:{port}")
    return dealer


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_listeners_accepting_only_allowed_peers_never_read_a_strangers_messages() -> None:
    """With accept_only_allowed_peers, ZMQ closes a stranger's connection as it accepts it: its
    flood is never read (not even counted), while a peer inside the allowed networks is read as
    before, on the notify and on the handshake port."""
    allowed = "127.0.0.2"
    sec = ControlSecurity.from_config(
        {"allowed_peers": [f"{allowed}/32"], "accept_only_allowed_peers": True}
    )
    provider = lambda _request: HandshakeResponse(engine_id="p", engine_metadata=b"meta")  # noqa: E731
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as notify,
        HandshakeServer(0, provider, sec, bind_host=LOCAL) as handshake,
    ):
        for listener in (notify, handshake):
            with (
                contextlib.closing(_dealer(listener.port)) as stranger,  # from 127.0.0.1
                contextlib.closing(_dealer(listener.port, source=allowed)) as peer,
            ):
                for i in range(FLOOD):
                    with contextlib.suppress(zmq.Again):  # nobody takes them
                        stranger.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)], zmq.NOBLOCK)
                peer.send(encode(Release("from inside")))
                deadline = time.monotonic() + WAIT
                while listener.stats()["received"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)  # time for a stranger's message to be read, were it let in
                assert listener.stats()["received"] == 1
        assert notify.get(WAIT) == Release("from inside")
        assert handshake.stats()["dropped_malformed"] == 1  # a release is no handshake


def _greeted(port: int, source: str) -> bool:
    """Whether the listener at ``port`` answers a raw connection from ``source`` with its own
    ZMTP greeting (False: it closed the connection, as its accept filter does)."""
    address, origin = (LOCAL, port), (source, 0)
    with socket.create_connection(address, timeout=WAIT, source_address=origin) as conn:
        try:
            return greeted(conn)
        except ConnectionError:  # reset: closed at accept
            return False


def test_an_accept_only_listener_closes_a_stranger_before_its_first_frame() -> None:
    """ZMQ queues every frame of a multipart message until its last one, with no limit on their
    number (MAXMSGSIZE bounds one frame), before the application sees anything: a stranger's
    never-ending message of empty frames grows a listener's process without bound, unless a
    secret is set (the next test; docs/reliability.md, Security). Without one,
    accept_only_allowed_peers is the mitigation: the stranger's connection is closed at accept,
    before its first frame, while a peer inside the networks is greeted as before."""
    sec = ControlSecurity.from_config(
        {"allowed_peers": ["127.0.0.2/32"], "accept_only_allowed_peers": True}
    )
    provider = lambda _request: HandshakeResponse(engine_id="p", engine_metadata=b"meta")  # noqa: E731
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as notify,
        HandshakeServer(0, provider, sec, bind_host=LOCAL) as handshake,
    ):
        for listener in (notify, handshake):
            assert not _greeted(listener.port, source=LOCAL)
            assert _greeted(listener.port, source="127.0.0.2")


SECRET = "test-secret-0123456789"


def test_with_a_secret_a_peer_without_it_gets_no_frame_queued_nor_read() -> None:
    """With a secret, every listener is a CURVE server whose keys only a holder of the secret
    can derive. Before: anyone who reached a port could send a multipart message that never
    ends (ZMQ queued its frames without bound; the HMAC is checked only on a whole message:
    491 MiB for 8 million empty frames) and a flood of forged messages that the listener read
    and dropped one by one. Now ZMQ's I/O thread closes such a connection at its handshake: the
    endless message is cut off, and neither a plain peer's nor a wrong secret's messages are
    read (not even counted), while a peer with the secret is read as before."""
    sec = ControlSecurity.from_config({"auth_secret": SECRET, "allowed_peers": ["127.0.0.0/8"]})
    provider = lambda _request: HandshakeResponse(engine_id="p", engine_metadata=b"meta")  # noqa: E731
    auth = MessageAuth(SECRET)
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as notify,
        HandshakeServer(0, provider, sec, bind_host=LOCAL) as handshake,
    ):
        for listener in (notify, handshake):
            # A multipart message that never ends is cut off (not taken on for 2 s).
            endless = send_endless_message(LOCAL, listener.port, frames=200_000, linger_s=2.0)
            assert endless.closed
            with (
                contextlib.closing(_dealer(listener.port)) as plain,
                contextlib.closing(
                    _dealer(listener.port, secret="another secret, 0123456789")
                ) as wrong,
                contextlib.closing(_dealer(listener.port, secret=SECRET)) as holder,
            ):
                for i in range(FLOOD):
                    with contextlib.suppress(zmq.Again):  # nobody takes them
                        plain.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)], zmq.NOBLOCK)
                        wrong.send_multipart(
                            MessageAuth("another secret, 0123456789").seal(encode(Release("x"))),
                            zmq.NOBLOCK,
                        )
                holder.send_multipart(auth.seal(encode(Release("from a holder"))))
                deadline = time.monotonic() + WAIT
                while listener.stats()["received"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)  # time for another message to be read, were it let in
                stats = listener.stats()
                assert stats["received"] == 1 and stats["dropped_auth"] == 0, stats
        assert notify.get(WAIT) == Release("from a holder")
        assert handshake.stats()["dropped_malformed"] == 1  # a release is no handshake


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "curve"])
def test_a_handshake_that_stalls_with_a_huge_command_is_cut_off_soon(secret: str | None) -> None:
    """ZMQ reads a handshake command as it reads a message, up to MAXMSGSIZE (16 MiB on a notify
    listener): a peer without the secret that opens a CURVE handshake (or, with no secret, a
    NULL one) and sends most of a 16 MiB HELLO it never finishes holds that memory of the
    listener's process for as long as the connection lasts -- 30 s by ZMQ's default, on as
    many connections as it opens (found by a review: 2,283 MiB with 150 connections). Now a
    listener ends a handshake after its limit (2 s by default): the connection is closed within it
    (and a few seconds' slack), so what such a peer holds is what it can send in that time."""
    config: dict[str, object] = {"allowed_peers": ["127.0.0.0/8"]}
    if secret is not None:
        config["auth_secret"] = secret
    mechanism = b"NULL" if secret is None else b"CURVE"
    wait_s = DEFAULT_LISTENER_HANDSHAKE_TIMEOUT + 3
    with NotifyListener(0, ControlSecurity.from_config(config), bind_host=LOCAL) as notify:
        closed = stalled_handshake(
            LOCAL, notify.port, mechanism=mechanism, declared=16 << 20, sent=1 << 20, wait_s=wait_s
        )
        assert closed, f"a stalled handshake was still open after {wait_s:.0f}s"
        assert notify.stats()["received"] == 0


@pytest.mark.parametrize(
    ("limit_s", "wait_s", "closed"),
    [
        # Closed long before the default 2 s would have closed it...
        (0.3, 1.5, True),
        # ... or still open well after it: a slow link's operator can raise the limit.
        (30.0, DEFAULT_LISTENER_HANDSHAKE_TIMEOUT + 2, False),
    ],
    ids=["shorter", "longer"],
)
def test_a_listener_ends_a_stalled_handshake_after_the_configured_limit(
    limit_s: float, wait_s: float, closed: bool
) -> None:
    """``listener_handshake_timeout`` is every listener's limit: a link whose round trips are
    near half a second needs more than 2 s for CURVE's four, and was refused before the key."""
    config = {"allowed_peers": ["127.0.0.0/8"], "listener_handshake_timeout": limit_s}
    with NotifyListener(0, ControlSecurity.from_config(config), bind_host=LOCAL) as notify:
        got = stalled_handshake(
            LOCAL, notify.port, mechanism=b"NULL", declared=64, sent=8, wait_s=wait_s
        )
        assert got == closed, f"limit {limit_s}s: closed={got} after up to {wait_s}s"


@pytest.mark.parametrize(
    ("bind_host", "allowed", "target", "source", "read"),
    [
        # A listener on an IPv6 address sees an IPv4 peer as ::ffff:a.b.c.d: each IPv4 network
        # must match it so, and 10.0.0.0/8 must not become a prefix of 8 bits of all 128 (which
        # would let every IPv4 peer in).
        ("::ffff:127.0.0.1", ["127.0.0.2/32", "10.0.0.0/8"], LOCAL, "127.0.0.2", True),
        ("::ffff:127.0.0.1", ["127.0.0.2/32", "10.0.0.0/8"], LOCAL, None, False),
        # An IPv6 network holding the IPv4-mapped range ("any IPv6 peer") admits no IPv4 peer:
        # the allowlist's own check refuses them.
        pytest.param(
            "::ffff:127.0.0.1", ["10.0.0.0/8", "::/0"], LOCAL, None, False, id="ipv6-any-not-ipv4"
        ),
        pytest.param("::1", ["10.0.0.0/8", "::/0"], "::1", None, True, id="ipv6-any"),
        pytest.param("::1", ["::1/128"], "::1", None, True, id="ipv6-allowed"),
        pytest.param("::1", ["2001:db8::/64", "127.0.0.1"], "::1", None, False, id="ipv6-stranger"),
    ],
)
def test_a_listener_on_an_ipv6_address_accepts_only_allowed_peers_of_either_family(
    bind_host: str, allowed: list[str], target: str, source: str | None, read: bool
) -> None:
    if ":" in target and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback address (::1) on this machine")
    sec = ControlSecurity.from_config({"allowed_peers": allowed, "accept_only_allowed_peers": True})
    with (
        NotifyListener(0, sec, bind_host=bind_host) as listener,
        contextlib.closing(_dealer(listener.port, source=source, host=target)) as sender,
    ):
        with contextlib.suppress(zmq.Again):  # a refused sender has nobody to take it
            sender.send(encode(Release("from the sender")), zmq.NOBLOCK)
        assert listener.get(WAIT if read else 0.5) == (Release("from the sender") if read else None)
        assert listener.stats()["received"] == int(read)


def test_a_listener_that_drops_nothing_never_pauses() -> None:
    """Genuine traffic, idle or back to back, is read at once: no flood pause adds to it."""
    sec = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as listener,
        contextlib.closing(_dealer(listener.port)) as dealer,
    ):
        for i in range(FLOOD):
            dealer.send(encode(Release(f"genuine-{i}")))
        got = [listener.get(WAIT) for _ in range(FLOOD)]
        dealer.send(encode(Release("after-the-batch")))  # the listener is idle again
        last = listener.get(WAIT)
        stats = listener.stats()
    assert got == [Release(f"genuine-{i}") for i in range(FLOOD)]
    assert last == Release("after-the-batch")
    assert stats["delivered"] == FLOOD + 1 and stats["flood_pauses"] == 0


def test_a_flooded_listener_pauses_yet_reads_every_message_and_delivers_the_genuine_ones() -> None:
    sec = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})
    genuine = [Release(f"genuine-{i}") for i in range(10)]
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as listener,
        contextlib.closing(_dealer(listener.port)) as dealer,
    ):
        for message in genuine:
            for i in range(FLOOD):
                dealer.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)])
            dealer.send(encode(message))
        got = [listener.get(WAIT) for _ in genuine]
        stats = listener.stats()
    assert got == genuine
    assert stats["received"] == len(genuine) * (FLOOD + 1)
    assert stats["dropped_malformed"] == len(genuine) * FLOOD
    assert stats["flood_pauses"] > 0


def test_a_flooded_handshake_server_still_answers_a_genuine_handshake() -> None:
    sec = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})
    provider = lambda _request: HandshakeResponse(engine_id="p", engine_metadata=b"meta")  # noqa: E731
    with (
        HandshakeServer(0, provider, sec, bind_host=LOCAL) as server,
        contextlib.closing(_dealer(server.port)) as dealer,
    ):
        for i in range(FLOOD):
            dealer.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)])
        reply = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=sec, requester_engine_id="d"
        )
        for i in range(FLOOD):  # and after more flood, once more
            dealer.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)])
        again = fetch_metadata(
            LOCAL, server.port, timeout=WAIT, security=sec, requester_engine_id="d"
        )
        # The handshakes come on their own connections, so they may overtake the flood.
        deadline = time.monotonic() + WAIT
        while server.stats()["received"] < 2 * FLOOD + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = server.stats()
    assert reply.engine_metadata == again.engine_metadata == b"meta"
    assert stats["answered"] == 2 and stats["dropped_malformed"] == 2 * FLOOD
    assert stats["flood_pauses"] > 0


def test_a_flooded_listener_pauses_alone_not_the_other_listeners_of_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The listeners of a process share one reading thread; a flooded one pauses only its own
    reads (its next wake-up then reads what piled up): a genuine message to another listener is
    read during that pause, and closing it is not held up either."""
    monkeypatch.setattr(channel, "_FLOOD_PAUSE_S", 60.0)  # far beyond any wait below
    sec = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})
    with (
        NotifyListener(0, sec, bind_host=LOCAL) as flooded,
        NotifyListener(0, sec, bind_host=LOCAL) as other,
        contextlib.closing(_dealer(flooded.port)) as flooder,
        contextlib.closing(_dealer(other.port)) as genuine,
    ):
        assert flooded.reader is other.reader  # one thread reads both
        for i in range(FLOOD):
            flooder.send(BAD_PAYLOADS[i % len(BAD_PAYLOADS)])
        deadline = time.monotonic() + WAIT
        while flooded.stats()["flood_pauses"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flooded.stats()["flood_pauses"] == 1  # it pauses now, for a minute
        genuine.send(encode(Release("genuine")))
        assert other.get(WAIT) == Release("genuine")
        flooder.send(encode(Release("behind the pause")))
        time.sleep(0.2)  # the paused listener does not read it yet
        assert flooded.drain() == []
        started = time.monotonic()
        other.close()
        assert time.monotonic() - started < WAIT
    assert flooded.stats()["received"] < FLOOD + 1  # closed in its pause, not read on


def test_the_flood_gauge_trips_on_a_flood_and_forgets_it(clock: Clock) -> None:
    """Flooded from the window with _FLOOD_DROPS drops through the next one; a stray drop now
    and then, or a flood that ended two windows ago, does not make the listener pause."""
    gauge = channel._FloodGauge()
    for _ in range(channel._FLOOD_DROPS - 1):
        gauge.dropped()
    assert not gauge.flooded()
    gauge.dropped()
    assert gauge.flooded()
    clock.now += channel._FLOOD_WINDOW_S  # the next window still remembers the last one
    assert gauge.flooded()
    gauge.dropped()
    clock.now += channel._FLOOD_WINDOW_S  # one drop in the last window: not a flood
    assert not gauge.flooded()
    for _ in range(channel._FLOOD_DROPS):
        gauge.dropped()
    assert gauge.flooded()
    clock.now += 5 * channel._FLOOD_WINDOW_S  # idle since: forgotten at once
    assert not gauge.flooded()
