"""Hybrid models through the connector, prefill and decode in two processes over UCX.

Each process runs vLLM's real Scheduler with the hybrid KV-cache manager on, for a model with
full-attention, sliding-window and Mamba groups, caches from vLLM's own grouping and allocator
(a different physical layout on each side). The test plays the proxy. READ and WRITE, with
equal block sizes and with prefill 16-token blocks against decode 64-token blocks and the
reverse; the decode's whole backing is compared byte by byte with what it must hold
(hybrid_support.expected_backing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from hybrid_support import NUM_BLOCKS, hybrid_specs
from moriio_native.control.addressing import ZmqAddress, format_request_id
from test_vllm_support import (
    RemoteSides,
    Side,
    decode_params,
    load,
    pd_request_id,
    prefill_params,
    transfer_id,
    write_model_dir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]

LEGS = "hybrid_support"


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteSides, RemoteSides]]:
    model_dir = write_model_dir(Path(tmp_path_factory.mktemp("model")))
    # Generous bounds: starting vLLM in a child takes minutes on a loaded 2-core machine.
    prefill, decode = RemoteSides(model_dir, timeout=600), RemoteSides(model_dir, timeout=600)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def _make(
    proc: RemoteSides, name: str, role: str, mode: str, block_size: int, layout: str, salt: int
) -> ZmqAddress:
    hs, notify, _ = proc.run(f"{LEGS}:leg_make", name, role, mode, block_size, layout, salt)
    return ZmqAddress("127.0.0.1", hs, notify)


def _pair(
    procs: tuple[RemoteSides, RemoteSides], mode: str, p_bs: int, d_bs: int
) -> tuple[str, ZmqAddress, ZmqAddress]:
    """A prefill (LBNHC) and a decode (BLNHC, other bytes) instance in ``mode``."""
    tag = f"{mode}-{p_bs}-{d_bs}"
    p_addr = _make(procs[0], f"p-{tag}", "kv_producer", mode, p_bs, "LBNHC", salt=1)
    d_addr = _make(procs[1], f"d-{tag}", "kv_consumer", mode, d_bs, "BLNHC", salt=2)
    return tag, p_addr, d_addr


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 17 + i * 29) % 241 + 3 for i in range(n)]


SIZES = [(16, 16), (16, 64), (64, 16)]  # (prefill, decode) block sizes


@pytest.mark.parametrize(("p_bs", "d_bs"), SIZES, ids=[f"p{p}-d{d}" for p, d in SIZES])
def test_hybrid_read_every_byte(
    procs: tuple[RemoteSides, RemoteSides], p_bs: int, d_bs: int
) -> None:
    p, d = procs
    tag, p_addr, d_addr = _pair(procs, "read", p_bs, d_bs)
    for seed, length in ((1, 150), (2, 37)):  # the second request reuses the handshake
        rid, tid = format_request_id(p_addr, d_addr), transfer_id()
        prompt = _prompt(length, seed)
        pre = p.run(f"{LEGS}:leg_prefill", f"p-{tag}", rid, prompt, prefill_params(tid))
        assert pre["computed"] == length - 1  # the decode computes the last prompt token
        returned = pre["params"]
        assert len(returned["remote_block_ids"]) == 3  # one list per KV-cache group
        out = d.run(
            f"{LEGS}:leg_decode_read",
            f"d-{tag}",
            rid,
            prompt,
            decode_params(tid, returned),
            pre["content"],
        )
        assert out["scheduled"][rid] == 1  # only the last prompt token is computed
        assert out["invalid"] == []
        assert out["differing_bytes"] == 0
        assert out["stats"]["transfers"] == 1 and out["stats"]["failures"] == 0
        assert out["stats"]["groups"] == 3  # full attention, sliding window and Mamba state
        free = p.run(f"{LEGS}:leg_until_sent", f"p-{tag}", rid)
        assert free == 40 - 1  # every block back in the pool (one is vLLM's null block)


@pytest.mark.parametrize(("p_bs", "d_bs"), SIZES, ids=[f"p{p}-d{d}" for p, d in SIZES])
def test_hybrid_write_every_byte(
    procs: tuple[RemoteSides, RemoteSides], p_bs: int, d_bs: int
) -> None:
    p, d = procs
    tag, p_addr, d_addr = _pair(procs, "write", p_bs, d_bs)
    for seed, length in ((3, 133), (4, 16)):
        rid, tid = format_request_id(p_addr, d_addr), transfer_id()
        prompt = _prompt(length, seed)
        started = d.run(
            f"{LEGS}:leg_decode_write_start", f"d-{tag}", rid, prompt, decode_params(tid)
        )
        assert rid not in started["scheduled"]  # waiting for the prefill's writes
        pre = p.run(f"{LEGS}:leg_prefill", f"p-{tag}", rid, prompt, prefill_params(tid))
        assert pre["computed"] == length - 1
        free = p.run(f"{LEGS}:leg_until_sent", f"p-{tag}", rid)
        assert free == 40 - 1
        out = d.run(f"{LEGS}:leg_decode_write_finish", f"d-{tag}", rid, length, pre["content"])
        assert out["failed"] is False
        assert out["differing_bytes"] == 0


def _local_side(model_dir: str, name: str, role: str, mode: str, **kw: object) -> Side:
    """An in-process instance (loopback backend) with the hybrid model."""
    block_size = int(kw.pop("block_size", 16))  # type: ignore[call-overload]
    tp_size = int(kw.pop("tp_size", 1))  # type: ignore[call-overload]
    return Side(
        name,
        role,
        mode,
        model_dir,
        num_blocks=NUM_BLOCKS,
        specs=hybrid_specs(block_size, **kw),  # type: ignore[arg-type]
        block_size=block_size,
        prefix_caching=False,
        hybrid_kv_cache_manager=True,
        tp_size=tp_size,
    )


# (prefill specs, decode specs, what the refusal says)
UNPAIRED = {
    "windows": (
        {"window": 40},
        {"window": 32},
        ("group 1 (sliding, block size 16, window 40", "our window is 32 tokens"),
    ),
    # Full attention and sliding window (2 KV heads) at prefill TP 1 and decode TP 2.
    "different-tp": (
        {"mamba": False},
        {"mamba": False, "tp_size": 2, "kv_heads": 1},
        (
            "prefill TP 1 and decode TP 2 differ, and the model has 2 KV-cache groups",
            "different TP sizes with several KV-cache groups are not supported",
        ),
    ),
    # Compressed states (4 tokens per stored state) with 64- and 128-token blocks.
    "compressed-block-sizes": (
        {"block_size": 64, "tokens_per_state": 4},
        {"block_size": 128, "tokens_per_state": 4},
        (
            "group 0 (full, block size 64, 4 tokens per state",
            "the block sizes differ (128 ours, 64 its)",
        ),
    ),
}


@pytest.mark.parametrize("case", list(UNPAIRED))
@pytest.mark.parametrize("mode", ["read", "write"])
def test_group_structures_that_differ_fail_the_load_clearly(
    tmp_path: Path, mode: str, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill whose sliding window differs from the decode's, whose compressed-state
    blocks have another size, or whose TP size differs: the groups do not pair, the load fails
    naming the groups and what differs, vLLM recomputes, the prefill's blocks are freed."""
    p_specs, d_specs, says = UNPAIRED[case]
    model_dir = write_model_dir(tmp_path / "model")
    p = _local_side(model_dir, "p", "kv_producer", mode, **p_specs)
    d = _local_side(model_dir, "d", "kv_consumer", mode, **d_specs)
    p_tp, d_tp = p.tp_size, d.tp_size
    try:
        rid, tid = pd_request_id(p, d), transfer_id()
        prompt = list(range(5, 90))
        with caplog.at_level("WARNING", logger="moriio_native"):
            if mode == "write":
                d.add_request(rid, prompt, params=decode_params(tid, None, p_tp), max_tokens=1)
                d.step()
            p.add_request(rid, prompt, params=prefill_params(tid, d_tp), max_tokens=1)
            finished = p.step().finished()
            if mode == "read":
                d.add_request(
                    rid, prompt, params=decode_params(tid, finished[rid].kv_transfer_params, p_tp)
                )
                loaded = load(d, rid)
                assert loaded.scheduled[rid] == len(prompt)  # recomputed in full
            else:
                # The refusal may be reported in any step since the announcement started.
                d.run_until(lambda r: d.reports["finished_recving"][rid] > 0, what="fail")
                assert d.reports["failed_recving"][rid] == 1
            p.run_until(lambda r: rid in r.transfer.finished_sending, what="freed")
        for text in says:
            assert text in caplog.text
        assert p.free_blocks() == p.initial_free
    finally:
        p.shutdown()
        d.shutdown()


def test_prefill_truncation_keeps_the_block_hashes_of_the_tokens_it_keeps(tmp_path: Path) -> None:
    """With a sliding-window group the prefill leaves the prompt's last token to the decode.
    The request's block hashes (prefix caching on) must then be those of the tokens it holds:
    a hash of the original last block would name a block whose last token the prefill never
    computed, and vLLM extends the list from its length, so it would never be corrected."""
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    model_dir = write_model_dir(tmp_path / "model")
    p = Side(
        "p",
        "kv_producer",
        "read",
        model_dir,
        num_blocks=NUM_BLOCKS,
        specs=hybrid_specs(16, mamba=False),
        block_size=16,
        prefix_caching=True,
        hybrid_kv_cache_manager=True,
    )
    try:
        hasher = get_request_block_hasher(p.hash_block_size, p.hash_fn)
        prompt = [(i * 37) % 241 + 3 for i in range(64)]  # four whole blocks of 16 tokens
        rid = pd_request_id(p, p)
        request = p.add_request(rid, prompt, params=prefill_params(transfer_id()), max_tokens=1)
        assert len(request.block_hashes) == 3  # cut on admission: the fourth block is partial
        p.run_until(lambda r: rid in r.finished(), what="prefilled")
        assert request.num_prompt_tokens == 63
        tokens = list(request.all_token_ids)
        assert tokens[:63] == prompt[:63] and len(tokens) == 64  # 63 prompt tokens, 1 sampled
        fresh = Request(
            request_id="fresh",
            prompt_token_ids=tokens,
            sampling_params=request.sampling_params,
            pooling_params=None,
            block_hasher=hasher,
        )
        assert list(request.block_hashes) == list(fresh.block_hashes)
    finally:
        p.shutdown()
