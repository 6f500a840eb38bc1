"""The head-range plan across prefill / decode TP sizes (moriio_native.pd.heads)."""

from __future__ import annotations

import itertools

import pytest

from moriio_native.errors import IncompatiblePeerError
from moriio_native.pd.heads import HeadSlice, TpPlan, heads_per_rank, rank_heads

HEADS = (1, 2, 3, 4, 6, 8, 12)
SIZES = range(1, 9)


def _valid(total: int, tp: int) -> bool:
    return total % tp == 0 or tp % total == 0


def _plans() -> list[tuple[int, int, int, bool]]:
    out = []
    for total, p, d in itertools.product(HEADS, SIZES, SIZES):
        if _valid(total, p) and _valid(total, d):
            out.extend([(total, p, d, True), (total, p, d, False)])
    return out


@pytest.mark.parametrize(("total", "p", "d", "whole"), _plans())
def test_every_decode_head_comes_from_a_prefill_rank_that_holds_it(
    total: int, p: int, d: int, whole: bool
) -> None:
    plan = TpPlan.make(p, d, total, whole)
    for rank in range(d):
        mine = rank_heads(total, d, rank)
        covered: list[int] = []
        for s in plan.head_sources(rank):
            assert s.heads >= 1
            theirs = rank_heads(total, p, s.rank)
            assert s.remote_begin >= 0 and s.remote_begin + s.heads <= len(theirs)
            assert s.local_begin >= 0 and s.local_begin + s.heads <= len(mine)
            for i in range(s.heads):
                assert theirs[s.remote_begin + i] == mine[s.local_begin + i]
            covered.extend(range(s.local_begin, s.local_begin + s.heads))
        # Every local head exactly once, in order.
        assert covered == list(range(heads_per_rank(total, d)))
        sources = plan.sources(rank)
        assert len(set(sources)) == len(sources)
        assert {s.rank for s in plan.head_sources(rank)} <= set(sources)
        if whole:
            assert plan.whole_source(rank) in sources
        else:
            assert plan.whole_source(rank) is None


@pytest.mark.parametrize(("total", "p", "d", "whole"), _plans())
def test_release_fan_in_is_exact(total: int, p: int, d: int, whole: bool) -> None:
    plan = TpPlan.make(p, d, total, whole)
    received = dict.fromkeys(range(p), 0)
    for rank in range(d):
        targets = plan.release_targets(rank)
        assert len(set(targets)) == len(targets)
        for target in targets:
            received[target] += 1
    for prefill in range(p):
        # Every prefill rank hears from exactly the decode ranks it waits for, never zero.
        assert received[prefill] == plan.expected_releases(prefill) >= 1
        consumers = plan.consumers(prefill)
        for rank in range(d):
            assert plan.releases(rank, prefill) == (prefill in plan.release_targets(rank))
            assert (rank in consumers) == (prefill in plan.sources(rank))


@pytest.mark.parametrize(("total", "p", "d", "whole"), _plans())
def test_write_targets_invert_the_read_sources(total: int, p: int, d: int, whole: bool) -> None:
    plan = TpPlan.make(p, d, total, whole)
    reads = {
        (s.rank, rank, s.remote_begin, s.local_begin, s.heads)
        for rank in range(d)
        for s in plan.head_sources(rank)
    }
    writes = {
        (prefill, s.rank, s.local_begin, s.remote_begin, s.heads)
        for prefill in range(p)
        for s in plan.head_targets(prefill)
    }
    assert reads == writes


@pytest.mark.parametrize("tp", SIZES)
@pytest.mark.parametrize("total", HEADS)
def test_equal_sizes_pair_rank_with_rank_whole(tp: int, total: int) -> None:
    if not _valid(total, tp):
        return
    plan = TpPlan.make(tp, tp, total, True)
    for rank in range(tp):
        assert plan.head_sources(rank) == (HeadSlice(rank, 0, 0, heads_per_rank(total, tp)),)
        assert plan.sources(rank) == (rank,)
        assert plan.release_targets(rank) == (rank,)
        assert plan.expected_releases(rank) == 1


@pytest.mark.parametrize(("p", "d"), itertools.product(SIZES, SIZES))
def test_whole_caches_only_keep_the_old_rule(p: int, d: int) -> None:
    # Decode rank r reads prefill rank r mod P; the prefill ranks no decode rank reads
    # (P > D) are released by decode rank p mod D.
    plan = TpPlan.make(p, d, 0, True)
    for rank in range(d):
        unread = [q for q in range(d, p) if q % d == rank]
        assert plan.sources(rank) == (rank % p,)
        assert plan.release_targets(rank) == (rank % p, *unread)
    for prefill in range(p):
        assert plan.expected_releases(prefill) == (len(range(prefill, d, p)) or 1)


def test_examples() -> None:
    # 8 heads, prefill TP 2 -> decode TP 4: each decode rank slices half of one prefill rank.
    plan = TpPlan.make(2, 4, 8, True)
    assert [plan.head_sources(r) for r in range(4)] == [
        (HeadSlice(0, 0, 0, 2),),
        (HeadSlice(0, 2, 0, 2),),
        (HeadSlice(1, 0, 0, 2),),
        (HeadSlice(1, 2, 0, 2),),
    ]
    assert plan.consumers(1) == (2, 3)
    # 8 heads, prefill TP 4 -> decode TP 2: gather from two prefill ranks.
    plan = TpPlan.make(4, 2, 8, True)
    assert plan.head_sources(1) == (HeadSlice(2, 0, 0, 2), HeadSlice(3, 0, 2, 2))
    assert plan.head_targets(3) == (HeadSlice(1, 2, 0, 2),)  # decode heads [2,4)
    # 6 heads, TP 2 (3 each) -> TP 3 (2 each): decode rank 1 straddles both prefill ranks.
    plan = TpPlan.make(2, 3, 6, True)
    assert plan.head_sources(1) == (HeadSlice(0, 2, 0, 1), HeadSlice(1, 0, 1, 1))
    assert plan.consumers(0) == (0, 1) and plan.consumers(1) == (1, 2)
    # 2 heads replicated on prefill TP 4 -> decode TP 2: one replica each, the others unused
    # and released by decode rank p mod 2.
    plan = TpPlan.make(4, 2, 2, True)
    assert plan.sources(0) == (0,) and plan.sources(1) == (3,)
    assert plan.release_targets(0) == (0, 2) and plan.release_targets(1) == (3, 1)


def test_refusals_name_both_sizes_and_the_heads() -> None:
    with pytest.raises(IncompatiblePeerError, match=r"prefill TP 4 -> decode TP 2 with 6 KV"):
        TpPlan.make(4, 2, 6, True)
    with pytest.raises(IncompatiblePeerError, match="neither divides"):
        TpPlan.make(2, 4, 6, False)
    with pytest.raises(IncompatiblePeerError, match="decode rank 3 outside TP size 2"):
        TpPlan.make(1, 2, 2, True).head_sources(3)


def test_describe_names_every_part_in_global_heads() -> None:
    # Gather (prefill TP 2 -> decode TP 1): the decode rank's parts, one per prefill rank.
    plan = TpPlan.make(2, 1, 2, True)
    assert plan.describe(0, prefill=False, whole_layers=False) == (
        "prefill TP 2 -> decode TP 1, 2 KV heads: decode rank 0 takes KV heads [0, 1) from "
        "prefill rank 0, [1, 2) from prefill rank 1"
    )
    assert plan.describe(1, prefill=True, whole_layers=False) == (
        "prefill TP 2 -> decode TP 1, 2 KV heads: prefill rank 1 gives KV heads [1, 2) to "
        "decode rank 0"
    )
    # Slice (1 -> 2): each decode rank's heads from the one prefill rank, which gives both.
    plan = TpPlan.make(1, 2, 2, True)
    assert plan.describe(1, prefill=False, whole_layers=True).endswith(
        "decode rank 1 takes KV heads [1, 2) from prefill rank 0; whole caches from prefill rank 0"
    )
    assert plan.describe(0, prefill=True, whole_layers=False).endswith(
        "prefill rank 0 gives KV heads [0, 1) to decode rank 0, [1, 2) to decode rank 1"
    )
    # Replicated (2 heads, prefill TP 4 -> decode TP 2): prefill rank 1 holds head 0 too, but
    # decode rank 0 takes it from rank 0; global head indices, not the rank's own.
    plan = TpPlan.make(4, 2, 2, True)
    assert plan.describe(3, prefill=True, whole_layers=False).endswith(
        "prefill rank 3 gives KV heads [1, 2) to decode rank 1"
    )
    assert plan.describe(1, prefill=True, whole_layers=False).endswith(
        "prefill rank 1 moves no split heads"
    )


def _reference_consumers(plan: TpPlan, prefill_rank: int) -> tuple[int, ...]:
    """The definition: every decode rank that names the prefill rank among its sources."""
    return tuple(d for d in range(plan.decode_tp) if prefill_rank in plan.sources(d))


@pytest.mark.parametrize("total", [0, 1, 2, 4, 8, 16])
def test_consumers_worked_out_from_the_heads_equal_every_decode_ranks_sources(total: int) -> None:
    sizes = (1, 2, 3, 4, 8, 16, 32, 64)
    for p, d in itertools.product(sizes, sizes):
        if total and not (_valid(total, p) and _valid(total, d)):
            continue
        for whole in (True, False) if total else (True,):
            plan = TpPlan.make(p, d, total, whole)
            for prefill in range(p):
                assert plan.consumers(prefill) == _reference_consumers(plan, prefill), (
                    total,
                    p,
                    d,
                    whole,
                    prefill,
                )


def test_the_consumers_of_a_huge_decode_tp_ask_no_decode_rank_for_its_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a prefill rank's consumers were found by asking each of the decode TP size's
    ranks for its sources; for the 65,536 a request may name (the client's word), a third of a
    second per new size in vLLM's engine step. Now they follow from the rank's heads: no decode
    rank is asked, and the answer is the same."""
    asked: list[int] = []
    sources = TpPlan.sources

    def counted(plan: TpPlan, decode_rank: int) -> tuple[int, ...]:
        asked.append(decode_rank)
        return sources(plan, decode_rank)

    monkeypatch.setattr(TpPlan, "sources", counted)
    for prefill_tp in (1, 4, 16):
        plan = TpPlan.make(prefill_tp, 65536, 8, True)
        consumers = plan.consumers(prefill_tp - 1)
        assert len(consumers) == 65536 // prefill_tp
        assert plan.expected_releases(prefill_tp - 1) == len(consumers)
    assert asked == []
    monkeypatch.setattr(TpPlan, "sources", sources)
    assert consumers == _reference_consumers(plan, 15)
