"""GPU benchmark of the UCX backend: two processes on one node, KV caches as torch CUDA tensors.

Prefill and decode each own one page-aligned CUDA backing holding every layer's cache in a vLLM
layout (Llama-3-8B-like dense K/V, or DeepSeek-V3-like MLA latent). For each request of
``--blocks`` random, non-contiguous block ids the decode READs (pulls) and the prefill WRITEs
(pushes, one ``write_layer`` per layer, then ``seal``; op ``write_layers``: every layer in one
``write_layers`` call, then ``seal``, as a WRITE flushed after the forward); every destination
block is verified on
the GPU against a regenerated copy of the source. GB/s is printed beside one large
``torch`` copy measured in the same run (on one device, or from the prefill's device to the
decode's with ``--devices 0,1``: the peer-to-peer rate), for the batched-kernel path
(``ucp_rkey_ptr`` mapping + one gather/scatter kernel per batch) and the per-run UCX path
(``ucx_direct_copy=off``).

``--layout nhd-hnd``: the prefill holds separated NHD caches ``[2, N, B, H, D]``, the decode
interleaved HND ones ``[N, 2, H, B, D]`` (different axis orders: a block's runs are single
``head_size`` cells, which the engine moves as cells, one transposing kernel per batch); every
destination block is compared with its source block transposed by torch.

``--overlap``: per-layer WRITE overlapped with a synthetic forward pass instead. The prefill
runs, per layer, a bf16 matmul sized so that it takes about as long as that layer's transfer,
then fills the request's blocks of that layer with a value of (request, layer) (the layer's KV,
as attention would write it), records a CUDA event and calls ``write_layer`` with it at once: the
copy waits for that event on the GPU, never on the host. Reported: the transfer time left
exposed after the last layer's compute finished, next to the same transfer started after the
whole forward (``after``), and one layer's transfer time; every destination block is checked
to hold its layer's value (a copy that ran before its layer's compute would fail that). Also
reported: the same overlap with the event waited for on the host (``host wait``: a writer
thread takes each layer's event, synchronises it, then calls ``write_layer`` without it, as the
vLLM connector did before it passed events to an engine that honours them, and as it still does
on any other engine). ``--direct-copy off``: the copies are UCX operations (the path to a peer
on another node, over RDMA), which cannot wait on the GPU: the engine's progress thread polls
each layer's event and posts the layer once it completed, against the same host wait.

``--overlap-trace PATH`` (with ``--overlap``): after the timed requests, one more overlapped
request and one WRITE after the forward run under ``torch.profiler`` in the prefill process
(which issues the copies: the kernels, or with ``--direct-copy off`` UCX's own copies, which
CUPTI records as memcpys), and PATH gets, per request, where the copies ran against the
forward: the matmul and copy intervals on the GPU (copy time inside the forward's window and
after it, time a copy ran alongside a matmul), and the host calls that issued the copies
(how many before the forward ended) -- what tells a copy that waited for the host from one
that waited for the GPU.

``--timeline PATH``: after the timed requests of each operation, one more request runs under
``torch.profiler`` in the process that makes the call (the decode for READ, the prefill for
WRITE) and its timeline goes to PATH as JSON: the call returning, each copy kernel's start and
end (every batch is one kernel), the terminal event seen, all in ms from the call, with the
time the GPU copied (the union of the kernels) and the idle gaps between kernels, and every
CUDA call of any thread between the call and the first launch. With a build that has the
engine's timing marks compiled in (``-DMORIIO_NATIVE_TRACE_MARKS=ON``), the profiled request
also records them (steady clock, in the calling process: the engine's call entry, planning,
each batch cut and handed to the backend, the progress thread taking it and submitting its
copy) and the timeline lists them in ms from the Python call, with the first of each.

``--in-flight K`` (default 1): each timed round issues K requests back to back, to disjoint
destination blocks, before waiting for any, as a decode serving many requests does; GB/s is the
K requests' bytes over the time from the first call to the last terminal event, so one
request's fixed costs (planning its first piece, the progress thread's wake-up, the last
event's notice) overlap with the others' copies. With K = 1 a request's fixed costs are all
exposed: that is the latency of one request, K > 1 the throughput of several.

``--pre MODE`` (repeatable, default ``none`` and ``prime``; each mode gets its own warm-up and
``--requests`` requests, in the same process pair, rows tagged with it): what happens between
one request's verification and baseline copy (both in the decode process) and the next timed
request. ``none``: nothing (the only figure before). ``settle``: both processes synchronize
their device and sit idle ``--settle-ms`` before the call. ``prime``: ``settle``, then the
calling process runs one tiny kernel and waits for it before the clock starts, so that the
process's own GPU work ran last when the request begins. On one shared GPU a WRITE (called by
the prefill) otherwise starts right after the decode's checks and pays 0.1-0.2 ms for it on an
H200 (docs/benchmarks.md; most likely the switch from the decode's context to the prefill's),
which idling alone does not remove; a READ (called by the decode) does not pay it. ``prime`` is
the figure of a P/D deployment, where prefill and decode do not share a GPU. ``--ops
write,read`` runs the WRITEs first. ``--overlap`` ignores both.

Run (device with CUDA, torch and this package built with the UCX and CUDA plugins)::

    python3 bench/gpu_bench.py --preset llama3-8b --preset deepseek-v3 --json out.json
    python3 bench/gpu_bench.py --preset llama3-8b --overlap --json overlap.json
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from device_copy import device_copy_gbps

logger = logging.getLogger("moriio_native.bench.gpu")

# Same geometry as moriio_native.presets, as torch tensors.
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"layers": 32, "kind": "kv", "heads": 8, "head": 128, "block": 16},
    "deepseek-v3": {"layers": 61, "kind": "mla", "heads": 1, "head": 576, "block": 64},
    # One of llama3-8b's 8 KV heads per rank (tensor parallel 8): with ``--layout separated``
    # every block's K and V planes are 4 KiB runs, the small-run case.
    "llama3-8b-tp8": {"layers": 32, "kind": "kv", "heads": 1, "head": 128, "block": 16},
}


def _fill_value(seed: int, layer: int) -> float:
    """What the synthetic forward writes into the request's blocks of ``layer`` (exact in bf16)."""
    return float((seed * 7 + layer) % 200 + 1)


@dataclass
class OverlapRow:
    preset: str
    direct_copy: str
    blocks: int
    layers: int
    matmul_n: int
    compute_per_layer_ms: float
    transfer_per_layer_ms: float
    after_forward_exposed_ms: float
    overlapped_exposed_ms: float
    exposed_over_one_layer: float
    host_wait_exposed_ms: float
    host_wait_over_one_layer: float
    # The forward's own time (medians): after it, overlapped, with the host wait. A waiting
    # path that slowed the forward would show here, not in the exposed times.
    forward_after_ms: float
    forward_overlapped_ms: float
    forward_host_wait_ms: float
    verified: bool


@dataclass
class Row:
    preset: str
    layout: str
    path: str
    op: str
    blocks: int
    run_bytes: int
    bytes: int
    gbps: float
    ratio_to_device_copy: float
    verified: bool
    cell_batches: int = 0  # of the last request: batches moved as cells (a transposing copy)
    stamped_batches: int = 0  # of the last request: batches moved stamped (template and ids)
    state_copy_gbps: float = 0.0  # median copy_ in the decode's memory state, after each request
    ratio_to_state_copy: float = 0.0
    pre: str = "none"  # what ran between the previous request's checks and this one (--pre)
    in_flight: int = 1  # requests issued together per timed round (--in-flight)


@dataclass
class TimelineRow:
    """One profiled request, ms from the call's start (see ``--timeline``)."""

    preset: str
    op: str
    bytes: int
    total_ms: float  # call to terminal event, host clock (profiler running)
    call_ms: float  # the read call (or every write_layer and the seal) returned
    kernels: int
    first_launch_ms: float  # the first kernel launch call began, host side (-1: not recorded)
    first_kernel_start_ms: float
    last_kernel_end_ms: float
    last_query_ms: float  # the backend's last event query ended (-1: not recorded)
    event_ms: float  # the wait returned the terminal event
    gpu_busy_ms: float  # union of the kernels' intervals
    gaps_ms: float  # idle time between the first kernel's start and the last one's end
    kernel_ms: list[list[float]]  # [start, end] of each kernel, in start order
    # The CUDA calls of every thread that began between the call and the first launch:
    # [name, thread, start ms, duration ms] (the progress thread's first one is when the first
    # batch reached it), and the calls' summed duration by name over the whole request.
    before_launch: list[list[Any]] = field(default_factory=list)
    cuda_calls_ms: dict[str, float] = field(default_factory=dict)
    # The engine's timing marks (empty unless compiled in): [name, ms from the Python call,
    # batch token, thread number] in recording order; ``first_marks_ms`` the first of each name
    # (``call_exit``: the last), ``marks_dropped`` those past the recorder's capacity.
    marks: list[list[Any]] = field(default_factory=list)
    first_marks_ms: dict[str, float] = field(default_factory=dict)
    marks_dropped: int = 0
    verified: bool = False
    pre: str = "none"


def _trace_events(prof: Any) -> list[dict[str, Any]]:
    """The events of a finished ``torch.profiler`` run (its Chrome trace)."""
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return events


def _timeline_of(prof: Any) -> dict[str, Any]:
    """The request's intervals out of a finished ``torch.profiler`` run (its Chrome trace)."""
    events = _trace_events(prof)
    marks = {
        e["name"]: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("moriio.")
    }
    t0 = marks["moriio.call"][0]
    # Launch calls of any thread (the backend's progress thread launches the copies), as CUPTI
    # records them: the host side of each kernel's start.
    launches = sorted(
        float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "LaunchKernel" in e.get("name", "")
        and float(e["ts"]) >= t0
    )
    kernels = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("cat") == "kernel" and float(e["ts"]) >= t0
    )
    # The progress thread queries its kernels' events until the last one is done: the last
    # query's end is when the backend saw the request's last kernel finish.
    queries = [
        float(e["ts"]) + float(e.get("dur", 0))
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "EventQuery" in e.get("name", "")
        and float(e["ts"]) >= t0
        and float(e["ts"]) <= marks["moriio.wait"][1]
    ]
    cuda_calls = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and float(e["ts"]) >= t0
        and float(e["ts"]) <= marks["moriio.wait"][1]
    ]
    first_launch = launches[0] if launches else marks["moriio.wait"][1]
    ms = 1e-3
    before_launch = [
        [e["name"], e.get("tid", 0), (float(e["ts"]) - t0) * ms, float(e.get("dur", 0)) * ms]
        for e in sorted(cuda_calls, key=lambda e: float(e["ts"]))
        if float(e["ts"]) <= first_launch
    ]
    by_name: dict[str, float] = {}
    for e in cuda_calls:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e.get("dur", 0)) * ms
    busy, gaps, reach = 0.0, 0.0, None
    for start, end in kernels:
        if reach is None or start > reach:
            if reach is not None:
                gaps += start - reach
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return {
        "call_ms": (marks["moriio.call"][1] - t0) * ms,
        "kernels": len(kernels),
        "first_launch_ms": (launches[0] - t0) * ms if launches else -1.0,
        "first_kernel_start_ms": (kernels[0][0] - t0) * ms if kernels else 0.0,
        "last_kernel_end_ms": (max(k[1] for k in kernels) - t0) * ms if kernels else 0.0,
        "last_query_ms": (max(queries) - t0) * ms if queries else -1.0,
        "event_ms": (marks["moriio.wait"][1] - t0) * ms,
        "gpu_busy_ms": busy * ms,
        "gaps_ms": gaps * ms,
        "kernel_ms": [[(a - t0) * ms, (b - t0) * ms] for a, b in kernels],
        "before_launch": before_launch,
        "cuda_calls_ms": by_name,
    }


def _marks_of(start_ns: int) -> dict[str, Any]:
    """The engine's timing marks recorded since ``trace_marks_enable``, in ms from ``start_ns``
    (``time.monotonic_ns``: the clock the engine stamps with)."""
    from moriio_native import _native

    stamps, dropped = _native.trace_marks_take()
    _native.trace_marks_disable()
    marks = [[name, (ns - start_ns) * 1e-6, token, thread] for name, ns, token, thread in stamps]
    first: dict[str, float] = {}
    for name, ms, _token, _thread in marks:
        if name == "call_exit" or name not in first:
            first[name] = ms
    return {"marks": marks, "first_marks_ms": first, "marks_dropped": dropped}


def _timed_request(
    engine: Any, tids: list[str], call: Any, timeline: bool, prime: bool
) -> tuple[float, list[Any], Any]:
    """Runs ``call(tid)`` (which starts transfer ``tid``) for every tid, back to back, and waits
    for their terminal events: seconds from the first call to the last event, the events and,
    with ``timeline`` (one tid only), the request's intervals under ``torch.profiler`` (after the
    same request once under it: the profiler's first kernels and ranges cost extra).
    ``prime``: one tiny kernel of this process runs to completion before the clock starts."""
    import torch

    if prime:
        torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    if not timeline:
        start = time.perf_counter()
        for tid in tids:
            call(tid)
        events = engine.wait(tids, timeout=300)
        return time.perf_counter() - start, [events[t] for t in tids], None
    from torch.profiler import ProfilerActivity, profile, record_function

    from moriio_native import _native

    (tid,) = tids
    marked = _native.trace_marks_compiled_in()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("warm-up"):
            call(tid + "-warm-up")
            engine.wait([tid + "-warm-up"], timeout=300)
        torch.cuda.synchronize()
        if marked:
            _native.trace_marks_enable(65536)
        start = time.perf_counter()
        with record_function("moriio.call"):
            start_ns = time.monotonic_ns()
            call(tid)
        with record_function("moriio.wait"):
            event = engine.wait([tid], timeout=300)[tid]
        seconds = time.perf_counter() - start
    timeline = _timeline_of(prof)
    if marked:
        timeline.update(_marks_of(start_ns))
    return seconds, [event], timeline


def _layer_views(backing: Any, preset: dict[str, Any], layout: str, num_blocks: int) -> list[Any]:
    """Every layer's cache as a view into ``backing`` (bf16), in the vLLM layout asked for."""
    import torch

    h, d, b = preset["heads"], preset["head"], preset["block"]
    planes = 2 if preset["kind"] == "kv" else 1
    per_layer = num_blocks * planes * h * b * d * 2
    views = []
    for layer in range(preset["layers"]):
        flat = backing[layer * per_layer : (layer + 1) * per_layer].view(torch.bfloat16)
        if preset["kind"] == "mla":  # standardized [N, 1, B, D]
            views.append(flat.view(num_blocks, 1, b, d))
        elif layout == "separated":  # [2, N, B, H, D]: K and V planes of 32 KiB per block
            views.append(flat.view(2, num_blocks, b, h, d))
        elif layout == "hnd":  # [N, 2, H, B, D]: heads outside tokens, K and V per block
            views.append(flat.view(num_blocks, 2, h, b, d))
        else:  # standardized [N, H, B, 2D] over block-outermost physical [N, B, H, 2D]
            views.append(flat.view(num_blocks, b, h, 2 * d).permute(0, 2, 1, 3))
    return views


def _backing_bytes(preset: dict[str, Any], num_blocks: int) -> int:
    planes = 2 if preset["kind"] == "kv" else 1
    return (
        preset["layers"]
        * num_blocks
        * planes
        * preset["heads"]
        * preset["block"]
        * preset["head"]
        * 2
    )


def _block_bytes(preset: dict[str, Any]) -> int:
    return _backing_bytes(preset, 1)


def _filled_backing(nbytes: int, seed: int) -> Any:
    import torch

    from moriio_native import allocate_kv_backing

    backing = allocate_kv_backing(nbytes, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    backing.random_(0, 256, generator=gen)
    return backing


def _block_axis(preset: dict[str, Any], layout: str) -> int:
    return 1 if preset["kind"] == "kv" and layout == "separated" else 0


def _layout_of(cfg: dict[str, Any], role: str) -> str:
    """The physical layout of ``role``'s caches (``nhd-hnd`` gives the two sides different ones)."""
    if cfg["layout"] == "nhd-hnd":
        return "separated" if role == "prefill" else "hnd"
    return cfg["layout"]


def _blocks_of(view: Any, preset: dict[str, Any], layout: str, ids: Any) -> Any:
    """The blocks ``ids`` of one layer, as [blocks, 2, H, B, D] for the K/V layouts that differ
    between the sides (so both compare in one order), else as the view holds them."""
    got = view.index_select(_block_axis(preset, layout), ids)
    return got.permute(1, 0, 3, 2, 4) if preset["kind"] == "kv" and layout == "separated" else got


def _verify(
    dst_views: list[Any],
    src_views: list[Any],
    dst_ids: Any,
    src_ids: Any,
    preset: dict[str, Any],
    dst_layout: str,
    src_layout: str,
) -> bool:
    import torch

    cross = dst_layout != src_layout
    for dst, src in zip(dst_views, src_views, strict=True):
        if cross:
            got = _blocks_of(dst, preset, dst_layout, dst_ids)
            want = _blocks_of(src, preset, src_layout, src_ids)
        else:
            axis = _block_axis(preset, dst_layout)
            got, want = dst.index_select(axis, dst_ids), src.index_select(axis, src_ids)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            return False
    return True


def _state_copy_gbps(backing: Any, mirror: Any, nbytes: int) -> float:
    """GB/s of one ``copy_`` of ``nbytes`` from the verifier's mirror into this process's cache,
    i.e. between two buffers in the memory state the transfers just ran in (a copy measured at
    the start of the process, before the caches exist, can be ~10 % faster). The bytes it
    overwrote are then poisoned, so that a later transfer that skipped a block fails its check."""
    import torch

    n = min(nbytes, backing.numel(), mirror.numel())
    torch.cuda.synchronize()
    start = time.perf_counter()
    backing[:n].copy_(mirror[:n])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    backing[:n].fill_(0x5A)
    torch.cuda.synchronize()
    return n / seconds / 1e9


def _device_pair(text: str) -> tuple[int, int]:
    """``"0,1"`` -> (0, 1): the prefill's and the decode's CUDA device."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected PREFILL,DECODE device indices, got {text!r}")
    return int(parts[0]), int(parts[1])


# READ; WRITE one write_layer per layer; WRITE every layer in one write_layers call.
_OPS = ("read", "write", "write_layers")


def _ops(text: str) -> tuple[str, ...]:
    """``"write,read"`` -> ("write", "read"): the operations of --ops, in order."""
    ops = tuple(o.strip() for o in text.split(","))
    if not ops or any(o not in _OPS for o in ops):
        raise argparse.ArgumentTypeError(
            f"expected some of {', '.join(_OPS)}, comma-separated, got {text!r}"
        )
    return ops


def _ids(ids: list[int]) -> Any:
    import numpy as np

    return np.asarray(ids, dtype=np.int64)


def _worker(role: str, conn: Any, cfg: dict[str, Any]) -> None:
    """One side: registers its caches, exchanges metadata over ``conn``, then serves commands."""
    import torch

    import moriio_native as mn

    device = cfg["devices"][role]
    torch.cuda.set_device(device)
    preset = PRESETS[cfg["preset"]]
    seed = {"prefill": 1, "decode": 2}[role]
    backing = _filled_backing(_backing_bytes(preset, cfg["num_blocks"]), seed)
    layout = _layout_of(cfg, role)
    views = _layer_views(backing, preset, layout, cfg["num_blocks"])
    spec = mn.CacheSpec(
        kind=preset["kind"],
        block_size=preset["block"],
        num_kv_heads=preset["heads"],
        head_size=preset["head"],
        dtype_bytes=2,
        # The shapes _layer_views makes: [2, N, B, H, D] lists tokens first, the 4-D views heads.
        axis_order="nhd" if preset["kind"] == "kv" and layout == "separated" else "hnd",
    )
    regs = [
        mn.LayerRegistration(
            f"layer.{i}",
            v,
            spec,
            (backing.data_ptr(), backing.numel()),
            memory="cuda",
            device=device,
        )
        for i, v in enumerate(views)
    ]
    options = {**cfg["options"], "ucx_direct_copy": cfg["direct_copy"]}
    engine = mn.Engine(role, "ucx", options=options, transfer_timeout=120.0)
    conn.send(engine.register_kv_caches(regs))
    engine.add_peer(conn.recv())
    peer = "decode" if role == "prefill" else "prefill"
    names = [f"layer.{i}" for i in range(len(views))]
    mirror: Any = None
    mirror_views = None
    operands: dict[int, tuple[Any, Any]] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "quit":
            break
        if cmd == "matmul_ms":  # prefill: the median time of one n x n bf16 matmul
            n = args[0]
            a, b = operands.setdefault(n, _operands(n))
            conn.send(_time_ms(lambda a=a, b=b: a @ b))
            continue
        if cmd == "forward_write":  # prefill: synthetic forward + per-layer WRITE
            conn.send(_forward_write(engine, peer, views, preset, cfg, operands, *args))
            continue
        if cmd == "verify_fill":  # decode: each layer's destination blocks hold its value
            dst_ids = torch.as_tensor(args[0], device="cuda")
            axis = _block_axis(preset, layout)
            ok = all(
                bool((v.index_select(axis, dst_ids) == _fill_value(args[1], layer)).all())
                for layer, v in enumerate(views)
            )
            conn.send(ok)
            continue
        if cmd in _OPS:
            # Block ids as int64 arrays, as the vLLM connector holds them (converted once per
            # request, outside the timing), by transfer id; a profiled warm-up reuses its
            # request's ids.
            tids, timeline, prime = args[0], *args[3:]
            pairs = zip(tids, args[1], args[2], strict=True)
            ids = {t: (_ids(lo), _ids(re)) for t, lo, re in pairs}

            def call(tid: str, op: str = cmd, ids: dict[str, Any] = ids) -> None:
                local, remote = ids[tid.removesuffix("-warm-up")]
                if op == "read":
                    engine.read(tid, peer, local, remote)
                    return
                if op == "write_layers":
                    engine.write_layers(tid, names, peer, local, remote)
                else:
                    for name in names:
                        engine.write_layer(tid, name, peer, local, remote)
                engine.seal(tid, peer, expected_writes=len(names))

            seconds, events, trace = _timed_request(engine, tids, call, timeline, prime)
            # A base build from before stamped batches has no count of them.
            shapes = (events[-1].cell_batches, getattr(events[-1], "stamped_batches", 0))
            ends = [(e.state, e.bytes, e.message) for e in events]
            conn.send((seconds, ends, shapes, trace))
        elif cmd == "verify":  # decode only: destination blocks == regenerated prefill blocks
            dst_ids, src_ids = (torch.as_tensor(x, device="cuda") for x in args)
            src_layout = _layout_of(cfg, "prefill")
            if mirror_views is None:
                mirror = _filled_backing(_backing_bytes(preset, cfg["num_blocks"]), 1)
                mirror_views = _layer_views(mirror, preset, src_layout, cfg["num_blocks"])
            conn.send(_verify(views, mirror_views, dst_ids, src_ids, preset, layout, src_layout))
        elif cmd == "sync":  # either side: its device idle (--pre settle and prime)
            torch.cuda.synchronize()
            conn.send(True)
        elif cmd == "copy":  # decode only, after "verify": the baseline in this memory state
            conn.send(_state_copy_gbps(backing, mirror, args[0]))
    engine.remove_peer(peer)
    conn.send("bye")


def _operands(n: int) -> tuple[Any, Any]:
    import torch

    return (
        torch.randn(n, n, dtype=torch.bfloat16, device="cuda"),
        torch.randn(n, n, dtype=torch.bfloat16, device="cuda"),
    )


def _time_ms(fn: Any, reps: int = 20) -> float:
    import torch

    fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _forward_write(
    engine: Any,
    peer: str,
    views: list[Any],
    preset: dict[str, Any],
    cfg: dict[str, Any],
    operands: dict[int, tuple[Any, Any]],
    tid: str,
    local: list[int],
    remote: list[int],
    n: int,
    seed: int,
    wait: str,
    trace: bool = False,
) -> tuple[float, float, str, str, dict[str, Any] | None]:
    """Runs the synthetic forward (per layer: an n x n matmul, then the layer's blocks filled)
    and WRITEs every layer: behind its CUDA event at once, the engine waiting for it (on the GPU,
    or in its progress thread with ``--direct-copy off``; ``wait="device"``), from a writer
    thread that waits for each event on the host (``"host"``), or after the whole forward
    (``"after"``). Returns (forward seconds, seconds from the forward's end to the WRITE's
    event, the event's state, its message, and with ``trace`` the request's
    :func:`_overlap_trace_of`)."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    local_ids, remote_ids = _ids(local), _ids(remote)
    ids_t = torch.as_tensor(local_ids, device="cuda")
    axis = _block_axis(preset, _layout_of(cfg, "prefill"))
    a, b = operands.setdefault(n, _operands(n)) if n else (None, None)
    events = []  # one per layer, alive until the transfer's event
    layer_events: queue.Queue[tuple[int, Any] | None] = queue.Queue()

    def host_waiting_writer() -> None:
        try:
            while (item := layer_events.get()) is not None:
                layer, ev = item
                ev.synchronize()
                engine.write_layer(tid, f"layer.{layer}", peer, local_ids, remote_ids)
        finally:  # sealed whatever happened, so the wait below ends with the transfer's state
            engine.seal(tid, peer, expected_writes=len(views))

    writer = threading.Thread(target=host_waiting_writer) if wait == "host" else None

    def run_forward() -> None:
        """Per layer a matmul, the layer's blocks filled, its event recorded and (unless
        ``wait="after"``) the layer handed to the engine or to the host-waiting writer."""
        if writer is not None:
            writer.start()
        for layer, view in enumerate(views):
            if a is not None:
                torch.matmul(a, b)
            view.index_fill_(axis, ids_t, _fill_value(seed, layer))
            if wait == "after":
                continue
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
            if writer is not None:
                layer_events.put((layer, ev))
            else:
                engine.write_layer(
                    tid, f"layer.{layer}", peer, local_ids, remote_ids, ev.cuda_event
                )
        if writer is not None:
            layer_events.put(None)
        elif wait == "device":
            engine.seal(tid, peer, expected_writes=len(views))

    torch.cuda.synchronize()
    profiler = (
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        if trace
        else contextlib.nullcontext()
    )
    mark = record_function if trace else lambda _: contextlib.nullcontext()
    with profiler as prof:
        start = time.perf_counter()
        with mark("overlap.forward"):
            run_forward()
            torch.cuda.synchronize()
        forward_end = time.perf_counter()
        with mark("overlap.wait"):
            if wait == "after":
                for layer in range(len(views)):
                    engine.write_layer(tid, f"layer.{layer}", peer, local_ids, remote_ids)
                engine.seal(tid, peer, expected_writes=len(views))
            event = engine.wait([tid], timeout=300)[tid]
        if writer is not None:
            writer.join()
        done = time.perf_counter()
    summary = _overlap_trace_of(prof) if trace else None
    return forward_end - start, done - forward_end, event.state, event.message, summary


_GEMM_NAMES = ("gemm", "cutlass", "nvjet", "sm90_xmma", "matmul")
# The CUDA copy plugin's kernels (cpp/cudacopy/cudacopy.cu), lower-cased.
_COPY_KERNEL_NAMES = ("gatherscatter", "stampkernel", "cellcopykernel")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """The summed length of the union of ``intervals`` (µs in, ms out)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total / 1e3


def _clipped(
    intervals: list[tuple[float, float]], lo: float, hi: float
) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _overlap_trace_of(prof: Any) -> dict[str, Any]:
    """Where one overlapped request's copies ran (see ``--overlap-trace``), from its profile:
    ms from the forward's start."""
    events = _trace_events(prof)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    marks = {
        e["name"]: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in spans
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("overlap.")
    }
    f0, f1 = marks["overlap.forward"]
    w1 = marks["overlap.wait"][1]

    def gpu(cat: str, pick: Any = lambda name: True) -> list[tuple[float, float]]:
        return [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in spans
            if e.get("cat") == cat and pick(e.get("name", "").lower())
        ]

    gemms = gpu("kernel", lambda n: any(g in n for g in _GEMM_NAMES))
    copy_kernels = gpu("kernel", lambda n: any(k in n for k in _COPY_KERNEL_NAMES))
    memcpys = gpu("gpu_memcpy", lambda n: "htod" not in n and "dtoh" not in n)
    copies = copy_kernels + memcpys
    posts = sorted(
        float(e["ts"])
        for e in spans
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and ("memcpy" in e.get("name", "").lower() or "launchkernel" in e.get("name", "").lower())
        and f0 <= float(e["ts"]) <= w1
    )
    alongside = sum(_union_ms(_clipped(copies, lo, hi)) for lo, hi in gemms)
    return {
        "forward_ms": (f1 - f0) / 1e3,
        "wait_end_ms": (w1 - f0) / 1e3,
        "gemm_kernels": len(gemms),
        "gemm_busy_ms": _union_ms(gemms),
        "copy_kernels": len(copy_kernels),
        "memcpys": len(memcpys),
        "memcpy_streams": len({e.get("tid") for e in spans if e.get("cat") == "gpu_memcpy"}),
        "copy_busy_in_forward_ms": _union_ms(_clipped(copies, f0, f1)),
        "copy_busy_after_forward_ms": _union_ms(_clipped(copies, f1, w1)),
        "copy_alongside_gemm_ms": alongside,
        "first_copy_ms": (min(a for a, _ in copies) - f0) / 1e3 if copies else -1.0,
        "last_copy_end_ms": (max(b for _, b in copies) - f0) / 1e3 if copies else -1.0,
        "copy_calls": len(posts),
        "copy_calls_in_forward": sum(1 for t in posts if t <= f1),
        "last_copy_call_ms": (posts[-1] - f0) / 1e3 if posts else -1.0,
    }


def _request_ids(rng: Any, args: argparse.Namespace) -> list[int]:
    """One side's block ids of an --overlap request: ``--blocks`` random ids of the cache, or
    with ``--contiguous`` that many consecutive ids from a random start."""
    if args.contiguous:
        start = int(rng.integers(0, args.num_blocks - args.blocks + 1))
        return list(range(start, start + args.blocks))
    return rng.permutation(args.num_blocks)[: args.blocks].tolist()


def _start_pair(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Spawns the prefill and decode workers and lets them exchange their metadata."""
    ctx = mp.get_context("spawn")
    conns: dict[str, Any] = {}
    procs: list[Any] = []
    for role in ("prefill", "decode"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(role, child, cfg), daemon=True, name=role)
        p.start()
        conns[role] = parent
        procs.append(p)
    conns["decode"].send(_recv(conns["prefill"], procs))
    conns["prefill"].send(_recv(conns["decode"], procs))
    return conns, procs


def _stop_pair(conns: dict[str, Any], procs: list[Any]) -> None:
    for role in ("prefill", "decode"):
        conns[role].send(("quit",))
    for role in ("prefill", "decode"):
        _recv(conns[role], procs)
    for p in procs:
        p.join(timeout=30)


def run_overlap_case(preset_name: str, args: argparse.Namespace) -> OverlapRow:
    """Per-layer WRITE overlapped with a synthetic forward, against the same WRITE after it."""
    import numpy as np

    preset = PRESETS[preset_name]
    cfg = {
        "preset": preset_name,
        "layout": args.layout if preset["kind"] == "kv" else "standardized",
        "direct_copy": args.direct_copy,
        "num_blocks": args.num_blocks,
        "devices": {"prefill": args.devices[0], "decode": args.devices[1]},
        "options": dict(o.split("=", 1) for o in args.option),
    }
    conns, procs = _start_pair(cfg)
    rng = np.random.default_rng(11)
    layers = preset["layers"]
    counter = iter(range(1 << 30))

    traces: list[dict[str, Any]] = []

    def one(n: int, wait: str, trace: bool = False) -> tuple[float, float]:
        r = next(counter)
        src, dst = (_request_ids(rng, args) for _ in range(2))
        tid = f"fw-{r}"
        conns["prefill"].send(("forward_write", tid, src, dst, n, r, wait, trace))
        forward, exposed, state, msg, summary = _recv(conns["prefill"], procs)
        if state != "done":
            raise RuntimeError(f"{tid} ended {state}: {msg}")
        conns["decode"].send(("verify_fill", dst, r))
        if not _recv(conns["decode"], procs):
            raise RuntimeError(f"{tid}: a destination block does not hold its layer's value")
        if summary is not None:
            traces.append(
                {
                    "preset": preset_name,
                    "direct_copy": args.direct_copy,
                    "wait": wait,
                    "exposed_ms": exposed * 1e3,
                    **summary,
                }
            )
        return forward, exposed

    one(0, "after")  # warm-up: IPC mapping, kernel load
    # One layer's transfer: the WRITE of all layers after a forward without matmuls, per layer.
    transfer_layer = statistics.median(one(0, "after")[1] for _ in range(3)) / layers
    # The matmul size whose time is one layer's transfer: time grows about as n^3, so scale from
    # a timed size, three times (small sizes fill the GPU less, so one step undershoots).
    n = 2048
    for _ in range(3):
        conns["prefill"].send(("matmul_ms", n))
        ms = _recv(conns["prefill"], procs)
        n = max(256, int(n * (transfer_layer * 1e3 / ms) ** (1 / 3)) // 64 * 64)
    conns["prefill"].send(("matmul_ms", n))
    compute_layer = _recv(conns["prefill"], procs) / 1e3
    runs: dict[str, list[tuple[float, float]]] = {"after": [], "device": [], "host": []}
    for _ in range(args.requests):  # interleaved, so drift hits all alike
        for wait, timed in runs.items():
            timed.append(one(n, wait))
    if args.overlap_trace:
        for wait in ("device", "after", "device"):  # the first profiled run pays for CUPTI
            one(n, wait, trace=True)
        _append_json(args.overlap_trace, traces[1:])
        for t in traces[1:]:
            logging.info("overlap trace %s", json.dumps(t))
    _stop_pair(conns, procs)

    def median(wait: str, part: int) -> float:
        return statistics.median(t[part] for t in runs[wait])

    exposed = median("device", 1)
    host_exposed = median("host", 1)
    return OverlapRow(
        preset_name,
        args.direct_copy,
        args.blocks,
        layers,
        n,
        compute_layer * 1e3,
        transfer_layer * 1e3,
        median("after", 1) * 1e3,
        exposed * 1e3,
        exposed / transfer_layer,
        host_exposed * 1e3,
        host_exposed / transfer_layer,
        median("after", 0) * 1e3,
        median("device", 0) * 1e3,
        median("host", 0) * 1e3,
        True,
    )


def _recv(conn: Any, procs: list[Any], timeout: float = 300.0) -> Any:
    """The next message on ``conn``; raises when a worker died or nothing came in time."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.5):
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"worker {dead[0].name} exited with code {dead[0].exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from a worker within {timeout} s")
    return conn.recv()


def _round_ids(
    rng: Any, args: argparse.Namespace, in_flight: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Source and destination block ids of a round's ``in_flight`` requests: sources drawn
    independently (they are only read), destinations disjoint (requests in flight together must
    not write the same block, or a later one's bytes could pass the earlier one's check)."""
    b = args.blocks
    dst_pool = rng.permutation(args.num_blocks)[: b * in_flight].tolist()
    srcs = [rng.permutation(args.num_blocks)[:b].tolist() for _ in range(in_flight)]
    return srcs, [dst_pool[k * b : (k + 1) * b] for k in range(in_flight)]


def run_case(
    preset_name: str,
    layout: str,
    direct_copy: str,
    args: argparse.Namespace,
    device_copy: float,
    timelines: list[TimelineRow],
) -> list[Row]:
    import numpy as np

    preset = PRESETS[preset_name]
    cfg = {
        "preset": preset_name,
        "layout": layout,
        "direct_copy": direct_copy,
        "num_blocks": args.num_blocks,
        "devices": {"prefill": args.devices[0], "decode": args.devices[1]},
        "options": dict(o.split("=", 1) for o in args.option),
    }
    conns, procs = _start_pair(cfg)
    rng = np.random.default_rng(7)
    requests = args.requests if direct_copy == "auto" else args.per_run_requests
    rows: list[Row] = []
    path = "batched-kernel" if direct_copy == "auto" else "per-run ucx"
    run_bytes = (
        _block_bytes(preset)
        // preset["layers"]
        // (2 if layout == "separated" and preset["kind"] == "kv" else 1)
    )
    if layout == "nhd-hnd":  # one run per (plane, head, token) cell
        run_bytes = preset["head"] * 2
    for op, pre in ((op, pre) for op in args.ops for pre in args.pre or ["none", "prime"]):
        samples, copies, verified, total, shapes = [], [], True, 0, (0, 0)
        # Request 0 warms up (IPC mapping, kernel load); with --timeline one more is profiled.
        profiled = requests + 1 if args.timeline and direct_copy == "auto" else None
        for r in range(requests + 1 + (profiled is not None)):
            srcs, dsts = _round_ids(rng, args, 1 if r == profiled else args.in_flight)
            tids = [f"{op}-{direct_copy}-{pre}-{r}-{k}" for k in range(len(dsts))]
            if pre != "none":
                for role in ("prefill", "decode"):
                    conns[role].send(("sync",))
                    _recv(conns[role], procs)
                time.sleep(args.settle_ms / 1e3)
            # READ: decode pulls prefill's src into its dst; WRITE: prefill pushes src into dst.
            caller = "decode" if op == "read" else "prefill"
            locals_, remotes = (dsts, srcs) if op == "read" else (srcs, dsts)
            conns[caller].send((op, tids, locals_, remotes, r == profiled, pre == "prime"))
            seconds, ends, shapes, trace = _recv(conns[caller], procs)
            for tid, (state, _, msg) in zip(tids, ends, strict=True):
                if state != "done":
                    raise RuntimeError(f"{tid} ended {state}: {msg}")
            nbytes = sum(n for _, n, _ in ends)
            ok = True
            for dst, src in zip(dsts, srcs, strict=True):
                conns["decode"].send(("verify", dst, src))
                ok &= bool(_recv(conns["decode"], procs))
            verified &= ok
            if trace is not None:
                timelines.append(
                    TimelineRow(
                        preset_name, op, nbytes, seconds * 1e3, verified=ok, pre=pre, **trace
                    )
                )
                continue
            # The baseline copies one request's bytes (its rate does not depend on the size at
            # these sizes, and K of them might not fit the cache).
            conns["decode"].send(("copy", ends[0][1]))
            copy_gbps = _recv(conns["decode"], procs)
            if r > 0:
                samples.append(nbytes / seconds / 1e9)
                copies.append(copy_gbps)
                total = nbytes
        gbps = statistics.median(samples)
        state_copy = statistics.median(copies)
        rows.append(
            Row(
                preset_name,
                layout,
                path,
                op,
                args.blocks,
                run_bytes,
                total,
                gbps,
                gbps / device_copy,
                verified,
                *shapes,
                state_copy,
                gbps / state_copy,
                pre,
                args.in_flight,
            )
        )
    _stop_pair(conns, procs)
    return rows


def _append_json(path: str, items: list[dict[str, Any]]) -> None:
    """``items`` added to the JSON list at ``path`` (created when absent)."""
    existing = []
    if os.path.exists(path):
        with open(path) as f:
            existing = json.load(f)
    with open(path, "w") as f:
        json.dump(existing + items, f, indent=1)


def _write_json(path: str | None, rows: Sequence[Any]) -> None:
    """The rows as a JSON list of objects, when ``--json PATH`` was given."""
    if path:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS))
    parser.add_argument(
        "--layout", default="standardized", choices=["standardized", "separated", "nhd-hnd"]
    )
    parser.add_argument("--blocks", type=int, default=2048, help="blocks per request")
    parser.add_argument("--num-blocks", type=int, default=4096, help="blocks per cache")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--per-run-requests", type=int, default=1)
    parser.add_argument("--skip-per-run", action="store_true")
    parser.add_argument(
        "--devices",
        type=_device_pair,
        default=(0, 0),
        help="CUDA devices of the prefill and decode processes, e.g. 0,1 (default 0,0)",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="per-layer WRITE overlapped with a synthetic forward (see the module docstring)",
    )
    parser.add_argument(
        "--contiguous",
        action="store_true",
        help="--overlap: each request's blocks are consecutive ids on both sides (their runs "
        "merge: one operation per layer and K/V plane instead of one per block), not random",
    )
    parser.add_argument(
        "--overlap-trace",
        metavar="PATH",
        help="--overlap: profile one more overlapped request and one WRITE after the forward "
        "and append where their copies ran to PATH as JSON (see the module docstring)",
    )
    parser.add_argument(
        "--direct-copy",
        default="auto",
        choices=["auto", "off"],
        help="--overlap's copy path: auto, the kernel behind each event on the GPU; off, UCX "
        "operations (the path to a peer on another node), posted once the engine's progress "
        "thread saw the event complete",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine backend option for both processes, e.g. progress_mode=busy",
    )
    parser.add_argument(
        "--pre",
        action="append",
        choices=["none", "settle", "prime"],
        help="what runs before each timed request (repeatable, default none and prime; see the "
        "module docstring)",
    )
    parser.add_argument(
        "--settle-ms", type=float, default=20.0, help="idle time of --pre settle and prime"
    )
    parser.add_argument(
        "--ops",
        type=_ops,
        default=("read", "write"),
        help=f"the operations in order, comma-separated, of {', '.join(_OPS)} (default read,write)",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="requests issued together per timed round, to disjoint destination blocks (see "
        "the module docstring; default 1)",
    )
    parser.add_argument("--json", help="write the rows as JSON to this file")
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        help="profile one more request per operation and write its timeline as JSON to PATH",
    )
    args = parser.parse_args(argv)
    if args.in_flight < 1 or args.in_flight * args.blocks > args.num_blocks:
        parser.error(
            f"--in-flight {args.in_flight} with --blocks {args.blocks} needs 1 <= in-flight and "
            f"in-flight x blocks <= --num-blocks ({args.num_blocks}): the requests' destination "
            "blocks must be disjoint"
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    presets = args.preset or ["llama3-8b", "deepseek-v3"]
    if args.overlap:
        overlap_rows = []
        for name in presets:
            o = run_overlap_case(name, args)
            overlap_rows.append(o)
            logger.info(
                "%-12s direct copy %s, %d layers x %d blocks: matmul n=%d %.3f ms/layer, transfer"
                " %.3f ms/layer;"
                " exposed after the forward: WRITE after it %.3f ms, overlapped %.3f ms = %.2f"
                " layers' transfer (host wait: %.3f ms = %.2f); forward %.3f / %.3f / %.3f ms"
                " (after / overlapped / host wait), verified=%s",
                o.preset,
                o.direct_copy,
                o.layers,
                o.blocks,
                o.matmul_n,
                o.compute_per_layer_ms,
                o.transfer_per_layer_ms,
                o.after_forward_exposed_ms,
                o.overlapped_exposed_ms,
                o.exposed_over_one_layer,
                o.host_wait_exposed_ms,
                o.host_wait_over_one_layer,
                o.forward_after_ms,
                o.forward_overlapped_ms,
                o.forward_host_wait_ms,
                o.verified,
            )
        _write_json(args.json, overlap_rows)
        return 0 if all(o.verified for o in overlap_rows) else 1
    rows: list[Row] = []
    timelines: list[TimelineRow] = []
    for name in presets:
        request_bytes = _block_bytes(PRESETS[name]) * args.blocks
        device_copy = device_copy_gbps(request_bytes, *args.devices)
        logger.info(
            "%s: one %.2f GB torch copy_ from cuda:%d to cuda:%d: %.0f GB/s",
            name,
            request_bytes / 1e9,
            *args.devices,
            device_copy,
        )
        layout = args.layout if PRESETS[name]["kind"] == "kv" else "standardized"
        for direct in ("auto",) if args.skip_per_run else ("auto", "off"):
            for row in run_case(name, layout, direct, args, device_copy, timelines):
                rows.append(row)
                logger.info(
                    "%-12s %-13s %-15s %-5s pre=%-6s %d in flight, %6d blocks, runs %6d B: "
                    "%8.1f GB/s = %.3fx "
                    "device copy, %.3fx a copy_ in the same state (%.0f GB/s), verified=%s, cell "
                    "batches %d, stamped batches %d",
                    row.preset,
                    row.layout,
                    row.path,
                    row.op,
                    row.pre,
                    row.in_flight,
                    row.blocks,
                    row.run_bytes,
                    row.gbps,
                    row.ratio_to_device_copy,
                    row.ratio_to_state_copy,
                    row.state_copy_gbps,
                    row.verified,
                    row.cell_batches,
                    row.stamped_batches,
                )
    for t in timelines:
        logger.info(
            "timeline %-12s %-5s pre=%-6s %.3f ms: call returned %.3f, first launch %.3f, "
            "%d kernels from %.3f to %.3f (GPU busy %.3f, gaps %.3f), last query %.3f, "
            "event seen %.3f; "
            "verified=%s",
            t.preset,
            t.op,
            t.pre,
            t.total_ms,
            t.call_ms,
            t.first_launch_ms,
            t.kernels,
            t.first_kernel_start_ms,
            t.last_kernel_end_ms,
            t.gpu_busy_ms,
            t.gaps_ms,
            t.last_query_ms,
            t.event_ms,
            t.verified,
        )
        if t.first_marks_ms:
            logger.info(
                "  marks (first of each, ms from the call): %s%s",
                ", ".join(f"{k} {v:.3f}" for k, v in t.first_marks_ms.items()),
                f" ({t.marks_dropped} dropped)" if t.marks_dropped else "",
            )
        for name, thread, start, dur in t.before_launch:
            logger.info(
                "  before the first launch: %8.3f ms %7.3f ms %s (thread %s)",
                start,
                dur,
                name,
                thread,
            )
    _write_json(args.json, rows)
    _write_json(args.timeline, timelines)
    return 0 if all(r.verified for r in rows) and all(t.verified for t in timelines) else 1


if __name__ == "__main__":
    sys.exit(main())
