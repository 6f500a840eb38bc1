"""The fault table of docs/reliability.md from the rows the fault tests append to
``$MORIIO_FAULT_REPORT`` (JSON lines; one per scenario run; runs of one scenario are summed).

    python3 scripts/reliability_table.py faults.jsonl
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    merged: dict[str, dict[str, Any]] = {}
    for row in rows:
        got = merged.setdefault(row["scenario"], {**row, "rounds": 0, "faults": 0, "violations": 0})
        for key in ("rounds", "faults", "violations"):
            got[key] += row[key]
        for key in ("detect_s_max", "recover_s_max"):
            values = [v for v in (got.get(key), row.get(key)) if v is not None]
            got[key] = max(values) if values else None
    lines = [
        "| scenario | rounds | faults injected | invariant violations | detect (s, max) "
        "| recover (s, max) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in merged.values():
        lines.append(
            f"| {row['scenario']} | {row['rounds']} | {row['faults']} | {row['violations']} "
            f"| {_seconds(row['detect_s_max'])} | {_seconds(row['recover_s_max'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(__doc__ or "")
        return 2
    with open(argv[1]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    sys.stdout.write(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
