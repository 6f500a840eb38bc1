"""The one shape every protocol state machine of :mod:`moriio_native.pd` has.

A machine is an ``Enum`` of states, an ``Enum`` of events and ONE table ``{(state, event):
next state}``. :meth:`Machine.advance` is the only way to change the state; an event the table
does not allow in the current state raises :class:`IllegalTransitionError` naming the machine,
the transfer, the state and the event -- a protocol bug is loud, never a silently ignored
boolean. Not thread-safe by itself: each owner changes its machines under its own lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

from moriio_native.errors import FailedPreconditionError

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)


class IllegalTransitionError(FailedPreconditionError):
    """An event arrived in a state whose transition table does not allow it."""


class Machine(Generic[S, E]):
    """One transfer's state under ``table``. ``name`` and ``subject`` (the transfer id) only
    make error messages say which protocol and which transfer."""

    __slots__ = ("_state", "_table", "name", "subject")

    def __init__(self, name: str, subject: str, table: Mapping[tuple[S, E], S], initial: S) -> None:
        self.name = name
        self.subject = subject
        self._table = table
        self._state = initial

    @property
    def state(self) -> S:
        return self._state

    def allows(self, event: E) -> bool:
        return (self._state, event) in self._table

    def advance(self, event: E) -> S:
        """Apply ``event``; the new state. IllegalTransitionError (nothing changed) when the
        table has no transition for it in the current state."""
        try:
            self._state = self._table[(self._state, event)]
        except KeyError:
            raise IllegalTransitionError(
                f"{self.name} {self.subject}: event {event.name} is not allowed in state "
                f"{self._state.name}"
            ) from None
        return self._state

    def __repr__(self) -> str:
        return f"{self.name}({self.subject!r}, {self._state.name})"


def states_of(table: Mapping[tuple[S, E], S]) -> set[S]:
    """Every state the table names (for documentation and tests)."""
    return {s for s, _ in table} | set(table.values())


__all__ = ["IllegalTransitionError", "Machine", "states_of"]
