"""The waiting acknowledgements of abort_write: bounded, due in order, found by the rank they
name."""

from __future__ import annotations

from moriio_native.pd.acks import DueAck, RankKey, WaitingAcks

RANK_1: RankKey = ("engine-1", 0, 0, 1, 8100)
RANK_2: RankKey = ("engine-2", 0, 0, 1, 8100)
RANK_3: RankKey = ("engine-3", 0, 1, 2, 8101)


def test_the_oldest_go_past_the_bound_and_leave_the_rank_index() -> None:
    acks = WaitingAcks(2)
    assert acks.put(b"a", RANK_1, "tx-a", 0.0, 5.0) == []
    assert acks.put(b"b", RANK_2, "tx-b", 1.0, 6.0) == []
    assert acks.put(b"c", RANK_1, "tx-c", 2.0, 7.0) == [b"a"]
    assert len(acks) == 2
    assert acks.put(b"d", RANK_3, "tx-d", 3.0, 8.0) == [b"b"]
    assert acks.take_naming(RANK_2) == []
    assert acks.take_naming(RANK_1) == ["tx-c"]
    assert len(acks) == 1


def test_put_again_moves_an_acknowledgement_to_its_new_try() -> None:
    acks = WaitingAcks(4)
    acks.put(b"a", RANK_1, "tx-a", 0.0, 5.0)
    acks.put(b"b", RANK_1, "tx-b", 1.0, 6.0)
    acks.put(b"a", RANK_1, "tx-a", 0.0, 10.0)
    assert acks.take_due(7.0, 100.0, free=8) == [DueAck(b"b", 1.0, False)]
    assert acks.take_due(10.0, 100.0, free=8) == [DueAck(b"a", 0.0, False)]
    assert len(acks) == 0 and acks.take_naming(RANK_1) == []


def test_take_due_takes_the_expired_and_at_most_free_others_in_order() -> None:
    acks = WaitingAcks(8)
    acks.put(b"old", RANK_1, "tx-old", 0.0, 5.0)  # first tried long ago: expired at 50
    acks.put(b"a", RANK_2, "tx-a", 40.0, 6.0)
    acks.put(b"b", RANK_2, "tx-b", 41.0, 7.0)
    acks.put(b"later", RANK_2, "tx-later", 42.0, 60.0)  # not due at 50
    assert acks.take_due(50.0, 30.0, free=1) == [
        DueAck(b"old", 0.0, True),
        DueAck(b"a", 40.0, False),
    ]
    assert acks.take_due(50.0, 30.0, free=0) == []  # b stays due
    assert acks.take_naming(RANK_2) == ["tx-b", "tx-later"]  # oldest first
    assert len(acks) == 0


def test_take_naming_takes_only_that_rank() -> None:
    """The same engine id at another rank, TP size or port is another rank: left waiting."""
    acks = WaitingAcks(8)
    acks.put(b"a", RANK_1, "tx-a", 0.0, 5.0)
    acks.put(b"b", ("engine-1", 0, 0, 2, 8100), "tx-b", 1.0, 6.0)
    acks.put(b"c", ("engine-1", 0, 0, 1, 8102), "tx-c", 2.0, 7.0)
    assert acks.take_naming(RANK_1) == ["tx-a"]
    assert len(acks) == 2
    assert [d.wire for d in acks.take_due(10.0, 100.0, free=8)] == [b"b", b"c"]


def test_remove_of_a_wire_not_waiting_changes_nothing() -> None:
    acks = WaitingAcks(2)
    acks.put(b"a", RANK_1, "tx-a", 0.0, 5.0)
    acks.remove(b"zzz")
    acks.remove(b"a")
    acks.remove(b"a")
    assert len(acks) == 0 and acks.take_naming(RANK_1) == []


def test_take_due_gives_up_the_expired_behind_one_that_waits_for_budget() -> None:
    """Expired acknowledgements are taken whatever the budget, also those due after one that
    has to wait for it."""
    acks = WaitingAcks(8)
    acks.put(b"a", RANK_2, "tx-a", 40.0, 5.0)
    acks.put(b"old", RANK_1, "tx-old", 0.0, 6.0)  # expired at 50, due after a
    assert acks.take_due(50.0, 30.0, free=0) == [DueAck(b"old", 0.0, True)]
    assert acks.take_due(50.0, 30.0, free=1) == [DueAck(b"a", 40.0, False)]
