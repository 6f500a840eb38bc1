"""Acknowledgements of ``abort_write`` that wait for a handshake (the prefill's side).

An ``abort_write`` of a transfer a prefill rank never knew is acknowledged only where a
handshake proved the decode rank it names. When no handshake may start (a flood took the
budget) or one failed, the acknowledgement waits here for its next try, as its wire bytes and
the decode rank it names (:data:`RankKey`), in one flat tuple of numbers, strings and bytes
(nothing the garbage collector tracks per message), so that a handshake proving that rank (a
genuine WRITE into it, or another acknowledgement's handshake) finds the acknowledgements
waiting for it by comparing those fields, decoding none, and sends them at once instead of
leaving them behind a flood's for the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# A decode rank as an abort_write names it and as a handshake proves it: its engine id, DP
# rank, TP rank, TP size and the notify port those put it at (-1: a port its fields cannot
# give, which nothing proves).
RankKey = tuple[str, int, int, int, int]


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
        # wire -> (first try, next try, its transfer id, *the decode rank it names)
        self._entries: OrderedDict[bytes, tuple[float, float, str, str, int, int, int, int]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, wire: bytes, rank: RankKey, transfer_id: str, since: float, due: float
    ) -> list[bytes]:
        """``wire`` (of ``transfer_id``) waits until ``due`` (last in order; it is the latest
        next try), naming ``rank``; returns the oldest ones it pushed past the bound
        (removed)."""
        self.remove(wire)
        self._entries[wire] = (since, due, transfer_id, *rank)
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
        for wire, (since, at, *_) in self._entries.items():
            if at > now:
                break  # in the order of their next try
            expired = now - since > abort_timeout
            if not expired:
                if free <= 0:
                    continue  # expired ones due later are still given up
                free -= 1
            taken.append(DueAck(wire, since, expired))
        for ack in taken:
            self.remove(ack.wire)
        return taken

    def take_naming(self, rank: RankKey) -> list[str]:
        """Remove those that name ``rank`` and return their transfer ids, oldest first (a
        comparison per waiting one: at most ``bound``, each without decoding it)."""
        wires = [wire for wire, entry in self._entries.items() if entry[3:] == rank]
        taken = sorted((self._entries.pop(wire) for wire in wires), key=lambda e: e[0])
        return [entry[2] for entry in taken]

    def remove(self, wire: bytes) -> None:
        self._entries.pop(wire, None)


__all__ = ["DueAck", "RankKey", "WaitingAcks"]
