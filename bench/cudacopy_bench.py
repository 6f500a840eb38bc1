"""The CUDA gather/scatter plugin alone: what one kernel per batch moves, without UCX or the engine.

Loads ``libmoriio_native_cudacopy.so`` (beside the loaded ``libmoriio_native.so``, or
``--plugin``) through its C ABI and, for each run size, copies ``--gib`` GiB of runs between
random blocks of two CUDA caches of twice that size (as a KV transfer names random blocks on
both sides), in batches submitted back to back as the engine submits a large request in pieces:
8192 runs, or as many more as make 256 MiB up to 65,536 runs (``engine_batch_runs``; the
engine's READ cut), or ``--batch-runs`` runs each. Printed per run size: GB/s from the first
submit to the last completion, the host time spent in ``submit`` per run, and two ratios: to one
``torch`` device copy of the same bytes measured fresh at the start of the process, and to a
``copy_`` of the same bytes between the same two caches, timed before each repetition of the
kernel (the same memory state: once earlier sizes' caches were allocated and freed, a plain copy
runs up to ~10 % slower than the fresh one). The contents are checked against
``torch.index_select`` of the same blocks.

Run on a machine with CUDA and torch::

    python3 bench/cudacopy_bench.py --json cudacopy.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from device_copy import device_copy_gbps
from moriio_native.bench.cudacopy import Queue
from moriio_native.cudacopy import Plugin, default_plugin_path

logger = logging.getLogger("moriio_native.bench.cudacopy")


@dataclass
class Row:
    run_bytes: int
    batch_runs: int
    runs: int
    bytes: int
    gbps: float
    ratio_to_device_copy: float  # against the fresh copy at the start of the process
    state_copy_gbps: float  # median copy_ between the same two caches, beside each repetition
    ratio_to_state_copy: float
    submit_ns_per_run: float
    verified: bool


def engine_batch_runs(run_bytes: int) -> int:
    """Runs per piece of a large READ of ``run_bytes`` runs (cpp/engine.cpp's cut: 8192 runs
    once they carry 256 MiB, else up to 65,536 runs)."""
    return min(65536, max(8192, -(-(256 << 20) // run_bytes)))


def measure(queue: Queue, run_bytes: int, args: argparse.Namespace, copy_gbps: float) -> Row:
    import numpy as np
    import torch

    runs = int(args.gib * 2**30) // run_bytes
    src = torch.randint(0, 256, (2 * runs * run_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(2 * runs * run_bytes, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(run_bytes)
    src_blocks = rng.permutation(2 * runs)[:runs].astype(np.int64)
    dst_blocks = rng.permutation(2 * runs)[:runs].astype(np.int64)
    # Sorted by destination, as the engine plans a READ (by local offset); a random order on
    # both sides spreads each moment's accesses over the whole caches and runs slower.
    order = np.argsort(dst_blocks) if args.order == "destination" else np.arange(runs)
    src_blocks, dst_blocks = src_blocks[order], dst_blocks[order]
    src_off = src_blocks * run_bytes
    dst_off = dst_blocks * run_bytes
    sizes = np.full(runs, run_bytes, dtype=np.int64)
    batch = args.batch_runs or engine_batch_runs(run_bytes)
    plans = [
        (dst_off[i : i + batch], src_off[i : i + batch], sizes[i : i + batch])
        for i in range(0, runs, batch)
    ]
    samples, submit, copies = [], [], []
    gather = queue.prepare_gather(dst.data_ptr(), src.data_ptr(), plans)
    nbytes = runs * run_bytes
    for rep in range(args.repeats + 1):  # the first one warms up (tables, module load)
        # The baseline first, so that the kernel writes the destination blocks last: the copy_
        # overwrites the first half of dst, which the check below would otherwise read.
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst[:nbytes].copy_(src[:nbytes])
        torch.cuda.synchronize()
        copy_seconds = time.perf_counter() - start
        start = time.perf_counter()
        in_submit = gather()
        seconds = time.perf_counter() - start
        if rep > 0:
            samples.append(nbytes / seconds / 1e9)
            copies.append(nbytes / copy_seconds / 1e9)
            submit.append(in_submit / runs * 1e9)
    got = dst.view(2 * runs, run_bytes).index_select(0, torch.as_tensor(dst_blocks, device="cuda"))
    want = src.view(2 * runs, run_bytes).index_select(0, torch.as_tensor(src_blocks, device="cuda"))
    verified = bool(torch.equal(got, want))
    gbps = statistics.median(samples)
    state_copy = statistics.median(copies)
    del src, dst, got, want
    if not args.keep_cache:
        torch.cuda.empty_cache()
    return Row(
        run_bytes,
        batch,
        runs,
        nbytes,
        gbps,
        gbps / copy_gbps,
        state_copy,
        gbps / state_copy,
        statistics.median(submit),
        verified,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin", help="path of libmoriio_native_cudacopy.so")
    parser.add_argument(
        "--run-bytes",
        type=int,
        action="append",
        help="run sizes (default 4 KiB, 32 KiB, 64 KiB, 72 KiB, 256 KiB, 2 MiB)",
    )
    parser.add_argument("--gib", type=float, default=4.0, help="GiB gathered per measurement")
    parser.add_argument(
        "--batch-runs",
        type=int,
        default=0,
        help="runs per submitted batch (default 0: as the engine cuts a READ)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--order",
        default="destination",
        choices=["destination", "random"],
        help="run order within the request: sorted by destination (as the engine plans) or not",
    )
    parser.add_argument(
        "--keep-cache",
        action="store_true",
        help="keep torch's freed caches between sizes (default: empty_cache, back to the driver)",
    )
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = args.run_bytes or [4096, 32768, 65536, 73728, 262144, 2 << 20]
    plugin = Plugin(args.plugin or default_plugin_path())
    copy_gbps = device_copy_gbps(int(args.gib * 2**30))
    logger.info("one %.1f GiB torch device copy: %.0f GB/s", args.gib, copy_gbps)
    queue = Queue(plugin, 0)
    rows = []
    try:
        for run_bytes in sizes:
            row = measure(queue, run_bytes, args, copy_gbps)
            rows.append(row)
            logger.info(
                "runs of %7d B x %7d in batches of %5d: %7.1f GB/s = %.2fx device copy, "
                "%.2fx a copy_ in the same state (%.0f GB/s), submit %.1f ns/run, verified=%s",
                row.run_bytes,
                row.runs,
                row.batch_runs,
                row.gbps,
                row.ratio_to_device_copy,
                row.ratio_to_state_copy,
                row.state_copy_gbps,
                row.submit_ns_per_run,
                row.verified,
            )
    finally:
        queue.close()
    # The same copy again at the end: a later state of the GPU (clocks, placement of the caches)
    # would show as a different rate here, next to the ratios computed against the first one.
    logger.info(
        "the same torch device copy after the runs: %.0f GB/s",
        device_copy_gbps(int(args.gib * 2**30)),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
