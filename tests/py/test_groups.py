"""KV-cache groups and different block sizes: the segment plan (moriio_native.pd.groups) and
the handshake's group check, as pure functions."""

from __future__ import annotations

import random

import pytest

from moriio_native.control.messages import HandshakeResponse, InvalidMessageError, KvGroup, decode
from moriio_native.control.messages import encode as encode_message
from moriio_native.errors import IncompatiblePeerError, InvalidArgumentError
from moriio_native.pd.groups import (
    NULL_BLOCK,
    GroupedBlocks,
    Segment,
    check_groups,
    plan_segments,
)

FULL = ("l0.attn", "l3.attn")
SWA = ("l1.swa",)
MAMBA = ("l2.mamba",)


def full(bs: int, layers: tuple[str, ...] = FULL) -> KvGroup:
    return KvGroup(kind="full", block_size=bs, layers=layers, element_types=("float16",))


def sliding(bs: int, window: int) -> KvGroup:
    return KvGroup(
        kind="sliding", block_size=bs, layers=SWA, element_types=("float16",), sliding_window=window
    )


def mamba(bs: int = 1024) -> KvGroup:
    return KvGroup(kind="mamba", block_size=bs, layers=MAMBA, element_types=("float16",))


def token_map(
    segments: list[Segment], lbs: int, rbs: int
) -> dict[tuple[int, int], tuple[int, int]]:
    """(remote block, slot) -> (local block, slot) for every token cell the segments move;
    fails on a destination cell moved twice."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for s in segments:
        n = s.tokens
        for lb, rb in zip(s.local_blocks, s.remote_blocks, strict=True):
            count = lbs if n is None else n
            for k in range(count):
                local = (lb, s.local_token_begin + k)
                remote = (rb, s.remote_token_begin + k)
                assert local not in out.values(), f"local cell {local} written twice"
                out[remote] = local
    return out


@pytest.mark.parametrize(("lbs", "rbs"), [(16, 16), (64, 16), (16, 64), (32, 96), (48, 16)])
@pytest.mark.parametrize(("start", "end"), [(0, 100), (0, 64), (96, 191), (0, 1)])
def test_attention_tokens_map_one_to_one(lbs: int, rbs: int, start: int, end: int) -> None:
    """Every needed token's cell pairs with the same token's cell on the other side, exactly
    once, for equal, larger and smaller block sizes and a partial last block."""
    unit = min(lbs, rbs)
    if start % unit:
        pytest.skip("start not aligned to the smaller block")
    rng = random.Random(lbs * 1000 + rbs + end)
    n_local, n_remote = -(-end // lbs), -(-end // rbs)
    local = tuple(rng.sample(range(1, 500), n_local))
    remote = tuple(rng.sample(range(1, 500), n_remote))
    segments = plan_segments(
        [full(lbs)], [full(rbs)], GroupedBlocks((local,), (remote,), start, end), dest="local"
    )
    moved = token_map(segments, lbs, rbs)
    expected = {}
    for t in range(start // unit * unit, -(-end // unit) * unit):
        expected[(remote[t // rbs], t % rbs)] = (local[t // lbs], t % lbs)
    assert moved == expected
    for s in segments:
        assert s.layers == FULL
        assert (s.tokens is None) == (lbs == rbs)


def test_prefill_16_into_decode_64_is_four_windows() -> None:
    local = (5, 6)  # decode: 64-token blocks
    remote = (1, 2, 3, 4, 7, 8, 9)  # prefill: 16-token blocks, the last one partial
    segments = plan_segments(
        [full(64)], [full(16)], GroupedBlocks((local,), (remote,), 0, 100), dest="local"
    )
    assert [(s.local_token_begin, s.remote_token_begin, s.tokens) for s in segments] == [
        (0, 0, 16),
        (16, 0, 16),
        (32, 0, 16),
        (48, 0, 16),
    ]
    assert [s.local_blocks for s in segments] == [(5, 6), (5, 6), (5, 6), (5,)]
    assert [s.remote_blocks for s in segments] == [(1, 7), (2, 8), (3, 9), (4,)]


def test_prefill_64_into_decode_16_reads_windows_of_one_block() -> None:
    segments = plan_segments(
        [full(16)], [full(64)], GroupedBlocks(((1, 2, 3, 4, 7),), ((9, 10),), 0, 70), dest="local"
    )
    assert [(s.remote_token_begin, s.local_blocks, s.remote_blocks) for s in segments] == [
        (0, (1, 7), (9, 10)),
        (16, (2,), (9,)),
        (32, (3,), (9,)),
        (48, (4,), (9,)),
    ]


def test_start_not_on_the_smaller_block_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="starts at token 8, not a multiple of 16"):
        plan_segments(
            [full(16)], [full(64)], GroupedBlocks(((1, 2),), ((3,),), 8, 30), dest="local"
        )


def test_too_few_blocks_names_the_group_and_token() -> None:
    with pytest.raises(InvalidArgumentError, match=r"group 0 \(full.*token 32 needs .* remote"):
        plan_segments(
            [full(16)], [full(16)], GroupedBlocks(((1, 2, 3),), ((4, 5),), 0, 40), dest="local"
        )


def test_sliding_window_moves_only_what_the_window_needs() -> None:
    # window 24: the token at 100 attends to [77, 100) -> blocks 4, 5, 6 (tokens 64..111).
    local = (11, 12, 13, 14, 15, 16, 17)
    remote = (NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 24, 25, 26, 27)
    segments = plan_segments(
        [sliding(16, 24)],
        [sliding(16, 24)],
        GroupedBlocks((local,), (remote,), 0, 100),
        dest="local",
    )
    assert segments == [Segment(0, SWA, (15, 16, 17), (25, 26, 27))]


def test_sliding_window_skips_the_destination_null_block_and_refuses_a_freed_source() -> None:
    groups = [sliding(16, 40)]  # [61, 100): blocks 3..6
    local = (0, 0, 0, 0, 15, 16, 17)  # the decode holds nothing in block 3
    remote = (0, 0, 0, 24, 25, 26, 27)
    segments = plan_segments(
        groups, groups, GroupedBlocks((local,), (remote,), 0, 100), dest="local"
    )
    assert segments == [Segment(0, SWA, (15, 16, 17), (25, 26, 27))]
    freed = (0, 0, 0, 0, 25, 26, 27)
    with pytest.raises(InvalidArgumentError, match="token 48 is needed but the remote block"):
        plan_segments(
            groups,
            groups,
            GroupedBlocks(((1, 2, 3, 14, 15, 16, 17),), (freed,), 0, 100),
            dest="local",
        )
    # WRITE: the destination is the remote side; its null blocks are skipped, ours must be live.
    segments = plan_segments(
        groups, groups, GroupedBlocks((remote,), (local,), 0, 100), dest="remote"
    )
    assert segments == [Segment(0, SWA, (25, 26, 27), (15, 16, 17))]


def test_sliding_window_with_different_block_sizes() -> None:
    # decode 64-token blocks from prefill 16-token blocks, window 40: the token at 130 attends
    # to [91, 130) -> units from 80: decode block 1 windows 16, 32, 48, block 2 window 0; the
    # prefill freed its blocks before token 80.
    local = (21, 22, 23)
    remote = (0, 0, 0, 0, 0, 30, 31, 32, 33)
    segments = plan_segments(
        [sliding(64, 40)],
        [sliding(16, 40)],
        GroupedBlocks((local,), (remote,), 0, 130),
        dest="local",
    )
    moved = token_map(segments, 64, 16)
    assert moved == {(remote[t // 16], t % 16): (local[t // 64], t % 64) for t in range(80, 144)}


def test_mamba_pairs_the_state_blocks_whole() -> None:
    groups_l = [full(16), mamba(1024)]
    groups_r = [full(16), mamba(512)]  # no token axis: any block size pairs
    check_groups(groups_l, groups_r, "p")
    segments = plan_segments(
        groups_l, groups_r, GroupedBlocks(((1,), (7,)), ((2,), (9,)), 0, 10), dest="local"
    )
    assert segments[-1] == Segment(1, MAMBA, (7,), (9,))
    with pytest.raises(
        InvalidArgumentError, match=r"group 1 \(mamba.*remote side: expected exactly one"
    ):
        plan_segments(
            groups_l, groups_r, GroupedBlocks(((1,), (7,)), ((2,), (9, 10)), 0, 10), dest="local"
        )


def test_ids_for_another_number_of_groups_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="1 local / 2 remote KV-cache group"):
        plan_segments(
            [full(16)], [full(16)], GroupedBlocks(((1,),), ((1,), (2,)), 0, 10), dest="local"
        )


@pytest.mark.parametrize(
    ("remote", "match"),
    [
        ([full(16)], "has 1 KV-cache group"),
        ([full(16), full(16, MAMBA)], "ours is mamba"),
        ([full(16, ("l0.attn", "l9.attn")), mamba()], r"layers \['l3.attn', 'l9.attn'\]"),
        ([full(16, ("l3.attn", "l0.attn")), mamba()], "another order"),
        ([full(24), mamba()], "block sizes 16 \\(ours\\) and 24 do not divide"),
    ],
)
def test_group_structures_that_differ_are_refused(remote: list[KvGroup], match: str) -> None:
    with pytest.raises(IncompatiblePeerError, match=match):
        check_groups([full(16), mamba()], remote, "prefill-0")


def test_sliding_windows_that_differ_are_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="our window is 32 tokens"):
        check_groups([sliding(16, 32)], [sliding(16, 64)], "p")
    check_groups([sliding(16, 32)], [sliding(64, 32)], "p")


def test_group_wire_form_round_trips_and_is_checked() -> None:
    groups = (full(16), sliding(16, 24), mamba())
    response = HandshakeResponse(engine_id="e/dp0/tp0", engine_metadata=b"m", kv_groups=groups)
    back = decode(encode_message(response), (HandshakeResponse,), max_bytes=1 << 20)
    assert back.kv_groups == groups
    with pytest.raises(InvalidMessageError, match="sliding_window"):
        KvGroup(
            kind="full", block_size=16, layers=FULL, element_types=("float16",), sliding_window=8
        )
    with pytest.raises(InvalidMessageError, match="layers"):
        KvGroup(kind="full", block_size=16, layers=(), element_types=("float16",))


def test_hybrid_layout_reads_vllm_per_group_lists() -> None:
    """vLLM's per-group lists -> what the grouped tasks carry: a Mamba list cut to its state
    block (before the speculative scratch slots), non-transfer groups dropped, WRITE
    announcements with the null block where the decode holds the tokens already."""
    pytest.importorskip("vllm")
    from moriio_native.vllm.hybrid import HybridLayout

    layout = HybridLayout(
        groups=(full(16), sliding(16, 24), mamba()),
        group_ids=(0, 1, 3),  # vLLM's group 2 takes no part in transfers
        num_groups=4,
        spec_blocks=(0, 0, 2),
    )
    assert layout.prefill_backoff() == 1
    vllm_lists = ([1, 2, 3, 4], [0, 6, 7, 8], [99], [10, 11, 12])
    selected = layout.select(vllm_lists)
    assert selected == ((1, 2, 3, 4), (0, 6, 7, 8), (10,))
    # tokens [32, 60): attention blocks 2..3, the Mamba state, never the null block
    assert layout.destination_ids(selected, 32, 60) == (3, 4, 7, 8, 10)
    assert layout.announced(selected, 32, 60) == ((0, 0, 3, 4), (0, 0, 7, 8), (10,))
    with pytest.raises(ValueError, match="3 block-id groups, the KV-cache config has 4"):
        layout.select(vllm_lists[:3])
    dense = HybridLayout(groups=(full(16),), group_ids=(0,), num_groups=1, spec_blocks=(0,))
    assert dense.prefill_backoff() == 0


def compressed(bs: int, tokens_per_state: tuple[int, int] = (4, 1)) -> KvGroup:
    return KvGroup(
        kind="full",
        block_size=bs,
        layers=FULL,
        element_types=("float16",),
        tokens_per_state=tokens_per_state,
    )


@pytest.mark.parametrize("tokens_per_state", [(4, 1), (1, 2)])
@pytest.mark.parametrize(("ours", "theirs"), [(16, 64), (64, 16)])
def test_compressed_states_with_different_block_sizes_are_refused(
    tokens_per_state: tuple[int, int], ours: int, theirs: int
) -> None:
    """A block of stored states that cover other than one token each has no token window
    that maps onto a whole range of its states: refused at the handshake, naming the group,
    its tokens per state and both block sizes, on either side."""
    local = [compressed(ours, tokens_per_state), mamba()]
    remote = [compressed(theirs, tokens_per_state), mamba()]
    num, den = tokens_per_state
    ratio = f"{num}/{den}" if den != 1 else str(num)
    want = (
        rf"group 0 \(full, block size {theirs}, {ratio} tokens per state, 2 layers from "
        rf"l0.attn\).*tokens_per_state {num}/{den}\) and the block sizes differ \({ours} ours, "
        rf"{theirs} its\)"
    )
    with pytest.raises(IncompatiblePeerError, match=want):
        check_groups(local, remote, "prefill-0")
    with pytest.raises(IncompatiblePeerError, match="the block sizes differ"):
        check_groups(remote, local, "decode-0")


def test_compressed_states_with_equal_block_sizes_move_whole_blocks() -> None:
    groups = [compressed(64), mamba()]
    check_groups(groups, groups, "p")
    blocks = GroupedBlocks(((3, 4), (8,)), ((5, 6), (9,)), 0, 100)
    assert plan_segments(groups, groups, blocks, dest="local") == [
        Segment(0, FULL, (3, 4), (5, 6)),
        Segment(1, MAMBA, (8,), (9,)),
    ]


def test_tokens_per_state_that_differ_are_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="cover 1 tokens each, ours 4"):
        check_groups([compressed(16)], [full(16)], "p")
    with pytest.raises(IncompatiblePeerError, match="cover 1/2 tokens each, ours 4"):
        check_groups([compressed(16)], [compressed(16, (1, 2))], "p")


def test_tokens_per_state_wire_form() -> None:
    groups = (compressed(16, (1, 2)), mamba())
    response = HandshakeResponse(engine_id="e/dp0/tp0", engine_metadata=b"m", kv_groups=groups)
    back = decode(encode_message(response), (HandshakeResponse,), max_bytes=1 << 20)
    assert back.kv_groups == groups and back.kv_groups[0].compressed
    with pytest.raises(InvalidMessageError, match="tokens_per_state"):
        KvGroup(
            kind="mamba",
            block_size=16,
            layers=MAMBA,
            element_types=("float16",),
            tokens_per_state=(4, 1),
        )
    with pytest.raises(InvalidMessageError, match="tokens_per_state"):
        KvGroup(
            kind="full",
            block_size=16,
            layers=FULL,
            element_types=("float16",),
            tokens_per_state=(0, 1),
        )


def test_kv_groups_carry_vllms_tokens_per_state() -> None:
    """specs.kv_groups reads each attention group's tokens_per_state from vLLM's spec (an
    int, or a Fraction for several states per token); Mamba groups say (1, 1)."""
    pytest.importorskip("vllm")
    from fractions import Fraction

    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from moriio_native.vllm.specs import kv_groups

    kv = {"num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
    groups = [
        KVCacheGroupSpec(list(FULL), FullAttentionSpec(block_size=64, tokens_per_state=4, **kv)),
        KVCacheGroupSpec(
            list(SWA),
            SlidingWindowSpec(
                block_size=64, sliding_window=24, tokens_per_state=Fraction(1, 2), **kv
            ),
        ),
        KVCacheGroupSpec(
            list(MAMBA),
            MambaSpec(block_size=1024, shapes=((3, 32),), dtypes=(torch.float16,)),
        ),
    ]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    assert kv_groups(config, "auto") == (
        compressed(64),
        KvGroup(
            kind="sliding",
            block_size=64,
            layers=SWA,
            element_types=("float16",),
            sliding_window=24,
            tokens_per_state=(1, 2),
        ),
        mamba(),
    )
