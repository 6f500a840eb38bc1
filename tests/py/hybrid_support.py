"""Legs of the hybrid-model connector tests (no tests here): run in the child processes of
:class:`test_vllm_support.RemoteSides` through ``run("hybrid_support:<leg>")``.

Each side is vLLM's real Scheduler with the hybrid KV-cache manager ON and caches from vLLM's
own grouping and allocator for a model with three KV-cache groups: full attention, sliding
window attention and Mamba state (conv + SSM states in one padded page per slot). The fake
forward writes a per-token pattern into the attention groups and a per-step pattern into each
request's Mamba state page.

The decode's check is independent of the connector's planning: token by token, the destination
cell of every token the load must move (the whole range for full attention, the window the next
token needs for sliding window, the state page for Mamba) must hold the prefill's bytes of the
same token, and every other byte of the decode's backing must be what it was before the load.
"""

from __future__ import annotations

from typing import Any

import torch

from test_vllm_support import (
    ChildContext,
    Side,
    _bits,
    backing_of,
    fill_random,
    load,
)

WINDOW = 40
NUM_BLOCKS = 40
MAMBA_BLOCK = 1024  # mamba_cache_mode "none": one state slot per request
FULL_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn")
SWA_LAYERS = ("model.layers.1.self_attn.attn", "model.layers.4.self_attn.attn")
MAMBA_LAYERS = ("model.layers.2.mixer", "model.layers.5.mixer")


def hybrid_specs(
    block_size: int,
    window: int = WINDOW,
    mamba: bool = True,
    tokens_per_state: int = 1,
    kv_heads: int = 2,
) -> dict[str, Any]:
    """Two layers each of full attention, sliding window and Mamba (conv + SSM state; none
    without ``mamba``): one page size for every group, as vLLM's hybrid manager needs (the
    Mamba page is padded up to the attention page), so vLLM makes three groups whose layers
    share three tensors. ``tokens_per_state`` > 1: attention blocks store one state per that
    many tokens (compressed states); ``kv_heads``: the KV heads of one TP rank."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    kv = {
        "num_kv_heads": kv_heads,
        "head_size": 16,
        "dtype": torch.float16,
        "tokens_per_state": tokens_per_state,
    }
    specs: dict[str, Any] = {}
    for name in FULL_LAYERS:
        specs[name] = FullAttentionSpec(block_size=block_size, **kv)
    for name in SWA_LAYERS:
        specs[name] = SlidingWindowSpec(block_size=block_size, sliding_window=window, **kv)
    page = specs[FULL_LAYERS[0]].page_size_bytes
    for name in MAMBA_LAYERS if mamba else ():
        specs[name] = MambaSpec(
            block_size=MAMBA_BLOCK,
            shapes=((3, 32), (2, 8, 16)),
            dtypes=(torch.float16, torch.float32),
            page_size_padded=page,
        )
    return dict(sorted(specs.items()))


def leg_make(
    ctx: ChildContext, name: str, role: str, mode: str, block_size: int, layout: str, salt: int
) -> tuple[int, int, int]:
    side = Side(
        name,
        role,
        mode,
        ctx.model_dir,
        num_blocks=NUM_BLOCKS,
        salt=salt,
        specs=hybrid_specs(block_size),
        layout=layout,
        extra={"backend": "ucx", "transfer_timeout": 30, "abort_timeout": 120},
        block_size=block_size,
        prefix_caching=False,
        hybrid_kv_cache_manager=True,
    )
    groups = side.kv_cache_config.kv_cache_groups
    assert len(groups) == 3, [type(g.kv_cache_spec).__name__ for g in groups]
    ctx.sides[name] = side
    return side.handshake_port, side.notify_port, side.initial_free


def _group_ids(side: Side, rid: str) -> list[list[int]]:
    return [list(ids) for ids in side.scheduler.kv_cache_manager.get_block_ids(rid)]


def _content(side: Side, rid: str) -> dict[str, Any]:
    """Every layer's blocks of ``rid`` (positional per group) and their bytes."""
    groups = _group_ids(side, rid)
    out: dict[str, Any] = {}
    for layer, cache in side.caches.items():
        gid, spec = side.group_of(layer)
        ids = groups[gid]
        out[layer] = {
            "ids": ids,
            "block_size": int(spec.block_size),
            "bytes": _bits(cache)[torch.tensor(ids, dtype=torch.long)].clone(),
        }
    return out


def leg_prefill(
    ctx: ChildContext, name: str, rid: str, prompt: list[int], params: dict[str, Any]
) -> dict[str, Any]:
    side = ctx.sides[name]
    request = side.add_request(rid, prompt, params=params, max_tokens=1)
    result = side.step()
    content = _content(side, rid)  # before the request finished (its blocks are held anyway)
    finished = result.finished()
    if rid not in finished:
        finished = side.step().finished()
    return {
        "params": finished[rid].kv_transfer_params,
        "computed": request.num_prompt_tokens,
        "content": content,
    }


def leg_until_sent(ctx: ChildContext, name: str, rid: str) -> int:
    side = ctx.sides[name]
    side.run_until(lambda r: rid in r.transfer.finished_sending, what="sent")
    return side.free_blocks()


def expected_backing(
    side: Side,
    before: torch.Tensor,
    groups: list[list[int]],
    remote: dict[str, Any],
    start: int,
    end: int,
) -> torch.Tensor:
    """``before`` with every cell the load of tokens ``[start, end)`` must move replaced by
    the prefill's bytes of the same token (see the module docstring)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    expected = before.clone()
    base = backing_of(side).data_ptr()
    for layer, cache in side.caches.items():
        gid, spec = side.group_of(layer)
        ids, src = groups[gid], remote[layer]
        es = cache.element_size()
        sizes = (*cache.shape[:-1], cache.shape[-1] * es)
        strides = (*(s * es for s in cache.stride()[:-1]), 1)
        view = _bits(torch.as_strided(expected, sizes, strides, cache.data_ptr() - base))
        src_bytes = src["bytes"].contiguous().view(torch.uint8)  # [blocks, H, N, C bytes]
        if isinstance(spec, MambaSpec):
            view[ids[-1]] = src_bytes[-1]
            continue
        dbs, sbs = int(spec.block_size), int(src["block_size"])
        unit = min(dbs, sbs)
        first = start
        if isinstance(spec, SlidingWindowSpec):
            first = max(start, end - WINDOW + 1)
        for t in range(first // unit * unit, -(-end // unit) * unit):
            dest = ids[t // dbs]
            if dest == 0:
                continue
            view[dest, :, t % dbs, :] = src_bytes[t // sbs, :, t % sbs, :]
    return expected


def leg_decode_read(
    ctx: ChildContext,
    name: str,
    rid: str,
    prompt: list[int],
    params: dict[str, Any],
    remote: dict[str, Any],
) -> dict[str, Any]:
    side = ctx.sides[name]
    fill_random(side, 7)
    before = backing_of(side).clone()
    side.add_request(rid, prompt, params=params, max_tokens=1)
    loaded: dict[str, Any] = {}

    def snapshot() -> None:
        loaded["backing"] = backing_of(side).clone()
        # The blocks of the allocation the load was planned for (the first step): vLLM may
        # free out-of-window blocks once the request resumes.
        loaded.setdefault("groups", _group_ids(side, rid))

    result = load(side, rid, before_forward=snapshot)
    want = expected_backing(side, before, loaded["groups"], remote, 0, len(prompt) - 1)
    return {
        "scheduled": result.scheduled,
        "differing_bytes": int((want != loaded["backing"]).sum()),
        "invalid": sorted(result.invalid_blocks),
        "stats": dict(result.stats.data) if result.stats else None,
    }


def leg_decode_write_start(
    ctx: ChildContext, name: str, rid: str, prompt: list[int], params: dict[str, Any]
) -> dict[str, Any]:
    side = ctx.sides[name]
    while side.scheduler.get_num_unfinished_requests():
        side.step()
    fill_random(side, 9)
    side.snapshot = backing_of(side).clone()  # type: ignore[attr-defined]
    side.add_request(rid, prompt, params=params, max_tokens=2)
    result = side.step()
    return {"scheduled": result.scheduled, "groups": _group_ids(side, rid)}


def leg_decode_write_finish(
    ctx: ChildContext, name: str, rid: str, n_prompt: int, remote: dict[str, Any]
) -> dict[str, Any]:
    side = ctx.sides[name]
    groups = _group_ids(side, rid)
    results = side.run_until(lambda r: rid in r.transfer.finished_recving, what="write_done")
    backing = backing_of(side).clone()
    want = expected_backing(side, side.snapshot, groups, remote, 0, n_prompt - 1)  # type: ignore[attr-defined]
    return {
        "differing_bytes": int((want != backing).sum()),
        "failed": rid in results[-1].transfer.failed_recving,
        "scheduled": [r.scheduled.get(rid, 0) for r in results],
    }
