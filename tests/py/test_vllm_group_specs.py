"""What the handshake says about vLLM's KV-cache groups beyond their layers: the element type
of each layer's bytes, the tokens a sliding-window load must cover, a group mixing stored-state
ratios, and a Mamba group wrapped in a uniform-type spec (found by a review of the layout
mapping, 2026-12-07; each test failed before its fix)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from moriio_native.control.messages import (
    HandshakeResponse,
    InvalidMessageError,
    KvGroup,
    decode,
)
from moriio_native.control.messages import encode as encode_message
from moriio_native.errors import IncompatiblePeerError
from moriio_native.pd.groups import GroupedBlocks, check_groups, plan_segments
from moriio_native.vllm.hybrid import HybridLayout
from moriio_native.vllm.specs import kv_groups


class _Config:
    def __init__(self, groups: list[Any]) -> None:
        self.kv_cache_groups = groups


def _attention(dtype: torch.dtype, quant: int = 0, layers: tuple[str, ...] = ("l0",)) -> _Config:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=dtype, kv_quant_mode=quant
    )
    return _Config([KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)])


# ---- element types -----------------------------------------------------------------------------


def test_layers_of_one_element_size_and_another_type_do_not_pair() -> None:
    """bfloat16 and float16 are both 2 bytes: before, the groups paired and a READ ended done
    with every value read in the other number format."""
    prefill = kv_groups(_attention(torch.bfloat16), "auto")
    decode = kv_groups(_attention(torch.float16), "auto")
    with pytest.raises(IncompatiblePeerError, match=r"layer l0 holds bfloat16 .*float16 here"):
        check_groups(decode, prefill, "prefill-0")
    check_groups(decode, kv_groups(_attention(torch.float16), "auto"), "prefill-0")


def test_fp8_formats_are_told_apart_by_the_kv_cache_dtype() -> None:
    """vLLM keeps every fp8 cache as a uint8 tensor, so only --kv-cache-dtype names the
    format."""
    e4m3 = kv_groups(_attention(torch.uint8, quant=1), "fp8_e4m3")
    e5m2 = kv_groups(_attention(torch.uint8, quant=1), "fp8_e5m2")
    assert e4m3[0].element_types == ("fp8_e4m3",)
    with pytest.raises(IncompatiblePeerError, match="fp8_e5m2"):
        check_groups(e4m3, e5m2, "prefill-0")


def test_fp8_and_its_alias_fp8_e4m3_pair() -> None:
    """vLLM's "fp8" is fp8_e4m3 (a checkpoint's fp8 KV cache resolves to "fp8_e4m3"): a decode
    given --kv-cache-dtype fp8 pairs with a prefill that resolved it so. Seen failing with the
    first version of the element types (refused at the handshake)."""
    e4m3 = kv_groups(_attention(torch.uint8, quant=1), "fp8_e4m3")
    check_groups(kv_groups(_attention(torch.uint8, quant=1), "fp8"), e4m3, "prefill-0")


def test_a_group_of_mixed_types_names_each_layer() -> None:
    """Layers left unquantized (--kv-cache-dtype-skip-layers) beside fp8 ones: the group's
    types are listed per layer, and the layer that differs is named."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        UniformTypeKVCacheSpecs,
    )

    def config(skipped: str) -> _Config:
        specs = {
            name: FullAttentionSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=8,
                dtype=torch.uint8 if name != skipped else torch.bfloat16,
                kv_quant_mode=0 if name == skipped else 1,
            )
            for name in ("l0", "l1", "l2")
        }
        uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
        return _Config([KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=uniform)])

    ours = kv_groups(config("l1"), "fp8_e4m3")
    assert ours[0].element_types == ("fp8_e4m3", "bfloat16", "fp8_e4m3")
    with pytest.raises(IncompatiblePeerError, match="layer l1 holds fp8_e4m3 elements there"):
        check_groups(ours, kv_groups(config("l2"), "fp8_e4m3"), "prefill-0")


def test_a_group_naming_types_for_some_layers_only_is_refused() -> None:
    with pytest.raises(InvalidMessageError, match="one for all of them, or one per layer"):
        KvGroup(kind="full", block_size=16, layers=("a", "b", "c"), element_types=("x", "y"))
    response = HandshakeResponse(
        engine_id="e/dp0/tp0",
        engine_metadata=b"m",
        kv_groups=(KvGroup(kind="full", block_size=16, layers=("a",), element_types=("x",)),),
    )
    wire = encode_message(response).replace(b"\xa1x", b"\xa1\x07")  # an unprintable name
    with pytest.raises(InvalidMessageError, match="element_types"):
        decode(wire, (HandshakeResponse,), max_bytes=1 << 20)


# ---- a sliding window's retained tail ----------------------------------------------------------


def test_a_load_covers_every_sliding_block_vllm_retains() -> None:
    """vLLM's sliding manager keeps ``extra_retained_tokens`` below the window (multi-module
    MTP re-prefills attend to them): before, those blocks were counted computed and never
    loaded."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    spec = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.bfloat16,
        sliding_window=16,
        extra_retained_tokens=32,
    )
    groups = kv_groups(_Config([KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=spec)]), "auto")
    end = 128
    ids = tuple(range(1, end // 16 + 1))
    segments = plan_segments(
        groups, groups, GroupedBlocks(local=(ids,), remote=(ids,), start=0, end=end), dest="local"
    )
    moved = {b for s in segments for b in s.local_blocks}
    skipped = end - spec.sliding_window + 1 - spec.extra_retained_tokens
    retained = set(ids[skipped // 16 :])
    assert retained <= moved, f"blocks {sorted(retained - moved)} retained but never loaded"


# ---- a group mixing stored-state ratios --------------------------------------------------------

ORDERS = [("layers.0.attn", "layers.1.attn"), ("layers.1.attn", "layers.0.attn")]


def _mixed_ratios(block_size: int, order: tuple[str, str]) -> _Config:
    from vllm.v1.kv_cache_interface import (
        KVCacheGroupSpec,
        MLAAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    ratio = {"layers.0.attn": 1, "layers.1.attn": 2}
    specs = {
        name: MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=64,
            dtype=torch.bfloat16,
            tokens_per_state=ratio[name],
        )
        for name in order
    }
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None  # vLLM groups the two ratios together (DeepSeek V4.1)
    return _Config([KVCacheGroupSpec(layer_names=list(order), kv_cache_spec=uniform)])


@pytest.mark.parametrize("order", ORDERS, ids=["ratio1-first", "ratio2-first"])
def test_a_group_mixing_state_ratios_is_compressed_whatever_its_order(order) -> None:  # type: ignore[no-untyped-def]
    """Before: described by its first layer, so with the ratio-1 layer first other block sizes
    passed the handshake and every transfer was refused at planning."""
    (group,) = kv_groups(_mixed_ratios(64, order), "auto")
    assert group.compressed, group
    with pytest.raises(IncompatiblePeerError, match="block sizes differ"):
        check_groups(
            kv_groups(_mixed_ratios(128, order), "auto"),
            kv_groups(_mixed_ratios(64, order), "auto"),
            "prefill-0",
        )


# ---- a Mamba group wrapped in a uniform-type spec ----------------------------------------------


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain-mamba-spec", "uniform-type-wrapped"])
def test_the_mamba_state_block_is_selected_not_a_scratch_slot(wrapped: bool) -> None:
    """vLLM wraps Mamba layers in UniformTypeKVCacheSpecs when it buckets mixed page sizes:
    before, their speculative scratch slots were not counted and the last scratch slot moved
    instead of the state."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        UniformTypeKVCacheSpecs,
    )

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    mamba = {
        name: MambaSpec(
            block_size=16,
            shapes=shapes,
            dtypes=(torch.float16, torch.float32),
            page_size_padded=attn.page_size_bytes,
            num_speculative_blocks=2,
        )
        for name, shapes in (("m0", ((3, 32), (2, 8, 16))), ("m1", ((3, 16), (2, 8, 16))))
    }
    if wrapped:
        uniform = UniformTypeKVCacheSpecs.from_specs(mamba)
        assert uniform is not None
        mamba_groups = [KVCacheGroupSpec(layer_names=list(mamba), kv_cache_spec=uniform)]
    else:
        mamba_groups = [KVCacheGroupSpec(layer_names=["m0"], kv_cache_spec=mamba["m0"])]
    config = _Config([KVCacheGroupSpec(layer_names=["a0"], kv_cache_spec=attn), *mamba_groups])
    layout = HybridLayout.from_kv_cache_config(config, "auto")
    assert layout.groups[1].kind == "mamba"
    assert layout.groups[1].element_types == ("float16+float32",)
    state = 40
    assert layout.select([[1, 2, 3], [state, 41, 42]])[1] == (state,)
