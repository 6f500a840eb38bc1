"""Transfer benchmark: GB/s through the engine against memcpy in one process, per run size.

For each run size (4 KiB .. 2 MiB) one key-only cache is laid out so that one block is exactly
one run. A transfer moves ``bytes_per_transfer`` bytes: the local blocks are every other block of
a cache twice that size (so no two runs merge) and the remote blocks a random sample in random
order (a fragmented allocator). Timed in the same run, medians of ``repeats`` rounds
(the four methods interleaved within each round):

* ``memcpy``: one contiguous ``numpy.copyto`` of the same number of bytes (the memory-bandwidth
  ceiling of this machine);
* ``gather``: the same rows gathered/scattered in one process with numpy fancy indexing (a C loop
  of one memcpy per run: what the engine's job costs without a second process or a transport);
* ``read``: ``Engine.read`` pulling from the peer, wall time from the call to its terminal event;
* ``write``: ``Engine.write_layer`` + ``seal`` pushing to the peer, same clock.

With the UCX backend the peer is a second process (``multiprocessing`` spawn; UCX picks shared
memory / CMA / TCP); with loopback both engines live in this process. The bytes of the first
read and the first write of every size are verified (digests of the rows on both sides),
outside the timed region.

``run_transfer_bench`` returns a dict (see its docstring); ``python -m
moriio_native.bench.transfer`` prints a table. Blocks the caller; bounded by ``timeout`` per
wait.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from moriio_native import kvcache as kc
from moriio_native.engine import Engine, choose_backend
from moriio_native.errors import InvalidArgumentError, MoriioError

logger = logging.getLogger("moriio_native.bench.transfer")

DEFAULT_RUN_SIZES: tuple[int, ...] = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20)
QUICK_RUN_SIZES: tuple[int, ...] = (4 << 10, 64 << 10, 2 << 20)
DEFAULT_BYTES_PER_TRANSFER = 32 << 20
_LAYER = "kv.runs"
_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """One run size: ``runs`` runs of ``run_bytes`` per transfer, caches of ``2 * runs`` blocks."""

    run_bytes: int
    runs: int

    @property
    def blocks(self) -> int:
        return 2 * self.runs

    def shape(self) -> kc.LayerShape:
        # Key-only [N, B, D] with 1-byte elements: one block = 16 tokens x D bytes = one run.
        return kc.LayerShape(
            _LAYER,
            "latent",
            block_size=_BLOCK_TOKENS,
            head_size=self.run_bytes // _BLOCK_TOKENS,
            dtype="uint8",
        )


def _rows(cache: kc.KvCacheSet, case: Case) -> np.ndarray:
    """The cache as [blocks, run_bytes] bytes (a view)."""
    off = cache.offsets[_LAYER]
    return cache.backing[off : off + case.blocks * case.run_bytes].reshape(
        case.blocks, case.run_bytes
    )


def _digest(rows: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(rows).tobytes(), digest_size=16).hexdigest()


class _PeerSide:
    """The peer's engine and cache for one case (lives in the peer process or in this one)."""

    def __init__(self, backend: str, case: Case, seed: int, timeout: float) -> None:
        self.case = case
        self.cache = kc.build_caches([case.shape()], case.blocks)
        kc.fill_random(self.cache, seed)
        self.engine = Engine(f"bench-peer-{case.run_bytes}", backend, transfer_timeout=timeout)
        self.metadata = self.engine.register_kv_caches(self.cache.registrations())

    def digest(self, ids: Sequence[int]) -> str:
        return _digest(_rows(self.cache, self.case)[np.asarray(ids, dtype=np.int64)])


def _peer_main(conn: Connection, backend: str, timeout: float) -> None:
    """The peer process: serves ("case", (case, seed)), ("digest", ids) and ("quit", None)."""
    side: _PeerSide | None = None
    while True:
        try:
            cmd, arg = conn.recv()
        except (EOFError, OSError):
            return  # the benchmark went away
        try:
            if cmd == "case":
                side = None  # drop the previous engine and cache first
                side = _PeerSide(backend, arg[0], arg[1], timeout)
                conn.send(("ok", side.metadata))
            elif cmd == "digest":
                assert side is not None
                conn.send(("ok", side.digest(arg)))
            elif cmd == "quit":
                conn.send(("ok", None))
                return
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Peer:
    """The benchmark's handle on its peer: a process (ucx) or an object here (loopback)."""

    def __init__(self, backend: str, timeout: float) -> None:
        self.backend = backend
        self.timeout = timeout
        self.local: _PeerSide | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        if backend != "loopback":
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(
                target=_peer_main,
                args=(child, backend, timeout),
                name="moriio-bench-peer",
                daemon=True,
            )
            self.proc.start()
            child.close()

    @property
    def processes(self) -> int:
        return 1 if self.proc is None else 2

    def _call(self, cmd: str, arg: Any, limit: float) -> Any:
        assert self.conn is not None
        self.conn.send((cmd, arg))
        if not self.conn.poll(limit):
            raise MoriioError(f"bench peer process: no answer to {cmd!r} within {limit:.0f}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise MoriioError(f"bench peer process: {cmd!r} failed: {value}")
        return value

    def setup(self, case: Case, seed: int) -> bytes:
        if self.proc is None:
            self.local = None
            self.local = _PeerSide(self.backend, case, seed, self.timeout)
            return self.local.metadata
        return self._call("case", (case, seed), max(self.timeout, 120.0))

    def digest(self, ids: Sequence[int]) -> str:
        if self.proc is None:
            assert self.local is not None
            return self.local.digest(ids)
        return self._call("digest", [int(i) for i in ids], self.timeout)

    def close(self) -> None:
        self.local = None
        if self.proc is None:
            return
        with contextlib.suppress(MoriioError, OSError, EOFError):
            self._call("quit", None, 10.0)
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        assert self.conn is not None
        self.conn.close()


def pick_backend(choice: str) -> str:
    """``auto`` -> ucx when it can run here, else loopback (``choose_backend``, role
    ``local``); a named backend must be available."""
    if choice not in ("auto", "ucx", "loopback"):
        raise InvalidArgumentError(f"backend must be auto, ucx or loopback, got {choice!r}")
    return choose_backend(choice, role="local")


def _bench_case(
    engine_backend: str, peer: _Peer, case: Case, repeats: int, timeout: float, seed: int
) -> dict[str, Any]:
    rng = np.random.default_rng([seed, case.run_bytes])
    meta = peer.setup(case, seed + 1)
    cache = kc.build_caches([case.shape()], case.blocks)
    kc.fill_random(cache, seed + 2)
    engine = Engine(f"bench-local-{case.run_bytes}", engine_backend, transfer_timeout=timeout)
    engine.register_kv_caches(cache.registrations())
    peer_id = engine.add_peer(meta)
    local = np.arange(0, case.blocks, 2, dtype=np.int64)[: case.runs]
    remote = rng.permutation(case.blocks)[: case.runs].astype(np.int64)
    nbytes = case.runs * case.run_bytes
    rows = _rows(cache, case)
    counter = iter(range(1 << 30))
    last: dict[str, Any] = {}

    def transfer(kind: str) -> None:
        tid = f"bench-{kind}-{case.run_bytes}-{next(counter)}"
        if kind == "read":
            engine.read(tid, peer_id, local, remote)
        else:
            engine.write_layer(tid, _LAYER, peer_id, local, remote)
            engine.seal(tid, peer_id, expected_writes=1)
        event = engine.wait([tid], timeout=timeout).get(tid)
        if event is None:
            engine.abort(tid)
            raise MoriioError(
                f"{kind} of {nbytes} bytes in {case.runs} runs: no completion within {timeout}s"
            )
        if event.state != "done":
            raise MoriioError(f"{kind} {tid} {event.state}: {event.message}")
        last[kind] = event

    # Verify once per direction, outside the timed region.
    transfer("read")
    read_ok = _digest(rows[local]) == peer.digest(remote)
    rows[local] ^= 0x5A  # new content, so the write must really move bytes
    transfer("write")
    write_ok = _digest(rows[local]) == peer.digest(remote)

    src = np.random.default_rng(seed).integers(0, 256, 2 * nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_rows = src[: case.blocks * case.run_bytes].reshape(case.blocks, case.run_bytes)
    dst_rows = dst[: case.blocks * case.run_bytes].reshape(case.blocks, case.run_bytes)

    def gather() -> None:
        dst_rows[local] = src_rows[remote]

    methods: dict[str, Callable[[], None]] = {
        "read": lambda: transfer("read"),
        "write": lambda: transfer("write"),
        "memcpy": lambda: np.copyto(dst[:nbytes], src[:nbytes]),
        "gather": gather,
    }
    # Interleaved, so a noisy neighbour slows every method alike rather than one of them.
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(repeats):
        for key, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    read_s, write_s, memcpy_s, gather_s = (
        statistics.median(times[k]) for k in ("read", "write", "memcpy", "gather")
    )
    gbps = {
        k: nbytes / s / 1e9
        for k, s in (
            ("memcpy", memcpy_s),
            ("gather", gather_s),
            ("read", read_s),
            ("write", write_s),
        )
    }
    return {
        "run_bytes": case.run_bytes,
        "runs": case.runs,
        "bytes_per_transfer": nbytes,
        "engine_runs": int(last["read"].runs),
        "engine_batches": int(last["read"].batches),
        "memcpy_gbps": gbps["memcpy"],
        "gather_gbps": gbps["gather"],
        "read_gbps": gbps["read"],
        "write_gbps": gbps["write"],
        "read_vs_memcpy": gbps["read"] / gbps["memcpy"],
        "write_vs_memcpy": gbps["write"] / gbps["memcpy"],
        "read_vs_gather": gbps["read"] / gbps["gather"],
        "write_vs_gather": gbps["write"] / gbps["gather"],
        "verified": bool(read_ok and write_ok),
    }


def run_transfer_bench(
    backend: str = "auto",
    run_sizes: Sequence[int] = DEFAULT_RUN_SIZES,
    bytes_per_transfer: int = DEFAULT_BYTES_PER_TRANSFER,
    repeats: int = 5,
    timeout: float = 60.0,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Benchmark every run size; returns ``{"backend", "processes", "ucx_tls_env" (UCX_TLS as
    set in the environment, or None), "bytes_per_transfer", "repeats", "rows": [...]}``. Each
    row: run_bytes, runs, bytes_per_transfer, engine_runs and engine_batches (of one read),
    memcpy_gbps, gather_gbps, read_gbps, write_gbps, the four ratios
    ``{read,write}_vs_{memcpy,gather}`` and ``verified`` (both directions' bytes matched).
    ``progress(done, total)`` is called after each size.

    Raises InvalidArgumentError for a run size that is not a positive multiple of 16 or a
    bad count, BackendUnavailableError when ``ucx`` was asked for but cannot run.
    """
    if repeats < 1 or bytes_per_transfer < 1:
        raise InvalidArgumentError("repeats and bytes_per_transfer must be positive")
    for size in run_sizes:
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or size < _BLOCK_TOKENS
            or size % _BLOCK_TOKENS
        ):
            raise InvalidArgumentError(f"run size {size!r} must be a positive multiple of 16 bytes")
    chosen = pick_backend(backend)
    peer = _Peer(chosen, timeout)
    rows = []
    try:
        for i, size in enumerate(run_sizes):
            case = Case(size, max(2, bytes_per_transfer // size))
            logger.info("transfer bench: %d-byte runs x %d over %s", size, case.runs, chosen)
            rows.append(_bench_case(chosen, peer, case, repeats, timeout, seed))
            if progress is not None:
                progress(i + 1, len(run_sizes))
    finally:
        peer.close()
    return {
        "backend": chosen,
        "processes": peer.processes,
        "ucx_tls_env": os.environ.get("UCX_TLS") if chosen == "ucx" else None,
        "bytes_per_transfer": bytes_per_transfer,
        "repeats": repeats,
        "rows": rows,
    }


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of a ``run_transfer_bench`` result."""
    header = (
        "run",
        "runs",
        "memcpy GB/s",
        "gather GB/s",
        "read GB/s",
        "write GB/s",
        "read/memcpy",
        "read/gather",
        "verified",
    )
    lines = [header]
    for r in result["rows"]:
        lines.append(
            (
                _size(r["run_bytes"]),
                str(r["runs"]),
                f"{r['memcpy_gbps']:.2f}",
                f"{r['gather_gbps']:.2f}",
                f"{r['read_gbps']:.2f}",
                f"{r['write_gbps']:.2f}",
                f"{r['read_vs_memcpy']:.2f}",
                f"{r['read_vs_gather']:.2f}",
                "yes" if r["verified"] else "NO",
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in lines]
    out.insert(1, "-" * len(out[0]))
    out.append(
        f"backend {result['backend']} ({result['processes']} process(es)), "
        f"{_size(result['bytes_per_transfer'])} per transfer, median of "
        f"{result['repeats']}"
    )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moriio_native.bench.transfer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--backend", default="auto", choices=("auto", "ucx", "loopback"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_RUN_SIZES))
    parser.add_argument(
        "--mib", type=int, default=DEFAULT_BYTES_PER_TRANSFER >> 20, help="MiB per transfer"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run_transfer_bench(args.backend, args.sizes, args.mib << 20, args.repeats)
    sys.stdout.write((json.dumps(result, indent=2) if args.json else format_table(result)) + "\n")
    return 0 if all(r["verified"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
