"""The transposing cell copy alone: a request between two K/V caches of different axis orders.

Prefill cache ``[2,N,B,H,D]`` (NHD, separated K/V planes) and decode cache ``[N,2,H,B,D]``
(HND, interleaved), bf16, by default llama3-8b's layer (8 KV heads, head size 128, 16-token
blocks: 256-byte cells, 64 KiB blocks). The decode reads ``--gib`` GiB of random blocks of a
prefill cache twice that size into random blocks of its own, in batches of ``--batch-blocks``
blocks (one layer of a 2,048-block request each), two ways, each timed from the first submit to
the last completion:

- **cells**: ``submit_cells`` with the pair's cell geometry (``BlockTemplate.cell_geometry``),
  one entry per block;
- **runs**: the pair's run plan (``BlockTemplate.plan``: one 256-byte run per cell) through
  ``submit`` in batches of 8,192 runs, as the engine submits it today (on ``--runs-gib``).

Printed: GB/s and the ratio to one ``torch`` device copy of the same bytes measured in the same
run; every destination block is compared with the source block it came from, transposed by
torch. Run on a machine with CUDA and torch::

    python3 bench/cellcopy_bench.py --json cellcopy.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import moriio_native as mn
from device_copy import device_copy_gbps
from moriio_native.bench.cudacopy import Queue, cells_of
from moriio_native.cudacopy import Plugin, default_plugin_path

logger = logging.getLogger("moriio_native.bench.cellcopy")


@dataclass
class Row:
    path: str
    blocks: int
    bytes: int
    copies: int  # submitted entries: blocks (cells) or runs
    gbps: float
    ratio_to_device_copy: float
    verified: bool


def _caches(blocks: int, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    import torch

    h, b, d = args.heads, args.block, args.head_size
    bits = torch.randint(
        -(2**15), 2**15, (2, 2 * blocks, b, h, d), dtype=torch.int16, device="cuda"
    )
    prefill = bits.view(torch.bfloat16)
    decode = torch.zeros((2 * blocks, 2, h, b, d), dtype=torch.bfloat16, device="cuda")

    def spec(order: str) -> Any:
        return mn.CacheSpec(
            block_size=b, num_kv_heads=h, head_size=d, dtype_bytes=2, axis_order=order
        )

    local = mn.describe_layer("decode", decode, spec("hnd"))
    remote = mn.describe_layer("prefill", prefill, spec("nhd"))
    return prefill, decode, local, remote


def measure(queue: Queue, path: str, gib: float, args: argparse.Namespace) -> Row:
    import numpy as np
    import torch

    block_bytes = 2 * args.heads * args.block * args.head_size * 2
    blocks = int(gib * 2**30) // block_bytes
    prefill, decode, local, remote = _caches(blocks, args)
    rng = np.random.default_rng(blocks)
    local_ids = rng.permutation(2 * blocks)[:blocks]
    remote_ids = rng.permutation(2 * blocks)[:blocks]
    tmpl = mn.block_template(local, remote)
    dst, src = decode.data_ptr(), prefill.data_ptr()
    if path == "cells":
        geometry = tmpl.cell_geometry
        assert geometry is not None and tmpl.prefers_cell_copy
        cells = cells_of(geometry, into_local=True)
        work: list[Any] = []
        for i in range(0, blocks, args.batch_blocks):
            pairs = mn.BlockPairs(
                local_ids[i : i + args.batch_blocks].tolist(),
                remote_ids[i : i + args.batch_blocks].tolist(),
            )
            work.append(tmpl.block_offsets(pairs))
        copies = blocks
        run = queue.prepare_cells(dst, src, cells, work)
    else:
        plan = tmpl.plan(mn.BlockPairs(local_ids.tolist(), remote_ids.tolist()))
        lo, ro, sz = plan.local_offsets, plan.remote_offsets, plan.sizes
        work = [
            (lo[i : i + 8192], ro[i : i + 8192], sz[i : i + 8192]) for i in range(0, len(sz), 8192)
        ]
        copies = len(sz)
        run = queue.prepare_gather(dst, src, work)

    samples = []
    for rep in range(args.repeats + 1):  # the first one warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        if rep > 0:
            samples.append(blocks * block_bytes / seconds / 1e9)
    lidx = torch.as_tensor(local_ids, device="cuda")
    ridx = torch.as_tensor(remote_ids, device="cuda")
    got = decode.index_select(0, lidx)  # [n, 2, H, B, D]
    want = prefill.index_select(1, ridx).permute(1, 0, 3, 2, 4)  # [2,n,B,H,D] -> [n,2,H,B,D]
    verified = bool(torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16)))
    gbps = statistics.median(samples)
    copy_gbps = device_copy_gbps(blocks * block_bytes)
    del prefill, decode, got, want
    torch.cuda.empty_cache()
    return Row(path, blocks, blocks * block_bytes, copies, gbps, gbps / copy_gbps, verified)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin", help="path of libmoriio_native_cudacopy.so")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB moved by the cell copy")
    parser.add_argument("--runs-gib", type=float, default=0.25, help="GiB moved as runs")
    parser.add_argument("--batch-blocks", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    queue = Queue(Plugin(args.plugin or default_plugin_path()), 0)
    rows = []
    try:
        for path, gib in (("cells", args.gib), ("runs", args.runs_gib)):
            if gib <= 0:
                continue
            row = measure(queue, path, gib, args)
            rows.append(row)
            logger.info(
                "%-5s %7d blocks (%5.2f GB, %9d entries): %7.1f GB/s = %.3fx device copy, "
                "verified=%s",
                row.path,
                row.blocks,
                row.bytes / 1e9,
                row.copies,
                row.gbps,
                row.ratio_to_device_copy,
                row.verified,
            )
    finally:
        queue.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
