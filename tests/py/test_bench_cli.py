"""``moriio-native bench --json`` structure (not timing), run as a user runs it: the CLI in its
own process with ``--quick``. Every number must be present, finite and positive; the planners
must agree on the runs; every transfer size must have verified bytes; ``--plot`` must write a
PNG."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

import moriio_native as mn
from moriio_native.bench import transfer

TIMEOUT = 600  # hang guard, not a performance bound


def run_bench(*args: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "moriio_native.cli", "bench", "--quick", "--json", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON on stdout (rc={proc.returncode}): {proc.stdout!r} {proc.stderr!r}")
    return proc.returncode, doc, proc.stderr


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_quick_bench_json_has_both_sections(tmp_path) -> None:
    plot = tmp_path / "bench.png"
    args = ["--plot", str(plot)] if importlib.util.find_spec("matplotlib") else []
    rc, doc, err = run_bench("--backend", "loopback", *args)
    assert rc == 0, err
    assert doc["schema"] == "moriio-native-bench/1"
    assert doc["quick"] is True
    assert doc["command"].startswith("moriio-native bench --quick --json --backend loopback")
    assert doc["date"][:2] == "20" and "T" in doc["date"]
    machine = doc["machine"]
    assert machine["nproc"] >= 1 and machine["moriio_native"] == mn.__version__
    assert set(machine) >= {"cpu", "platform", "python", "numpy", "vllm"}

    planning = doc["planning"]
    assert planning["presets"] == ["llama3-8b", "deepseek-v3", "minimax-m3"]
    assert planning["vllm"] is False  # --quick skips the slow vLLM import unless --vllm on
    cases = {(r["preset"], r["context_tokens"]) for r in planning["results"]}
    assert cases == {(p, c) for p in planning["presets"] for c in planning["contexts"]}
    for r in planning["results"]:
        assert r["blocks"] == -(-r["context_tokens"] // r["block_size"])
        assert r["runs_emitted"] >= r["blocks"] * r["layers"] / 2
        for key in (
            "ours_s_per_request",
            "ours_ns_per_run",
            "python_s_per_request",
            "speedup_vs_python",
        ):
            assert _positive(r[key]), (key, r[key])
        assert r["matches_python"] is True
        assert r["vllm_s_per_request"] is None and r["speedup_vs_vllm"] is None

    t = doc["transfer"]
    assert t["backend"] == "loopback" and t["processes"] == 1
    assert [row["run_bytes"] for row in t["rows"]] == list(transfer.QUICK_RUN_SIZES)
    for row in t["rows"]:
        assert row["verified"] is True
        assert row["runs"] * row["run_bytes"] == row["bytes_per_transfer"]
        assert row["engine_runs"] == row["runs"]  # one block = one run, none merged
        for key in (
            "memcpy_gbps",
            "gather_gbps",
            "read_gbps",
            "write_gbps",
            "read_vs_memcpy",
            "write_vs_memcpy",
            "read_vs_gather",
            "write_vs_gather",
        ):
            assert _positive(row[key]), (key, row[key])
        assert row["read_vs_memcpy"] == pytest.approx(row["read_gbps"] / row["memcpy_gbps"])

    if args:
        assert doc["plot"] == str(plot)
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_selected_sections_only() -> None:
    rc, doc, err = run_bench("--planning", "--presets", "deepseek-v3", "--contexts", "2048")
    assert rc == 0, err
    assert doc["transfer"] is None
    assert [(r["preset"], r["context_tokens"]) for r in doc["planning"]["results"]] == [
        ("deepseek-v3", 2048)
    ]
    rc, doc, err = run_bench("--transfer", "--sizes", "8192", "--mib", "1")
    assert rc == 0, err
    assert doc["planning"] is None
    ucx = any(i.name == "ucx" and i.available for i in mn.available_backends())
    assert doc["transfer"]["backend"] == ("ucx" if ucx else "loopback")
    assert doc["transfer"]["processes"] == (2 if ucx else 1)
    assert [r["run_bytes"] for r in doc["transfer"]["rows"]] == [8192]
    assert doc["transfer"]["rows"][0]["verified"] is True


def test_bad_run_size_is_an_error_naming_it() -> None:
    with pytest.raises(mn.InvalidArgumentError, match="run size 1000"):
        transfer.run_transfer_bench("loopback", [1000])
    proc = subprocess.run(
        [sys.executable, "-m", "moriio_native.cli", "bench", "--transfer", "--sizes", "100"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 3 and "run size 100" in proc.stdout
