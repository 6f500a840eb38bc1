"""Rank pairing across different prefill / decode TP sizes (moriio_native.vllm.tp)."""

from __future__ import annotations

import pytest

from moriio_native.vllm.tp import expected_releases, read_source, release_targets, releases


@pytest.mark.parametrize("prefill_tp", range(1, 9))
@pytest.mark.parametrize("decode_tp", range(1, 9))
def test_every_prefill_rank_gets_exactly_the_releases_it_waits_for(
    prefill_tp: int, decode_tp: int
) -> None:
    received = {p: 0 for p in range(prefill_tp)}
    for r in range(decode_tp):
        targets = release_targets(r, decode_tp, prefill_tp)
        assert targets[0] == read_source(r, prefill_tp)
        assert len(set(targets)) == len(targets)
        for p in targets:
            assert 0 <= p < prefill_tp
            received[p] += 1
    for p in range(prefill_tp):
        assert received[p] == expected_releases(p, prefill_tp, decode_tp), p
        for r in range(decode_tp):
            assert releases(r, decode_tp, p, prefill_tp) == (
                p in release_targets(r, decode_tp, prefill_tp)
            ), (r, p)


@pytest.mark.parametrize("tp", range(1, 9))
def test_equal_sizes_pair_rank_with_rank(tp: int) -> None:
    for r in range(tp):
        assert read_source(r, tp) == r
        assert release_targets(r, tp, tp) == [r]
        assert expected_releases(r, tp, tp) == 1


def test_examples() -> None:
    # Decode TP 4 over prefill TP 2: two readers per prefill rank.
    assert [read_source(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert expected_releases(0, 2, 4) == 2
    # Decode TP 2 over prefill TP 4: ranks 2 and 3 are not read; ranks 0 and 1 release them.
    assert release_targets(0, 2, 4) == [0, 2]
    assert release_targets(1, 2, 4) == [1, 3]
    assert expected_releases(3, 4, 2) == 1
