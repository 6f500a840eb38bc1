"""Host cost of a request's block ids: ``moriio_native.BlockPairs`` (copy, check for negative
and repeated ids, sort by local id: what ``Engine.read`` and the first ``write_layer`` of a
request run before planning) against a numpy sort of the same pairs in the same process
(``np.argsort`` of the local ids and both arrays taken in that order, no checks).

Cases: random ids of a cache twice the request's size (a decode's READ in ``gpu_bench``: 2,048
of 4,096 and 4,096 of 8,192 blocks), the same ids already ascending, and a few ids spread over
a large cache. Each case is timed in ``--repeats`` batches of ``--calls`` calls
(``time.perf_counter_ns``); the median per call is reported, and its ratio to the numpy sort's.

    PYTHONPATH=build/dev/python python3 bench/pairs_bench.py --json pairs.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import moriio_native as mn

logger = logging.getLogger("moriio_native.bench.pairs")


def _cases(seed: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    cases = []
    for blocks in (2048, 4096):
        local = rng.permutation(2 * blocks)[:blocks].astype(np.int64)
        remote = rng.permutation(2 * blocks)[:blocks].astype(np.int64)
        cases.append((f"random {blocks} of {2 * blocks}", local, remote))
        order = np.argsort(local)
        cases.append((f"ascending {blocks} of {2 * blocks}", local[order], remote[order]))
    local = rng.choice(1 << 20, 64, replace=False).astype(np.int64)
    remote = rng.choice(1 << 20, 64, replace=False).astype(np.int64)
    cases.append(("random 64 of 1,048,576", local, remote))
    return cases


def _median_ns(fn: Callable[[], object], calls: int, repeats: int) -> float:
    fn()
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(per_call)


def run(calls: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    results = []
    for name, local, remote in _cases(seed):
        pairs = mn.BlockPairs(local, remote)
        if len(pairs) != len(local):
            raise RuntimeError(f"{name}: BlockPairs holds {len(pairs)} pairs, not {len(local)}")

        def numpy_sort(local: np.ndarray = local, remote: np.ndarray = remote) -> object:
            order = np.argsort(local)
            return local[order], remote[order]

        ours = _median_ns(
            lambda local=local, remote=remote: mn.BlockPairs(local, remote), calls, repeats
        )
        base = _median_ns(numpy_sort, calls, repeats)
        results.append(
            {
                "case": name,
                "pairs_us": ours / 1e3,
                "numpy_sort_us": base / 1e3,
                "ratio": ours / base,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=9, help="timed batches per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="printed before each line")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args.calls, args.repeats, args.seed)
    for r in results:
        logger.info(
            "%s%-26s BlockPairs %8.2f us   numpy sort %8.2f us   ratio %.3f",
            args.label,
            r["case"],
            r["pairs_us"],
            r["numpy_sort_us"],
            r["ratio"],
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
