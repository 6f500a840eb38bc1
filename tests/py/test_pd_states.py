"""The protocol core's state machines: every transition in each table applies, every other
(state, event) pair is refused loudly and changes nothing, and terminal states are final."""

from __future__ import annotations

from enum import Enum
from typing import Any

import pytest

from moriio_native.pd.fsm import IllegalTransitionError, Machine, states_of
from moriio_native.pd.puller import (
    AWAIT_TERMINAL,
    AWAIT_TRANSITIONS,
    READ_TERMINAL,
    READ_TRANSITIONS,
    AwaitEvent,
    AwaitState,
    ReadEvent,
    ReadState,
)
from moriio_native.pd.pusher import (
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    SEND_TRANSITIONS,
    JobEvent,
    JobState,
    SendEvent,
    SendState,
)

TABLES: list[tuple[str, dict[Any, Any], type[Enum], type[Enum], frozenset[Any]]] = [
    ("READ", READ_TRANSITIONS, ReadState, ReadEvent, READ_TERMINAL),
    ("WRITE-await", AWAIT_TRANSITIONS, AwaitState, AwaitEvent, AWAIT_TERMINAL),
    ("WRITE", JOB_TRANSITIONS, JobState, JobEvent, JOB_TERMINAL),
    (
        "READ-hold",
        SEND_TRANSITIONS,
        SendState,
        SendEvent,
        frozenset({SendState.RELEASED, SendState.EXPIRED}),
    ),
]
IDS = [t[0] for t in TABLES]


@pytest.mark.parametrize(("name", "table", "states", "events", "terminal"), TABLES, ids=IDS)
def test_every_listed_transition_applies(name, table, states, events, terminal) -> None:
    for (state, event), target in table.items():
        machine = Machine(name, "t-1", table, state)
        assert machine.allows(event)
        assert machine.advance(event) is target
        assert machine.state is target


@pytest.mark.parametrize(("name", "table", "states", "events", "terminal"), TABLES, ids=IDS)
def test_every_other_pair_is_refused_and_changes_nothing(
    name, table, states, events, terminal
) -> None:
    refused = 0
    for state in states:
        for event in events:
            if (state, event) in table:
                continue
            machine = Machine(name, "t-9", table, state)
            assert not machine.allows(event)
            with pytest.raises(IllegalTransitionError) as info:
                machine.advance(event)
            # The message names the protocol, the transfer, the state and the event.
            for part in (name, "t-9", state.name, event.name):
                assert part in str(info.value)
            assert machine.state is state
            refused += 1
    assert refused > 0


@pytest.mark.parametrize(("name", "table", "states", "events", "terminal"), TABLES, ids=IDS)
def test_terminal_states_are_final_and_every_state_is_used(
    name, table, states, events, terminal
) -> None:
    assert not any(state in terminal for state, _ in table)
    assert states_of(table) == set(states)
    # Every non-terminal state can reach a terminal one.
    for start in set(states) - set(terminal):
        seen, frontier = {start}, [start]
        while frontier:
            current = frontier.pop()
            for (state, _), target in table.items():
                if state is current and target not in seen:
                    seen.add(target)
                    frontier.append(target)
        assert seen & set(terminal), f"{name}: {start.name} never ends"


def test_a_quarantined_read_ends_only_through_its_drain() -> None:
    machine = Machine("READ", "r", READ_TRANSITIONS, ReadState.CONNECTING)
    machine.advance(ReadEvent.POSTED)
    machine.advance(ReadEvent.UNDRAINED)
    for event in (ReadEvent.DONE, ReadEvent.FAILED, ReadEvent.UNDRAINED, ReadEvent.POSTED):
        with pytest.raises(IllegalTransitionError):
            machine.advance(event)
    assert machine.advance(ReadEvent.DRAINED) is ReadState.FAILED


def test_a_write_job_is_done_only_after_its_seal() -> None:
    machine = Machine("WRITE", "w", JOB_TRANSITIONS, JobState.PENDING)
    machine.advance(JobEvent.READY)
    machine.advance(JobEvent.CONNECTED)
    with pytest.raises(IllegalTransitionError):
        machine.advance(JobEvent.ENGINE_DONE)  # done before the seal fixed the count
    machine.advance(JobEvent.SEAL)
    assert machine.advance(JobEvent.ENGINE_DONE) is JobState.DONE
