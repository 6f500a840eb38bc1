"""The vLLM adapter's specs against vLLM's own KV-cache views when the head count equals the block
size (or the kernel block size). vLLM 0.33 views every layer as logical ``[B, H, N, C]`` whatever
the physical ``KVCacheLayout``; the adapter states that order (``axis_order="hnd"``) so the layout
engine never has to tell H from N by their sizes.

Every offset is checked against torch's own indexing of the view vLLM allocated
(``allocate_kv_cache``) for every ``KVCacheLayout``, and a loopback READ between two different
layouts is checked through those views.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

import moriio_native as mn
from moriio_native.vllm.specs import VLLM_AXIS_ORDER, cache_specs
from test_vllm_support import make_kv_cache_config, make_vllm_config, write_model_dir

NUM_BLOCKS = 6
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _layouts() -> list[str]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return [member.name for member in KVCacheLayout]


def _specs(heads: int) -> dict[str, Any]:
    """Two dense K|V layers with ``heads`` KV heads of 4 elements, block size 16, fp16."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=4, dtype=torch.float16)
    return dict.fromkeys(LAYERS, spec)


def _vllm_caches(
    tmp_path: Path, layout: str, heads: int, kernel: int | None
) -> dict[str, torch.Tensor]:
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config = make_vllm_config(write_model_dir(tmp_path / layout), role="kv_both", extra={})
    specs = _specs(heads)
    config = make_kv_cache_config(vllm_config, specs, NUM_BLOCKS, layout)
    resolved = vllm_config.cache_config.get_resolved_kv_cache_layout()
    assert resolved.name == layout
    kernels = None if kernel is None else [kernel] * len(config.kv_cache_groups)
    return allocate_kv_cache(config, torch.device("cpu"), resolved, kernels)


def _check_cells(layout: mn.LayerLayout, view: torch.Tensor, dk: int) -> None:
    """Each (block, plane, head, token) cell starts where torch's indexing of the view says."""
    p = layout.params
    kb = p["kernel_block_size"]
    per = p["block_size"] // kb
    base = view.data_ptr()
    for b in range(layout.num_blocks):
        for h in range(view.shape[1]):
            for t in range(p["block_size"]):
                for plane in range(2):
                    cell = view[b * per + t // kb, h, t % kb, plane * dk]
                    offset = (
                        b * p["block_stride"]
                        + p["plane_offset"][plane]
                        + h * p["head_stride"]
                        + (t // kb) * p["kernel_block_stride"]
                        + (t % kb) * p["token_stride"]
                    )
                    assert cell.data_ptr() - base == offset, (b, plane, h, t)


@pytest.mark.parametrize(
    ("layout", "heads", "kernel"),
    [(layout, 16, None) for layout in _layouts()]
    # vLLM splits kernel blocks only where a block is one dense page (layer-compact layouts).
    + [(layout, 8, 8) for layout in ("LBHNC", "LBNHC")],
)
def test_adapter_specs_read_vllm_views_with_heads_equal_to_block(
    tmp_path: Path, layout: str, heads: int, kernel: int | None
) -> None:
    caches = _vllm_caches(tmp_path, layout, heads, kernel)
    specs = cache_specs(_specs(heads))
    assert all(s.axis_order == VLLM_AXIS_ORDER == "hnd" for s in specs.values())
    for name in LAYERS:
        view = caches[name]
        assert view.shape[1] == view.shape[2] == heads  # [B, H, N, C]: H, N of the same size
        layer = mn.describe_layer(name, view, specs[name])
        assert (layer.num_blocks, layer.num_heads) == (NUM_BLOCKS, heads)
        _check_cells(layer, view, dk=4)
    # The other order contradicts vLLM's view: refused, never silently transposed.
    tokens_first = mn.CacheSpec(
        kind="kv", block_size=16, num_kv_heads=heads, head_size=4, dtype_bytes=2, axis_order="nhd"
    )
    with pytest.raises(mn.InvalidArgumentError, match="contradicts"):
        mn.describe_layer(LAYERS[0], caches[LAYERS[0]], tokens_first)


@pytest.mark.parametrize(("prefill", "decode"), [("LBNHC", "LBHNC"), ("BLHNC", "LHBNC")])
def test_read_between_vllm_layouts_with_heads_equal_to_block_moves_each_token(
    tmp_path: Path, prefill: str, decode: str
) -> None:
    p_caches = _vllm_caches(tmp_path / "p", prefill, 16, None)
    d_caches = _vllm_caches(tmp_path / "d", decode, 16, None)
    specs = cache_specs(_specs(16))
    gen = torch.Generator().manual_seed(3)
    for caches in (p_caches, d_caches):
        backing = next(iter(caches.values())).untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(backing)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    # Random bytes are not all valid float16 values: compare bit patterns.
    p_bits = {n: v.view(torch.int16) for n, v in p_caches.items()}
    d_bits = {n: v.view(torch.int16) for n, v in d_caches.items()}
    d_before = {n: v.clone() for n, v in d_bits.items()}
    p_engine, d_engine = mn.Engine("prefill-0"), mn.Engine("decode-0")
    meta_p = p_engine.register_kv_caches(
        [mn.LayerRegistration(n, v, specs[n]) for n, v in p_caches.items()]
    )
    meta_d = d_engine.register_kv_caches(
        [mn.LayerRegistration(n, v, specs[n]) for n, v in d_caches.items()]
    )
    d_engine.add_peer(meta_p)
    p_engine.add_peer(meta_d)
    local, remote = [4, 0, 2], [1, 5, 3]
    d_engine.read("r", "prefill-0", local, remote)
    assert d_engine.wait(["r"], timeout=10)["r"].state == "done"
    for name, bits in d_bits.items():
        expected = d_before[name].clone()
        expected[local] = p_bits[name][remote]  # logical [B, H, N, C] indexing
        assert torch.equal(bits, expected), name


def test_a_five_dimensional_cache_gets_no_hint_and_is_refused_when_ambiguous() -> None:
    # Another vLLM version or backend may hand a 5-D [2, N, B, H, D] (tokens first) cache: the
    # adapter must not claim heads come first, so equal head and block sizes are refused.
    specs = cache_specs(_specs(16), tensor_ndims=dict.fromkeys(LAYERS, 5))
    assert all(s.axis_order == "auto" for s in specs.values())
    tokens_first = torch.zeros(2, NUM_BLOCKS, 16, 16, 4, dtype=torch.float16)
    with pytest.raises(mn.MoriioError, match=r"(?i)ambiguous"):
        mn.describe_layer(LAYERS[0], tokens_first, specs[LAYERS[0]])
    # The 4-D view keeps the hint.
    assert all(s.axis_order == "hnd" for s in cache_specs(_specs(16)).values())
