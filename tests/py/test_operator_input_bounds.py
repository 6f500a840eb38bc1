"""Configuration and operator input refused at start-up (or, where a peer may differ, warned
about), naming the key and the value. Each failed before its fix (2026-12-07)."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from moriio_native.errors import InvalidArgumentError
from moriio_native.pd import PdConfig
from moriio_native.vllm.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[2]


def _refused_or_warned(
    caplog: pytest.LogCaptureFixture, extra: dict[str, Any], role: str, *keys: str
) -> None:
    """``extra`` is either refused (InvalidArgumentError naming every key of ``keys``) or
    accepted with a WARNING naming them: never accepted silently."""
    caplog.set_level(logging.WARNING, logger="moriio_native")
    try:
        ConnectorConfig.from_extra_config(extra, role=role)
    except InvalidArgumentError as exc:
        for key in keys:
            assert key in str(exc), f"refusal does not name {key!r}: {exc}"
        return
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and all(k in r.getMessage() for k in keys)
    ]
    assert warned, f"{extra} (role {role}) accepted silently: no refusal, no warning naming {keys}"


# ---- 1. READ: a prefill whose abort_timeout is not above transfer_timeout + 1 s -------------
#
# The prefill's answer states hold_until = now + abort_timeout; a decode reads only when
# prefill_now + transfer_timeout + 1 s <= hold_until (pd/context.py check_hold). With the same
# kv_connector_extra_config on both instances (the usual deployment) and abort_timeout <=
# transfer_timeout + 1, EVERY READ is refused and recomputed: disaggregation silently off.
@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
@pytest.mark.parametrize(
    "extra",
    [
        {"mode": "read", "abort_timeout": 20},  # transfer_timeout default 30
        {"mode": "read", "transfer_timeout": 120},  # abort_timeout default 120
        {"mode": "read", "transfer_timeout": 60, "defer_timeout": 45},
    ],
    ids=["abort20", "transfer120", "legacy_defer45"],
)
def test_read_prefill_abort_timeout_not_above_transfer_timeout(
    caplog: pytest.LogCaptureFixture, extra: dict[str, Any], role: str
) -> None:
    _refused_or_warned(caplog, extra, role, "abort_timeout", "transfer_timeout")


# ---- 2. WRITE: a decode whose transfer_timeout is not below its abort_timeout ----------------
#
# docs/configuration.md: transfer_timeout "keep it ... below the decode's abort_timeout". A WRITE
# decode gives a request abort_timeout for its KV, so a transfer_timeout at or above it is never
# reached: the request is quarantined/recomputed at abort_timeout while the prefill still writes.
@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_write_decode_transfer_timeout_not_below_abort_timeout(
    caplog: pytest.LogCaptureFixture, role: str
) -> None:
    _refused_or_warned(
        caplog,
        {"mode": "write", "transfer_timeout": 180},
        role,
        "abort_timeout",
        "transfer_timeout",
    )


# ---- 3. ping_interval unbounded -------------------------------------------------------------
#
# 1e-9 s makes the pinger thread of rank 0 spin (ProxyPinger._run sends, waits ~0 s, sends
# again: tens of thousands of pings a second, holding the GIL of vLLM's worker process); 1e6 s
# pings once and never again, so any router that forgets silent instances (the example proxy:
# STALE_AFTER_S = 30) stops routing to it after its first half minute.
@pytest.mark.parametrize("interval", [1e-9, 1e-6, 1e6])
def test_ping_interval_out_of_sane_range_refused(interval: float) -> None:
    extra = {
        "ping_interval": interval,
        "proxy_ip": "127.0.0.1",
        "http_port": 8000,
        "host_ip": "127.0.0.1",
    }
    with pytest.raises(InvalidArgumentError, match="ping_interval"):
        ConnectorConfig.from_extra_config(extra, role="kv_producer")


# ---- 4. PdConfig (the framework-free core's settings) takes any truthy/odd value -------------
_PD_BASE = dict(
    engine_id="e/dp0/tp0",
    mode="read",
    producer=True,
    consumer=False,
    host_ip="127.0.0.1",
    handshake_port=0,
    notify_port=0,
)


@pytest.mark.parametrize(
    "extra",
    [
        {"transfer_timeout": math.inf},  # ConnectorConfig bounds it to a year; the core does not
        {"abort_timeout": math.inf},  # hold_until_ms(inf) raises OverflowError
        {"abort_timeout": True},  # a bool taken as 1 s
        {"verify": "false"},  # a non-empty string: verify ON
        {"confirm_reads": "false"},
        {"max_peers": 2.5},
        {"tp_size": True},
    ],
    ids=lambda e: "-".join(f"{k}={v!r}" for k, v in e.items()),
)
def test_pd_config_refuses_bad_types_and_non_finite(extra: dict[str, Any]) -> None:
    key = next(iter(extra))
    with pytest.raises(InvalidArgumentError, match=key):
        PdConfig(**{**_PD_BASE, **extra})


def test_pd_config_string_timeout_refused_as_invalid_argument() -> None:
    # Today: TypeError "'>' not supported between instances of 'str' and 'int'", naming nothing.
    with pytest.raises(InvalidArgumentError, match="abort_timeout"):
        PdConfig(**{**_PD_BASE, "abort_timeout": "30"})


# ---- 5. the example proxy's ports ---------------------------------------------------------
def _load_proxy() -> Any:
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    pytest.importorskip("uvicorn")
    spec = importlib.util.spec_from_file_location(
        "moriio_example_proxy_bounds", ROOT / "examples/launch/proxy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "70000"],
        ["--port", "-1"],
        ["--port", "0"],  # uvicorn binds a random port nobody is told about
        ["--discovery-port", "0"],  # ZMQ binds a random port: no instance ever registers
    ],
    ids=["port70000", "port-1", "port0", "discovery0"],
)
def test_proxy_refuses_bad_ports(argv: list[str]) -> None:
    proxy = _load_proxy()
    with pytest.raises(SystemExit) as info:
        proxy.parse_args(argv)
    assert info.value.code == 2  # argparse's usage error, naming the option


# ---- 6. `moriio-native demo --num-blocks` too large: a traceback and exit 1 ("mismatch") --------
#
# DemoConfig.validated bounds requests/blocks/timeout but not the cache size: 10**15 blocks
# pass, the prefill worker thread dies with MemoryError and the main thread raises ValueError
# ("Maximum allowed dimension exceeded") out of run_demo -- an uncaught traceback, exit 1, which
# the docs reserve for "mismatch / failed transfer / block left held"; 3 is "could not start".
def test_demo_absurd_num_blocks_exits_3_naming_it() -> None:
    import os
    import resource
    import subprocess

    def limit() -> None:  # no real allocation may succeed, whatever the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moriio_native.cli",
            "demo",
            "--backend",
            "loopback",
            "--num-blocks",
            str(10**15),
            "--requests",
            "1",
            "--layers",
            "1",
            "--mode",
            "read",
            "--timeout",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=limit,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, f"exit {proc.returncode}:\n{out[-1500:]}"
    assert "num_blocks" in out or "num-blocks" in out
    assert "Traceback" not in out


# ---- 7. kv_transfer_params: a deeply nested remote_block_ids escapes as RecursionError --------
#
# msgspec refuses the value (ValidationError), then explain() -> describe() calls repr() of the
# whole value to name it, and repr of a ~950-deep list overflows the interpreter's recursion
# limit when the caller already uses some stack. parse_kv_transfer_params then raises
# RecursionError, not InvalidArgumentError -- and SchedulerSide._parse catches only the latter,
# so the error would propagate out of the connector's scheduler hook into vLLM's schedule().
# A JSON body carries such a value (json.loads takes it below).
def _stack_depth() -> int:
    frame, n = sys._getframe(), 0
    while frame is not None:
        frame, n = frame.f_back, n + 1
    return n


def _deep_params() -> dict[str, Any]:
    """As deep as json.loads can parse at the caller's stack depth (an API server's)."""
    import json

    depth = sys.getrecursionlimit() - _stack_depth() - 15
    return json.loads('{"transfer_id": "t", "remote_block_ids": ' + "[" * depth + "]" * depth + "}")


def _with_stack(frames: int, fn: Any) -> Any:
    return fn() if frames == 0 else _with_stack(frames - 1, fn)


def test_parse_kv_transfer_params_deep_nesting_is_invalid_argument() -> None:
    from moriio_native.control.addressing import parse_kv_transfer_params

    raw = _deep_params()
    with pytest.raises(InvalidArgumentError, match="remote_block_ids"):
        _with_stack(60, lambda: parse_kv_transfer_params(raw))


def test_scheduler_ignores_deeply_nested_kv_transfer_params() -> None:
    from moriio_native.vllm.scheduler import SchedulerSide

    cfg = ConnectorConfig.from_extra_config({"host_ip": "127.0.0.1"}, role="kv_consumer")
    sched = SchedulerSide(cfg, 16, 0, None)  # type: ignore[arg-type]  # _parse uses no layout
    raw = _deep_params()
    # Expected: None (logged, "it runs without KV transfer"), as for any other bad params.
    assert _with_stack(60, lambda: sched._parse("req-1", raw)) is None


# ---- 8. transfer_timeout below a millisecond: accepted here, refused by the Engine later -------
#
# TransferSeconds is documented as "what the engine takes as transfer_timeout", but the Engine
# refuses anything under 1 ms (engine.py: "transfer_timeout must be at least one millisecond"),
# so the refusal comes at register_kv_caches -- after vLLM loaded the model -- and names no
# kv_connector_extra_config key.
def test_sub_millisecond_transfer_timeout_refused_at_parse() -> None:
    with pytest.raises(InvalidArgumentError, match="transfer_timeout"):
        ConnectorConfig.from_extra_config(
            {"transfer_timeout": 0.0004, "host_ip": "127.0.0.1"}, role="kv_producer"
        )


def test_pd_config_takes_the_longest_timeouts_the_connector_config_takes() -> None:
    """A value the connector's config accepts must not be refused later by PdConfig (the
    worker builds one from it after vLLM loaded the model): the longest of each timeout."""
    longest = ConnectorConfig.from_extra_config(
        {"transfer_timeout": 365 * 86400, "abort_timeout": 1e9, "quarantine_timeout": 1e9},
        role="kv_consumer",
    )
    config = PdConfig(
        engine_id="d:1/dp0/tp0",
        mode="read",
        producer=False,
        consumer=True,
        host_ip="127.0.0.1",
        handshake_port=0,
        notify_port=0,
        transfer_timeout=longest.transfer_timeout,
        abort_timeout=longest.abort_timeout,
        quarantine_timeout=longest.quarantine_timeout,
    )
    assert config.quarantine_timeout == 1e9
