"""vLLM's hybrid KV-cache manager as the scheduler-side connector sees it: the transfer groups
and what each request's per-group block ids mean. Pure functions over block ids.

vLLM hands the connector one block list per KV-cache group (``KVCacheBlocks.get_block_ids``,
``request_finished_all_groups``), positional from the request's first token: an attention
group's block ``i`` holds tokens ``[i*bs, (i+1)*bs)``; a sliding-window group holds the null
block (0) where the window no longer needs one; a Mamba group (``mamba_cache_mode`` "none")
holds the running state in its last block before the ``num_speculative_blocks`` scratch slots
of speculative decoding. :class:`HybridLayout` turns such lists into what the protocol core's
grouped tasks carry (:class:`moriio_native.pd.groups.GroupedBlocks`).

The decode computes the prompt's last token itself (to sample the next one). Mamba state
cannot be rewound to the token before it, and a sliding-window group of a prefill that computed
the whole prompt may already have freed the block the decode's recomputed token needs. With a
Mamba or sliding-window group the prefill therefore computes all but the last prompt token
(:meth:`HybridLayout.prefill_backoff`), and the decode loads exactly those tokens, in READ and
WRITE mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moriio_native.control.messages import KvGroup
from moriio_native.pd.groups import NULL_BLOCK
from moriio_native.vllm.specs import group_layer_specs, kv_groups


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HybridLayout:
    """The transfer groups of one instance (immutable, thread-safe)."""

    groups: tuple[KvGroup, ...]
    group_ids: tuple[int, ...]  # index of each transfer group among all of vLLM's groups
    num_groups: int  # all of vLLM's groups (transfer or not)
    spec_blocks: tuple[int, ...]  # Mamba groups: trailing speculative scratch slots

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, cache_dtype: str) -> HybridLayout:
        """The transfer groups of ``kv_cache_config``; ``cache_dtype`` is vLLM's
        ``--kv-cache-dtype`` (``cache_config.cache_dtype``)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        def scratch_slots(group: Any) -> int:
            # A uniform-type group of Mamba layers (vLLM buckets mixed page sizes so) holds
            # MambaSpecs of one num_speculative_blocks (is_uniform_with_collection).
            spec = group_layer_specs(group.kv_cache_spec, group.layer_names)[0][1]
            return int(spec.num_speculative_blocks) if isinstance(spec, MambaSpec) else 0

        all_groups = kv_cache_config.kv_cache_groups
        ids = tuple(i for i, g in enumerate(all_groups) if getattr(g, "enable_kv_transfer", True))
        spec_blocks = tuple(scratch_slots(all_groups[i]) for i in ids)
        return cls(kv_groups(kv_cache_config, cache_dtype), ids, len(all_groups), spec_blocks)

    def prefill_backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode (see the module docstring)."""
        return 1 if any(g.kind != "full" for g in self.groups) else 0

    def select(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """The transfer groups' positional ids out of vLLM's per-group lists; a Mamba group's
        list is cut to its state block."""
        if len(block_ids) != self.num_groups:
            raise ValueError(
                f"{len(block_ids)} block-id groups, the KV-cache config has {self.num_groups}"
            )
        out = []
        for index, gid in enumerate(self.group_ids):
            ids = tuple(block_ids[gid])
            if self.groups[index].kind == "mamba" and ids:
                scratch = min(self.spec_blocks[index], len(ids) - 1)
                ids = ids[: len(ids) - scratch][-1:]
            out.append(ids)
        return tuple(out)

    def _covers(self, group: KvGroup, index: int, start: int, end: int) -> bool:
        if group.kind == "mamba":
            return True
        return start // group.block_size <= index < _cdiv(end, group.block_size)

    def destination_ids(
        self, groups: Sequence[Sequence[int]], start: int, end: int
    ) -> tuple[int, ...]:
        """Every non-null id a load of tokens ``[start, end)`` may write (what a failed load
        reports for recomputation)."""
        found = {
            b
            for group, ids in zip(self.groups, groups, strict=True)
            for i, b in enumerate(ids)
            if b != NULL_BLOCK and self._covers(group, i, start, end)
        }
        return tuple(sorted(found))

    def announced(
        self, groups: Sequence[Sequence[int]], start: int, end: int
    ) -> tuple[tuple[int, ...], ...]:
        """A WRITE announcement: each attention group's ids up to the block of token
        ``end - 1``, with the null block where the decode already holds the tokens (its
        prefix-cache hits before ``start``); Mamba groups their state block."""
        out = []
        for group, ids in zip(self.groups, groups, strict=True):
            if group.kind != "mamba":
                bs = group.block_size
                ids = tuple(
                    b if i >= start // bs else NULL_BLOCK
                    for i, b in enumerate(ids[: _cdiv(end, bs)])
                )
            out.append(tuple(ids))
        return tuple(out)


__all__ = ["HybridLayout"]
