"""Planning benchmark: how long computing one request's per-layer copy plans takes.

Three implementations plan the same inputs (same layouts, same block ids):

* ours: the native core. The request's block pairs are validated and sorted once
  (``moriio_native.BlockPairs``), then every layer's cached block template stamps them
  (``block_template(local, remote).plan(...)``).
* pure Python: the same planning written plainly — a per-cell walk builds each layer's block
  template once, then every request stamps it per block in Python, sorts by local offset and
  merges runs contiguous on both sides (the same merge semantics as the native planner).
* vLLM (when importable): ``moriio_layout.compute_block_transfer_offsets`` from vLLM's MoRIIO
  connector, on meta tensors of the same shape (it only reads shape, strides and dtype).

Block ids are a random sample of a cache twice the request's size on each side (a fragmented
allocator), so few blocks are adjacent and the runs emitted are close to
``blocks * runs per block``. All three produce the same runs; the benchmark checks that once per
case, outside the timed region.

``run_planning_bench`` returns one dict per (preset, context) for the CLI to print, dump as JSON
or plot; ``python -m moriio_native.bench.planning`` prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import moriio_native as mn
from moriio_native import presets as model_presets

logger = logging.getLogger("moriio_native.bench.planning")

Runs = tuple[list[int], list[int], list[int]]


# ---------------------------------------------------------------------------------------------
# Presets


@dataclass(frozen=True)
class LayerGroup:
    """``count`` layers that share one cache geometry."""

    name: str
    count: int
    kind: str  # "kv" (K and V planes) or "mla" (one latent / key-only plane)
    num_kv_heads: int
    head_size: int
    dtype_bytes: int


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    block_size: int
    groups: tuple[LayerGroup, ...]

    @property
    def num_layers(self) -> int:
        return sum(g.count for g in self.groups)


def _from_model(model: model_presets.Preset) -> Preset:
    """The model preset's caches as layer groups: one group per cache of a transformer layer,
    every layer sharing that geometry (so the demo and this benchmark cannot drift apart)."""
    groups = []
    for shape in model.shapes(layers=1):
        spec = shape.spec()
        groups.append(
            LayerGroup(
                "indexer" if "indexer" in shape.name else ("mla" if shape.is_latent else "dense"),
                model.num_layers,
                spec.kind,
                spec.num_kv_heads or 1,
                spec.head_size or 0,
                spec.dtype_bytes,
            )
        )
    return Preset(model.name, model.description, model.block_size, tuple(groups))


PRESETS: dict[str, Preset] = {
    name: _from_model(model) for name, model in model_presets.PRESETS.items()
}
# The issue's dense case: 61 layers of Llama-like dense K/V.
PRESETS["dense-61"] = Preset(
    "dense-61",
    "Dense-like 61 layers, 8 KV heads x 128, bf16, block 16 (the issue's dense case)",
    16,
    (LayerGroup("dense", 61, "kv", 8, 128, 2),),
)

DEFAULT_PRESETS = ("llama3-8b", "deepseek-v3", "minimax-m3")
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072)
# The issue's case: 61 layers x 8192 blocks, MLA-like and dense-like.
ISSUE_CASES = (("deepseek-v3", 8192 * 64), ("dense-61", 8192 * 16))


# ---------------------------------------------------------------------------------------------
# Pure-Python planner (the baseline)


def _cell_offset(p: dict[str, Any], plane: int, head: int, token: int) -> int:
    kb = p["kernel_block_size"]
    return (
        p["plane_offset"][plane]
        + head * p["head_stride"]
        + (token // kb) * p["kernel_block_stride"]
        + (token % kb) * p["token_stride"]
    )


def _merge_sorted(rows: Iterable[tuple[int, int, int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for local, remote, size in rows:
        if merged:
            last = merged[-1]
            if local == last[0] + last[2] and remote == last[1] + last[2]:
                last[2] += size
                continue
        merged.append([local, remote, size])
    return merged


@dataclass
class PythonTemplate:
    """A layer pair's block template, built in pure Python from the two layouts' numbers."""

    runs: list[tuple[int, int, int]]
    local_stride: int
    remote_stride: int
    local_blocks: int
    remote_blocks: int
    name: str = field(default="")


def python_block_template(local: mn.LayerLayout, remote: mn.LayerLayout) -> PythonTemplate:
    """Walk every (plane, head, token) cell, sort by local offset, merge where both sides touch."""
    lp, rp = local.params, remote.params
    for key in ("kind", "block_size", "num_heads", "plane_bytes", "dtype_bytes"):
        if lp[key] != rp[key]:
            raise mn.IncompatiblePeerError(
                f"layer '{local.name}': {key} {lp[key]} != remote '{remote.name}' {rp[key]}"
            )
    planes = 2 if lp["kind"] == "kv" else 1
    cells = [
        (_cell_offset(lp, plane, h, t), _cell_offset(rp, plane, h, t), lp["plane_bytes"][plane])
        for plane in range(planes)
        for h in range(lp["num_heads"])
        for t in range(lp["block_size"])
    ]
    cells.sort()
    runs = [(a, b, c) for a, b, c in _merge_sorted(cells)]
    return PythonTemplate(
        runs, lp["block_stride"], rp["block_stride"], lp["num_blocks"], rp["num_blocks"], local.name
    )


def python_plan(tmpl: PythonTemplate, local_ids: Sequence[int], remote_ids: Sequence[int]) -> Runs:
    """One layer's plan: validate ids, stamp the template per block pair, sort, merge."""
    n = len(local_ids)
    if n > len(remote_ids):
        raise mn.InvalidArgumentError(
            f"local_block_ids longer than remote_block_ids: {n} > {len(remote_ids)}"
        )
    remote_ids = remote_ids[:n]
    if len(set(local_ids)) != n or len(set(remote_ids)) != n:
        raise mn.InvalidArgumentError(f"layer '{tmpl.name}': duplicate block ids")
    for side, ids, limit in (
        ("local", local_ids, tmpl.local_blocks),
        ("remote", remote_ids, tmpl.remote_blocks),
    ):
        for b in ids:
            if not 0 <= b < limit:
                raise mn.OutOfRangeError(f"{side} block id {b} outside [0, {limit})")
    ls, rs = tmpl.local_stride, tmpl.remote_stride
    rows = [
        (lb * ls + lo, rb * rs + ro, size)
        for lb, rb in zip(local_ids, remote_ids, strict=True)
        for lo, ro, size in tmpl.runs
    ]
    rows.sort()
    merged = _merge_sorted(rows)
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


# ---------------------------------------------------------------------------------------------
# Inputs shared by all implementations


def _cache_shape(group: LayerGroup, block_size: int, cache_blocks: int) -> list[int]:
    if group.kind == "kv":
        # vLLM's [2, num_blocks, block_size, heads, head_size] (K and V planes separated).
        return [2, cache_blocks, block_size, group.num_kv_heads, group.head_size]
    # The standardized [num_blocks, heads=1, block_size, content] view of a latent cache.
    return [cache_blocks, 1, block_size, group.head_size]


def _contiguous(shape: Sequence[int]) -> list[int]:
    strides, s = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = s
        s *= shape[i]
    return strides


def _describe(name: str, group: LayerGroup, block_size: int, cache_blocks: int) -> mn.LayerLayout:
    shape = _cache_shape(group, block_size, cache_blocks)
    spec = mn.CacheSpec(
        kind=group.kind,
        block_size=block_size,
        num_kv_heads=group.num_kv_heads,
        head_size=group.head_size,
        dtype_bytes=group.dtype_bytes,
        axis_order="nhd" if group.kind == "kv" else "hnd",  # the shapes _cache_shape makes
    )
    geometry = mn.TensorGeometry(shape, _contiguous(shape), group.dtype_bytes, 0)
    return mn.describe_layer(name, geometry, spec)


def _block_ids(blocks: int, cache_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(cache_blocks), blocks), rng.sample(range(cache_blocks), blocks)


# ---------------------------------------------------------------------------------------------
# vLLM


@dataclass
class _VllmPlanner:
    compute: Callable[..., Runs]
    torch: Any
    full_spec: type
    mla_spec: type


_VLLM: list[_VllmPlanner | None] = []  # memo: [] = not tried yet


def vllm_planner() -> _VllmPlanner | None:
    """vLLM's MoRIIO offset function, or None (logged) when vLLM cannot be imported."""
    if not _VLLM:
        try:
            import torch
            from vllm.distributed.kv_transfer.kv_connector.v1.moriio import moriio_layout
            from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
        except Exception as exc:  # any import failure means "no vLLM baseline"
            logger.info("vLLM baseline unavailable: %s", exc)
            _VLLM.append(None)
        else:
            _VLLM.append(
                _VllmPlanner(
                    moriio_layout.compute_block_transfer_offsets,
                    torch,
                    FullAttentionSpec,
                    MLAAttentionSpec,
                )
            )
    return _VLLM[0]


def _vllm_layer(
    v: _VllmPlanner, group: LayerGroup, block_size: int, cache_blocks: int
) -> tuple[Any, Any]:
    torch = v.torch
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[group.dtype_bytes]
    spec_cls = v.full_spec if group.kind == "kv" else v.mla_spec
    spec = spec_cls(
        block_size=block_size,
        num_kv_heads=group.num_kv_heads,
        head_size=group.head_size,
        dtype=dtype,
    )
    tensor = torch.empty(_cache_shape(group, block_size, cache_blocks), dtype=dtype, device="meta")
    return tensor, spec


# ---------------------------------------------------------------------------------------------
# Timing


def _median_seconds(
    fn: Callable[[], object], min_time: float, min_reps: int, max_reps: int
) -> float:
    """Median wall time of ``fn`` over at least ``min_reps`` calls and ``min_time`` seconds."""
    fn()  # warm-up: caches, lazy allocations
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps and (
        len(samples) < min_reps or time.perf_counter() - start < min_time
    ):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------
# The benchmark


def _supports_pairs(tmpl: Any, pairs: Any) -> bool:
    try:
        tmpl.plan(pairs)
    except TypeError:
        return False
    return True


def bench_case(
    preset: Preset,
    context_tokens: int,
    *,
    seed: int = 0,
    min_time: float = 0.2,
    min_reps: int = 3,
    max_reps: int = 1000,
    include_vllm: bool = True,
    baseline_layers: int = 2,
) -> dict[str, Any]:
    """Time one request's planning for every layer of ``preset`` at ``context_tokens``.

    Ours runs the whole request (every layer) per repetition. The baselines are timed on
    ``baseline_layers`` layers of each group and scaled by the group's layer count (layers of a
    group cost the same). Returns one result dict (see ``run_planning_bench``).
    """
    bs = preset.block_size
    blocks = max(1, math.ceil(context_tokens / bs))
    cache_blocks = 2 * blocks + 64
    lids, rids = _block_ids(blocks, cache_blocks, seed)
    lids_np = np.asarray(lids, dtype=np.int64)
    rids_np = np.asarray(rids, dtype=np.int64)
    vllm = vllm_planner() if include_vllm else None

    templates: list[Any] = []
    layouts: list[tuple[mn.LayerLayout, mn.LayerLayout]] = []
    groups_out: list[dict[str, Any]] = []
    runs_total = 0
    matches_python = True
    matches_vllm: bool | None = None if vllm is None else True
    python_total = 0.0
    vllm_total: float | None = None if vllm is None else 0.0
    for g in preset.groups:
        layer_templates = []
        for i in range(g.count):
            local = _describe(f"{g.name}.{i}", g, bs, cache_blocks)
            remote = _describe(f"peer.{g.name}.{i}", g, bs, cache_blocks)
            layer_templates.append((local, remote, mn.block_template(local, remote)))
        templates.extend(t for _, _, t in layer_templates)
        layouts.extend((lo, re) for lo, re, _ in layer_templates)
        local, remote, tmpl = layer_templates[0]
        ours = tmpl.plan(lids_np, rids_np)
        ours_runs = (ours.local_offsets.tolist(), ours.remote_offsets.tolist(), ours.sizes.tolist())
        runs_total += len(ours) * g.count

        # Baselines: one representative layer (all layers of a group plan identically).
        py_tmpl = python_block_template(local, remote)
        matches_python &= python_plan(py_tmpl, lids, rids) == ours_runs
        py_layers = [
            python_block_template(lo, re) for lo, re, _ in layer_templates[:baseline_layers]
        ]

        def run_python(tmpls: list[PythonTemplate] = py_layers) -> None:
            for t in tmpls:
                python_plan(t, lids, rids)

        py_s = _median_seconds(run_python, min_time, min_reps, max_reps) / len(py_layers)
        python_total += py_s * g.count

        vllm_s: float | None = None
        if vllm is not None and vllm_total is not None:
            tensor, spec = _vllm_layer(vllm, g, bs, cache_blocks)
            names = [f"{g.name}.{i}" for i in range(min(baseline_layers, g.count))]
            layer_to_spec = dict.fromkeys(names, spec)
            got = vllm.compute(names[0], tensor, layer_to_spec, lids, rids, cache_blocks)
            matches_vllm = bool(matches_vllm) and (tuple(list(x) for x in got) == ours_runs)

            def run_vllm(
                names: list[str] = names, tensor: Any = tensor, layer_to_spec: dict = layer_to_spec
            ) -> None:
                for name in names:
                    vllm.compute(name, tensor, layer_to_spec, lids, rids, cache_blocks)

            vllm_s = _median_seconds(run_vllm, min_time, min_reps, max_reps) / len(names)
            vllm_total += vllm_s * g.count
        groups_out.append(
            {
                "name": g.name,
                "layers": g.count,
                "kind": g.kind,
                "runs_per_block": len(tmpl.runs),
                "runs_per_layer_request": len(ours),
                "python_s_per_layer_request": py_s,
                "vllm_s_per_layer_request": vllm_s,
            }
        )

    probe_pairs = mn.BlockPairs(lids_np, rids_np)
    pairs_once = _supports_pairs(templates[0], probe_pairs)
    if pairs_once:

        def run_ours() -> None:
            pairs = mn.BlockPairs(lids_np, rids_np)
            for t in templates:
                t.plan(pairs)
    else:
        logger.warning(
            "BlockTemplate.plan() does not take BlockPairs in this build: the native "
            "path re-validates and sorts the block ids for every layer"
        )

        def run_ours() -> None:
            for t in templates:
                t.plan(lids_np, rids_np)

    ours_request = _median_seconds(run_ours, min_time, min_reps, max_reps)

    # The public one-call planner as a quick-start user calls it for every layer of a request,
    # with block ids as Python lists: ids validated and sorted per call, or a BlockPairs once.
    def run_convenience_ids() -> None:
        for lo, re in layouts:
            mn.plan_block_copies(lo, re, lids, rids)

    def run_convenience_pairs() -> None:
        pairs = mn.BlockPairs(lids, rids)
        for lo, re in layouts:
            mn.plan_block_copies(lo, re, pairs)

    convenience_ids = _median_seconds(run_convenience_ids, min_time, min_reps, max_reps)
    convenience_pairs = _median_seconds(run_convenience_pairs, min_time, min_reps, max_reps)
    prepare = _median_seconds(
        lambda: mn.BlockPairs(lids_np, rids_np), min_time / 4, min_reps, max_reps
    )
    layers = preset.num_layers
    return {
        "preset": preset.name,
        "description": preset.description,
        "context_tokens": context_tokens,
        "block_size": bs,
        "blocks": blocks,
        "cache_blocks": cache_blocks,
        "layers": layers,
        "groups": groups_out,
        "runs_emitted": runs_total,
        "ours_mode": "pairs-once" if pairs_once else "ids-per-layer",
        "ours_prepare_s": prepare,
        "ours_s_per_request": ours_request,
        "ours_s_per_layer_request": ours_request / layers,
        "ours_ns_per_run": ours_request / max(runs_total, 1) * 1e9,
        "python_s_per_request": python_total,
        "python_s_per_layer_request": python_total / layers,
        "vllm_s_per_request": vllm_total,
        "vllm_s_per_layer_request": None if vllm_total is None else vllm_total / layers,
        "speedup_vs_python": _ratio(python_total, ours_request),
        "speedup_vs_vllm": _ratio(vllm_total, ours_request),
        "convenience_ids_s_per_request": convenience_ids,
        "convenience_pairs_s_per_request": convenience_pairs,
        "convenience_ids_speedup_vs_vllm": _ratio(vllm_total, convenience_ids),
        "convenience_pairs_speedup_vs_vllm": _ratio(vllm_total, convenience_pairs),
        "matches_python": matches_python,
        "matches_vllm": matches_vllm,
    }


def run_planning_bench(
    presets: Sequence[str] = DEFAULT_PRESETS,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    *,
    cases: Sequence[tuple[str, int]] = ISSUE_CASES,
    include_vllm: bool = True,
    seed: int = 0,
    min_time: float = 0.2,
    min_reps: int = 3,
    max_reps: int = 1000,
    baseline_layers: int = 2,
) -> list[dict[str, Any]]:
    """Run every (preset, context) and every extra ``(preset, context)`` case.

    Each result dict holds: preset, description, context_tokens, block_size, blocks (per
    request), cache_blocks, layers, groups (per layer group: name, layers, kind, runs_per_block,
    runs_per_layer_request, python/vllm seconds per layer-request), runs_emitted (all layers of
    one request), ours_mode ("pairs-once" or "ids-per-layer"), ours_prepare_s (BlockPairs,
    once per request), ours_s_per_request, ours_s_per_layer_request, ours_ns_per_run,
    python_s_per_request, python_s_per_layer_request, vllm_s_per_request and
    vllm_s_per_layer_request (None without vLLM), speedup_vs_python, speedup_vs_vllm (None
    without vLLM), convenience_ids_s_per_request and convenience_pairs_s_per_request (every layer
    through ``plan_block_copies`` with list ids per call, or with one ``BlockPairs``) and their
    convenience_*_speedup_vs_vllm, matches_python and matches_vllm (the implementations produced
    identical runs; None without vLLM). Times are medians of repeated runs (time.perf_counter).
    """
    unknown = [p for p in [*presets, *(c[0] for c in cases)] if p not in PRESETS]
    if unknown:
        raise mn.InvalidArgumentError(
            f"unknown planning preset(s) {unknown}; known: {sorted(PRESETS)}"
        )
    if any(c <= 0 for c in [*contexts, *(c[1] for c in cases)]):
        raise mn.InvalidArgumentError("context lengths must be positive")
    todo = [(p, c) for p in presets for c in contexts] + [tuple(c) for c in cases]
    results = []
    for name, ctx in todo:
        logger.info("planning bench: %s at %d tokens", name, ctx)
        results.append(
            bench_case(
                PRESETS[name],
                int(ctx),
                seed=seed,
                min_time=min_time,
                min_reps=min_reps,
                max_reps=max_reps,
                include_vllm=include_vllm,
                baseline_layers=baseline_layers,
            )
        )
    return results


# ---------------------------------------------------------------------------------------------
# Text output


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}x"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of ``run_planning_bench`` results."""
    header = (
        "preset",
        "ctx",
        "blocks",
        "layers",
        "runs",
        "ours/layer",
        "ns/run",
        "python/layer",
        "vllm/layer",
        "vs python",
        "vs vllm",
        "pbc ids vs vllm",
        "pbc pairs vs vllm",
        "same",
    )
    rows = [header]
    for r in results:
        same = "yes" if r["matches_python"] and r["matches_vllm"] in (True, None) else "NO"
        rows.append(
            (
                r["preset"],
                f"{r['context_tokens'] // 1024}K",
                str(r["blocks"]),
                str(r["layers"]),
                str(r["runs_emitted"]),
                _fmt_s(r["ours_s_per_layer_request"]),
                f"{r['ours_ns_per_run']:.2f}",
                _fmt_s(r["python_s_per_layer_request"]),
                _fmt_s(r["vllm_s_per_layer_request"]),
                _fmt_x(r["speedup_vs_python"]),
                _fmt_x(r["speedup_vs_vllm"]),
                _fmt_x(r["convenience_ids_speedup_vs_vllm"]),
                _fmt_x(r["convenience_pairs_speedup_vs_vllm"]),
                same,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    modes = sorted({r["ours_mode"] for r in results})
    lines.append("")
    lines.append(
        "ours: native BlockPairs + per-layer template stamping (mode: "
        + ", ".join(modes)
        + "); /layer = one layer of one request; runs = runs "
        "emitted by one request over all layers; pbc = plan_block_copies per layer with list "
        "ids (ids) or one BlockPairs per request (pairs)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moriio_native.bench.planning", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--presets", nargs="+", default=list(DEFAULT_PRESETS), choices=sorted(PRESETS)
    )
    parser.add_argument(
        "--contexts",
        nargs="+",
        type=int,
        default=list(DEFAULT_CONTEXTS),
        help="context lengths in tokens",
    )
    parser.add_argument(
        "--no-issue-cases", action="store_true", help="skip the 61 layers x 8192 blocks cases"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    parser.add_argument(
        "--min-time", type=float, default=0.2, help="seconds each measurement repeats for at least"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    results = run_planning_bench(
        args.presets,
        args.contexts,
        cases=() if args.no_issue_cases else ISSUE_CASES,
        include_vllm=not args.no_vllm,
        seed=args.seed,
        min_time=args.min_time,
    )
    out = json.dumps(results, indent=2) if args.json else format_table(results)
    sys.stdout.write(out + "\n")
    # As ``moriio-native bench``: 1 when the planners' runs disagree (column "same runs").
    same = all(r["matches_python"] and r["matches_vllm"] in (True, None) for r in results)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
