"""Property test: executing a copy plan with memcpy on real host buffers moves exactly the bytes
a naive per-element copy moves, and nothing else.

For random logical layers (K/V or latent, heads, head sizes, block size, dtype bytes) each side
gets its own physical layout: a shape family, a kernel-block split, a random stride order (as a
permute would produce) and optional padding on any axis (padded pages, gaps between planes).
The naive reference below walks logical (plane, head, token, element) indices and computes
element addresses from the shape and strides on its own; it shares no code with the planner.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moriio_native as mn

GUARD = 24  # bytes of guard around each cache; they must never change

# Shape families, as torch reports the shape (logical order). k = kernel block index,
# tt = token inside the kernel block, p = plane (K=0, V=1), h = head, e = element.
KV_FAMILIES = ("sep_bh", "sep_hb", "inter_bh", "inter_hb", "packed")
LATENT_FAMILIES = ("lat3", "lat4")


@dataclass(frozen=True)
class Logical:
    kind: str
    block_size: int
    heads: int
    dk: int
    dv: int  # 0 for latent
    es: int


@dataclass
class Side:
    family: str
    num_blocks: int
    kb: int  # kernel block size
    shape: list[int]
    strides: list[int]  # elements
    nbytes: int  # bytes of the cache region (from its base)


def _shape(lg: Logical, family: str, nk: int, kb: int) -> list[int]:
    h, d = lg.heads, lg.dk
    return {
        "sep_bh": [2, nk, kb, h, d],
        "sep_hb": [2, nk, h, kb, d],
        "inter_bh": [nk, 2, kb, h, d],
        "inter_hb": [nk, 2, h, kb, d],
        "packed": [nk, h, kb, lg.dk + lg.dv],
        "lat3": [nk, kb, d],
        "lat4": [nk, h, kb, d],
    }[family]


def _index(lg: Logical, side: Side, block, plane: int, head, token, elem) -> tuple:
    """Element index tuple of logical (block, plane, head, token, elem) (numpy-broadcastable)."""
    kpb = lg.block_size // side.kb
    k = block * kpb + token // side.kb
    tt = token % side.kb
    f = side.family
    if f == "sep_bh":
        return (plane, k, tt, head, elem)
    if f == "sep_hb":
        return (plane, k, head, tt, elem)
    if f == "inter_bh":
        return (k, plane, tt, head, elem)
    if f == "inter_hb":
        return (k, plane, head, tt, elem)
    if f == "packed":
        return (k, head, tt, plane * lg.dk + elem)
    if f == "lat3":
        return (k, tt, elem)
    return (k, head, tt, elem)


def _byte_offsets(lg: Logical, side: Side, block, plane: int, head, token, elem) -> np.ndarray:
    idx = _index(lg, side, block, plane, head, token, elem)
    off = sum(np.asarray(i, dtype=np.int64) * s for i, s in zip(idx, side.strides, strict=True))
    return np.asarray(off, dtype=np.int64) * lg.es


@st.composite
def logicals(draw, heads_equal_block: bool = False) -> Logical:
    kind = draw(st.sampled_from(["kv", "mla"]))
    if heads_equal_block:  # the shapes whose token and head axes only the spec tells apart
        block_size = draw(st.sampled_from([2, 4]))
        heads = block_size
    else:
        block_size = draw(st.sampled_from([1, 2, 4, 8]))
        heads = draw(st.integers(1, 3))
    dk = draw(st.integers(1, 4))
    dv = 0
    if kind == "kv":
        dv = draw(st.one_of(st.just(dk), st.integers(1, 4)))
    es = draw(st.sampled_from([1, 2, 4]))
    return Logical(kind, block_size, heads, dk, dv, es)


@st.composite
def sides(draw, lg: Logical) -> Side:
    if lg.kind == "kv":
        families = list(KV_FAMILIES) if lg.dk == lg.dv else ["packed"]
    else:
        families = ["lat3", "lat4"] if lg.heads == 1 else ["lat4"]
    # Heads equal to the kernel block size (kb == heads) make [.., H, kb, ..] and [.., kb, H, ..]
    # the same shape: the spec's axis_order (see _describe) tells them apart.
    kb = draw(st.sampled_from([d for d in range(1, lg.block_size + 1) if lg.block_size % d == 0]))
    family = draw(st.sampled_from(families))
    num_blocks = draw(st.integers(1, 6))
    shape = _shape(lg, family, num_blocks * (lg.block_size // kb), kb)
    n = len(shape)
    # Physical order of the non-content axes (outer -> inner), padding after each axis step.
    order = draw(st.permutations(list(range(n - 1))))
    pads = draw(st.lists(st.sampled_from([0, 0, 0, 1, 3]), min_size=n - 1, max_size=n - 1))
    strides = [0] * n
    strides[-1] = 1
    running = shape[-1]
    for ax in reversed(order):
        strides[ax] = running + pads[ax]
        running = strides[ax] * shape[ax]
    tail = draw(st.sampled_from([0, 0, 5]))
    return Side(family, num_blocks, kb, shape, strides, (running + tail) * lg.es)


@st.composite
def cases(draw, heads_equal_block: bool = False):
    lg = draw(logicals(heads_equal_block))
    local = draw(sides(lg))
    remote = draw(sides(lg))
    n = draw(st.integers(0, min(local.num_blocks, remote.num_blocks)))
    if draw(st.booleans()):
        lids = draw(st.permutations(list(range(local.num_blocks))))[:n]
        rids_all = draw(st.permutations(list(range(remote.num_blocks))))
    else:  # consecutive runs of blocks, where merging across blocks can happen
        a = draw(st.integers(0, local.num_blocks - n))
        c = draw(st.integers(0, remote.num_blocks - n))
        lids = list(range(a, a + n))
        rids_all = list(range(c, c + n)) + [
            b for b in range(remote.num_blocks) if not c <= b < c + n
        ]
    extra = draw(st.integers(0, len(rids_all) - n))
    rids = rids_all[: n + extra]
    seed = draw(st.integers(0, 2**32 - 1))
    return lg, local, remote, lids, rids, seed


def _spec(lg: Logical, axis_order: str) -> mn.CacheSpec:
    if lg.kind == "mla":
        return mn.CacheSpec(
            kind="mla",
            block_size=lg.block_size,
            num_kv_heads=lg.heads,
            head_size=lg.dk,
            dtype_bytes=lg.es,
            axis_order=axis_order,
        )
    return mn.CacheSpec(
        kind="kv",
        block_size=lg.block_size,
        num_kv_heads=lg.heads,
        head_size=lg.dk,
        head_size_v=lg.dv if lg.dv != lg.dk else None,
        dtype_bytes=lg.es,
        axis_order=axis_order,
    )


def _axis_order(family: str) -> str:
    """The order the family's shape lists tokens and heads in (the 4-D ones: heads first)."""
    return "nhd" if family.endswith("_bh") or family == "lat3" else "hnd"


def _describe(name: str, lg: Logical, side: Side, buf: np.ndarray) -> mn.LayerLayout:
    axis = {"sep": "separated", "int": "interleaved"}.get(side.family[:3], "auto")
    geometry = mn.TensorGeometry(side.shape, side.strides, lg.es, buf.ctypes.data + GUARD)
    spec = _spec(lg, _axis_order(side.family))
    return mn.describe_layer(name, geometry, spec, kv_plane_axis=axis)


def _naive_copy(lg: Logical, local: Side, remote: Side, lids, rids, src, dst) -> None:
    """Per element: dst[remote address] = src[local address], for every pair's logical cells."""
    n = len(lids)
    if n == 0:
        return
    lb = np.asarray(lids, dtype=np.int64)[:, None, None, None]
    rb = np.asarray(rids[:n], dtype=np.int64)[:, None, None, None]
    head = np.arange(lg.heads)[None, :, None, None]
    token = np.arange(lg.block_size)[None, None, :, None]
    planes = [(0, lg.dk)] if lg.kind == "mla" else [(0, lg.dk), (1, lg.dv)]
    byte = np.arange(lg.es)
    for plane, width in planes:
        elem = np.arange(width)[None, None, None, :]
        lo = _byte_offsets(lg, local, lb, plane, head, token, elem).reshape(-1)
        ro = _byte_offsets(lg, remote, rb, plane, head, token, elem).reshape(-1)
        src_bytes = GUARD + (lo[:, None] + byte).reshape(-1)
        dst[GUARD + (ro[:, None] + byte).reshape(-1)] = src[src_bytes]


def _check_plan_shape(plan, local_bytes: int, remote_bytes: int, expect_bytes: int) -> None:
    lo = plan.local_offsets.tolist()
    ro = plan.remote_offsets.tolist()
    sz = plan.sizes.tolist()
    assert sum(sz) == expect_bytes, "every requested byte moves exactly once"
    for i, (loc, rem, size) in enumerate(zip(lo, ro, sz, strict=True)):
        assert size > 0
        assert loc >= 0 and loc + size <= local_bytes, f"run {i} leaves the local cache"
        assert rem >= 0 and rem + size <= remote_bytes, f"run {i} leaves the remote cache"
        if i:
            # Sorted by local offset, disjoint, and merged wherever both sides touch.
            assert lo[i - 1] + sz[i - 1] <= loc
            assert not (lo[i - 1] + sz[i - 1] == loc and ro[i - 1] + sz[i - 1] == rem)
    by_remote = sorted(zip(ro, sz, strict=True))
    for (r0, s0), (r1, _) in itertools.pairwise(by_remote):
        assert r0 + s0 <= r1, "two runs write the same remote bytes"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_moves_exactly_the_naive_bytes(case) -> None:
    _check_plan_moves_exactly_the_naive_bytes(case)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(heads_equal_block=True))
def test_plan_moves_exactly_the_naive_bytes_with_heads_equal_to_block(case) -> None:
    _check_plan_moves_exactly_the_naive_bytes(case)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(heads_equal_block=True))
def test_equal_token_and_head_axes_are_ambiguous_without_axis_order(case) -> None:
    lg, local, _, _, _, _ = case
    buf = np.zeros(GUARD + local.nbytes + GUARD, dtype=np.uint8)
    geometry = mn.TensorGeometry(local.shape, local.strides, lg.es, buf.ctypes.data + GUARD)
    axis = {"sep": "separated", "int": "interleaved"}.get(local.family[:3], "auto")
    five_d = len(local.shape) == 5
    if five_d and local.shape[2] == local.shape[3]:
        with pytest.raises(mn.InvalidArgumentError, match="Ambiguous"):
            mn.describe_layer("layer", geometry, _spec(lg, "auto"), kv_plane_axis=axis)
    else:  # the sizes differ (a kernel block smaller than the heads), or a 4-D form
        layout = mn.describe_layer("layer", geometry, _spec(lg, "auto"), kv_plane_axis=axis)
        assert layout == _describe("layer", lg, local, buf)


def _check_plan_moves_exactly_the_naive_bytes(case) -> None:
    lg, local, remote, lids, rids, seed = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size=GUARD + local.nbytes + GUARD, dtype=np.uint8)
    dst0 = rng.integers(0, 256, size=GUARD + remote.nbytes + GUARD, dtype=np.uint8)
    src_before = src.copy()

    llayout = _describe("local", lg, local, src)
    rlayout = _describe("remote", lg, remote, dst0)
    assert llayout.num_blocks == local.num_blocks
    assert rlayout.num_blocks == remote.num_blocks
    assert llayout.span_bytes <= local.nbytes
    block_bytes = lg.heads * lg.block_size * (lg.dk + lg.dv) * lg.es
    assert llayout.block_bytes == block_bytes

    plan = mn.plan_block_copies(llayout, rlayout, lids, rids)
    _check_plan_shape(plan, local.nbytes, remote.nbytes, len(lids) * block_bytes)

    expected = dst0.copy()
    _naive_copy(lg, local, remote, lids, rids, src, expected)
    actual = dst0.copy()
    for loc, rem, size in zip(
        plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.sizes.tolist(), strict=True
    ):
        actual[GUARD + rem : GUARD + rem + size] = src[GUARD + loc : GUARD + loc + size]
    # Same bytes everywhere: requested cells copied, guards and other blocks untouched.
    assert np.array_equal(actual, expected)
    assert np.array_equal(src, src_before)

    # The opposite direction (a READ from the other side) moves the same runs.
    n = len(lids)
    back = mn.plan_block_copies(rlayout, llayout, rids[:n], lids)
    forward_runs = sorted(
        zip(
            plan.local_offsets.tolist(),
            plan.remote_offsets.tolist(),
            plan.sizes.tolist(),
            strict=True,
        )
    )
    backward_runs = sorted(
        zip(
            back.remote_offsets.tolist(),
            back.local_offsets.tolist(),
            back.sizes.tolist(),
            strict=True,
        )
    )
    assert forward_runs == backward_runs


@settings(max_examples=40, deadline=None)
@given(cases())
def test_out_of_range_ids_are_refused_without_a_plan(case) -> None:
    lg, local, remote, lids, rids, _ = case
    src = np.zeros(GUARD + local.nbytes + GUARD, dtype=np.uint8)
    dst = np.zeros(GUARD + remote.nbytes + GUARD, dtype=np.uint8)
    llayout = _describe("local", lg, local, src)
    rlayout = _describe("remote", lg, remote, dst)
    n = len(lids)
    # One past the end on the local side, then on the remote side (each side's own count).
    with pytest.raises(mn.OutOfRangeError, match="local block id"):
        mn.plan_block_copies(llayout, rlayout, [*lids, local.num_blocks], [*rids[:n], 10**6])
    spare_local = [b for b in range(local.num_blocks) if b not in lids]
    if spare_local:
        with pytest.raises(mn.OutOfRangeError, match="remote block id"):
            mn.plan_block_copies(
                llayout, rlayout, [*lids, spare_local[0]], [*rids[:n], remote.num_blocks]
            )
