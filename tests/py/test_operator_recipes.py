"""The operator surface as a new user meets it (a review, 2026-12-07) (docs/vllm.md's launch recipe,
examples/launch/*, the CLI). Each test follows the documentation literally."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moriio_native.control.channel import ProxyPinger
from moriio_native.control.messages import ProxyRegistration, ZmqAddress
from moriio_native.control.security import ControlSecurity, PeerNotAllowedError
from moriio_native.vllm.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"


def _recipe_config(env: dict[str, str], role: str, ports: tuple[int, int, int]) -> dict:
    """kv_transfer_config as prefill.sh / decode.sh build it (common.sh's function)."""
    script = (
        f"source {LAUNCH}/common.sh && kv_transfer_config {role} {ports[0]} {ports[1]} {ports[2]}"
    )
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True, timeout=30
    )
    return json.loads(out.stdout)


def _recipe_from_docs() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """docs/vllm.md "Launch recipe": (what step 0 exports, the variables the prefill.sh line
    sets, the variables the decode.sh line sets). A value computed by a command ($(...)) is
    replaced by a fixed test value."""
    import re
    import shlex

    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text.split("## Launch recipe", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    exported: dict[str, str] = {}
    lines: dict[str, dict[str, str]] = {}
    for line in section.splitlines():
        line = line.strip()
        if line.startswith("export "):
            for item in re.findall(r"(\w+)=(\S+)", line[len("export ") :]):
                exported[item[0]] = "ab" * 32 if item[1].startswith("$(") else item[1]
            continue
        for script in ("prefill.sh", "decode.sh"):
            if line.endswith(f"examples/launch/{script}"):
                words = shlex.split(line)[:-1]
                lines[script] = dict(w.split("=", 1) for w in words)
    return exported, lines["prefill.sh"], lines["decode.sh"]


def _env_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


# ---- 1. docs/vllm.md "Launch recipe (one host)": the decode may not dial its prefill -------------


@pytest.mark.parametrize("mode", ["read", "write"])
def test_one_host_launch_recipe_lets_the_decode_dial_its_prefill(tmp_path: Path, mode: str) -> None:
    # A host whose first address (hostname -I) is not 127.0.0.1, as almost every real host:
    # common.sh takes VLLM_HOST_IP from it. docs/vllm.md step 2/3, literally:
    #   MODE=read examples/launch/prefill.sh
    #   MODE=read ALLOWED_PEERS=127.0.0.1/32 examples/launch/decode.sh
    fake = tmp_path / "bin"
    fake.mkdir()
    hostname = fake / "hostname"
    hostname.write_text("#!/bin/sh\necho '10.0.0.5 fd00::2 '\n")
    hostname.chmod(hostname.stat().st_mode | stat.S_IEXEC)
    env = _env_without("VLLM_HOST_IP", "ALLOWED_PEERS", "EXTRA_CONFIG", "MORIIO_NATIVE_AUTH_SECRET")
    env["PATH"] = f"{fake}:{env['PATH']}"
    _, prefill_vars, decode_vars = _recipe_from_docs()
    prefill_raw = _recipe_config(
        {**env, **prefill_vars, "MODE": mode}, "kv_producer", (20005, 6301, 61005)
    )
    decode_raw = _recipe_config(
        {**env, **decode_vars, "MODE": mode}, "kv_consumer", (40005, 7301, 7501)
    )
    prefill = ConnectorConfig.from_extra_config(
        prefill_raw["kv_connector_extra_config"], role="kv_producer"
    )
    decode = ConnectorConfig.from_extra_config(
        decode_raw["kv_connector_extra_config"], role="kv_consumer"
    )
    # The prefill advertises (remote_host of its answer, its handshake/notify listeners bind it)
    # host_ip; the decode dials exactly that address for the handshake, the READ's release
    # and the WRITE's remote_blocks (control/channel.py: security.allowlist.require).
    assert prefill.bind_host == prefill.host_ip
    decode_security = ControlSecurity.from_config(decode.control_config())
    try:
        decode_security.allowlist.require(
            prefill.host_ip, purpose=f"handshake with {prefill.host_ip}:{prefill.handshake_port}"
        )
    except PeerNotAllowedError as exc:
        pytest.fail(
            f"the documented one-host recipe cannot work: prefill host_ip {prefill.host_ip}, "
            f"decode allowed_peers {decode.allowed_peers}: {exc}"
        )


# ---- 2. docs/vllm.md step 0 (export MORIIO_NATIVE_AUTH_SECRET) + proxy.sh: nothing registers -----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_proxy():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("aiohttp")
    spec = importlib.util.spec_from_file_location("revc_launch_proxy", LAUNCH / "proxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("proxy_auth", [None, "1"], ids=["recipe-as-documented", "PROXY_AUTH=1"])
def test_launch_recipe_with_the_optional_secret_registers_with_the_proxy(
    monkeypatch: pytest.MonkeyPatch, proxy_auth: str | None
) -> None:
    # "PROXY_AUTH=1" is the control: the same harness registers once the pings are signed.
    proxy = _load_proxy()
    exported, prefill_vars, _ = _recipe_from_docs()
    secret = exported.get("MORIIO_NATIVE_AUTH_SECRET")
    assert secret, "step 0 of the recipe exports the secret"
    # Step 0: export MORIIO_NATIVE_AUTH_SECRET=$(openssl rand -hex 32), in the shell that then
    # runs proxy.sh, prefill.sh and decode.sh.
    monkeypatch.setenv("MORIIO_NATIVE_AUTH_SECRET", secret)
    ping_port = _free_port()
    # Step 1: proxy.sh -> proxy.py, as its main() sets itself up.
    args = proxy.parse_args(["--discovery-port", str(ping_port)])
    verifier = proxy.RegistrationVerifier(
        proxy.MessageAuth(os.environ.get(proxy.ENV_AUTH_SECRET) or None)
    )
    registry = proxy.Registry()
    stop = threading.Event()
    loop = proxy.start_discovery(args, registry, stop, verifier)
    pinger = None
    try:
        # Step 2: prefill.sh with the recipe's defaults (PROXY_AUTH is not mentioned).
        env = _env_without("ALLOWED_PEERS", "EXTRA_CONFIG", "PROXY_AUTH")
        env.update(exported)
        env.update(prefill_vars)
        env.update(
            VLLM_HOST_IP="127.0.0.1",
            PROXY_PING_PORT=str(ping_port),
        )
        if proxy_auth is not None:
            env["PROXY_AUTH"] = proxy_auth
        raw = _recipe_config(env, "kv_producer", (20005, 6301, 61005))
        cfg = ConnectorConfig.from_extra_config(
            {**raw["kv_connector_extra_config"], "ping_interval": 0.1}, role="kv_producer"
        )
        security = ControlSecurity.from_config(cfg.control_config())
        assert cfg.proxy_ip is not None and cfg.http_port is not None
        # What the worker does (vllm/worker.py _start_pinger).
        pinger = ProxyPinger(
            cfg.proxy_ip,
            cfg.proxy_ping_port,
            ProxyRegistration(
                role="P",
                http_address=f"{cfg.host_ip}:{cfg.http_port}",
                zmq_address=ZmqAddress(cfg.host_ip, cfg.handshake_port, cfg.notify_port),
                dp_size=1,
                tp_size=1,
                transfer_mode=cfg.transfer_mode,
            ),
            interval=cfg.ping_interval,
            auth=security.auth if cfg.proxy_auth else None,
            allowlist=security.allowlist,
        ).start()
        deadline = time.monotonic() + 5.0
        while not registry.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert registry.snapshot(), (
            "the recipe's prefill never registered with the recipe's proxy "
            f"(proxy verifies signatures: {verifier.enabled}; instance proxy_auth: "
            f"{cfg.proxy_auth}; pings handed to ZMQ: {pinger.pings_sent})"
        )
    finally:
        if pinger is not None:
            pinger.stop()
        stop.set()
        loop.join(5)


# ---- 3. the protocol version the docs state vs the one the code speaks ---------------------------


def test_documented_protocol_version_is_the_one_spoken() -> None:
    import re

    from moriio_native.control.messages import PROTOCOL_VERSION

    protocol = (ROOT / "docs" / "protocol.md").read_text()
    # handshake_request's and handshake_response's rows: "| `protocol_version` | int 1..65536 | `N`"
    stated = re.findall(r"^\| `protocol_version` \| int 1\.\.65536 \| `(\d+)`", protocol, re.M)
    speaks = re.findall(r"this side speaks (\d+)\)", protocol)
    trouble = (ROOT / "docs" / "troubleshooting.md").read_text()
    this_one = re.findall(r"\((\d+): this one;", trouble)
    readme = (ROOT / "README.md").read_text()
    readme_speaks = re.findall(r"this side speaks (\d+)\)", readme)
    assert stated and this_one and readme_speaks
    wrong = {
        "docs/protocol.md protocol_version rows": stated,
        "docs/protocol.md 'this side speaks'": speaks,
        "docs/troubleshooting.md '(N: this one)'": this_one,
        "README.md 'this side speaks'": readme_speaks,
    }
    wrong = {k: v for k, v in wrong.items() if any(int(n) != PROTOCOL_VERSION for n in v)}
    assert not wrong, f"the code speaks protocol version {PROTOCOL_VERSION}; the docs say {wrong}"


# ---- 4/5. exit codes of the CLI vs docs/quickstart.md and docs/configuration.md ------------------


def _cli(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moriio_native.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "sideways"],
        ["--requests", "abc"],
        ["--backend", "mori"],
        ["--requests", "0"],  # the control: a bad value argparse does not check gives 3
    ],
    ids=["bad-mode", "non-int-requests", "unknown-backend", "zero-requests"],
)
def test_demo_bad_option_exits_3_as_documented(argv: list[str]) -> None:
    # quickstart.md: "Exit code: ... 3 the demo could not start (bad option, ...)"; the demo's
    # own --help: "3: could not start".
    out = _cli("demo", "--backend", "loopback", "--layers", "1", *argv)
    assert out.returncode == 3, (out.returncode, out.stderr[-300:])


def test_bench_setup_failure_is_exit_3_not_the_bytes_disagree_code() -> None:
    # docs/configuration.md: bench "Exit 1 when a transfer's bytes or the planners' runs
    # disagree"; _cmd_bench answers 3 ("bench could not run") for what stops it from running.
    # A --mib past what can be allocated stops it before any byte moved.
    out = _cli(
        "bench",
        "--transfer",
        "--backend",
        "loopback",
        "--sizes",
        "4096",
        "--repeats",
        "1",
        "--mib",
        str(1 << 44),
    )
    assert out.returncode == 3 and "bench could not run" in (out.stdout + out.stderr), (
        out.returncode,
        (out.stdout + out.stderr)[-400:],
    )


# ---- 6. examples/launch/proxy.py: a registration port it cannot bind leaves it serving 503s -----


def test_proxy_that_cannot_bind_its_registration_port_does_not_keep_serving() -> None:
    import urllib.error
    import urllib.request

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)  # another proxy, or vllm-router, already owns the registration port
    discovery_port = taken.getsockname()[1]
    http_port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(LAUNCH / "proxy.py"),
            "--port",
            str(http_port),
            "--discovery-port",
            str(discovery_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env_without("MORIIO_NATIVE_AUTH_SECRET"),
    )
    serving = False
    try:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=1):
                    serving = True
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
    finally:
        taken.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
        else:
            out, _ = proc.communicate()
    assert not serving, (
        "proxy.py answers /health although its registration listener died (no instance can "
        f"ever register, every request gets 503); its output:\n{out[-800:]}"
    )
    assert proc.returncode not in (None, 0)


# ---- 7. demo --timeout outside what the engine takes: a worker traceback naming another key ------


@pytest.mark.parametrize("timeout", ["inf", "1e300", "0.0001"])
def test_demo_refuses_a_bad_timeout_naming_the_option(timeout: str) -> None:
    out = _cli(
        "demo", "--backend", "loopback", "--layers", "1", "--requests", "1", "--timeout", timeout
    )
    text = out.stdout + out.stderr
    assert out.returncode == 3
    # DemoConfig.validated() promises "InvalidArgumentError naming the bad option", before any
    # worker starts.
    assert "demo: timeout" in text and "Traceback" not in text, text[-600:]


# ---- 8. examples/launch/proxy.py: after a switch of mode it routes nothing for 10 minutes ---


def test_proxy_routes_a_pair_restarted_in_the_other_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = _load_proxy()
    now = [1000.0]
    monkeypatch.setattr(proxy.time, "monotonic", lambda: now[0])

    def reg(role: str, port: int, mode: str) -> ProxyRegistration:
        return ProxyRegistration(
            role=role,
            http_address=f"127.0.0.1:{port}",
            zmq_address=ZmqAddress("127.0.0.1", port + 1, port + 2),
            dp_size=1,
            tp_size=1,
            transfer_mode=mode,
        )

    registry = proxy.Registry()
    # A READ pair serves ...
    registry.update(reg("P", 20005, "READ"))
    registry.update(reg("D", 40005, "READ"))
    assert registry.pick() is not None
    # ... then the pair is replaced by one with MODE=write (common.sh: "the same on both
    # instances") on other ports or hosts.
    # The READ instances stop pinging; the WRITE ones ping every ping_interval.
    for _ in range(20):  # one minute of 3 s pings: the READ pair is long stale (30 s)
        now[0] += 3.0
        registry.update(reg("P", 20006, "WRITE"))
        registry.update(reg("D", 40006, "WRITE"))
    picked = registry.pick()
    assert picked is not None and picked[2] == "WRITE", (
        "the proxy keeps the mode of instances silent for a minute and ignores the live pair "
        f"(answering 503) until FORGET_AFTER_S={proxy.FORGET_AFTER_S:.0f}s passed: "
        f"{registry.snapshot()}"
    )


# ---- 9. the bind_host that listens on every interface, IPv6 ones too ---------------------------


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_docs_name_a_bind_host_for_ipv6_peers_and_the_refusal_points_to_it() -> None:
    """README said bind_host "*" binds every interface, and the connector refused host_ip "::"
    telling the operator to set it; but "*" binds IPv4 only (ZMQ without IPV6), so an instance
    with an IPv6 host_ip refused every peer. "*" stays IPv4 (dual-stack would need IPv6 in
    every kernel it runs on); the docs and the refusal now name "::" for IPv6 too."""
    readme = (ROOT / "README.md").read_text()
    assert '`"*"` binds every IPv4 interface' in readme
    assert '`"::"` binds every interface, IPv6 ones too' in readme
    with pytest.raises(ValueError, match=r"bind_host '\*' \(IPv4\) or '::' \(IPv6 too\)"):
        ConnectorConfig.from_extra_config({"host_ip": "::"}, role="kv_producer")


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("accept_only", [False, True])
def test_bind_host_of_every_ipv6_interface_serves_ipv4_and_ipv6_peers(accept_only: bool) -> None:
    from moriio_native.control.channel import NotifyListener

    config = {"allowed_peers": ["127.0.0.1", "::1"], "accept_only_allowed_peers": accept_only}
    # The connector's own check of the same settings passes.
    ConnectorConfig.from_extra_config(
        {**config, "host_ip": "::1", "bind_host": "::"}, role="kv_producer"
    )
    listener = NotifyListener(0, ControlSecurity.from_config(config), bind_host="::")
    try:
        reached = {}
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family) as s:
                s.settimeout(2)
                try:
                    s.connect((address, listener.port))
                    reached[address] = True
                except OSError as exc:
                    reached[address] = str(exc)
    finally:
        listener.close()
    assert reached == {"127.0.0.1": True, "::1": True}, reached


def test_demo_timeout_the_check_accepts_is_one_the_demo_can_wait() -> None:
    """The first fix checked --timeout up front as "0.001 s to a year", but the demo waits on
    its pipe with Connection.poll(timeout), which raises OverflowError past INT_MAX milliseconds
    (24.8 days): ``demo --timeout 3000000`` passed the check, started the prefill worker, then
    died in _Router.recv with a traceback instead of being refused naming the option."""
    from moriio_native import cli

    rc = cli.main(["demo", "--timeout", "3000000", "--backend", "loopback"])
    assert rc == 3
