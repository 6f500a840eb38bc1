"""The waiting acknowledgements of abort_write: bounded, due in order, found by engine id."""

from __future__ import annotations

from moriio_native.pd.acks import DueAck, WaitingAcks


def test_the_oldest_go_past_the_bound_and_leave_the_engine_index() -> None:
    acks = WaitingAcks(2)
    assert acks.put(b"a", "engine-1", 0.0, 5.0) == []
    assert acks.put(b"b", "engine-2", 1.0, 6.0) == []
    assert acks.put(b"c", "engine-1", 2.0, 7.0) == [b"a"]
    assert len(acks) == 2
    assert acks.naming("engine-1") == [(b"c", 2.0)]
    assert acks.put(b"d", "engine-3", 3.0, 8.0) == [b"b"]
    assert acks.naming("engine-2") == []


def test_put_again_moves_an_acknowledgement_to_its_new_try() -> None:
    acks = WaitingAcks(4)
    acks.put(b"a", "engine-1", 0.0, 5.0)
    acks.put(b"b", "engine-1", 1.0, 6.0)
    acks.put(b"a", "engine-1", 0.0, 10.0)
    assert acks.take_due(7.0, 100.0, free=8) == [DueAck(b"b", 1.0, False)]
    assert acks.take_due(10.0, 100.0, free=8) == [DueAck(b"a", 0.0, False)]
    assert len(acks) == 0 and acks.naming("engine-1") == []


def test_take_due_takes_the_expired_and_at_most_free_others_in_order() -> None:
    acks = WaitingAcks(8)
    acks.put(b"old", "engine-1", 0.0, 5.0)  # first tried long ago: expired at 50
    acks.put(b"a", "engine-2", 40.0, 6.0)
    acks.put(b"b", "engine-2", 41.0, 7.0)
    acks.put(b"later", "engine-2", 42.0, 60.0)  # not due at 50
    assert acks.take_due(50.0, 30.0, free=1) == [
        DueAck(b"old", 0.0, True),
        DueAck(b"a", 40.0, False),
    ]
    assert acks.take_due(50.0, 30.0, free=0) == []  # b stays due
    assert sorted(w for w, _ in acks.naming("engine-2")) == [b"b", b"later"]


def test_remove_of_a_wire_not_waiting_changes_nothing() -> None:
    acks = WaitingAcks(2)
    acks.put(b"a", "engine-1", 0.0, 5.0)
    acks.remove(b"zzz")
    acks.remove(b"a")
    acks.remove(b"a")
    assert len(acks) == 0 and acks.naming("engine-1") == []
