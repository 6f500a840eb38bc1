"""One row of docs/reliability.md's fault table per scenario run (no torch, no vLLM: the
end-to-end tier's environment imports it too)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    """One scenario's line of docs/reliability.md."""

    scenario: str
    rounds: int = 0
    faults: int = 0
    violations: list[str] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    recover_s: list[float] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(what)

    def as_dict(self) -> dict[str, Any]:
        def worst(xs: list[float]) -> float | None:
            return round(max(xs), 3) if xs else None

        return {
            "scenario": self.scenario,
            "rounds": self.rounds,
            "faults": self.faults,
            "violations": len(self.violations),
            "detect_s_max": worst(self.detect_s),
            "recover_s_max": worst(self.recover_s),
        }


@contextmanager
def recorded(scenario: str) -> Iterator[Row]:
    """A row for ``scenario``; fails the test on any violation, and appends the row to
    ``$MORIIO_FAULT_REPORT`` (JSON lines) when set."""
    row = Row(scenario)
    yield row
    path = os.environ.get("MORIIO_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row.as_dict()) + "\n")
    assert not row.violations, f"{scenario}: {len(row.violations)} violations: {row.violations}"


__all__ = ["Row", "recorded"]
