"""KV transfer over the UCX backend between two processes, against a copy in one process.

For each run size (4 KiB, 32 KiB, 256 KiB, 2 MiB by default) one key-only layer is laid out so
that one block is exactly one run: the local side uses every other block (so no two runs merge)
and the remote blocks are a random sample in random order (a fragmented allocator). The same
gather/scatter is timed, in the same run:

* a single-process baseline every ratio is relative to. Host memory: one ``memmove`` per run
  (ctypes) between two arrays (numpy fancy indexing ``dst[local] = src[remote]`` is shown beside
  it; it goes through a temporary and is slower). CUDA memory (``--memory cuda``): torch's
  ``dst[local] = src[remote]`` on the GPU;
* ``read``: ``Engine.read`` in this process pulling from a second process (wall time from the
  call to its terminal event);
* ``write``: ``Engine.write_layer`` + ``seal`` pushing to the second process.

Variants. Host: ``plain`` (numpy memory on both sides; the backend proves the peer is a
process of this host and pid namespace and moves up to IOV_MAX runs per process_vm_readv/writev),
``plain_ucx_ops`` (same memory, ``ucx_direct_copy=off``: UCX's cma, one system call per run),
``allocated`` (backing from the backend's allocator, i.e.
UCP_MEM_MAP_ALLOCATE shared memory the peer maps with ucp_rkey_ptr and fills with memcpy) and
``allocated_ucx_ops`` (same memory, ``ucx_direct_copy=off``); the allocated variants need
``Engine.allocate_host_backing`` and are reported as not run without it. CUDA: ``cuda`` (CUDA IPC
mapped with ucp_rkey_ptr, one gather/scatter kernel per batch) and ``cuda_ucx_ops`` (one UCX
cuda_ipc operation per run). On request (``--variants tcp_get,tcp_push``): UCX over tcp only, READ
by ``ucp_get_nbx`` against READ pushed by the target; the push/get ratio of their reads is printed.

Processes are pinned to different CPUs when there are several. Every transfer's bytes are
verified once per size (digests of the moved blocks on both sides), outside the timed region.

    PYTHONPATH=build/<dir>/python python3 bench/ucx_host_bench.py [--memory host|cuda]
        [--sizes 4096,32768] [--total-mib 128] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import moriio_native as mn
from moriio_native import kvcache as kc

TIMEOUT = 300.0

# variant -> (engine options, memory: "host" | "allocated" | "cuda")
VARIANTS: dict[str, tuple[dict[str, str], str]] = {
    "plain": ({}, "host"),
    "plain_ucx_ops": ({"ucx_direct_copy": "off"}, "host"),
    "allocated": ({}, "allocated"),
    "allocated_ucx_ops": ({"ucx_direct_copy": "off"}, "allocated"),
    "cuda": ({}, "cuda"),
    "cuda_ucx_ops": ({"ucx_direct_copy": "off"}, "cuda"),
    # TCP only, as between two hosts: READ by ucp_get_nbx (served in software by the target's
    # UCX) against READ pushed by the target (the backend's default over tcp).
    "tcp_get": ({"ucx_tls": "tcp", "ucx_direct_copy": "off", "ucx_read_push": "off"}, "host"),
    "tcp_push": ({"ucx_tls": "tcp", "ucx_direct_copy": "off"}, "host"),
}
DEFAULT_VARIANTS = {
    "host": "plain,plain_ucx_ops,allocated,allocated_ucx_ops",
    "cuda": "cuda,cuda_ucx_ops",
}


@dataclass(frozen=True)
class Case:
    run_bytes: int
    runs: int  # blocks moved per transfer
    blocks: int  # blocks in each side's cache (2 * runs)

    def shape(self) -> kc.LayerShape:
        # latent [N, B, D] bf16: one block = block_size * head_size * 2 bytes = run_bytes.
        return kc.LayerShape("kv", "latent", block_size=16, head_size=self.run_bytes // 32)

    @property
    def backing_bytes(self) -> int:
        return self.blocks * self.run_bytes


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {cpu})


# ---- memory of each kind -----------------------------------------------------------------------


def _backing(engine: mn.Engine, nbytes: int, memory: str) -> Any:
    if memory == "allocated":
        return engine.allocate_host_backing(nbytes)  # type: ignore[attr-defined]
    if memory == "cuda":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return mn.allocate_host_backing(nbytes)


def _rows(case: Case, backing: Any) -> Any:
    """The backing as [blocks, run_bytes] (a view)."""
    return backing[: case.backing_bytes].reshape(case.blocks, case.run_bytes)


def _registration(case: Case, backing: Any, memory: str) -> list[mn.LayerRegistration]:
    shape = case.shape()
    if memory == "cuda":
        import torch

        view = backing[: case.backing_bytes].view(torch.int16).view(case.blocks, 16, -1)
        base, size = backing.data_ptr(), backing.numel()
        return [
            mn.LayerRegistration(
                "kv", view, shape.spec(), allocation=(base, size), memory="cuda", device=0
            )
        ]
    view = backing[: case.backing_bytes].view(np.int16).reshape(case.blocks, 16, shape.head_size)
    return [
        mn.LayerRegistration(
            "kv", view, shape.spec(), allocation=(backing.ctypes.data, backing.nbytes)
        )
    ]


def _fill(backing: Any, seed: int) -> None:
    if isinstance(backing, np.ndarray):
        backing[:] = np.random.default_rng(seed).integers(0, 256, backing.nbytes, dtype=np.uint8)
        return
    import torch

    gen = torch.Generator(device=backing.device).manual_seed(seed)
    backing.random_(0, 256, generator=gen)
    # The backend copies on its own stream: the bytes must be in memory before a transfer starts
    # (as a KV connector must wait for the forward pass that wrote the cache).
    torch.cuda.synchronize(backing.device)


def _digest(rows: Any) -> str:
    if not isinstance(rows, np.ndarray):
        rows = rows.cpu().numpy()
    return hashlib.blake2b(np.ascontiguousarray(rows).tobytes(), digest_size=16).hexdigest()


def _index(idx: np.ndarray, like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return idx
    import torch

    return torch.as_tensor(idx, device=like.device)


# ---- the remote process ------------------------------------------------------------------------


def _child(conn: Connection, options: dict[str, str], memory: str, cpu: int) -> None:
    """The remote side: one cache per case, filled with seed 2; answers digests of rows."""
    _pin(cpu)
    engine = mn.Engine("remote", "ucx", options)
    conn.send(True)
    backing: Any = None
    case: Case | None = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "case":
            case = arg
            backing = None
            engine = mn.Engine("remote", "ucx", options)  # fresh registrations per case
            backing = _backing(engine, case.backing_bytes, memory)
            _fill(backing, 2)
            conn.send(engine.register_kv_caches(_registration(case, backing, memory)))
        elif cmd == "digest":
            assert backing is not None and case is not None
            rows = _rows(case, backing)
            conn.send(_digest(rows[_index(np.asarray(arg, dtype=np.int64), rows)]))
        elif cmd == "quit":
            conn.send(True)
            return


# ---- baselines ---------------------------------------------------------------------------------


def _memmove_runs(
    dst: np.ndarray, src: np.ndarray, local: np.ndarray, remote: np.ndarray, size: int
) -> Callable[[], None]:
    """One memmove per run (ctypes), the plainest single-process copy of the same runs."""
    d, s = dst.ctypes.data, src.ctypes.data
    pairs = list(zip((local * size).tolist(), (remote * size).tolist(), strict=True))

    def run() -> None:
        move = ctypes.memmove
        for lo, ro in pairs:
            move(d + lo, s + ro, size)

    return run


def _time(
    reps: int, fn: Callable[[], None], sync: Callable[[], None] = lambda: None
) -> list[float]:
    fn()  # warm-up
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _baselines(
    case: Case, local: np.ndarray, remote: np.ndarray, reps: int, memory: str
) -> dict[str, list[float]]:
    """The same gather/scatter in one process, on two fresh buffers of the same memory kind."""
    if memory == "cuda":
        import torch

        src = torch.empty((case.blocks, case.run_bytes), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        _fill(src.view(-1), 3)
        li, ri = _index(local, src), _index(remote, src)

        def gather() -> None:
            dst[li] = src[ri]

        return {
            "baseline": _time(reps, gather, torch.cuda.synchronize),
            "one_copy": _time(reps, lambda: dst.copy_(src), torch.cuda.synchronize),
        }
    src_np = np.empty((case.blocks, case.run_bytes), dtype=np.uint8)
    dst_np = np.empty_like(src_np)
    _fill(src_np.reshape(-1), 3)
    dst_np[:] = 0  # faults the pages in

    def fancy() -> None:
        dst_np[local] = src_np[remote]

    return {
        "baseline": _time(reps, _memmove_runs(dst_np, src_np, local, remote, case.run_bytes)),
        "numpy": _time(reps, fancy),
        "one_copy": _time(reps, lambda: np.copyto(dst_np, src_np)),
    }


# ---- one variant -------------------------------------------------------------------------------


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _wait(engine: mn.Engine, tid: str) -> None:
    event = engine.wait([tid], timeout=TIMEOUT).get(tid)
    if event is None or event.state != "done":
        raise RuntimeError(f"transfer {tid} did not finish: {event}")


def run_variant(
    name: str, options: dict[str, str], memory: str, cases: list[Case], reps: int
) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn, options, memory, 1), daemon=True)
    proc.start()
    child_conn.close()
    conn.recv()
    _pin(0)
    rng = np.random.default_rng(7)
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            engine = mn.Engine("local", "ucx", options)
            backing = _backing(engine, case.backing_bytes, memory)
            _fill(backing, 1)
            engine.register_kv_caches(_registration(case, backing, memory))
            conn.send(("case", case))
            peer = engine.add_peer(conn.recv())
            local = np.arange(0, case.blocks, 2, dtype=np.int64)[: case.runs]
            remote = rng.permutation(case.blocks)[: case.runs].astype(np.int64)
            nbytes = case.runs * case.run_bytes
            mine = _rows(case, backing)
            base = _baselines(case, local, remote, reps, memory)

            t_read, t_write = [], []
            for rep in range(reps + 1):  # rep 0 warms up (first touch of mapped memory)
                tid = f"r-{case.run_bytes}-{rep}"
                t0 = time.perf_counter()
                engine.read(tid, peer, local, remote)
                _wait(engine, tid)
                if rep:
                    t_read.append(time.perf_counter() - t0)
            conn.send(("digest", remote.tolist()))
            read_ok = conn.recv() == _digest(mine[_index(local, mine)])
            _fill(backing, 4)
            for rep in range(reps + 1):
                tid = f"w-{case.run_bytes}-{rep}"
                t0 = time.perf_counter()
                engine.write_layer(tid, "kv", peer, local, remote)
                engine.seal(tid, peer, expected_writes=1)
                _wait(engine, tid)
                if rep:
                    t_write.append(time.perf_counter() - t0)
            conn.send(("digest", remote.tolist()))
            write_ok = conn.recv() == _digest(mine[_index(local, mine)])
            b = _gbps(nbytes, base["baseline"])
            rows.append(
                {
                    "variant": name,
                    "memory": memory,
                    "run_bytes": case.run_bytes,
                    "runs": case.runs,
                    "bytes": nbytes,
                    "baseline_gbps": b,
                    "numpy_gbps": _gbps(nbytes, base["numpy"]) if "numpy" in base else None,
                    "one_copy_gbps": _gbps(case.backing_bytes, base["one_copy"]),
                    "read_gbps": _gbps(nbytes, t_read),
                    "write_gbps": _gbps(nbytes, t_write),
                    "read_ratio": _gbps(nbytes, t_read) / b,
                    "write_ratio": _gbps(nbytes, t_write) / b,
                    "verified": bool(read_ok and write_ok),
                }
            )
            del mine, backing  # before the engine: allocated memory dies with it
            del engine
    finally:
        conn.send(("quit", None))
        conn.recv()
        proc.join(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--memory", choices=["host", "cuda"], default="host")
    ap.add_argument("--sizes", default="4096,32768,262144,2097152")
    ap.add_argument(
        "--total-mib",
        type=int,
        default=0,
        help="bytes moved per transfer (default 128 MiB for host, 1024 MiB for cuda)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="", help="comma list; default: all of --memory's")
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine option for every variant (repeatable), e.g. ucx_tls=sm,self",
    )
    args = ap.parse_args(argv)

    info = {i.name: i for i in mn.available_backends()}
    if not info["ucx"].available:
        print(f"UCX backend unavailable: {info['ucx'].reason}")
        return 1
    total_mib = args.total_mib or (1024 if args.memory == "cuda" else 128)
    cases = []
    for s in (int(x) for x in args.sizes.split(",")):
        runs = max(1, (total_mib << 20) // s)
        cases.append(Case(run_bytes=s, runs=runs, blocks=2 * runs))
    extra = dict(kv.split("=", 1) for kv in args.option)
    rows: list[dict[str, Any]] = []
    not_run: dict[str, str] = {}
    for name in (args.variants or DEFAULT_VARIANTS[args.memory]).split(","):
        options, memory = VARIANTS[name]
        options = {**options, **extra}
        if memory == "allocated" and not hasattr(mn.Engine, "allocate_host_backing"):
            not_run[name] = "Engine.allocate_host_backing is not in this build"
            continue
        rows += run_variant(name, options, memory, cases, args.reps)

    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.node()} {os.cpu_count()} CPUs, "
        f"{total_mib} MiB per transfer, median of {args.reps}"
        + (f", options {extra}" if extra else "")
    )
    base_name = "torch" if args.memory == "cuda" else "memcpy"
    print(
        f"{'variant':<18} {'run':>8} {'runs':>7} {base_name:>8} {'numpy':>8} {'1 copy':>8} "
        f"{'read':>8} {'write':>8} {'read/' + base_name:>12} {'write/' + base_name:>13}  ok"
    )
    for r in rows:
        numpy_col = f"{r['numpy_gbps']:>8.2f}" if r["numpy_gbps"] is not None else f"{'-':>8}"
        print(
            f"{r['variant']:<18} {r['run_bytes']:>8} {r['runs']:>7} {r['baseline_gbps']:>8.2f} "
            f"{numpy_col} {r['one_copy_gbps']:>8.2f} {r['read_gbps']:>8.2f} "
            f"{r['write_gbps']:>8.2f} {r['read_ratio']:>12.2f} {r['write_ratio']:>13.2f}  "
            f"{r['verified']}"
        )
    print(
        f"(GB/s. {base_name}: the same runs in one process; 1 copy: one contiguous copy of the "
        f"whole backing. Ratios are against {base_name}.)"
    )
    reads = {(r["variant"], r["run_bytes"]): r["read_gbps"] for r in rows}
    for (variant, run_bytes), gbps in reads.items():
        get = reads.get(("tcp_get", run_bytes))
        if variant == "tcp_push" and get:
            print(f"tcp READ, {run_bytes}-byte runs: push / get = {gbps / get:.2f}")
    for name, why in not_run.items():
        print(f"{name}: not run: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "not_run": not_run}, f, indent=1)
    return 0 if rows and all(r["verified"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
