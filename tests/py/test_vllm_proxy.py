"""The example proxy (examples/launch/proxy.py) against fake prefill/decode HTTP servers.

Checks the protocol the connector relies on: registration pings from the connector's own
pinger, both legs getting the same transfer id and a request id that embeds both control
addresses, the prefill leg forced to one token, READ waiting for the prefill's
``kv_transfer_params`` and WRITE starting both legs at once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from net_support import free_port

pytest.importorskip("vllm")  # the proxy uses the web stack vLLM brings
pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from aiohttp import web
from fastapi.testclient import TestClient

from moriio_native.control.addressing import ZmqAddress, parse_request_id
from moriio_native.control.channel import ProxyPinger
from moriio_native.control.messages import ProxyRegistration, encode
from moriio_native.control.security import MessageAuth, RegistrationVerifier

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def load_proxy() -> Any:
    spec = importlib.util.spec_from_file_location(
        "moriio_example_proxy", ROOT / "examples/launch/proxy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class FakeInstance:
    """An HTTP server that records what it is sent and answers like vLLM would."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.requests: list[tuple[Any, dict[str, Any], float]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.headers.copy(), body, time.monotonic()))
        if self.role == "P":
            params = dict(body["kv_transfer_params"])
            params.update(
                do_remote_prefill=True,
                do_remote_decode=False,
                remote_block_ids=[4, 5],
                remote_engine_id="10.0.0.1:6301",
            )
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("data: one\n\n", "data: two\n\n"):
            await resp.write(word.encode())
        await resp.write_eof()
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.ready.set()
        self.loop.run_forever()

    def registration(self, mode: str, hs: int, notify: int) -> ProxyRegistration:
        return ProxyRegistration(
            role=self.role,
            http_address=f"127.0.0.1:{self.port}",
            zmq_address=ZmqAddress("127.0.0.1", hs, notify),
            dp_size=1,
            tp_size=2,
            transfer_mode=mode,
        )

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def fakes() -> Iterator[tuple[FakeInstance, FakeInstance]]:
    p, d = FakeInstance("P"), FakeInstance("D")
    yield p, d
    p.stop()
    d.stop()


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
def test_proxy_routes_both_legs(fakes: tuple[FakeInstance, FakeInstance], mode: str) -> None:
    proxy = load_proxy()
    p, d = fakes
    registry = proxy.Registry()
    registry.update(p.registration(mode, 6301, 61005))
    registry.update(d.registration(mode, 7301, 7501))
    with TestClient(proxy.make_app(registry)) as client:
        resp = client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True}
        )
        assert resp.status_code == 200
        assert resp.text == "data: one\n\ndata: two\n\n"
    (p_headers, p_body, _), (d_headers, d_body, _) = p.requests[0], d.requests[0]
    # Same request id on both legs, embedding both control addresses.
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"]
    addrs = parse_request_id(p_headers["X-Request-Id"])
    assert addrs is not None
    assert (addrs.prefill.handshake_port, addrs.decode.notify_port) == (6301, 7501)
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["kv_transfer_params"]["remote_tp_size"] == 2
    tid = p_body["kv_transfer_params"]["transfer_id"]
    dp = d_body["kv_transfer_params"]
    assert dp["transfer_id"] == tid and dp["do_remote_prefill"] is True
    assert d_body["max_tokens"] == 9
    if mode == "READ":
        assert dp["remote_block_ids"] == [4, 5] and dp["remote_engine_id"] == "10.0.0.1:6301"
    else:
        assert dp["remote_block_ids"] is None


class ResettingPrefill:
    """A prefill whose HTTP server keeps each connection open after answering (keep-alive) and
    resets it (RST) when another request arrives on it: what a client meets when it reuses a
    pooled connection in the moment the server closes it for sitting idle past its keep-alive
    timeout (vLLM's uvicorn: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s). Listens on 127.0.0.1; every
    socket has a timeout, and ``stop`` ends it."""

    def __init__(self) -> None:
        self.answered = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    @staticmethod
    def _read_request(conn: socket.socket) -> dict[str, Any] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
        parsed: dict[str, Any] = json.loads(body)
        return parsed

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            try:
                request = self._read_request(conn)
                if request is None:
                    return
                params = dict(request["kv_transfer_params"])
                params.update(remote_block_ids=[4, 5], remote_engine_id="10.0.0.1:6301")
                body = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": params})
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Connection: keep-alive\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
                )
                with self._lock:
                    self.answered += 1
                if conn.recv(65536):  # a second request on this connection: reset it
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                return

    def registration(self) -> ProxyRegistration:
        return ProxyRegistration(
            role="P",
            http_address=f"127.0.0.1:{self.port}",
            zmq_address=ZmqAddress("127.0.0.1", 6301, 61005),
            dp_size=1,
            tp_size=1,
            transfer_mode="READ",
        )

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        self._accept.join(5)
        for thread in self._threads:
            thread.join(35)


def test_proxy_never_reuses_a_connection_the_instance_may_be_closing() -> None:
    """Before: the proxy pooled keep-alive connections, and a request sent on one the prefill
    closed at that moment failed (HTTP 502, "connection reset"; in WRITE mode the decode then
    waited abort_timeout for writes that never came). Each leg has its own connection now."""
    proxy = load_proxy()
    p, d = ResettingPrefill(), FakeInstance("D")
    try:
        registry = proxy.Registry()
        registry.update(p.registration())
        registry.update(d.registration("READ", 7301, 7501))
        with TestClient(proxy.make_app(registry)) as client:
            for i in range(2):
                resp = client.post(
                    "/v1/completions", json={"model": "m", "prompt": f"hi {i}", "max_tokens": 9}
                )
                assert resp.status_code == 200, f"request {i}: {resp.status_code} {resp.text}"
        assert (p.answered, p.connections) == (2, 2)
        assert len(d.requests) == 2
    finally:
        p.stop()
        d.stop()


def test_proxy_without_instances_answers_503() -> None:
    proxy = load_proxy()
    with TestClient(proxy.make_app(proxy.Registry())) as client:
        resp = client.post("/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 503


def test_connector_pings_register_with_the_proxy(fakes: tuple[FakeInstance, FakeInstance]) -> None:
    proxy = load_proxy()
    p, _ = fakes
    registry = proxy.Registry()
    port = free_port()
    stop = threading.Event()
    thread = threading.Thread(
        target=proxy.discovery_loop, args=(registry, "127.0.0.1", port, stop), daemon=True
    )
    thread.start()
    pinger = ProxyPinger(
        "127.0.0.1", port, p.registration("WRITE", 6301, 61005), interval=0.05
    ).start()
    try:
        deadline = time.monotonic() + 20
        while not registry.snapshot() and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = registry.snapshot()
        assert len(snap) == 1
        assert snap[0]["type"] == "P" and snap[0]["transfer_mode"] == "WRITE"
        assert (
            json.loads(json.dumps(snap[0]))["zmq_address"]
            == "host:127.0.0.1,handshake:6301,notify:61005"
        )
    finally:
        pinger.stop()
        stop.set()
        thread.join(5)


# ---- registration security --------------------------------------------------------------------

SECRET = "registration-secret-0123456789ab"


class Discovery:
    """The proxy's registration listener on a free loopback port, in its own thread."""

    def __init__(self, proxy: Any, verifier: RegistrationVerifier | None) -> None:
        self.registry = proxy.Registry()
        self.port = free_port()
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=proxy.discovery_loop,
            args=(self.registry, "127.0.0.1", self.port, self.stop, verifier),
            daemon=True,
        )
        self.thread.start()

    def addresses(self) -> set[str]:
        return {entry["http_address"] for entry in self.registry.snapshot()}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def _send(port: int, frames: list[bytes], secret: str | None = None) -> None:
    """``frames`` to the proxy's registration port; with ``secret``, over a CURVE connection
    with its keys (as a signing pinger dials a proxy with the secret)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    # ZMQ delivers in the background after close: long enough for a loaded machine's handshake
    # (1 s lost a ping now and then while a full test run shared the cores).
    sock.setsockopt(zmq.LINGER, 10_000)
    MessageAuth(secret).secure_dialer(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart(frames)
    sock.close()


def _wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _registration(http_port: int, mode: str = "READ") -> ProxyRegistration:
    return ProxyRegistration(
        "P", f"127.0.0.1:{http_port}", ZmqAddress("127.0.0.1", 6301, 61005), 1, 1, mode
    )


def test_signed_pings_register_with_a_proxy_holding_the_secret() -> None:
    proxy = load_proxy()
    discovery = Discovery(proxy, RegistrationVerifier(MessageAuth(SECRET)))
    pinger = ProxyPinger(
        "127.0.0.1", discovery.port, _registration(8001), interval=0.05, auth=MessageAuth(SECRET)
    ).start()
    try:
        _wait_until(lambda: discovery.addresses() == {"127.0.0.1:8001"}, "signed registration")
        # Every ping carries a fresh stamp, so repeated pings keep being accepted.
        first = pinger.pings_sent
        _wait_until(lambda: pinger.pings_sent >= first + 3, "more pings")
    finally:
        pinger.stop()
        discovery.close()


def test_proxy_with_a_secret_refuses_unsigned_forged_replayed_and_cross_registrations(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer without the secret cannot even connect (CURVE); over a connection that holds the
    secret's keys, every ping that is unsigned, forged, moved or replayed is dropped."""
    proxy = load_proxy()
    discovery = Discovery(proxy, RegistrationVerifier(MessageAuth(SECRET)))
    auth, other = MessageAuth(SECRET), MessageAuth("not the proxy's secret, 32 bytes")
    genuine = encode(_registration(8001))
    attacker = encode(_registration(6666))
    payload, stamp, tag = auth.seal_registration(genuine)
    try:
        with caplog.at_level(logging.WARNING, logger="moriio_native.proxy"):
            _send(discovery.port, [attacker])  # a stranger's connection: never read
            _send(discovery.port, [payload, stamp, tag], SECRET)
            _wait_until(lambda: discovery.addresses() == {"127.0.0.1:8001"}, "genuine ping")
            attempts: list[list[bytes]] = [
                [attacker],  # unsigned
                other.seal_registration(attacker),  # signed with another secret
                [attacker, stamp, tag],  # the genuine ping's stamp and tag on another payload
                auth.seal(attacker),  # a control-message tag (other domain, no stamp)
                [payload, stamp, tag],  # replay of the genuine ping
            ]
            for frames in attempts:
                _send(discovery.port, frames, SECRET)
            _wait_until(
                lambda: caplog.text.count("dropped registration") >= len(attempts),
                "every refusal",
            )
        assert discovery.addresses() == {"127.0.0.1:8001"}
        for reason in ("not signed", "does not match", "replayed"):
            assert reason in caplog.text
    finally:
        discovery.close()


def test_a_ping_nested_too_deeply_is_dropped_and_registration_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = load_proxy()
    discovery = Discovery(proxy, None)  # no secret: vLLM's router format, the default
    # {"type": "P", "http_address": [[[...1,000 deep...]]]}: 1,030 bytes, under MAX_PING_BYTES
    nested = b"\x82\xa4type\xa1P\xachttp_address" + b"\x91" * 1000 + b"\xc0"
    try:
        with caplog.at_level(logging.WARNING, logger="moriio_native.proxy"):
            _send(discovery.port, [nested])
            # Pings on two connections may arrive in either order: the registration follows
            # only once the nested ping was dropped.
            _wait_until(lambda: "dropped registration" in caplog.text, "the drop")
            _send(discovery.port, [encode(_registration(8001))])
            _wait_until(lambda: discovery.addresses() == {"127.0.0.1:8001"}, "registration")
        assert discovery.thread.is_alive()
    finally:
        discovery.close()


def test_an_unexpected_error_on_one_ping_leaves_registration_working(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = load_proxy()
    checked = proxy.decode

    def bug_on_the_first_ping(payload: bytes, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(proxy, "decode", checked)
        raise ZeroDivisionError("a bug in the proxy")

    monkeypatch.setattr(proxy, "decode", bug_on_the_first_ping)
    discovery = Discovery(proxy, None)
    try:
        with caplog.at_level(logging.WARNING, logger="moriio_native.proxy"):
            # Two connections' pings may arrive in either order: the second is sent only once
            # the first has met the bug, so the bug cannot land on it.
            _send(discovery.port, [encode(_registration(8001))])
            _wait_until(lambda: "a bug in the proxy" in caplog.text, "the bug")
            _send(discovery.port, [encode(_registration(8002))])
            _wait_until(lambda: discovery.addresses() == {"127.0.0.1:8002"}, "registration")
    finally:
        discovery.close()


def test_a_flood_of_bad_pings_logs_a_few_lines_only(caplog: pytest.LogCaptureFixture) -> None:
    """Dropped registrations are logged through a rate limit (20 lines per 10 s, as the
    instances' listeners log their drops): a stranger's garbage must not flood the log. (No
    secret, as vLLM's router format: with one, a stranger's connection is not even read.)"""
    flood = 500
    proxy = load_proxy()
    discovery = Discovery(proxy, None)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{discovery.port}")
    try:
        with caplog.at_level(logging.WARNING, logger="moriio_native.proxy"):
            for _ in range(flood):
                sock.send(b"garbage")
            # Over the same connection, so read after every bad ping.
            sock.send(encode(_registration(8001)))
            _wait_until(lambda: discovery.addresses() == {"127.0.0.1:8001"}, "registration")
    finally:
        sock.close()
        discovery.close()
    lines = [r for r in caplog.records if "dropped registration" in r.getMessage()]
    assert 0 < len(lines) < flood // 10  # two windows at most while the flood is read


def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (IPv4, from /proc)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            out.add(".".join(str(int(host_hex[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def test_proxy_binds_the_configured_address_only() -> None:
    proxy = load_proxy()
    args = proxy.parse_args([])
    assert (args.host, args.discovery_host) == ("127.0.0.1", "127.0.0.1")
    assert proxy.parse_args(["--host", "10.0.0.5"]).discovery_host == "10.0.0.5"
    assert args.handshake_ms == 2000
    assert proxy.parse_args(["--handshake-timeout", "6"]).handshake_ms == 6000
    with pytest.raises(SystemExit):  # argparse's error names the option
        proxy.parse_args(["--handshake-timeout", "0"])
    discovery = Discovery(proxy, None)
    try:
        _wait_until(lambda: _listening_addresses(discovery.port), "the listener")
        assert _listening_addresses(discovery.port) == {"127.0.0.1"}
    finally:
        discovery.close()


def test_connector_with_proxy_auth_registers_with_a_proxy_holding_the_secret(
    tmp_path: Path,
) -> None:
    """The connector itself signs its pings when proxy_auth is set (the example proxy with a
    secret drops unsigned ones)."""
    from test_vllm_support import Side, write_model_dir

    proxy = load_proxy()
    discovery = Discovery(proxy, RegistrationVerifier(MessageAuth(SECRET)))
    http_port = free_port()
    side = Side(
        "prefill",
        "kv_producer",
        "write",
        write_model_dir(tmp_path),
        extra={
            "proxy_ip": "127.0.0.1",
            "proxy_ping_port": discovery.port,
            "http_port": http_port,
            "ping_interval": 0.05,
            "proxy_auth": True,
            "auth_secret": SECRET,
        },
    )
    try:
        _wait_until(
            lambda: discovery.addresses() == {f"127.0.0.1:{http_port}"},
            "the connector's signed registration",
        )
    finally:
        side.shutdown()
        discovery.close()


def test_pings_of_another_mode_or_new_addresses_log_a_few_lines_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Pings of the other transfer mode, and pings at ever new addresses, pass the schema: each
    logged a line of its own (a WARNING, an INFO), so a stranger's valid pings flooded the log.
    (Found by a review, 2026-12-07.)"""
    flood = 300
    proxy = load_proxy()
    discovery = Discovery(proxy, None)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{discovery.port}")
    other = [_registration(20000 + i, "WRITE") for i in range(flood)]
    new = [_registration(30000 + i) for i in range(flood)]
    try:
        with caplog.at_level(logging.INFO, logger="moriio_native.proxy"):
            for reg in [_registration(8001), *other, *new]:
                sock.send(encode(reg))
            _wait_until(lambda: len(discovery.addresses()) == flood + 1, "registrations")
    finally:
        sock.close()
        discovery.close()
    lines = [r for r in caplog.records if r.name == "moriio_native.proxy"]
    assert 0 < len(lines) < flood // 5  # a few windows' bursts at most


def test_silent_instances_are_forgotten_and_the_registry_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registry kept every address that ever pinged: anyone reaching the port (no secret)
    grew the proxy, and every routed request's walk, without bound. Now an instance silent for
    FORGET_AFTER_S is forgotten (then the mode is free again), and past MAX_INSTANCES new
    addresses are dropped while those held keep pinging. (Found by a review, 2026-12-07.)"""
    proxy = load_proxy()
    monkeypatch.setattr(proxy, "FORGET_AFTER_S", 0.5)
    monkeypatch.setattr(proxy, "MAX_INSTANCES", 3)
    registry = proxy.Registry()
    for port in (8001, 8002, 8003, 8004):
        registry.update(_registration(port))
    held = {e["http_address"] for e in registry.snapshot()}
    assert held == {"127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"}
    time.sleep(0.3)
    registry.update(_registration(8001))  # still pinging
    time.sleep(0.3)  # the other two silent for 0.6 s
    registry.update(_registration(8005, "WRITE"))  # the old mode's instance is still held
    assert {e["http_address"] for e in registry.snapshot()} == {"127.0.0.1:8001"}
    time.sleep(0.6)
    registry.update(_registration(8005, "WRITE"))  # every READ instance forgotten
    assert {e["http_address"] for e in registry.snapshot()} == {"127.0.0.1:8005"}


def test_an_instance_registered_at_an_ipv6_address_is_reached_there() -> None:
    """Instances register ``http_address`` as host:port with an IPv6 host unbracketed; the
    proxy's URL for it was not a URL. (Found by a review, 2026-12-07.)"""
    proxy = load_proxy()
    reg = ProxyRegistration("P", "fd00::5:8100", ZmqAddress("fd00::5", 6301, 61005), 1, 1, "READ")
    assert proxy.Instance(reg, 0.0).url == "http://[fd00::5]:8100"
    assert proxy.Instance(_registration(8001), 0.0).url == "http://127.0.0.1:8001"


def test_a_secret_variable_named_but_unset_stops_the_proxy_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--auth-secret-env NAME with $NAME unset or empty ran the proxy without a secret,
    believing every unsigned ping: authentication asked for by name failed open. (Found by a
    review, 2026-12-07.)"""
    proxy = load_proxy()
    monkeypatch.delenv("PROXY_TEST_UNSET_SECRET", raising=False)
    monkeypatch.setenv("PROXY_TEST_EMPTY_SECRET", "")
    for name in ("PROXY_TEST_UNSET_SECRET", "PROXY_TEST_EMPTY_SECRET"):
        with pytest.raises(SystemExit):
            proxy.parse_args(["--auth-secret-env", name])
        assert f"${name} is not set" in capsys.readouterr().err
    monkeypatch.delenv("MORIIO_NATIVE_AUTH_SECRET", raising=False)
    assert proxy.parse_args([]).auth_secret_env is None  # unsigned by default, as before


def test_the_connector_refuses_a_proxy_outside_allowed_peers(tmp_path: Path) -> None:
    """The registration pings dial proxy_ip as any peer is dialled; the connector's pinger was
    built without the allowlist and registered with a proxy outside allowed_peers. Now the
    worker refuses such a config before it starts anything. (Found by a review, 2026-12-07.)"""
    from moriio_native.control.security import PeerNotAllowedError
    from test_vllm_support import Side, write_model_dir

    with pytest.raises(PeerNotAllowedError, match=r"proxy registration to 127\.0\.0\.1"):
        Side(
            "prefill",
            "kv_producer",
            "write",
            write_model_dir(tmp_path),
            extra={
                "allowed_peers": ["10.9.9.0/24"],
                "proxy_ip": "127.0.0.1",
                "proxy_ping_port": free_port(),
                "http_port": free_port(),
            },
        )
