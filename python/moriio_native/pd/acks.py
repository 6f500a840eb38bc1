"""Acknowledgements of ``abort_write`` that wait for a handshake (the prefill's side).

An ``abort_write`` of a transfer a prefill rank never knew is acknowledged only where a
handshake proved the decode rank it names. When no handshake may start (a flood took the
budget) or one failed, the acknowledgement waits here for its next try, as its wire bytes
(numbers and bytes: nothing the garbage collector tracks per message). Each is also indexed by
the decode engine id it names, so that a handshake proving that rank (a genuine WRITE into it,
or another acknowledgement's handshake) sends the acknowledgements waiting for it at once,
instead of leaving them behind a flood's for the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DueAck:
    """One acknowledgement taken for a try: its wire bytes, its first try's time, and whether
    it waited past ``abort_timeout`` (then it is given up, not tried)."""

    wire: bytes
    since: float
    expired: bool


class WaitingAcks:
    """Waiting acknowledgements, in the order of their next try, at most ``bound`` of them.
    Not thread-safe (the pusher's lock)."""

    def __init__(self, bound: int) -> None:
        self._bound = bound
        # wire -> (first try, next try, decode engine id it names)
        self._entries: OrderedDict[bytes, tuple[float, float, str]] = OrderedDict()
        self._by_engine: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, wire: bytes, engine_id: str, since: float, due: float) -> list[bytes]:
        """``wire`` waits until ``due`` (last in order; it is the latest next try), naming
        ``engine_id``; returns the oldest ones it pushed past the bound (removed)."""
        self.remove(wire)
        self._entries[wire] = (since, due, engine_id)
        self._by_engine.setdefault(engine_id, set()).add(wire)
        dropped = []
        while len(self._entries) > self._bound:
            oldest = next(iter(self._entries))
            self.remove(oldest)
            dropped.append(oldest)
        return dropped

    def take_due(self, now: float, abort_timeout: float, free: int) -> list[DueAck]:
        """Remove and return those due at ``now``: every one expired, and at most ``free`` of
        the others (as many as handshakes may start; the rest stay due)."""
        taken = []
        for wire, (since, at, _) in self._entries.items():
            if at > now:
                break  # in the order of their next try
            expired = now - since > abort_timeout
            if not expired:
                if free <= 0:
                    break
                free -= 1
            taken.append(DueAck(wire, since, expired))
        for ack in taken:
            self.remove(ack.wire)
        return taken

    def naming(self, engine_id: str) -> list[tuple[bytes, float]]:
        """The waiting acknowledgements that name decode engine ``engine_id``, with their
        first try's time (left waiting: :meth:`remove` the ones sent)."""
        wires = self._by_engine.get(engine_id, ())
        return [(wire, self._entries[wire][0]) for wire in wires]

    def remove(self, wire: bytes) -> None:
        entry = self._entries.pop(wire, None)
        if entry is None:
            return
        engine_id = entry[2]
        wires = self._by_engine[engine_id]
        wires.discard(wire)
        if not wires:
            del self._by_engine[engine_id]


__all__ = ["DueAck", "WaitingAcks"]
