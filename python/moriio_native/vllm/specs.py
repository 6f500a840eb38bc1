"""vLLM KV-cache specs -> :class:`moriio_native.CacheSpec`, layer by layer.

vLLM 0.33 hands every attention layer a standardized ``[B, H, N, C]`` view (blocks, head
slots, stored states, content) of one shared backing. The mapping reads the spec, never the
shape, so a tensor that does not match its spec is an error that names the layer. Every
CacheSpec of a 4-D view says ``axis_order="hnd"`` (:data:`VLLM_AXIS_ORDER`: the view's shape
lists heads before tokens for every ``KVCacheLayout``), so equal head and block sizes are never
ambiguous; other tensors get no hint:

================================================ ====== =========================================
vLLM spec                                        kind   fields
================================================ ====== =========================================
AttentionSpec / FullAttentionSpec /              "kv"   num_kv_heads, head_size, head_size_v,
SlidingWindowSpec / ChunkedLocal... (dense K|V)         dtype bytes, block_size
MLAAttentionSpec, SlidingWindowMLASpec, any      "mla"  heads = spec.num_heads, head_size = the
AttentionSpec with ``head_size_v == 0``                 latent width (key-only: MLA, indexer)
(key-only)
AttentionSpec with a packed page                 "mla"  the page is moved as opaque bytes:
(``num_head_slots``, ``state_content_bytes``)           heads = H, head_size = C / dtype bytes
``tokens_per_state != 1``                        either block_size = states per block
MambaSpec (mamba_cache_mode "none")              "mla"  one state slot = one opaque byte page:
                                                        block_size 1, heads 1, head_size = C
                                                        bytes (conv + SSM states)
other non-attention specs                        --     refused (:class:`UnsupportedSpecError`)
================================================ ====== =========================================

Contents: :func:`layer_specs` (layer name -> vLLM spec for every transferable layer),
:func:`kv_groups` (the transfer groups as the handshake describes them),
:func:`to_cache_spec`, :func:`cache_specs`. Pure functions, thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from moriio_native.control.messages import KvGroup
from moriio_native.errors import InvalidArgumentError
from moriio_native.layout import CacheSpec

logger = logging.getLogger("moriio_native.vllm.specs")

# vLLM 0.33 hands the connector one logical [B, H, N, C] view per layer whatever the physical
# KVCacheLayout (vllm/v1/kv_cache_layout.py: "The logical shape is always [L, B, H, N,
# <content>]"; vllm/v1/kv_cache_interface.py create_kv_cache_views): heads come before tokens
# in the shape. The physical order is read from the strides. Stating it means a layer whose head
# count equals its block (or kernel block) size is never ambiguous.
VLLM_AXIS_ORDER = "hnd"


class UnsupportedSpecError(InvalidArgumentError):
    """A layer's KV-cache spec has no transfer mapping here (e.g. Mamba state)."""


def _dtype_bytes(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"cannot tell the element size of dtype {dtype!r}")
    return size


def layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Layer name -> its own vLLM spec, for every layer of every group that takes part in KV
    transfer (``enable_kv_transfer``); ``UniformTypeKVCacheSpecs`` groups are split per layer."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                out[name] = spec.kv_cache_specs[name]
            else:
                out[name] = spec
    return out


def to_cache_spec(layer_name: str, spec: Any, tensor_ndim: int = 4) -> CacheSpec:
    """The CacheSpec of one layer whose cache tensor has ``tensor_ndim`` dimensions. Raises
    UnsupportedSpecError naming the layer and spec type for specs without a per-layer attention
    cache. Only vLLM 0.33's 4-D logical view is known to list heads before tokens; any other
    tensor (a 5-D cache of another vLLM version or backend) gets no hint, so a shape whose head
    count equals its block size is refused as ambiguous instead of read one way."""
    axis_order = VLLM_AXIS_ORDER if tensor_ndim == 4 else "auto"
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    if isinstance(spec, MambaSpec):
        return _mamba_cache_spec(layer_name, spec)
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedSpecError(
            f"layer {layer_name}: {type(spec).__name__} caches cannot be transferred by "
            "MoRIIONativeConnector (attention K/V and MLA/indexer caches only)"
        )
    dtype_bytes = _dtype_bytes(spec.dtype)
    # The token axis of the view holds stored states, not tokens, when states compress tokens.
    states = int(spec.num_states)
    packed = spec.num_head_slots is not None or spec.state_content_bytes is not None
    if packed or spec.tokens_per_state != 1:
        content = int(spec.state_content_size_bytes)
        if content % dtype_bytes:
            raise UnsupportedSpecError(
                f"layer {layer_name}: packed content of {content} bytes is not a whole number "
                f"of {dtype_bytes}-byte elements"
            )
        if (
            not packed
            and not isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))
            and spec.head_size_v
        ):
            return CacheSpec(
                kind="kv",
                block_size=states,
                num_kv_heads=int(spec.num_heads),
                head_size=int(spec.head_size),
                head_size_v=int(spec.head_size_v),
                dtype_bytes=dtype_bytes,
                axis_order=axis_order,
            )
        return CacheSpec(
            kind="mla",
            block_size=states,
            num_kv_heads=int(spec.num_heads),
            head_size=content // dtype_bytes,
            dtype_bytes=dtype_bytes,
            axis_order=axis_order,
        )
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)) or not spec.head_size_v:
        return CacheSpec(
            kind="mla",
            block_size=states,
            num_kv_heads=int(spec.num_heads),
            head_size=int(spec.head_size),
            dtype_bytes=dtype_bytes,
            axis_order=axis_order,
        )
    return CacheSpec(
        kind="kv",
        block_size=states,
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        head_size_v=int(spec.head_size_v),
        dtype_bytes=dtype_bytes,
        axis_order=axis_order,
    )


def _mamba_cache_spec(layer_name: str, spec: Any) -> CacheSpec:
    """A Mamba/KDA/GDN state layer: vLLM views each state slot as one ``[1, 1, C]`` byte page
    (C = every state's bytes, conv state then SSM state, as ``MambaBase.bind_kv_cache`` cuts
    them; a padded page only widens the block stride). With equal TP on both sides the page
    moves as opaque bytes, so the conv state's sub-projection split (x, B, C shards of each
    rank) is carried as it is; different TP sizes are refused (the state is split across
    ranks, :func:`first_split_across_tp`)."""
    if spec.mamba_cache_mode == "align":
        raise UnsupportedSpecError(
            f"layer {layer_name}: mamba_cache_mode 'align' (Mamba prefix caching) keeps one "
            "state per block position, which MoRIIONativeConnector does not transfer; use "
            "mamba_cache_mode 'none'"
        )
    return CacheSpec(
        kind="mla",
        block_size=1,
        num_kv_heads=1,
        head_size=int(spec.state_content_size_bytes),
        dtype_bytes=1,
        axis_order=VLLM_AXIS_ORDER,
    )


def group_layer_specs(spec: Any, layers: Sequence[str]) -> list[tuple[str, Any]]:
    """A KV-cache group's layers with their specs: a uniform-type group's own spec for each
    layer, else the group's one spec for its first layer (it stands for them all)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [(name, spec.kv_cache_specs[name]) for name in layers]
    return [(layers[0], spec)]


def _group_kind(spec: Any, layers: Sequence[str]) -> tuple[str, int]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    spec = group_layer_specs(spec, layers)[0][1]
    if isinstance(spec, MambaSpec):
        return "mamba", 0
    if isinstance(spec, (SlidingWindowSpec, SlidingWindowMLASpec)):
        # The tokens a load must cover: the attention window plus the tail vLLM's sliding
        # manager keeps below it for multi-module MTP re-prefill (extra_retained_tokens), as
        # vLLM's own offloading connector widens it ("restores all allocated history").
        return "sliding", int(spec.sliding_window) + int(
            getattr(spec, "extra_retained_tokens", 0) or 0
        )
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return "full", 0
    raise UnsupportedSpecError(
        f"layer {layers[0]}: a KV-cache group of {type(spec).__name__} cannot be transferred "
        "by MoRIIONativeConnector (full attention, sliding window and Mamba state groups only)"
    )


def _tokens_per_state(spec: Any, layers: Sequence[str]) -> tuple[int, int]:
    """An attention group's ``tokens_per_state`` as (numerator, denominator); (1, 1) for
    Mamba state, which has no token axis."""
    from vllm.v1.kv_cache_interface import MambaSpec

    per_layer = group_layer_specs(spec, layers)
    if isinstance(per_layer[0][1], MambaSpec):
        return (1, 1)
    # A uniform group may mix ratios (DeepSeek V4.1: compress ratios 1 and 2 in one group):
    # the group is compressed when any layer is, so that check_groups keeps both sides' blocks
    # whole (a token window of a compressed layer's block is no range of its states). The
    # first compressed layer's ratio stands for the group (the same layers on both sides).
    chosen = Fraction(1)
    for name, layer_spec in per_layer:
        ratio = Fraction(layer_spec.tokens_per_state)
        if ratio <= 0:
            raise UnsupportedSpecError(
                f"layer {name}: {type(layer_spec).__name__} stores "
                f"{layer_spec.tokens_per_state} tokens per state, which MoRIIONativeConnector "
                "cannot map onto block positions"
            )
        if chosen == 1 and ratio != 1:
            chosen = ratio
    return (chosen.numerator, chosen.denominator)


_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _element_type(spec: Any, cache_dtype: str) -> str:
    """What one layer's stored bytes are: a quantized layer's ``--kv-cache-dtype`` (every fp8
    format is a uint8 tensor to vLLM, so its dtype cannot tell e4m3 from e5m2), else the spec's
    dtype; a Mamba state's dtypes joined by ``+``."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec):
        return "+".join(_dtype_name(d) for d in spec.dtypes)
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is None or int(quant) == 0:  # KVQuantMode.NONE: the tensor's dtype is the type
        return _dtype_name(spec.dtype)
    if cache_dtype == "auto":
        return f"{_dtype_name(spec.dtype)}:quant{int(quant)}"
    # vLLM's "fp8" is fp8_e4m3 (a checkpoint's fp8 KV cache resolves to "fp8_e4m3"): one name.
    return _CACHE_DTYPE_ALIASES.get(cache_dtype, cache_dtype)


def _element_types(spec: Any, layers: Sequence[str], cache_dtype: str) -> tuple[str, ...]:
    """The group's layers' element types: one name when they agree, else one per layer."""
    names = tuple(_element_type(one, cache_dtype) for _, one in group_layer_specs(spec, layers))
    return names[:1] if len(set(names)) == 1 else names


def kv_groups(kv_cache_config: Any, cache_dtype: str) -> tuple[KvGroup, ...]:
    """The KV-cache groups that take part in KV transfer, in vLLM's order (the order of the
    per-group block ids): kind, block size in tokens, window, layers, their element types
    (``cache_dtype``: vLLM's ``--kv-cache-dtype``, which names what quantized layers hold)
    and tokens per stored state. Raises UnsupportedSpecError naming the layer for groups
    without a transfer mapping."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        if not getattr(group, "enable_kv_transfer", True):
            continue
        layers = tuple(group.layer_names)
        kind, window = _group_kind(group.kv_cache_spec, layers)
        out.append(
            KvGroup(
                kind=kind,  # type: ignore[arg-type]
                block_size=int(group.kv_cache_spec.block_size),
                layers=layers,
                element_types=_element_types(group.kv_cache_spec, layers, cache_dtype),
                sliding_window=window,
                tokens_per_state=_tokens_per_state(group.kv_cache_spec, layers),
            )
        )
    return tuple(out)


def cache_specs(
    specs: Mapping[str, Any],
    layers: Iterable[str] | None = None,
    tensor_ndims: Mapping[str, int] | None = None,
) -> dict[str, CacheSpec]:
    """:func:`to_cache_spec` for every layer of ``specs`` (or of ``layers``), with each layer's
    tensor rank from ``tensor_ndims`` (default 4, vLLM 0.33's view)."""
    names = list(specs) if layers is None else list(layers)
    missing = [n for n in names if n not in specs]
    if missing:
        raise InvalidArgumentError(
            f"no KV-cache spec for layer(s) {', '.join(missing[:4])}: the KV cache config and the "
            "registered caches disagree"
        )
    ndims = tensor_ndims or {}
    return {name: to_cache_spec(name, specs[name], ndims.get(name, 4)) for name in names}


def split_across_tp(specs: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(layers whose caches TP ranks split by KV head, layers every rank holds whole: MLA
    latent and indexer caches), each in ``specs`` order."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    whole = tuple(
        n for n, s in specs.items() if isinstance(s, (MLAAttentionSpec, SlidingWindowMLASpec))
    )
    return tuple(n for n in specs if n not in whole), whole


def checked_total_kv_heads(
    specs: Mapping[str, Any], split: Sequence[str], total_kv_heads: int, tp_size: int
) -> int:
    """``total_kv_heads`` when every split layer holds the share of them vLLM gives one rank
    of ``tp_size`` (``max(1, total // tp)``), one head slot per KV head, else 0 (logged): then
    different TP sizes are refused, since the head ranges of the ranks are not known, or, for
    a page that keeps each head's K and V in separate slots (NVFP4's, ``num_head_slots``),
    a head range is not one range of slots."""
    from moriio_native.pd.heads import heads_per_rank

    if not split or total_kv_heads < 1:
        return 0
    want = heads_per_rank(total_kv_heads, tp_size)
    for name in split:
        spec = specs[name]
        heads = int(getattr(spec, "num_kv_heads", 0) or 0)
        slots = int(getattr(spec, "num_heads", heads) or heads)
        if slots != heads:
            logger.warning(
                "layer %s keeps its %d KV heads in %d head slots: transfers between different "
                "TP sizes are refused",
                name,
                heads,
                slots,
            )
            return 0
        if heads != want:
            logger.warning(
                "layer %s holds %d KV heads, not the %d of %d over TP %d: transfers between "
                "different TP sizes are refused",
                name,
                heads,
                want,
                total_kv_heads,
                tp_size,
            )
            return 0
    return total_kv_heads


__all__ = [
    "VLLM_AXIS_ORDER",
    "UnsupportedSpecError",
    "cache_specs",
    "checked_total_kv_heads",
    "kv_groups",
    "layer_specs",
    "split_across_tp",
    "to_cache_spec",
]
