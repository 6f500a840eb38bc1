"""Host cost of planning a READ of small runs: ``Engine.read`` CPU time per run and the minor
page faults of the calling thread per request, on host memory over the loopback backend.

Two engines in one process hold the llama3-8b-tp8 caches of ``bench/gpu_bench.py`` (32 layers,
one KV head of 128, bf16, block 16) as separated NHD ``[2, N, B, H, D]`` torch CPU tensors: every
block's K and V planes of a layer are 4 KiB runs. Each request reads ``--blocks`` random blocks
(2,048 by default: 131,072 runs). Measured around the ``read`` call only (``time.thread_time_ns``
and ``getrusage(RUSAGE_THREAD)``): the planning, the batch columns and the backend's Submit, not
the copy, which the loopback backend runs on its own thread. The last request's destination
blocks are compared with their source blocks after it completes (``--verify-each``: every
request's, which puts torch's allocations between the reads, and those move malloc's thresholds
and with them the page faults measured).

``--build PATH`` (repeatable) runs the measurement once per build, in that order, each in a
fresh process with ``PYTHONPATH=PATH``, alternating for ``--rounds`` rounds, so that builds are
compared in the same minutes; without it, the ``moriio_native`` already importable is measured.

    python3 bench/plan_bench.py --build build/dev/python --build /path/to/base/python --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger("moriio_native.bench.plan")

LAYERS, HEADS, HEAD, BLOCK = 32, 1, 128, 16


def _side(mn: Any, torch: Any, name: str, num_blocks: int, seed: int) -> tuple[Any, list[Any]]:
    per_layer = 2 * num_blocks * BLOCK * HEADS * HEAD
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randint(-1000, 1000, (LAYERS * per_layer,), generator=gen, dtype=torch.int16)
    backing = backing.view(torch.bfloat16)
    views = [
        backing[i * per_layer : (i + 1) * per_layer].view(2, num_blocks, BLOCK, HEADS, HEAD)
        for i in range(LAYERS)
    ]
    spec = mn.CacheSpec(
        kind="kv",
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype_bytes=2,
        axis_order="nhd",
    )
    engine = mn.Engine(name, "loopback")
    meta = engine.register_kv_caches(
        [mn.LayerRegistration(f"layer.{i}", v, spec) for i, v in enumerate(views)]
    )
    return (engine, meta), views


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process's requests: CPU ns per run and minor faults of each ``read`` call."""
    import numpy as np
    import torch

    import moriio_native as mn

    (prefill, p_meta), p_views = _side(mn, torch, "prefill", args.num_blocks, 1)
    (decode, d_meta), d_views = _side(mn, torch, "decode", args.num_blocks, 2)
    prefill.add_peer(d_meta)
    decode.add_peer(p_meta)
    rng = np.random.default_rng(7)
    ns_per_run, faults, verified, runs = [], [], True, 0
    for r in range(args.requests + 1):  # request 0 warms up
        dst = rng.permutation(args.num_blocks)[: args.blocks].astype(np.int64)
        src = rng.permutation(args.num_blocks)[: args.blocks].astype(np.int64)
        tid = f"plan-{r}"
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        start = time.thread_time_ns()
        decode.read(tid, "prefill", dst, src)
        cpu = time.thread_time_ns() - start
        fault = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        event = decode.wait([tid], timeout=120)[tid]
        if event.state != "done":
            raise RuntimeError(f"{tid} ended {event.state}: {event.message}")
        if r > 0:  # per run of the plan (neighbouring blocks on both sides merge: a few less)
            ns_per_run.append(cpu / event.runs)
            faults.append(fault)
            runs = event.runs
        if r < args.requests and not args.verify_each:
            continue  # verified only at the end: torch's allocations change malloc's thresholds
        d_ids, s_ids = torch.as_tensor(dst), torch.as_tensor(src)
        verified &= all(
            # Compared as int16: the random bits hold NaNs as bf16, which never equal themselves.
            bool(
                torch.equal(
                    d.view(torch.int16).index_select(1, d_ids),
                    p.view(torch.int16).index_select(1, s_ids),
                )
            )
            for d, p in zip(d_views, p_views, strict=True)
        )
    return {
        "runs_per_read": runs,
        "ns_per_run_median": statistics.median(ns_per_run),
        "ns_per_run": ns_per_run,
        "minor_faults_median": statistics.median(faults),
        "minor_faults": faults,
        "verified": verified,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2048, help="blocks per request")
    parser.add_argument("--num-blocks", type=int, default=4096, help="blocks per cache")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--build", action="append", default=[], help="a PYTHONPATH to measure")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--verify-each",
        action="store_true",
        help="verify every request, not only the last (torch allocates between the reads then)",
    )
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.child or not args.build:
        result = measure(args)
        if args.child:
            json.dump(result, sys.stdout)
        else:
            logger.info("%s", json.dumps(result))
        return 0 if result["verified"] else 1
    rows = []
    child = [sys.executable, __file__, "--child", "--blocks", str(args.blocks)]
    child += ["--num-blocks", str(args.num_blocks), "--requests", str(args.requests)]
    child += ["--verify-each"] if args.verify_each else []
    for rnd in range(args.rounds):
        for build in args.build:
            env = {**os.environ, "PYTHONPATH": build}
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
            result = {"build": build, "round": rnd, **json.loads(out.stdout)}
            rows.append(result)
            logger.info(
                "round %d %-40s Engine.read %.1f ns/run (median of %d), minor faults per read "
                "%s, verified=%s",
                rnd,
                build,
                result["ns_per_run_median"],
                args.requests,
                result["minor_faults"],
                result["verified"],
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
