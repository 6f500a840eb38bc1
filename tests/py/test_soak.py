"""The soak (``python -m moriio_native.bench.soak``) as a user runs it, short: two processes
over UCX, 64 READs in flight, every block accounted for, sampled bytes verified. The full run
(10,000 transfers) is in docs/reliability.md; this checks that the soak's checks hold and that
its report is complete, and that it fails (exit 1) when a check does not hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moriio_native import kvcache as kc
from moriio_native.bench.soak import BlockPool

pytestmark = pytest.mark.ucx

TIMEOUT = 300  # hang guard, not a performance bound


def test_short_soak_has_no_violation(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moriio_native.bench.soak",
            "--transfers",
            "600",
            "--in-flight",
            "64",
            "--verify-every",
            "10",
            "--ucx-tls",
            "tcp",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    soak = doc["soak"]
    assert soak["transfers"] == 600 and soak["in_flight"] == 64
    assert soak["verified"] == 60 and soak["violations"] == []
    assert doc["baseline"]["in_flight"] == 1 and doc["baseline"]["violations"] == []
    assert soak["p50_ms"] <= soak["p99_ms"] <= soak["max_ms"]
    assert doc["throughput_ratio"] is not None


def test_block_pool_catches_a_double_give_back() -> None:
    pool = BlockPool(8, np.random.default_rng(0))
    blocks = pool.take(3, "t1")
    violations: list[str] = []
    pool.give_back(blocks, "t1", violations)
    pool.give_back(blocks, "t1", violations)
    assert len(violations) == 3 and "handed back but held by None" in violations[0]
    assert len(pool.free) == 8


def test_blocks_match_sees_one_wrong_byte() -> None:
    src = kc.build_caches(kc.mixed_model("prefill"), num_blocks=6)
    dst = kc.build_caches(kc.mixed_model("decode"), num_blocks=6)
    kc.fill_random(src, 1)
    kc.fill_random(dst, 2)
    dst.backing[:] = kc.expected_after_copy(dst, src, [4, 1], [0, 5])
    assert kc.blocks_match(dst, src, [4, 1], [0, 5])
    view = dst.views[dst.shapes[0].name]
    flat = kc.logical_view(view, dst.shapes[0])
    flat[1, 0, 0, 0, 0, 0] ^= 1
    assert not kc.blocks_match(dst, src, [4, 1], [0, 5])
    assert kc.blocks_match(dst, src, [4], [0])  # other blocks are not looked at
