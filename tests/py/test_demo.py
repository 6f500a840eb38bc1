"""``moriio-native demo`` end to end, as a user runs it: the CLI in its own process, small presets.

The demo must verify every destination byte and exit 0; a deliberately flipped bit (hidden
``--inject-fault``) inside a destination block or in a block no request touched must make it
report the mismatch and exit 1; bad options exit 3 with a message naming the option; and the
prefill process must be gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native import presets
from moriio_native.demo import KvPattern

TIMEOUT = 600  # hang guard for the whole CLI run, not a performance bound


def _ucx_available() -> bool:
    return any(i.name == "ucx" and i.available for i in mn.available_backends())


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moriio_native.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def run_json(*args: str) -> tuple[int, dict, str]:
    proc = run_cli("--json", *args)
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON on stdout (rc={proc.returncode}): {proc.stdout!r} {proc.stderr!r}")
    return proc.returncode, summary, proc.stderr


def _process_gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("backend", ["auto", "loopback"])
def test_small_demo_verifies_every_request_and_exits_zero(backend) -> None:
    rc, s, err = run_json(
        "--preset", "minimax-m3", "--layers", "2", "--requests", "3", "--backend", backend
    )
    assert rc == 0, err
    assert s["ok"] is True and s["verification"] == "passed"
    assert s["errors"] == []
    expected_backend = "ucx" if backend == "auto" and _ucx_available() else "loopback"
    assert s["backend"] == expected_backend
    if expected_backend == "ucx":
        assert s["processes"] == 2 and s["prefill_pid"] != s["decode_pid"]
        assert _process_gone(s["prefill_pid"])
    else:
        assert s["processes"] == 1 and s["prefill_pid"] == s["decode_pid"]
        assert "ONE process" in s["backend_note"]
    # minimax-m3 mixes dense K/V with key-only indexer caches: 2 caches per layer.
    assert s["caches"] == 4
    per_request = 4 * presets.get_preset("minimax-m3").bytes_per_block(2)
    assert s["bytes_per_block"] * 4 == per_request
    assert set(s["modes"]) == {"read", "write"}
    for mode in s["modes"].values():
        assert mode["requests"] == mode["verified_requests"] == 3
        assert mode["bytes"] == 3 * per_request
        assert mode["mismatches"] == [] and mode["failures"] == []
        assert mode["latency_ms"]["p50"] > 0 and mode["gb_per_s"] > 0
        assert mode["planning_us"]["p50"] > 0
    # Every READ was released; every block came back to the prefill allocator.
    assert s["prefill_releases"] == 3
    assert s["prefill_blocks_held_at_end"] == 0
    # The control plane really carried the notifications, HMAC-tagged, none dropped.
    assert s["control"]["hmac"] is True
    assert s["control"]["prefill_listener"]["delivered"] == 6  # 3 releases + 3 remote_blocks
    assert s["control"]["decode_listener"]["delivered"] == 3  # 3 write_done
    for stats in (s["control"]["prefill_listener"], s["control"]["decode_listener"]):
        assert stats["dropped_auth"] == stats["dropped_malformed"] == 0


def test_demo_with_the_integrity_check_checks_every_request() -> None:
    rc, s, err = run_json(
        "--preset",
        "llama3-8b",
        "--layers",
        "2",
        "--requests",
        "3",
        "--backend",
        "loopback",
        "--verify",
    )
    assert rc == 0, err
    assert s["ok"] is True and s["errors"] == []
    for name, mode in s["modes"].items():
        assert mode["verified_requests"] == 3, name  # the demo's own byte check
        assert (mode["integrity_checks"], mode["integrity_failures"]) == (3, 0), name
    rc, s, err = run_json("--preset", "llama3-8b", "--layers", "2", "--requests", "1")
    assert rc == 0, err
    assert all(m["integrity_checks"] == 0 for m in s["modes"].values())  # off by default


def test_table_output_and_single_mode() -> None:
    proc = run_cli("--preset", "llama3-8b", "--layers", "1", "--requests", "2", "--mode", "write")
    assert proc.returncode == 0, proc.stderr
    assert "verification: passed" in proc.stdout
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│")]
    assert rows == ["WRITE"]


@pytest.mark.parametrize(
    ("fault", "text"),
    [
        ("dst", "elements differ from the prefill pattern"),
        ("outside", "outside the request's blocks changed"),
    ],
)
def test_a_flipped_bit_fails_verification_and_exits_one(fault, text) -> None:
    rc, s, _ = run_json(
        "--preset", "deepseek-v3", "--layers", "2", "--requests", "2", "--inject-fault", fault
    )
    assert rc == 1
    assert s["ok"] is False and s["verification"] == "FAILED"
    first = s["modes"]["read"]
    assert len(first["mismatches"]) == 1 and text in first["mismatches"][0]
    assert "model.layers.0.self_attn.attn" in first["mismatches"][0]
    assert first["verified_requests"] == 1  # only the faulted request failed
    assert s["modes"]["write"]["verified_requests"] == 2
    assert s["prefill_blocks_held_at_end"] == 0
    if s["processes"] == 2:
        assert _process_gone(s["prefill_pid"])


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--preset", "gpt-17"], "unknown model preset 'gpt-17'"),
        (["--layers", "99", "--preset", "llama3-8b"], "layers must be 1..32"),
        (["--blocks-per-request", "8", "--num-blocks", "8"], "num_blocks (8) must exceed"),
        (["--requests", "0"], "requests must be a positive integer"),
    ],
)
def test_bad_options_exit_three_naming_the_option(args, text) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 3
    assert text in " ".join(proc.stdout.split())


def test_ucx_request_when_unavailable_is_refused_cleanly() -> None:
    if _ucx_available():
        pytest.skip("UCX is available here; the refusal path needs a machine without it")
    proc = run_cli("--backend", "ucx", "--layers", "1", "--requests", "1")
    assert proc.returncode == 3 and "UCX backend unavailable" in proc.stdout


# ---- building blocks the verification relies on --------------------------------------------


def test_pattern_tells_blocks_caches_and_requests_apart() -> None:
    cache = kc.build_caches(presets.preset_shapes("minimax-m3", 1), num_blocks=4)
    pattern = KvPattern(cache, seed=0)
    for index, shape in enumerate(cache.shapes):
        blocks = pattern.blocks("req-a", index, 256)
        flat = blocks.reshape(256, -1)
        # Distinct per block position, also for the 1-byte indexer cache.
        assert len({row.tobytes() for row in flat}) == 256, shape.name
        # Another request's content differs block for block.
        other = pattern.blocks("req-b", index, 256).reshape(256, -1)
        assert not any(np.array_equal(a, b) for a, b in zip(flat, other, strict=True))
    dense = pattern.blocks("req-a", 0, 1).tobytes()
    indexer = pattern.blocks("req-a", 1, 1).tobytes()
    assert dense[: len(indexer)] != indexer
    # A second instance (the other process) computes the same bytes.
    assert np.array_equal(
        KvPattern(cache, seed=0).blocks("req-a", 0, 3), pattern.blocks("req-a", 0, 3)
    )


def test_stamp_writes_only_the_given_blocks() -> None:
    cache = kc.build_caches(presets.preset_shapes("deepseek-v3", 2), num_blocks=6)
    kc.fill_random(cache, seed=5)
    before = cache.backing.copy()
    pattern = KvPattern(cache, seed=3)
    pattern.stamp(cache, "req", [4, 1])
    touched = set()
    for offset in np.flatnonzero(cache.backing != before):
        for shape in cache.shapes:
            rel = int(offset) - cache.offsets[shape.name]
            stride = cache.views[shape.name].strides[0]  # block axis outermost in these presets
            if 0 <= rel < 6 * stride:
                touched.add((shape.name, rel // stride))
    assert touched == {(s.name, b) for s in cache.shapes for b in (4, 1)}
    for index, shape in enumerate(cache.shapes):
        view = kc.logical_view(cache.views[shape.name], shape)
        assert np.array_equal(view[[4, 1]], pattern.blocks("req", index, 2))


def test_presets_match_the_published_geometry() -> None:
    llama = presets.preset_shapes("llama3-8b")
    assert len(llama) == 32
    assert all(s.block_bytes() == 2 * 8 * 16 * 128 * 2 for s in llama)
    deepseek = presets.preset_shapes("deepseek-v3")
    assert len(deepseek) == 61
    assert all(s.is_latent and s.block_bytes() == 64 * 576 * 2 for s in deepseek)
    minimax = presets.get_preset("minimax-m3")
    shapes = minimax.shapes()
    assert minimax.illustrative
    assert {s.is_latent for s in shapes} == {True, False}
    assert len({s.block_size for s in shapes}) == 1  # one request's block ids address all
    assert len({s.name for s in shapes}) == len(shapes)
    assert len(presets.preset_shapes("minimax-m3", 3)) == 6
    with pytest.raises(mn.InvalidArgumentError, match="known: deepseek-v3, llama3-8b, minimax-m3"):
        presets.get_preset("llama")
    with pytest.raises(mn.InvalidArgumentError, match=r"layers must be 1\.\.61"):
        presets.preset_shapes("deepseek-v3", 0)
