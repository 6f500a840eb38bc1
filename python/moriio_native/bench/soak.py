"""Soak: many READs of mixed-layout requests between two processes, with ``--in-flight`` of
them outstanding at all times, every block accounted for.

A spawned child plays the prefill: the mixed model of :func:`moriio_native.kvcache.mixed_model`
(every layout generation on one backing) filled with reproducible bytes, registered with its
engine. This process plays the decode with the decode's physical layout of the same model and a
block pool: each request takes 1..``--max-blocks`` free blocks, READs as many random prefill
blocks into them, and gives them back on its terminal event. Checked by code, every one a
violation (the exit status is 1 when any occurred):

* every transfer reaches exactly one terminal event, and it is ``done``;
* every block is held by at most one request and handed back exactly once; at the end the
  pool is full and the engine has no pending or quarantined transfer;
* a sample of requests (one in ``--verify-every``) is byte-verified on completion against a
  replica of the prefill's content (plain numpy indexing), and the prefill's backing is
  unchanged at the end.

Reported: transfers/s, p50/p99/max completion latency (post to terminal event), and the
transfers/s over a baseline measured in the same run: the same requests one at a time.

    PYTHONPATH=build/<dir>/python python3 -m moriio_native.bench.soak [--transfers 10000]
        [--in-flight 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import moriio_native as mn
from moriio_native import kvcache as kc

logger = logging.getLogger("moriio_native.bench.soak")

PREFILL_SEED = 11
DECODE_SEED = 22
_ANSWER_TIMEOUT_S = 120.0


def _prefill_caches(num_blocks: int) -> kc.KvCacheSet:
    caches = kc.build_caches(kc.mixed_model("prefill"), num_blocks=num_blocks)
    kc.fill_random(caches, PREFILL_SEED)
    return caches


def _prefill_main(conn: Connection, backend: str, options: dict[str, str], blocks: int) -> None:
    """The prefill process: registers its caches, sends its metadata, then answers ``check``
    (is the backing still what it was filled with?) until ``quit``."""
    engine = mn.Engine("soak-prefill", backend, options)
    caches = _prefill_caches(blocks)
    conn.send(engine.register_kv_caches(caches.registrations()))
    while True:
        cmd = conn.recv()
        if cmd == "check":
            conn.send(bool(np.array_equal(caches.backing, _prefill_caches(blocks).backing)))
        else:
            conn.send(True)
            return


@dataclass
class Result:
    mode: str  # "soak" or "baseline"
    transfers: int
    in_flight: int
    seconds: float
    transfers_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    gib_per_s: float
    verified: int
    violations: list[str] = field(default_factory=list)


class BlockPool:
    """The decode's blocks: taken by one request at a time, given back exactly once."""

    def __init__(self, num_blocks: int, rng: np.random.Generator) -> None:
        self.free: deque[int] = deque(int(b) for b in rng.permutation(num_blocks))
        self.holder: dict[int, str] = {}
        self.size = num_blocks

    def take(self, n: int, tid: str) -> list[int]:
        blocks = [self.free.popleft() for _ in range(n)]
        for b in blocks:
            self.holder[b] = tid
        return blocks

    def give_back(self, blocks: list[int], tid: str, violations: list[str]) -> None:
        for b in blocks:
            if self.holder.get(b) != tid:
                violations.append(f"{tid}: block {b} handed back but held by {self.holder.get(b)}")
                continue
            del self.holder[b]
            self.free.append(b)


def run(
    engine: mn.Engine,
    peer: str,
    decode: kc.KvCacheSet,
    replica: kc.KvCacheSet,
    *,
    mode: str,
    transfers: int,
    in_flight: int,
    max_blocks: int,
    verify_every: int,
    seed: int,
    timeout: float,
) -> Result:
    rng = np.random.default_rng(seed)
    pool = BlockPool(decode.num_blocks, rng)
    violations: list[str] = []
    outstanding: dict[str, tuple[float, list[int], list[int]]] = {}
    latencies: list[float] = []
    moved = verified = posted = 0
    start = time.monotonic()
    deadline = start + timeout
    while posted < transfers or outstanding:
        while posted < transfers and len(outstanding) < in_flight:
            n = int(rng.integers(1, max_blocks + 1))
            tid = f"{mode}-{posted}"
            local = pool.take(n, tid)
            remote = [int(b) for b in rng.choice(replica.num_blocks, n, replace=False)]
            outstanding[tid] = (time.monotonic(), local, remote)
            engine.read(tid, peer, local, remote)
            posted += 1
        if time.monotonic() > deadline:
            violations.append(f"{len(outstanding)} transfers not terminal within {timeout}s")
            break
        for event in engine.poll_events(timeout=0.1):
            now = time.monotonic()
            entry = outstanding.pop(event.transfer_id, None)
            if entry is None:
                violations.append(f"{event.transfer_id}: a second or unknown terminal event")
                continue
            started, local, remote = entry
            latencies.append(now - started)
            if event.state != "done":
                violations.append(f"{event.transfer_id}: {event.state} ({event.message})")
            else:
                moved += event.bytes
                index = int(event.transfer_id.rsplit("-", 1)[1])
                if index % verify_every == 0:
                    verified += 1
                    if not kc.blocks_match(decode, replica, local, remote):
                        violations.append(f"{event.transfer_id}: destination bytes differ")
            pool.give_back(local, event.transfer_id, violations)
    seconds = time.monotonic() - start
    if len(pool.free) != pool.size or pool.holder:
        violations.append(f"{len(pool.holder)} blocks never handed back")
    if engine.pending_transfers or engine.quarantined_transfers:
        violations.append(
            f"engine: {engine.pending_transfers} pending, {engine.quarantined_transfers} "
            "quarantined transfers at the end"
        )
    ms = sorted(x * 1000 for x in latencies) or [0.0]
    return Result(
        mode=mode,
        transfers=len(latencies),
        in_flight=in_flight,
        seconds=round(seconds, 3),
        transfers_per_s=round(len(latencies) / seconds, 1) if seconds else 0.0,
        p50_ms=round(statistics.median(ms), 3),
        p99_ms=round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
        max_ms=round(ms[-1], 3),
        gib_per_s=round(moved / seconds / 2**30, 3) if seconds else 0.0,
        verified=verified,
        violations=violations[:20],
    )


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"engine option {text!r} must be KEY=VALUE")
    return key, value


def soak(args: argparse.Namespace) -> dict[str, Any]:
    options = {"ucx_tls": args.ucx_tls} if args.ucx_tls and args.backend == "ucx" else {}
    options.update(args.option)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(
        target=_prefill_main,
        args=(child_conn, args.backend, options, args.prefill_blocks),
        daemon=True,
    )
    child.start()
    child_conn.close()
    try:
        if not conn.poll(_ANSWER_TIMEOUT_S):
            raise RuntimeError("the prefill process did not start")
        metadata = conn.recv()
        engine = mn.Engine("soak-decode", args.backend, options)
        decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=args.decode_blocks)
        kc.fill_random(decode, DECODE_SEED)
        engine.register_kv_caches(decode.registrations())
        peer = engine.add_peer(metadata)
        replica = _prefill_caches(args.prefill_blocks)
        common = {
            "max_blocks": args.max_blocks,
            "verify_every": args.verify_every,
            "timeout": args.timeout,
        }
        baseline = run(
            engine,
            peer,
            decode,
            replica,
            mode="baseline",
            transfers=max(1, args.transfers // 20),
            in_flight=1,
            seed=args.seed + 1,
            **common,
        )
        main = run(
            engine,
            peer,
            decode,
            replica,
            mode="soak",
            transfers=args.transfers,
            in_flight=args.in_flight,
            seed=args.seed,
            **common,
        )
        conn.send("check")
        if not conn.poll(_ANSWER_TIMEOUT_S) or not conn.recv():
            main.violations.append("the prefill's backing changed")
        conn.send("quit")
        conn.poll(_ANSWER_TIMEOUT_S)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return {
        "backend": args.backend,
        "options": options,
        "ucx_tls": args.ucx_tls or os.environ.get("UCX_TLS"),
        "layers": len(decode.shapes),
        "block_bytes": decode.total_block_bytes(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "cpus": os.cpu_count(),
        "baseline": asdict(baseline),
        "soak": asdict(main),
        "throughput_ratio": round(main.transfers_per_s / baseline.transfers_per_s, 2)
        if baseline.transfers_per_s
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moriio_native.bench.soak", description=__doc__)
    parser.add_argument("--transfers", type=int, default=10000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--max-blocks", type=int, default=8, help="blocks per request: 1..N")
    parser.add_argument("--verify-every", type=int, default=50)
    parser.add_argument("--prefill-blocks", type=int, default=256)
    parser.add_argument("--decode-blocks", type=int, default=1024)
    parser.add_argument("--backend", default="ucx")
    parser.add_argument("--ucx-tls", default="", help="the backend's ucx_tls option")
    parser.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another engine option of both engines (repeatable), e.g. progress_mode=busy",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    for name in ("transfers", "in_flight", "max_blocks", "verify_every", "prefill_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.timeout > 0:
        parser.error("--timeout must be positive")
    if args.in_flight * args.max_blocks > args.decode_blocks:
        parser.error("--decode-blocks must hold --in-flight requests of --max-blocks blocks")
    if args.max_blocks > args.prefill_blocks:
        parser.error("--max-blocks must not exceed --prefill-blocks")
    logging.basicConfig(level=logging.WARNING)
    result = soak(args)
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    s, b = result["soak"], result["baseline"]
    sys.stdout.write(
        f"soak: {s['transfers']} transfers, {s['in_flight']} in flight: "
        f"{s['transfers_per_s']:.0f}/s ({result['throughput_ratio']}x one at a time, "
        f"{b['transfers_per_s']:.0f}/s), p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms; "
        f"{s['verified']} verified; violations: {len(s['violations']) + len(b['violations'])}\n"
    )
    return 1 if s["violations"] or b["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
