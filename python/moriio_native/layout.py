"""Layout engine facade: describe a layer's KV cache and plan block copies between two layers.

The work happens in the native core; this module adapts torch tensors (read through their
``shape``/``stride()``/``element_size()``/``data_ptr()``, without importing torch) and caches
one block template per (local layout, remote layout) pair.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moriio_native import _native
from moriio_native._native import (
    BlockPairs,
    BlockTemplate,
    CacheSpec,
    CopyPlan,
    LayerLayout,
    TensorGeometry,
)
from moriio_native.errors import InvalidArgumentError
from moriio_native.integers import is_integer

KvPlaneAxis = Literal["auto", "separated", "interleaved"]
# CacheSpec.axis_order: the order in which the tensor's SHAPE lists a block's tokens (N) and the
# heads (H) -- "nhd" for [2,N,B,H,D] / [N,2,B,H,D], "hnd" for [2,N,H,B,D] / [N,2,H,B,D] and every
# 4-D form. The memory order comes from the strides. "auto" reads it from the shape and raises
# "Ambiguous" when both readings fit (num_kv_heads equal to the block or kernel block size).
AxisOrder = Literal["auto", "nhd", "hnd"]
BlockIds = Sequence[int] | Any  # any 1-D integer sequence or array

_TEMPLATE_CACHE_SIZE = 4096


@dataclass(frozen=True)
class CellWindow:
    """A rectangle of a block's cell grid: heads ``[head_begin, head_begin + heads)`` and tokens
    ``[token_begin, token_begin + tokens)`` of every plane. ``None`` counts run to the end of the
    block; the default is the whole block.

    What a transfer moves when one side holds part of the other's block: a head range when
    prefill and decode split the KV heads over different TP sizes, a token range when their
    block sizes differ. Cell (plane, h, t) of a local window pairs with cell (plane, h, t) of the
    remote window, ``h`` and ``t`` counted from each window's begin. A window outside its block
    is InvalidArgumentError naming the layer and the window when a transfer uses it.
    """

    head_begin: int = 0
    heads: int | None = None
    token_begin: int = 0
    tokens: int | None = None

    def _native(self) -> tuple[int, int | None, int, int | None]:
        def whole(name: str) -> int:
            # A float or a bool is refused, never truncated: 1.5 heads in would move heads 1..
            value = getattr(self, name)
            if not is_integer(value):
                raise InvalidArgumentError(
                    f"{self!r}: {name} must be an integer, got {type(value).__name__} {value!r}"
                )
            if not -(2**63) <= value < 2**63:  # the engine's window fields (int64)
                raise InvalidArgumentError(f"{self!r}: {name} {value} is out of range")
            return int(value)

        def count(name: str) -> int | None:
            return None if getattr(self, name) is None else whole(name)

        return (whole("head_begin"), count("heads"), whole("token_begin"), count("tokens"))


WHOLE_BLOCK = CellWindow()


def geometry_of(tensor_or_geometry: Any) -> TensorGeometry:
    """A TensorGeometry from a TensorGeometry, a numpy array or a torch.Tensor (duck-typed)."""
    if isinstance(tensor_or_geometry, TensorGeometry):
        return tensor_or_geometry
    t = tensor_or_geometry
    if isinstance(t, np.ndarray):
        if any(stride % t.itemsize for stride in t.strides):
            raise TypeError("numpy array strides must be whole elements")
        return TensorGeometry(
            shape=list(t.shape),
            strides=[stride // t.itemsize for stride in t.strides],
            element_size=t.itemsize,
            data_ptr=t.ctypes.data,
        )
    try:
        return TensorGeometry(
            shape=list(t.shape),
            strides=list(t.stride()),
            element_size=int(t.element_size()),
            data_ptr=int(t.data_ptr()),
        )
    except AttributeError as exc:
        raise TypeError(
            f"expected a TensorGeometry or a tensor with shape/stride()/element_size()/data_ptr(), "
            f"got {type(t).__name__}"
        ) from exc


def _layer_geometry(name: str, tensor_or_geometry: Any) -> TensorGeometry:
    """:func:`geometry_of` with the layer named in its error."""
    try:
        return geometry_of(tensor_or_geometry)
    except TypeError as exc:
        raise TypeError(f"layer {name!r}: {exc}") from None


def describe_layer(
    name: str, tensor_or_geometry: Any, spec: CacheSpec, kv_plane_axis: KvPlaneAxis = "auto"
) -> LayerLayout:
    """Read a layer's layout from its tensor (or geometry) and spec.

    Raises InvalidArgumentError naming the layer and shape when the tensor does not match the
    spec (or its ``axis_order``), or when the shape is ambiguous ("Ambiguous ...": pass
    ``axis_order`` in the spec, or ``kv_plane_axis``).
    """
    return _native._describe_layer(
        name, _layer_geometry(name, tensor_or_geometry), spec, kv_plane_axis
    )


_WHOLE = WHOLE_BLOCK._native()


@functools.lru_cache(maxsize=_TEMPLATE_CACHE_SIZE)
def _cached_template(
    local: LayerLayout,
    remote: LayerLayout,
    local_window: tuple[int, int | None, int, int | None],
    remote_window: tuple[int, int | None, int, int | None],
) -> BlockTemplate:
    if local_window == _WHOLE and remote_window == _WHOLE:
        return BlockTemplate(local, remote)
    return BlockTemplate(local, remote, local_window, remote_window)


def block_template(
    local: LayerLayout,
    remote: LayerLayout,
    local_window: CellWindow = WHOLE_BLOCK,
    remote_window: CellWindow = WHOLE_BLOCK,
) -> BlockTemplate:
    """The runs that copy one block of ``local`` to one block of ``remote`` -- or, with windows,
    the cells of ``local_window`` of a local block to those of ``remote_window`` of a remote
    block -- built once per (layout pair, windows) and cached (keyed on both layouts' full
    identity: name and every layout number, so two layouts that differ anywhere never share a
    template).

    Whole windows need the same logical content on both sides (IncompatiblePeerError naming both
    layouts otherwise). Windows may pair layers of other head counts or block sizes when kind,
    dtype and bytes per head and token agree and the windows hold as many heads and tokens."""
    # Checked before the cache is consulted: a window equal to a cached one (True == 1,
    # 0.0 == 0, same hash) must be refused as it would be on a miss.
    return _cached_template(local, remote, local_window._native(), remote_window._native())


block_template.cache_info = _cached_template.cache_info  # type: ignore[attr-defined]
block_template.cache_clear = _cached_template.cache_clear  # type: ignore[attr-defined]


def plan_block_copies(
    local_layout: LayerLayout,
    remote_layout: LayerLayout,
    local_block_ids: BlockIds | BlockPairs,
    remote_block_ids: BlockIds | None = None,
    *,
    local_window: CellWindow = WHOLE_BLOCK,
    remote_window: CellWindow = WHOLE_BLOCK,
) -> CopyPlan:
    """Byte runs that copy ``local_block_ids[i]`` <-> ``remote_block_ids[i]`` of one layer.

    The layer pair's block template is cached (:func:`block_template`). The block ids are either
    two sequences, validated and sorted on every call, or a :class:`BlockPairs` made once per
    request -- the fast path when a request plans many layers::

        pairs = BlockPairs(local_ids, remote_ids)  # once per request
        plans = [plan_block_copies(lo, re, pairs) for lo, re in layers]

    Offsets are relative to each side's layer base, sorted by local offset, merged where both
    sides are contiguous. A local list longer than the remote one is an error; a shorter one
    pairs with the first remote ids.

    ``local_window`` / ``remote_window`` restrict the copy to those cells of every block (see
    :class:`CellWindow` and :func:`block_template`).
    """
    template = block_template(local_layout, remote_layout, local_window, remote_window)
    if isinstance(local_block_ids, BlockPairs):
        if remote_block_ids is not None:
            raise InvalidArgumentError(
                "plan_block_copies: pass a BlockPairs or local and remote block ids, not both"
            )
        return template.plan(local_block_ids)
    if remote_block_ids is None:
        raise InvalidArgumentError(
            "plan_block_copies: remote_block_ids is required with local block ids "
            "(or pass a BlockPairs)"
        )
    return template.plan(local_block_ids, remote_block_ids)


__all__ = [
    "AxisOrder",
    "BlockPairs",
    "BlockTemplate",
    "CacheSpec",
    "CellWindow",
    "CopyPlan",
    "KvPlaneAxis",
    "LayerLayout",
    "TensorGeometry",
    "block_template",
    "describe_layer",
    "geometry_of",
    "plan_block_copies",
]
