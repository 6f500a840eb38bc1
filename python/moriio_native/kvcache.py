"""KV caches the way vLLM lays them out, on one shared backing, for the demo, benchmarks and tests.

A :class:`LayerShape` names a layer's cache geometry (which vLLM generation it mimics, heads,
head size, block size, kernel block size, dtype, physical order, page padding). :func:`build_caches`
carves every layer out of ONE page-aligned backing tensor (as vLLM's shared KV backing does) and
returns the views, specs and registrations. :func:`logical_view` re-indexes any layer's tensor as
``[num_blocks, planes, heads, kernel_blocks_per_block, kernel_block_size, head_dim]`` with plain
torch indexing -- an implementation independent of the native layout engine, used to verify
every transferred byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from moriio_native.engine import LayerRegistration, MemoryKind
from moriio_native.layout import CacheSpec
from moriio_native.memory import DEFAULT_PAGE_SIZE, allocate_kv_backing

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

    def spec(self) -> CacheSpec:
        return CacheSpec(
            kind="mla" if self.is_latent else "kv",
            block_size=self.block_size,
            num_kv_heads=self.num_heads,
            head_size=self.head_size,
            dtype_bytes=_dtype(self.dtype).itemsize,
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
        return self.planes * self.num_heads * self.block_size * self.head_size * _dtype(self.dtype).itemsize


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _layer_strides(shape: LayerShape, num_blocks: int) -> tuple[tuple[int, ...], list[int], int]:
    """(logical shape, element strides, bytes spanned) of ``shape`` laid out physically."""
    es = _dtype(shape.dtype).itemsize
    logical = shape.logical_shape(num_blocks)
    order = shape.order or tuple(range(len(logical)))
    strides = [0] * len(logical)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= logical[dim]
    nbytes = step * es
    if shape.pad_bytes:
        axis = shape.block_axis()
        # Padding after each block keeps the view non-overlapping only with the block axis
        # outermost.
        if shape.pad_bytes % es or order[0] != axis:
            raise ValueError(f"{shape.name}: padding needs whole elements and the block axis outermost")
        strides[axis] += shape.pad_bytes // es
        nbytes = logical[axis] * strides[axis] * es
    return logical, strides, nbytes


def _layer_tensor(backing: Any, offset: int, shape: LayerShape, num_blocks: int) -> Any:
    """A view of ``backing`` at byte ``offset`` laid out as ``shape``."""
    import torch

    logical, strides, nbytes = _layer_strides(shape, num_blocks)
    flat = backing[offset : offset + nbytes].view(_dtype(shape.dtype))
    return torch.as_strided(flat, size=logical, stride=strides)


def bits(tensor: Any) -> Any:
    """The same bytes as an integer tensor (exact comparison and indexing for any dtype)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(ints[tensor.element_size()])


@dataclass
class KvCacheSet:
    """Layer views carved from one backing tensor."""

    backing: Any
    shapes: list[LayerShape]
    num_blocks: int
    views: dict[str, Any] = field(default_factory=dict)
    memory: MemoryKind = "host"
    device_index: int = -1

    def registrations(self) -> list[LayerRegistration]:
        base = self.backing.data_ptr()
        size = self.backing.numel()
        return [
            LayerRegistration(
                name=s.name,
                tensor=self.views[s.name],
                spec=s.spec(),
                allocation=(base, size),
                memory=self.memory,
                device=self.device_index,
            )
            for s in self.shapes
        ]

    def total_block_bytes(self) -> int:
        return sum(s.block_bytes() for s in self.shapes)


def build_caches(
    shapes: Sequence[LayerShape],
    num_blocks: int,
    device: Any = "cpu",
    page_size: int = DEFAULT_PAGE_SIZE,
    gap_bytes: int = 256,
) -> KvCacheSet:
    """Carve every layer out of ONE page-aligned backing; layers start ``gap_bytes`` apart (so
    views are not page aligned, as in vLLM) and the gaps are bytes no transfer may touch."""
    import torch

    offsets: list[int] = []
    total = 0
    for s in shapes:
        total += gap_bytes
        offsets.append(total)
        total += _layer_strides(s, num_blocks)[2]
    total += gap_bytes
    backing = allocate_kv_backing(total, device=device, page_size=page_size)
    dev = torch.device(device)
    cache = KvCacheSet(
        backing=backing,
        shapes=list(shapes),
        num_blocks=num_blocks,
        memory="cuda" if dev.type == "cuda" else "host",
        device_index=dev.index if dev.type == "cuda" and dev.index is not None else (0 if dev.type == "cuda" else -1),
    )
    for s, off in zip(shapes, offsets, strict=True):
        cache.views[s.name] = _layer_tensor(backing, off, s, num_blocks)
    return cache


def logical_view(tensor: Any, shape: LayerShape) -> Any:
    """``tensor`` (laid out as ``shape``) viewed as [blocks, planes, heads, kb_per_block,
    kernel_block_size, head_dim] -- a view, so assignment writes through."""
    kb = shape.kernel
    per = shape.block_size // kb
    g = shape.generation
    if g == "separated_nhd":  # [2, NK, KB, H, D] -> [NK, 2, H, KB, D]
        v = tensor.permute(1, 0, 3, 2, 4)
    elif g == "separated_hnd":  # [2, NK, H, KB, D]
        v = tensor.permute(1, 0, 2, 3, 4)
    elif g == "interleaved_nhd":  # [NK, 2, KB, H, D]
        v = tensor.permute(0, 1, 3, 2, 4)
    elif g == "interleaved_hnd":  # [NK, 2, H, KB, D]
        v = tensor
    elif g == "standardized":  # [NK, H, KB, 2D] -> [NK, H, KB, 2, D] -> [NK, 2, H, KB, D]
        nk, h, kbs, two_d = tensor.shape
        v = tensor.unflatten(3, (2, two_d // 2)).permute(0, 3, 1, 2, 4)
    elif g == "latent":  # [NK, KB, D] -> [NK, 1, 1, KB, D]
        v = tensor.unsqueeze(1).unsqueeze(1)
    else:  # latent_standardized [NK, 1, KB, D] -> [NK, 1, 1, KB, D]
        v = tensor.unsqueeze(1)
    nk = v.shape[0]
    # [NK, P, H, KB, D] -> [NB, per, P, H, KB, D] -> [NB, P, H, per, KB, D]
    return v.unflatten(0, (nk // per, per)).permute(0, 2, 3, 1, 4, 5)


def expected_after_copy(
    dst: KvCacheSet, src: KvCacheSet, dst_blocks: Sequence[int], src_blocks: Sequence[int]
) -> Any:
    """The destination backing as it must look after copying ``src_blocks[i]`` of every layer of
    ``src`` to ``dst_blocks[i]`` of ``dst`` -- computed with torch indexing only."""
    import torch

    expected = dst.backing.clone()
    for s in dst.shapes:
        src_shape = next(x for x in src.shapes if x.name == s.name)
        target = logical_view(bits(_rebase(dst.views[s.name], dst.backing, expected)), s)
        source = logical_view(bits(src.views[s.name]), src_shape)
        idx_dst = torch.as_tensor(list(dst_blocks), dtype=torch.long, device=target.device)
        idx_src = torch.as_tensor(list(src_blocks), dtype=torch.long, device=source.device)
        # The two sides may split blocks into kernel blocks differently: copy token by token.
        kt, ks = s.kernel, src_shape.kernel
        for t in range(s.block_size):
            target[idx_dst, :, :, t // kt, t % kt] = source[idx_src, :, :, t // ks, t % ks].to(
                target.device
            )
    return expected


def _rebase(view: Any, old_backing: Any, new_backing: Any) -> Any:
    """The same strided view, over ``new_backing`` instead of ``old_backing``."""
    import torch

    offset_bytes = view.data_ptr() - old_backing.data_ptr()
    flat = new_backing[offset_bytes:].view(view.dtype)
    return torch.as_strided(flat, size=view.shape, stride=view.stride())


def fill_random(cache: KvCacheSet, seed: int) -> None:
    """Fill the whole backing (gaps included) with reproducible random bytes."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    data = torch.randint(0, 256, (cache.backing.numel(),), dtype=torch.uint8, generator=gen)
    cache.backing.copy_(data.to(cache.backing.device))


# Mixed model used by tests: every layout generation on one backing, with different physical
# orders, a kernel-block split and padded pages.
def mixed_model(side: Literal["prefill", "decode"]) -> list[LayerShape]:
    """Six+ layers of one model as one side lays them out; both sides hold the same logical
    content in different physical layouts."""
    if side == "prefill":
        return [
            LayerShape("dense.0", "separated_nhd", block_size=16, head_size=8, num_heads=2),
            LayerShape("dense.1", "interleaved_nhd", block_size=16, head_size=8, num_heads=2),
            LayerShape("dense.2", "standardized", block_size=16, head_size=8, num_heads=2, order=(0, 2, 1, 3)),
            LayerShape("dense.3", "separated_hnd", block_size=16, head_size=8, num_heads=2, kernel_block_size=8),
            LayerShape("indexer.0", "latent", block_size=16, head_size=12, dtype="float8_e4m3fn"),
            LayerShape("mla.0", "latent_standardized", block_size=16, head_size=24, pad_bytes=64),
        ]
    return [
        LayerShape("dense.0", "interleaved_hnd", block_size=16, head_size=8, num_heads=2),
        LayerShape("dense.1", "standardized", block_size=16, head_size=8, num_heads=2),
        LayerShape("dense.2", "separated_nhd", block_size=16, head_size=8, num_heads=2, kernel_block_size=4),
        LayerShape("dense.3", "standardized", block_size=16, head_size=8, num_heads=2, order=(0, 2, 1, 3), pad_bytes=32),
        LayerShape("indexer.0", "latent_standardized", block_size=16, head_size=12, dtype="float8_e4m3fn"),
        LayerShape("mla.0", "latent", block_size=16, head_size=24, kernel_block_size=8),
    ]


__all__ = [
    "Generation",
    "KvCacheSet",
    "LayerShape",
    "bits",
    "build_caches",
    "expected_after_copy",
    "fill_random",
    "logical_view",
    "mixed_model",
]
