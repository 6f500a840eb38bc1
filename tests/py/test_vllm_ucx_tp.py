"""Prefill and decode at different TP sizes, every rank in a process of its own, over UCX.

Each instance is vLLM's real Scheduler and output aggregator here, with one worker connector
per TP rank in a child process (tp_support.RankedSide). The model splits its dense attention
layers by KV head (vLLM's rule: rank r of tp holds heads [r*T/tp, (r+1)*T/tp)) and has an MLA
latent and an indexer cache every rank holds whole, all views of one backing per rank, with
another physical layout on each side. After each READ and WRITE, every byte of every decode
rank's backing is compared with what it must be: in the transferred blocks, each dense layer
holds exactly the prefill's bytes of that decode rank's global heads (gathered from the prefill
ranks that hold them), the whole caches the bytes of the prefill rank holding the decode
rank's first head; everywhere else the decode rank's previous bytes. Every prefill rank frees
its blocks exactly once, when all decode ranks that took from it released them -- or, for a
release that is lost, at its abort_timeout, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from moriio_native.control.addressing import format_request_id
from moriio_native.control.ports import rank_port
from test_vllm_support import (
    BLOCK_SIZE,
    LAYERS_DENSE,
    RemoteSides,
    decode_params,
    load,
    mixed_specs,
    prefill_params,
    transfer_id,
    write_model_dir,
)
from tp_support import RankedSide

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]

PROCESSES = 4
NUM_BLOCKS = 24
# (prefill TP, decode TP, the model's KV heads): slice, gather, and 6 heads at TP 2 -> 3,
# where one decode rank takes one head from each prefill rank.
RATIOS = [(1, 2, 8), (2, 1, 8), (2, 4, 8), (4, 2, 8), (2, 3, 6)]
# Fewer KV heads than the larger TP size, so vLLM replicates them (rank r of tp holds head
# r // (tp / T) alone): replicas on the decode (2 heads, 1 -> 4: decode ranks 0, 1 slice head 0
# of the one prefill rank, ranks 2, 3 head 1), on the prefill (2 heads, 4 -> 2: prefill ranks
# 0, 1 hold head 0 and 2, 3 head 1; decode rank d reads replica d mod 2 of its head, so ranks 0
# and 3, and releases the unused replica p with p mod 2 == d), and on both (1 head, 2 -> 4:
# every rank holds it; decode rank d reads prefill rank d mod 2).
REPLICATED = [(1, 4, 2), (4, 2, 2), (2, 4, 1)]


@pytest.fixture(scope="module")
def procs() -> Iterator[list[RemoteSides]]:
    made = [RemoteSides("", timeout=600.0) for _ in range(PROCESSES)]
    try:
        yield made
    finally:
        for proc in made:
            proc.close()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """A model directory per KV head count: attention heads = KV heads (6, 8: every TP size
    here divides them), or 4 attention heads over 1 or 2 KV heads (GQA, replicated at TP 4)."""
    return {
        heads: write_model_dir(
            Path(tmp_path_factory.mktemp(f"model{heads}")),
            num_attention_heads=max(heads, 4),
            num_key_value_heads=heads,
            hidden_size=max(heads, 4) * 16,  # head_dim 16
        )
        for heads in (1, 2, 6, 8)
    }


def _side(
    procs: list[RemoteSides],
    model_dir: str,
    name: str,
    role: str,
    mode: str,
    tp: int,
    heads: int,
    **extra: Any,
) -> RankedSide:
    # Prefill rank r in process r, decode rank r in process 3 - r: the ranks of an instance
    # each have a process of their own.
    producer = role == "kv_producer"
    placement = tuple(r if producer else PROCESSES - 1 - r for r in range(tp))
    return RankedSide(
        name,
        role,
        mode,
        model_dir,
        num_blocks=NUM_BLOCKS,
        salt=1 if producer else 2,
        specs=mixed_specs(max(1, heads // tp)),  # vLLM's share: one head when replicated
        layout="LBNHC" if producer else "BLNHC",
        # abort_timeout above transfer_timeout + 1 s: a decode READs only while the prefill
        # holds the blocks for all of a READ.
        extra={"backend": "ucx", "transfer_timeout": 30, "abort_timeout": 120, **extra},
        tp_size=tp,
        procs=procs,
        placement=placement,
    )


def _pair(
    procs: list[RemoteSides],
    model_dirs: dict[int, str],
    mode: str,
    p_tp: int,
    d_tp: int,
    heads: int,
    p_extra: dict[str, Any] | None = None,
    d_extra: dict[str, Any] | None = None,
) -> tuple[RankedSide, RankedSide]:
    tag = f"{mode}-{p_tp}-{d_tp}-{transfer_id()[-6:]}"
    model = model_dirs[heads]
    p = _side(procs, model, f"p-{tag}", "kv_producer", mode, p_tp, heads, **(p_extra or {}))
    d = _side(procs, model, f"d-{tag}", "kv_consumer", mode, d_tp, heads, **(d_extra or {}))
    return p, d


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 17 + i * 29) % 241 + 3 for i in range(n)]


def _head_source(p_tp: int, heads: int, head: int, decode_rank: int) -> tuple[int, int]:
    """(prefill rank, its own head index) decode rank ``decode_rank`` takes global head
    ``head`` from: the one rank holding it, or, when the prefill replicates its heads (TP
    above the heads), replica ``decode_rank mod replicas`` of the ranks holding it."""
    if p_tp <= heads:
        return head // (heads // p_tp), head % (heads // p_tp)
    replicas = p_tp // heads
    return head * replicas + decode_rank % replicas, 0


def _sources(p_tp: int, d_tp: int, heads: int, rank: int) -> list[tuple[int, int]]:
    """(prefill rank, its own head index) of each of decode rank ``rank``'s heads, in order."""
    if d_tp <= heads:
        mine = range(rank * (heads // d_tp), (rank + 1) * (heads // d_tp))
    else:  # replicated on the decode: one head per rank
        mine = range(rank // (d_tp // heads), rank // (d_tp // heads) + 1)
    return [_head_source(p_tp, heads, head, rank) for head in mine]


def _expected(
    contents: list[dict[str, torch.Tensor]], p_tp: int, d_tp: int, heads: int, rank: int
) -> dict[str, torch.Tensor]:
    """What decode rank ``rank`` must hold, layer by layer, given each prefill rank's content
    ([blocks, H, N, C]; replicas of a head hold different random bytes here, so the bytes name
    the replica they came from): its global heads of the dense layers, each from the prefill
    rank it takes that head from, and the whole caches of the prefill rank of its first
    head."""
    sources = _sources(p_tp, d_tp, heads, rank)
    out = {}
    for layer in contents[0]:
        if layer in LAYERS_DENSE:
            parts = [contents[src][layer][:, local : local + 1] for src, local in sources]
            out[layer] = torch.cat(parts, dim=1).contiguous()
        else:
            out[layer] = contents[sources[0][0]][layer]
    return out


def _prefill(
    p: RankedSide, rid: str, prompt: list[int], tid: str, d_tp: int, n_blocks: int
) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """Prefill one request; its kv_transfer_params and every rank's content of its first
    ``n_blocks`` blocks."""
    p.add_request(rid, prompt, params=prefill_params(tid, remote_tp_size=d_tp), max_tokens=1)
    finished = p.step().finished()
    assert rid in finished
    blocks = p.block_ids(rid)[:n_blocks]
    return finished[rid].kv_transfer_params, p.each("leg_blocks", lambda r: (p.name, r, blocks))


def _check_freed_once(p: RankedSide, rid: str) -> None:
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="every prefill rank freed")
    assert p.free_blocks() == p.initial_free  # every block back in vLLM's pool
    assert p.reports["finished_sending"][rid] == 1
    for rank, counts in enumerate(p.rank_reports):
        assert counts["finished_sending"][rid] == 1, rank


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), RATIOS + REPLICATED)
def test_read_every_rank_gets_its_heads(
    procs: list[RemoteSides], model_dirs: dict[int, str], p_tp: int, d_tp: int, heads: int
) -> None:
    p, d = _pair(procs, model_dirs, "read", p_tp, d_tp, heads)
    try:
        length = 70
        rid = format_request_id(p.zmq_address(), d.zmq_address())
        tid, prompt = transfer_id(), _prompt(length, seed=1)
        n_loaded = -(-(length - 1) // BLOCK_SIZE)
        returned, contents = _prefill(p, rid, prompt, tid, d_tp, n_loaded)
        d.each("leg_fill", lambda r: (d.name, r, 7 + r))
        d.snapshot = rid
        d.add_request(rid, prompt, params=decode_params(tid, returned, p_tp), max_tokens=1)
        loaded = load(d, rid)
        assert loaded.scheduled[rid] == 1  # only the last prompt token is computed
        assert not loaded.invalid_blocks
        # One READ per (decode rank, prefill rank it takes heads from): a replicated head is
        # read from one replica only.
        reads = sum(len({src for src, _ in _sources(p_tp, d_tp, heads, r)}) for r in range(d_tp))
        assert loaded.stats is not None and loaded.stats.data["transfers"] == reads
        blocks = loaded.blocks[:n_loaded]
        for rank in range(d_tp):
            want = _expected(contents, p_tp, d_tp, heads, rank)
            assert d.rank_leg(rank, "leg_differing_bytes", blocks, want, True) == 0, rank
        _check_freed_once(p, rid)
        d.run_until(lambda r: not d.scheduler.requests, what="the decode to finish")
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), RATIOS + REPLICATED)
def test_write_every_rank_gets_its_heads(
    procs: list[RemoteSides], model_dirs: dict[int, str], p_tp: int, d_tp: int, heads: int
) -> None:
    p, d = _pair(procs, model_dirs, "write", p_tp, d_tp, heads)
    try:
        length = 53
        rid = format_request_id(p.zmq_address(), d.zmq_address())
        tid, prompt = transfer_id(), _prompt(length, seed=3)
        n_blocks = -(-length // BLOCK_SIZE)
        d.each("leg_fill", lambda r: (d.name, r, 9 + r))
        d.add_request(rid, prompt, params=decode_params(tid, remote_tp_size=p_tp), max_tokens=2)
        assert rid not in d.step().scheduled  # waiting for the prefill's writes
        _, contents = _prefill(p, rid, prompt, tid, d_tp, n_blocks)
        _check_freed_once(p, rid)
        done = d.run_until(lambda r: rid in r.transfer.finished_recving, what="write_done")
        assert rid not in done[-1].transfer.failed_recving
        blocks = d.block_ids(rid)[:n_blocks]
        for rank in range(d_tp):
            want = _expected(contents, p_tp, d_tp, heads, rank)
            assert d.rank_leg(rank, "leg_differing_bytes", blocks, want, False) == 0, rank
        assert d.reports["finished_recving"][rid] == 1
        d.run_until(lambda r: not d.scheduler.requests, what="the decode to finish")
    finally:
        p.shutdown()
        d.shutdown()


def test_a_lost_release_frees_at_abort_timeout(
    procs: list[RemoteSides], model_dirs: dict[int, str]
) -> None:
    # Prefill TP 1 -> decode TP 2: both decode ranks read the prefill rank; decode rank 1's
    # release is lost, so the prefill holds the blocks until its abort_timeout frees them.
    p, d = _pair(
        procs,
        model_dirs,
        "read",
        1,
        2,
        8,
        p_extra={"abort_timeout": 6},
        d_extra={"transfer_timeout": 4},  # its READs end within the prefill's 6 s hold
    )
    try:
        d.rank_leg(1, "leg_drop_releases", rank_port(p.notify_port, 0, 0, 1))
        rid = format_request_id(p.zmq_address(), d.zmq_address())
        tid, prompt = transfer_id(), _prompt(40, 5)
        returned, _ = _prefill(p, rid, prompt, tid, 2, 3)
        d.add_request(rid, prompt, params=decode_params(tid, returned, 1), max_tokens=1)
        assert not load(d, rid).invalid_blocks
        d.run_until(lambda r: not d.scheduler.requests, what="the decode to finish")
        # Decode rank 0's release came; the prefill still waits for rank 1's.
        assert rid not in p.step().transfer.finished_sending
        assert p.free_blocks() < p.initial_free
        _check_freed_once(p, rid)
        assert p.rank_leg(0, "leg_warnings", "no release within abort_timeout") == 1
    finally:
        p.shutdown()
        d.shutdown()
