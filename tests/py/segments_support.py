"""Scenarios for transfers with segments (windows and per-group block ids), shared by the loopback
and the UCX two-process tests.

A scenario names each side's layers (a decode and one or more prefill ranks, each with its own
physical layouts), and per prefill rank the :class:`Part` s of one transfer: which layers, which
decode and prefill blocks, which window of each side's blocks. The same parts make a READ (the
decode pulls: local = decode) and a WRITE (the prefill pushes layer by layer: local = prefill).
:func:`expected_decode` computes what the decode backing must hold afterwards with plain numpy
indexing through :func:`moriio_native.kvcache.logical_view` -- independent of the layout engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moriio_native import kvcache as kc
from moriio_native.engine import BlockSegment
from moriio_native.layout import CellWindow

WHOLE = CellWindow()


@dataclass(frozen=True)
class Part:
    """Cells of ``layers`` (None: every layer) of ``prefill_blocks[i]`` (its ``prefill_window``)
    belong in ``decode_blocks[i]`` (its ``decode_window``)."""

    layers: tuple[str, ...] | None
    decode_blocks: tuple[int, ...]
    prefill_blocks: tuple[int, ...]
    decode_window: CellWindow = WHOLE
    prefill_window: CellWindow = WHOLE

    def moves(self, layer: str) -> bool:
        return self.layers is None or layer in self.layers


@dataclass(frozen=True)
class Side:
    """One process's caches: its layers, block count and fill seed."""

    shapes: tuple[kc.LayerShape, ...]
    num_blocks: int
    seed: int

    def build(self, allocate=None) -> kc.KvCacheSet:  # type: ignore[no-untyped-def]
        caches = kc.build_caches(list(self.shapes), num_blocks=self.num_blocks, allocate=allocate)
        kc.fill_random(caches, self.seed)
        return caches


@dataclass(frozen=True)
class Scenario:
    name: str
    decode: Side
    prefills: tuple[Side, ...]
    parts: tuple[tuple[Part, ...], ...]  # per prefill rank: one transfer's parts

    def layer_names(self) -> list[str]:
        return [s.name for s in self.decode.shapes]


def _segment(part: Part, decode_local: bool, layers: tuple[str, ...] | None) -> BlockSegment:
    near, far = (part.decode_blocks, part.prefill_blocks)[:: 1 if decode_local else -1]
    near_w, far_w = (part.decode_window, part.prefill_window)[:: 1 if decode_local else -1]
    return BlockSegment(near, far, layers, near_w, far_w)


def read_segments(parts: Sequence[Part]) -> list[BlockSegment]:
    """The decode's READ of ``parts``: local = decode."""
    return [_segment(p, True, p.layers) for p in parts]


def write_segments(parts: Sequence[Part], layer: str) -> list[BlockSegment]:
    """The prefill's write of ``layer``: local = prefill, the parts that move ``layer``."""
    return [_segment(p, False, None) for p in parts if p.moves(layer)]


def written_layers(parts: Sequence[Part], names: Sequence[str]) -> list[str]:
    return [n for n in names if any(p.moves(n) for p in parts)]


def _resolved(w: CellWindow, shape: kc.LayerShape) -> tuple[int, int, int, int]:
    heads = w.heads if w.heads is not None else shape.num_heads - w.head_begin
    tokens = w.tokens if w.tokens is not None else shape.block_size - w.token_begin
    return w.head_begin, heads, w.token_begin, tokens


def expected_decode(
    decode: kc.KvCacheSet,
    prefills: Sequence[kc.KvCacheSet],
    parts: Sequence[Sequence[Part]],
) -> np.ndarray:
    """The decode backing after every prefill rank's parts moved, cell by cell."""
    expected = decode.backing.copy()
    for shape in decode.shapes:
        view = decode.views[shape.name]
        copy = np.lib.stride_tricks.as_strided(
            _view_like(expected, decode, shape.name), shape=view.shape, strides=view.strides
        )
        target = kc.logical_view(copy, shape)
        for prefill, rank_parts in zip(prefills, parts, strict=True):
            src_shape = prefill.shape(shape.name)
            source = kc.logical_view(prefill.views[shape.name], src_shape)
            kt, ks = shape.kernel, src_shape.kernel
            for part in rank_parts:
                if not part.moves(shape.name):
                    continue
                dh, heads, dt, tokens = _resolved(part.decode_window, shape)
                sh, src_heads, st, src_tokens = _resolved(part.prefill_window, src_shape)
                assert (heads, tokens) == (src_heads, src_tokens), "the scenario's windows pair"
                d_idx = np.asarray(part.decode_blocks, dtype=np.int64)
                s_idx = np.asarray(part.prefill_blocks[: len(part.decode_blocks)], dtype=np.int64)
                for t in range(tokens):
                    a, b = dt + t, st + t
                    target[d_idx, :, dh : dh + heads, a // kt, a % kt] = source[
                        s_idx, :, sh : sh + heads, b // ks, b % ks
                    ]
    return expected


def _view_like(backing: np.ndarray, caches: kc.KvCacheSet, name: str) -> np.ndarray:
    """``backing`` (a copy of ``caches.backing``) from layer ``name``'s offset, as its dtype."""
    view = caches.views[name]
    flat = backing[caches.offsets[name] :]
    usable = flat.nbytes - flat.nbytes % view.itemsize
    return flat[:usable].view(view.dtype)


def _tp_shapes(heads: int, prefill: bool) -> tuple[kc.LayerShape, ...]:
    """A GQA model's layers at ``heads`` KV heads per rank, plus an MLA-style latent cache every
    rank holds whole."""
    if prefill:
        return (
            kc.LayerShape("attn.0", "separated_nhd", block_size=16, head_size=8, num_heads=heads),
            kc.LayerShape(
                "attn.1",
                "standardized",
                block_size=16,
                head_size=8,
                num_heads=heads,
                order=(0, 2, 1, 3),
            ),
            kc.LayerShape(
                "attn.2",
                "interleaved_hnd",
                block_size=16,
                head_size=8,
                num_heads=heads,
                kernel_block_size=8,
            ),
            kc.LayerShape("mla.0", "latent", block_size=16, head_size=24, pad_bytes=64),
        )
    return (
        kc.LayerShape("attn.0", "interleaved_hnd", block_size=16, head_size=8, num_heads=heads),
        kc.LayerShape("attn.1", "separated_hnd", block_size=16, head_size=8, num_heads=heads),
        kc.LayerShape("attn.2", "standardized", block_size=16, head_size=8, num_heads=heads),
        kc.LayerShape("mla.0", "latent_standardized", block_size=16, head_size=24),
    )


def _block_shapes(block_size: int, prefill: bool) -> tuple[kc.LayerShape, ...]:
    """Layers at ``block_size`` tokens per block (64-token blocks split into 16-token kernel
    blocks on some layers)."""
    kernel = 16 if block_size == 64 else None
    if prefill:
        return (
            kc.LayerShape(
                "attn.0", "separated_nhd", block_size=block_size, head_size=8, num_heads=2
            ),
            kc.LayerShape(
                "attn.1",
                "interleaved_hnd",
                block_size=block_size,
                head_size=8,
                num_heads=2,
                kernel_block_size=kernel,
            ),
            kc.LayerShape("mla.0", "latent", block_size=block_size, head_size=24),
        )
    return (
        kc.LayerShape(
            "attn.0",
            "interleaved_hnd",
            block_size=block_size,
            head_size=8,
            num_heads=2,
            kernel_block_size=kernel,
        ),
        kc.LayerShape("attn.1", "standardized", block_size=block_size, head_size=8, num_heads=2),
        kc.LayerShape(
            "mla.0", "latent_standardized", block_size=block_size, head_size=24, pad_bytes=48
        ),
    )


ATTN = ("attn.0", "attn.1", "attn.2")
LATENT = ("mla.0",)


def _quarters(decode_block_pairs: Sequence[tuple[int, Sequence[int]]]) -> tuple[Part, ...]:
    """Token windows 0/16/32/48 of 64-token decode blocks, each from one 16-token prefill block."""
    parts = []
    for q in range(4):
        d = tuple(block for block, _ in decode_block_pairs)
        p = tuple(sources[q] for _, sources in decode_block_pairs)
        parts.append(Part(None, d, p, decode_window=CellWindow(token_begin=16 * q, tokens=16)))
    return tuple(parts)


SCENARIOS: tuple[Scenario, ...] = (
    # (a) decode TP 2 of prefill TP 1: heads [4,8) of 8 into a 4-head decode layer.
    Scenario(
        "head_slice",
        decode=Side(_tp_shapes(4, prefill=False), 10, 2),
        prefills=(Side(_tp_shapes(8, prefill=True), 6, 1),),
        parts=(
            (
                Part(ATTN, (7, 2, 0), (1, 5, 3), prefill_window=CellWindow(head_begin=4)),
                Part(LATENT, (7, 2, 0), (1, 5, 3)),
            ),
        ),
    ),
    # (b) decode TP 1 of prefill TP 2: two prefill ranks' 4 heads into heads [0,4) and [4,8).
    Scenario(
        "gather",
        decode=Side(_tp_shapes(8, prefill=False), 10, 2),
        prefills=(Side(_tp_shapes(4, prefill=True), 6, 1), Side(_tp_shapes(4, prefill=True), 6, 3)),
        parts=(
            (
                Part(ATTN, (3, 6), (2, 4), decode_window=CellWindow(head_begin=0, heads=4)),
                Part(LATENT, (3, 6), (2, 4)),
            ),
            (Part(ATTN, (3, 6), (5, 1), decode_window=CellWindow(head_begin=4, heads=4)),),
        ),
    ),
    # (c) prefill block 16 -> decode block 64: four segments into windows 0/16/32/48.
    Scenario(
        "block_16_to_64",
        decode=Side(_block_shapes(64, prefill=False), 5, 2),
        prefills=(Side(_block_shapes(16, prefill=True), 12, 1),),
        parts=(_quarters([(3, (4, 9, 0, 11)), (1, (5, 6, 7, 8))]),),
    ),
    # (c') prefill block 64 -> decode block 16: each quarter of prefill block 2 into its own
    # decode block.
    Scenario(
        "block_64_to_16",
        decode=Side(_block_shapes(16, prefill=False), 12, 2),
        prefills=(Side(_block_shapes(64, prefill=True), 5, 1),),
        parts=(
            tuple(
                Part(
                    None,
                    (7 - q, 11 - q),
                    (2, 4),
                    prefill_window=CellWindow(token_begin=16 * q, tokens=16),
                )
                for q in range(4)
            ),
        ),
    ),
    # (d) layer groups with their own block ids in one transfer (hybrid caches).
    Scenario(
        "layer_groups",
        decode=Side(tuple(kc.mixed_model("decode")), 20, 2),
        prefills=(Side(tuple(kc.mixed_model("prefill")), 12, 1),),
        parts=(
            (
                Part(("dense.0", "dense.1", "dense.2", "dense.3"), (19, 0, 5), (3, 7, 1)),
                Part(("indexer.0", "mla.0"), (4, 8), (11, 2)),
            ),
        ),
    ),
)
