"""Model presets: the KV-cache geometry of a few well-known models as :class:`LayerShape` lists.

Used by ``moriio-native demo`` and ``moriio-native bench``. Every cache uses the layout vLLM
ships today: dense attention in the standardized ``[B, H, N, C]`` view (K and V packed along
``C``) over a block-outermost physical order, key-only caches (MLA latent, sparse-attention
indexer keys) as ``[B, 1, N, C]``. All caches of one preset share one block size, because one
request's block ids address every layer.

=============== =================================================================================
preset          geometry per transformer layer
=============== =================================================================================
``llama3-8b``   32 layers; dense K/V: 8 KV heads x head 128, bf16, block 16 (64 KiB per block)
``deepseek-v3`` 61 layers; MLA latent: 576 (512 + 64 rope) bf16, block 64 (72 KiB per block)
``minimax-m3``  ILLUSTRATIVE numbers (not taken from a published config): 62 layers, each with a
                dense K/V cache (8 KV heads x head 128, bf16) and a sparse-attention indexer key
                cache (132 bytes per token: 128 fp8 values + a 4-byte scale), block 64
                (256 KiB + 8.25 KiB per block; the same numbers as
                ``moriio_native.bench.planning``). It exists to exercise what broke before: dense
                and key-only caches with different geometry in one model.
=============== =================================================================================

``layers=`` keeps only the first N transformer layers (tests and quick runs). Pure data and
functions; safe from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from moriio_native.errors import InvalidArgumentError
from moriio_native.kvcache import LayerShape

# vLLM's standardized dense view is [num_blocks, heads, block_size, 2*head]; physically the
# block axis is outermost and heads sit inside tokens, i.e. logical dims in order (0, 2, 1, 3).
_STANDARDIZED_ORDER = (0, 2, 1, 3)


@dataclass(frozen=True)
class Preset:
    """One model's cache geometry. ``caches_per_layer`` lists the caches of every transformer
    layer as ``(suffix, kind)`` where kind is ``"dense"``, ``"mla"`` or ``"indexer"``."""

    name: str
    description: str
    num_layers: int
    block_size: int
    caches_per_layer: tuple[str, ...]
    num_kv_heads: int = 0
    head_size: int = 0
    latent_size: int = 0
    indexer_bytes: int = 0
    illustrative: bool = False

    def shapes(self, layers: int | None = None) -> list[LayerShape]:
        """The caches of the first ``layers`` transformer layers (all when None), in order.

        Raises InvalidArgumentError when ``layers`` is not in 1..num_layers.
        """
        n = self.num_layers if layers is None else layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_layers:
            raise InvalidArgumentError(
                f"preset {self.name}: layers must be 1..{self.num_layers}, got {layers!r}"
            )
        out: list[LayerShape] = []
        for i in range(n):
            prefix = f"model.layers.{i}"
            for kind in self.caches_per_layer:
                out.append(self._cache(prefix, kind))
        return out

    def _cache(self, prefix: str, kind: str) -> LayerShape:
        if kind == "dense":
            return LayerShape(
                f"{prefix}.self_attn.attn",
                "standardized",
                block_size=self.block_size,
                head_size=self.head_size,
                num_heads=self.num_kv_heads,
                dtype="bfloat16",
                order=_STANDARDIZED_ORDER,
            )
        if kind == "mla":
            return LayerShape(
                f"{prefix}.self_attn.attn",
                "latent_standardized",
                block_size=self.block_size,
                head_size=self.latent_size,
                dtype="bfloat16",
            )
        if kind == "indexer":
            return LayerShape(
                f"{prefix}.self_attn.indexer.k_cache",
                "latent_standardized",
                block_size=self.block_size,
                head_size=self.indexer_bytes,
                dtype="uint8",
            )
        raise InvalidArgumentError(f"preset {self.name}: unknown cache kind {kind!r}")

    def bytes_per_block(self, layers: int | None = None) -> int:
        """KV bytes one block holds over every cache of the (first ``layers``) layers."""
        return sum(s.block_bytes() for s in self.shapes(layers))


PRESETS: dict[str, Preset] = {
    "llama3-8b": Preset(
        name="llama3-8b",
        description="dense GQA, 32 layers, 8 KV heads x 128, bf16, block 16",
        num_layers=32,
        block_size=16,
        caches_per_layer=("dense",),
        num_kv_heads=8,
        head_size=128,
    ),
    "deepseek-v3": Preset(
        name="deepseek-v3",
        description="MLA latent 576, 61 layers, bf16, block 64",
        num_layers=61,
        block_size=64,
        caches_per_layer=("mla",),
        latent_size=576,
    ),
    "minimax-m3": Preset(
        name="minimax-m3",
        description=(
            "mixed dense + indexer (illustrative): 62 layers, dense 8 KV heads x 128 bf16 "
            "+ indexer 132 B/token fp8, block 64"
        ),
        num_layers=62,
        block_size=64,
        caches_per_layer=("dense", "indexer"),
        num_kv_heads=8,
        head_size=128,
        indexer_bytes=132,
        illustrative=True,
    ),
}

DEFAULT_PRESET = "minimax-m3"


def get_preset(name: str) -> Preset:
    """The preset called ``name``; InvalidArgumentError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}"
        ) from None


def preset_shapes(name: str, layers: int | None = None) -> list[LayerShape]:
    """``get_preset(name).shapes(layers)``."""
    return get_preset(name).shapes(layers)


__all__ = ["DEFAULT_PRESET", "PRESETS", "Preset", "get_preset", "preset_shapes"]
