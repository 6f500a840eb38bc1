"""The flood benchmark's short run (tests/py/connector_flood.py): garbage and valid-schema
messages of unknown transfers on every listening port of a connector pair (or valid-schema ones
only, on the notify ports) while genuine READ requests run. Checks what the benchmark checks
(every genuine request loaded and freed, every flood message received and dropped or ignored,
no flood handshake answered, the remembered-message gauges at most their bound, bounded RSS
growth); the latency ratio is printed by the full run, not asserted (no timings in tests)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import connector_flood

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("kind", connector_flood.KINDS)
def test_a_flood_neither_fails_genuine_requests_nor_grows_memory(kind: str) -> None:
    bound = 1500
    short = ["--rounds", "15", "--phases", "2", "--rate", "3000", "--remember", str(bound)]
    args = connector_flood.parse_args([*short, "--kind", kind])
    res = connector_flood.run(args)
    assert res.violations == []
    assert res.baseline_ms["n"] == res.flood_ms["n"] == 30
    counts = res.counts
    for name in ("prefill-notify", "decode-notify"):
        assert counts[name]["remembered"] == bound  # the flood filled the memory to its bound
        assert counts[name]["delivered"] > 0
        assert (counts[name]["dropped_malformed"] > 0) == (kind == "mixed")
    for name in ("prefill-handshake", "decode-handshake"):
        assert (counts[name]["dropped_malformed"] > 0) == (kind == "mixed")
    assert counts["prefill-early-releases"]["held"] == bound
    # Every port's flood at least filled the memories (a valid one floods the 2 notify ports).
    assert res.flood_messages > (4 if kind == "mixed" else 2) * bound
