"""KV caches the way vLLM lays them out, on one shared host backing, for the demo, benchmarks and
tests (numpy only: no torch needed).

A :class:`LayerShape` names a layer's cache geometry (which vLLM generation it mimics, heads,
head size, block size, kernel block size, dtype, physical order, page padding). :func:`build_caches`
carves every layer out of ONE page-aligned backing array (as vLLM's shared KV backing does) and
returns the views, specs and registrations. Element types are carried as same-sized integers
(bf16 as int16, fp8 as uint8): only bytes matter here. :func:`logical_view` re-indexes any layer
as ``[num_blocks, planes, heads, kernel_blocks_per_block, kernel_block_size, head_dim]`` from the
generation's axis roles alone -- independent of the native layout engine, so it can verify every
transferred byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from moriio_native.engine import LayerRegistration
from moriio_native.layout import AxisOrder, CacheSpec
from moriio_native.memory import DEFAULT_PAGE_SIZE, allocate_host_backing

Generation = Literal[
    "separated_nhd",  # [2, N, B, H, D]
    "separated_hnd",  # [2, N, H, B, D]
    "interleaved_nhd",  # [N, 2, B, H, D]
    "interleaved_hnd",  # [N, 2, H, B, D]
    "standardized",  # [N, H, B, Dk+Dv] (packed K|V; vLLM's current [B, H, N, C] view)
    "latent",  # [N, B, D] (MLA latent, key-only, indexer)
    "latent_standardized",  # [N, 1, B, D]
]


@dataclass(frozen=True)
class LayerShape:
    """Geometry of one layer's cache. ``order`` is the physical order of the logical dims
    (a permutation, outermost first; None = contiguous); ``pad_bytes`` is extra space after
    every block (padded pages); ``kernel_block_size`` splits each block along the token axis."""

    name: str
    generation: Generation
    block_size: int
    head_size: int
    num_heads: int = 1
    dtype: str = "bfloat16"
    kernel_block_size: int | None = None
    order: tuple[int, ...] | None = None
    pad_bytes: int = 0

    @property
    def is_latent(self) -> bool:
        return self.generation.startswith("latent")

    @property
    def planes(self) -> int:
        return 1 if self.is_latent else 2

    @property
    def kernel(self) -> int:
        return self.kernel_block_size or self.block_size

    @property
    def axis_order(self) -> AxisOrder:
        """The order the shape lists tokens and heads in (every 4-D form is heads first; the
        latent [N, B, D] has no head axis, tokens come first)."""
        if self.generation.endswith("nhd") or self.generation == "latent":
            return "nhd"
        return "hnd"

    def spec(self) -> CacheSpec:
        return CacheSpec(
            kind="mla" if self.is_latent else "kv",
            block_size=self.block_size,
            num_kv_heads=self.num_heads,
            head_size=self.head_size,
            dtype_bytes=_itemsize(self.dtype),
            axis_order=self.axis_order,
        )

    def logical_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The tensor shape vLLM would report, with kernel blocks folded in."""
        kb = self.kernel
        nk = num_blocks * (self.block_size // kb)
        h, d = self.num_heads, self.head_size
        shapes: dict[str, tuple[int, ...]] = {
            "separated_nhd": (2, nk, kb, h, d),
            "separated_hnd": (2, nk, h, kb, d),
            "interleaved_nhd": (nk, 2, kb, h, d),
            "interleaved_hnd": (nk, 2, h, kb, d),
            "standardized": (nk, h, kb, 2 * d),
            "latent": (nk, kb, d),
            "latent_standardized": (nk, 1, kb, d),
        }
        return shapes[self.generation]

    def block_axis(self) -> int:
        return 1 if self.generation.startswith("separated") else 0

    def block_bytes(self) -> int:
        return (
            self.planes * self.num_heads * self.block_size * self.head_size * _itemsize(self.dtype)
        )


_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_CONTAINER = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_ITEMSIZE)}") from None


def _layer_strides(shape: LayerShape, num_blocks: int) -> tuple[tuple[int, ...], list[int], int]:
    """(logical shape, BYTE strides, bytes spanned) of ``shape`` laid out physically."""
    es = _itemsize(shape.dtype)
    logical = shape.logical_shape(num_blocks)
    order = shape.order or tuple(range(len(logical)))
    strides = [0] * len(logical)
    step = es
    for dim in reversed(order):
        strides[dim] = step
        step *= logical[dim]
    nbytes = step
    if shape.pad_bytes:
        axis = shape.block_axis()
        # Padding after each block keeps the view non-overlapping only with the block axis
        # outermost.
        if shape.pad_bytes % es or order[0] != axis:
            raise ValueError(
                f"{shape.name}: padding needs whole elements and the block axis outermost"
            )
        strides[axis] += shape.pad_bytes
        nbytes = logical[axis] * strides[axis]
    return logical, strides, nbytes


def _strided(
    base: np.ndarray, offset: int, dtype: type, shape: tuple[int, ...], strides: list[int]
) -> np.ndarray:
    """A writable strided view of ``base`` starting ``offset`` bytes in (strides in bytes)."""
    flat = base[offset:]
    usable = flat.nbytes - flat.nbytes % np.dtype(dtype).itemsize
    return np.lib.stride_tricks.as_strided(flat[:usable].view(dtype), shape=shape, strides=strides)


@dataclass
class KvCacheSet:
    """Layer views carved from one backing array."""

    backing: np.ndarray
    shapes: list[LayerShape]
    num_blocks: int
    views: dict[str, np.ndarray] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)

    def registrations(self) -> list[LayerRegistration]:
        base = self.backing.ctypes.data
        size = self.backing.nbytes
        return [
            LayerRegistration(
                name=s.name, tensor=self.views[s.name], spec=s.spec(), allocation=(base, size)
            )
            for s in self.shapes
        ]

    def shape(self, name: str) -> LayerShape:
        return next(s for s in self.shapes if s.name == name)

    def total_block_bytes(self) -> int:
        return sum(s.block_bytes() for s in self.shapes)


def build_caches(
    shapes: Sequence[LayerShape],
    num_blocks: int,
    page_size: int = DEFAULT_PAGE_SIZE,
    gap_bytes: int = 256,
    allocate: Callable[[int], np.ndarray] | None = None,
) -> KvCacheSet:
    """Carve every layer out of ONE page-aligned backing; layers start ``gap_bytes`` apart (so
    views are not page aligned, as in vLLM) and the gaps are bytes no transfer may touch.

    ``allocate(nbytes)`` provides the backing (e.g. ``Engine.allocate_host_backing``, memory a
    same-host peer copies with memcpy); default: a page-aligned numpy allocation."""
    offsets: list[int] = []
    total = 0
    for s in shapes:
        total += gap_bytes
        offsets.append(total)
        total += _layer_strides(s, num_blocks)[2]
    total += gap_bytes
    backing = allocate(total) if allocate else allocate_host_backing(total, page_size)
    if backing.nbytes < total or backing.dtype != np.uint8:
        raise ValueError(f"the backing must be at least {total} uint8 bytes, got {backing.nbytes}")
    cache = KvCacheSet(backing=backing[:total], shapes=list(shapes), num_blocks=num_blocks)
    for s, off in zip(shapes, offsets, strict=True):
        logical, strides, _ = _layer_strides(s, num_blocks)
        cache.views[s.name] = _strided(
            cache.backing, off, _CONTAINER[_itemsize(s.dtype)], logical, strides
        )
        cache.offsets[s.name] = off
    return cache


def logical_view(array: np.ndarray, shape: LayerShape) -> np.ndarray:
    """``array`` (laid out as ``shape``) viewed as [blocks, planes, heads, kb_per_block,
    kernel_block_size, head_dim] -- a view, so assignment writes through."""
    kb = shape.kernel
    per = shape.block_size // kb
    st = array.strides
    d = shape.head_size
    es = array.itemsize
    g = shape.generation
    # (block, plane, head, token, content) byte strides per generation; 0 for absent axes.
    if g.startswith("separated"):
        head, tok = (3, 2) if g.endswith("nhd") else (2, 3)
        roles = (st[1], st[0], st[head], st[tok], st[4])
    elif g.startswith("interleaved"):
        head, tok = (3, 2) if g.endswith("nhd") else (2, 3)
        roles = (st[0], st[1], st[head], st[tok], st[4])
    elif g == "standardized":  # K|V packed in the content axis: V starts d elements in
        roles = (st[0], d * es, st[1], st[2], st[3])
    elif g == "latent":
        roles = (st[0], 0, 0, st[1], st[2])
    else:  # latent_standardized
        roles = (st[0], 0, st[1], st[2], st[3])
    sb, sp, sh, stok, sd = roles
    out_shape = (array.shape[shape.block_axis()] // per, shape.planes, shape.num_heads, per, kb, d)
    out_strides = (sb * per, sp, sh, sb, stok, sd)
    return np.lib.stride_tricks.as_strided(array, shape=out_shape, strides=out_strides)


def _token_copies(
    dst_views: Mapping[str, np.ndarray],
    dst: KvCacheSet,
    src: KvCacheSet,
    layers: Sequence[str] | None,
) -> Iterator[tuple[np.ndarray, np.ndarray, int, int, int]]:
    """Per layer (of ``layers``, default every one) and token slot: the logical views of the
    destination (from ``dst_views``) and of the source, with the token's (kernel block, slot)
    on each side -- the two sides may split blocks into kernel blocks differently."""
    for s in dst.shapes:
        if layers is not None and s.name not in layers:
            continue
        target = logical_view(dst_views[s.name], s)
        src_shape = src.shape(s.name)
        source = logical_view(src.views[s.name], src_shape)
        kt, ks = s.kernel, src_shape.kernel
        for t in range(s.block_size):
            yield target, source, t, kt, ks


def expected_after_copy(
    dst: KvCacheSet,
    src: KvCacheSet,
    dst_blocks: Sequence[int],
    src_blocks: Sequence[int],
    layers: Sequence[str] | None = None,
) -> np.ndarray:
    """The destination backing as it must look after copying ``src_blocks[i]`` of every layer
    (or of ``layers``) of ``src`` to ``dst_blocks[i]`` of ``dst`` -- plain numpy indexing."""
    expected = dst.backing.copy()
    views = {
        s.name: _strided(
            expected,
            dst.offsets[s.name],
            dst.views[s.name].dtype.type,
            dst.views[s.name].shape,
            list(dst.views[s.name].strides),
        )
        for s in dst.shapes
    }
    idx_dst = np.asarray(dst_blocks, dtype=np.int64)
    idx_src = np.asarray(src_blocks, dtype=np.int64)
    for target, source, t, kt, ks in _token_copies(views, dst, src, layers):
        target[idx_dst, :, :, t // kt, t % kt] = source[idx_src, :, :, t // ks, t % ks]
    return expected


def blocks_match(
    dst: KvCacheSet,
    src: KvCacheSet,
    dst_blocks: Sequence[int],
    src_blocks: Sequence[int],
    layers: Sequence[str] | None = None,
) -> bool:
    """Whether ``dst_blocks[i]`` of every layer (or of ``layers``) of ``dst`` hold exactly what
    ``src_blocks[i]`` of ``src`` hold (other blocks are not looked at: they may be in use)."""
    idx_dst = np.asarray(dst_blocks, dtype=np.int64)
    idx_src = np.asarray(src_blocks, dtype=np.int64)
    return all(
        np.array_equal(
            target[idx_dst, :, :, t // kt, t % kt], source[idx_src, :, :, t // ks, t % ks]
        )
        for target, source, t, kt, ks in _token_copies(dst.views, dst, src, layers)
    )


def fill_random(cache: KvCacheSet, seed: int) -> None:
    """Fill the whole backing (gaps included) with reproducible random bytes."""
    random_bytes = np.random.default_rng(seed).bytes(cache.backing.nbytes)
    cache.backing[:] = np.frombuffer(random_bytes, dtype=np.uint8)


# Mixed model used by tests: every layout generation on one backing, with different physical
# orders, a kernel-block split and padded pages.
def mixed_model(side: Literal["prefill", "decode"]) -> list[LayerShape]:
    """Six+ layers of one model as one side lays them out; both sides hold the same logical
    content in different physical layouts."""
    if side == "prefill":
        return [
            LayerShape("dense.0", "separated_nhd", block_size=16, head_size=8, num_heads=2),
            LayerShape("dense.1", "interleaved_nhd", block_size=16, head_size=8, num_heads=2),
            LayerShape(
                "dense.2",
                "standardized",
                block_size=16,
                head_size=8,
                num_heads=2,
                order=(0, 2, 1, 3),
            ),
            LayerShape(
                "dense.3",
                "separated_hnd",
                block_size=16,
                head_size=8,
                num_heads=2,
                kernel_block_size=8,
            ),
            LayerShape("indexer.0", "latent", block_size=16, head_size=12, dtype="float8_e4m3fn"),
            LayerShape("mla.0", "latent_standardized", block_size=16, head_size=24, pad_bytes=64),
        ]
    return [
        LayerShape("dense.0", "interleaved_hnd", block_size=16, head_size=8, num_heads=2),
        LayerShape("dense.1", "standardized", block_size=16, head_size=8, num_heads=2),
        LayerShape(
            "dense.2", "separated_nhd", block_size=16, head_size=8, num_heads=2, kernel_block_size=4
        ),
        LayerShape(
            "dense.3",
            "standardized",
            block_size=16,
            head_size=8,
            num_heads=2,
            order=(0, 2, 1, 3),
            pad_bytes=32,
        ),
        LayerShape(
            "indexer.0", "latent_standardized", block_size=16, head_size=12, dtype="float8_e4m3fn"
        ),
        LayerShape("mla.0", "latent", block_size=16, head_size=24, kernel_block_size=8),
    ]


__all__ = [
    "Generation",
    "KvCacheSet",
    "LayerShape",
    "build_caches",
    "expected_after_copy",
    "fill_random",
    "logical_view",
    "mixed_model",
]
