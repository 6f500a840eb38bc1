"""A layer pair's cell geometry as Python sees it (``BlockTemplate.cell_geometry``,
``block_offsets``) and the plugin's form of it (``cells_of``): runs everywhere, no GPU.

A numpy walk of the grid, written here from the geometry's definition, must move exactly the
bytes the pair's run plan moves; the GPU kernel is held to the same plans in test_cudacopy.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import moriio_native as mn
from moriio_native.bench.cudacopy import cells_of


def _layer(name: str, shape: tuple[int, ...], order: str, strides: tuple[int, ...] = ()) -> Any:
    spec = mn.CacheSpec(
        block_size=4, num_kv_heads=2, head_size=shape[-1], dtype_bytes=2, axis_order=order
    )
    if not strides:
        strides = tuple(int(s) for s in np.cumprod((1, *shape[:0:-1]))[::-1])
    return mn.describe_layer(name, mn.TensorGeometry(list(shape), list(strides), 2), spec)


def _cell_walk(geometry: dict[str, Any], blocks: tuple[Any, Any], dst: Any, src: Any) -> None:
    """Copies every cell of every block pair from the remote buffer into the local one."""
    n = geometry["cell_bytes"]
    loc, rem = geometry["local"], geometry["remote"]
    for lb, rb in zip(*blocks, strict=True):
        for p in range(geometry["planes"]):
            for h in range(geometry["heads"]):
                for t in range(geometry["tokens"]):
                    d = lb + p * loc["plane_stride"] + h * loc["head_stride"]
                    d += t * loc["token_stride"]
                    s = rb + p * rem["plane_stride"] + h * rem["head_stride"]
                    s += t * rem["token_stride"]
                    dst[d : d + n] = src[s : s + n]


def test_nhd_against_hnd_worked_example() -> None:
    # Prefill [2,N,B,H,D] = [2,8,4,2,3] bf16: plane 384 B, block 48, token 12, head 6. Decode
    # [N,2,H,B,D] = [16,2,2,4,3]: block 96, plane 48, head 24, token 6. Cells of 6 bytes.
    local = _layer("prefill.0", (2, 8, 4, 2, 3), "nhd")
    remote = _layer("decode.0", (16, 2, 2, 4, 3), "hnd")
    tmpl = mn.block_template(local, remote)
    assert tmpl.prefers_cell_copy
    assert tmpl.cell_geometry == {
        "planes": 2,
        "heads": 2,
        "tokens": 4,
        "cell_bytes": 6,
        "local": {"block_stride": 48, "plane_stride": 384, "head_stride": 6, "token_stride": 12},
        "remote": {"block_stride": 96, "plane_stride": 48, "head_stride": 24, "token_stride": 6},
    }
    lo, ro = tmpl.block_offsets(mn.BlockPairs([3, 1], [5, 4]), 1000, 7)
    assert lo.tolist() == [1000 + 48, 1000 + 3 * 48]
    assert ro.tolist() == [7 + 4 * 96, 7 + 5 * 96]
    # A READ copies into the local side: dst strides are the local ones.
    read = cells_of(tmpl.cell_geometry, into_local=True)
    assert (read.dst_head_stride, read.dst_token_stride) == (6, 12)
    assert (read.src_plane_stride, read.src_head_stride, read.src_token_stride) == (48, 24, 6)
    write = cells_of(tmpl.cell_geometry, into_local=False)
    assert (write.dst_plane_stride, write.src_plane_stride) == (48, 384)
    assert (write.planes, write.heads, write.tokens, write.cell_bytes) == (2, 2, 4, 6)


@pytest.mark.parametrize(
    ("local_shape", "local_order", "remote_shape", "remote_order", "remote_strides"),
    [
        ((2, 8, 4, 2, 3), "nhd", (16, 2, 2, 4, 3), "hnd", ()),
        ((8, 2, 2, 4, 3), "hnd", (2, 16, 4, 2, 3), "nhd", ()),
        ((2, 8, 2, 4, 3), "hnd", (2, 16, 2, 4, 3), "hnd", (700, 40, 18, 4, 1)),  # padded
    ],
)
def test_the_grid_moves_what_the_run_plan_moves(
    local_shape: tuple[int, ...],
    local_order: str,
    remote_shape: tuple[int, ...],
    remote_order: str,
    remote_strides: tuple[int, ...],
) -> None:
    local = _layer("l", local_shape, local_order)
    remote = _layer("r", remote_shape, remote_order, remote_strides)
    tmpl = mn.block_template(local, remote)
    pairs = mn.BlockPairs([6, 0, 3], [2, 15, 9])
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, remote.span_bytes, dtype=np.uint8)
    by_runs = rng.integers(0, 256, local.span_bytes, dtype=np.uint8)
    by_cells = by_runs.copy()
    for lo, ro, n in tmpl.plan(pairs).runs():
        by_runs[lo : lo + n] = src[ro : ro + n]
    _cell_walk(tmpl.cell_geometry, tmpl.block_offsets(pairs), by_cells, src)
    assert np.array_equal(by_cells, by_runs)


def test_no_geometry_is_refused_with_the_layer_named() -> None:
    # HND kernel blocks of 2 tokens: the second kernel block is not one token stride further.
    local = _layer("kernel_hnd", (2, 16, 2, 2, 3), "hnd")
    tmpl = mn.block_template(local, _layer("r", (2, 8, 4, 2, 3), "nhd"))
    assert tmpl.cell_geometry is None
    assert not tmpl.prefers_cell_copy
    with pytest.raises(mn.FailedPreconditionError, match="layer 'kernel_hnd'"):
        tmpl.block_offsets(mn.BlockPairs([1], [2]))


def test_block_offsets_refuse_ids_past_the_cache() -> None:
    tmpl = mn.block_template(
        _layer("l", (2, 8, 4, 2, 3), "nhd"), _layer("r", (16, 2, 2, 4, 3), "hnd")
    )
    with pytest.raises(mn.OutOfRangeError, match="remote block id 16"):
        tmpl.block_offsets(mn.BlockPairs([0], [16]))
