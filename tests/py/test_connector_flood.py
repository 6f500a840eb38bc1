"""The flood benchmark's short run (tests/py/connector_flood.py): garbage and valid-schema
messages of unknown transfers on every listening port of a connector pair (or valid-schema ones
only, on the notify ports) while genuine requests run, in READ or WRITE mode, without or with a
shared secret the flood does not know. Checks what the benchmark checks (every genuine request
loaded and freed, every flood message received and dropped or ignored, no flood handshake
answered, the remembered-message gauges at most their bound, with a secret no flood message
read at all: the flood is then one of keyless connections, refused at CURVE; bounded RSS
growth), and that ``--stages`` times every stage of a WRITE round; and ``--kind unanswered``:
aborts naming addresses that never answer leave the prefill's handshakes, retries, threads, fds
and log lines bounded. The latency ratio is printed by the full run, not asserted (no timings
in tests)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

pytest.importorskip("vllm")

import connector_flood

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("kind", "mode", "secret"),
    [
        ("mixed", "read", False),
        ("valid", "read", False),
        ("valid", "write", False),
        ("mixed", "write", True),
    ],
)
def test_a_flood_neither_fails_genuine_requests_nor_grows_memory(
    kind: str, mode: str, secret: bool
) -> None:
    bound = 1500
    short = ["--rounds", "15", "--phases", "2", "--rate", "3000", "--remember", str(bound)]
    stages = mode == "write" and not secret  # the WRITE rounds' breakdown too
    args = connector_flood.parse_args(
        [
            *short,
            *("--kind", kind, "--mode", mode),
            *(["--secret"] if secret else []),
            *(["--stages"] if stages else []),
        ]
    )
    res = connector_flood.run(args)
    assert res.violations == []
    if stages:
        _assert_every_stage_timed(res.stages)
    assert res.baseline_ms["n"] == res.flood_ms["n"] == 30
    counts = res.counts
    memory = "prefill-early-releases" if mode == "read" else "prefill-orphans"
    for name in ("prefill-notify", "decode-notify"):
        if secret:  # the flood's connections were all refused at CURVE: nothing read
            assert counts[name]["dropped_auth"] == counts[name]["dropped_malformed"] == 0
            assert counts[name]["remembered"] < bound
        else:
            assert counts[name]["remembered"] == bound  # the flood filled the memory
            assert (counts[name]["dropped_malformed"] > 0) == (kind == "mixed")
        assert counts[name]["delivered"] > 0
    for name in ("prefill-handshake", "decode-handshake"):
        dropped = counts[name]["dropped_malformed"] + counts[name]["dropped_auth"]
        assert (dropped > 0) == (kind == "mixed" and not secret)
    # A genuine round's own release (READ) or announcement (WRITE) reaches the prefill before
    # its task does, so it is kept in the same memory, evicting a flood record when full, and
    # taken out when the task comes: a round that ends after the flood's last message leaves
    # one place free (rounds run one at a time).
    held = counts[memory]["held"]
    if secret:
        assert held == 0
    else:
        assert bound - 1 <= held <= bound
    # Every port's flood at least filled the memories (a valid one floods the 2 notify ports).
    if not secret:
        assert res.flood_messages > (4 if kind == "mixed" else 2) * bound
    else:
        assert res.flood_messages > 0


def test_a_flood_to_a_sink_is_read_there_and_measured_beside_the_instances_flood() -> None:
    """--sink: a third kind of phase floods a sink process's ports instead of the instances';
    the sink reads every message, the instances' listeners none of it, and both ratios and the
    sink's CPU are reported. The hub's pause asked for (--flood-pause) holds while the phases
    run and is recorded; the module's own comes back after."""
    pause = connector_flood.channel_module._FLOOD_PAUSE_S
    short = ["--rounds", "10", "--phases", "2", "--rate", "3000", "--remember", "1000"]
    args = connector_flood.parse_args([*short, "--sink", "--flood-pause", str(2 * pause)])
    res = connector_flood.run(args)
    assert res.violations == []
    assert res.flood_pause_s == 2 * pause
    assert pause == connector_flood.channel_module._FLOOD_PAUSE_S  # restored
    kinds = [(w.flood, w.sink) for w in res.windows]
    assert kinds == [(False, False), (True, False), (False, True)] * 2
    assert res.baseline_ms["n"] == res.flood_ms["n"] == res.sink_ms["n"] == 20
    sunk = [w.messages for w in res.windows if w.sink]
    assert all(n > 0 for n in sunk) and res.sink_messages == sum(sunk)
    assert res.sink_cpu_ms_per_1000["sink"] > 0
    for key in ("p50", "p99"):
        assert res.sink_ratio[key] > 0 and res.flood_over_sink[key] > 0
    # In the sink phases the instances' listeners read the genuine rounds' messages (as in the
    # baseline phases: checked as a violation) and none of the sink's flood.
    for window in res.windows:
        if window.sink:
            assert 0 < window.received < window.messages


@pytest.mark.parametrize(
    "argv",
    [
        ["--sink", "--mode", "write", "--stages"],
        ["--sink", "--kind", "unanswered", "--mode", "write"],
        ["--flood-pause", "-0.001"],
        ["--switch-interval", "0"],
    ],
)
def test_the_flood_benchmark_refuses_options_it_cannot_measure(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        connector_flood.parse_args(argv)


def _assert_every_stage_timed(report: dict[str, Any]) -> None:
    """Every mark of a WRITE round was passed in the median rounds (a stage not timed reads
    NaN), and the pusher's time was taken for the flood's messages."""
    for kind in ("baseline", "flood"):
        row = report[kind]["median"]
        for a, b in itertools.pairwise(connector_flood.MARKS):
            assert math.isfinite(row[f"{a}->{b}"]), (kind, a, b)
        assert row["prefill_added->forward steps"] >= 1
    for message in ("remote_blocks", "abort_write"):
        assert report[f"pusher.on_{message} per flood message"]["n"] > 0


def test_aborts_naming_unanswering_addresses_stay_bounded() -> None:
    """abort_write of transfers the prefill never knew, each naming another decode address that
    never answers (refused ports, and listeners that accept and stay silent): the handshakes
    their acknowledgements need keep no genuine handshake waiting (each round's WRITE needs
    one), and the directory, the acknowledgements waiting, threads, fds and log lines stay
    bounded; every handshake ended after the flood."""
    bound = 1500
    args = connector_flood.parse_args(
        [
            *("--rounds", "5", "--phases", "2", "--rate", "3000", "--remember", str(bound)),
            *("--kind", "unanswered", "--mode", "write"),
            *("--transfer-timeout", "2", "--silent-listeners", "16"),
        ]
    )
    res = connector_flood.run(args)
    assert res.violations == []
    assert res.baseline_ms["n"] == res.flood_ms["n"] == 10
    # Both kinds of address were named, and the flood's handshakes went to them.
    assert res.targets["silent"] == 16 and res.targets["refused"] > 1000
    assert res.targets["accepted"] > 0
    assert res.after_drain["failures"] > 0  # handshakes with them timed out
    assert 0 < res.peaks["prefill-acks"]["retries"] <= connector_flood.pusher_module.MAX_ACK_RETRIES
    assert res.counts["prefill-orphans"]["held"] == bound
    assert res.after_drain["inflight"] == 0


def test_aborts_naming_answering_addresses_keep_the_peers_bounded() -> None:
    """abort_write of transfers the prefill never knew, each naming one of 24 addresses that
    answer every handshake as their own engine with valid metadata: the prefill connects each
    to acknowledge the abort. It never holds more than max_peers (8) engine peers or cached
    addresses, though more than 8 were handshaken (it evicted), and every genuine WRITE is
    written and loaded byte-exact. A genuine abort of a request the prefill does not have yet,
    from the decode it wrote to, is acknowledged though the flood takes the acknowledgement
    handshakes' budget (before: the decode's blocks stayed quarantined)."""
    bound = 1500
    args = connector_flood.parse_args(
        [
            *("--rounds", "5", "--phases", "2", "--rate", "1000", "--remember", str(bound)),
            *("--kind", "answering", "--mode", "write", "--transfer-timeout", "5"),
            *("--answering", "24", "--max-peers", "8"),
        ]
    )
    res = connector_flood.run(args)
    assert res.violations == []
    assert res.baseline_ms["n"] == res.flood_ms["n"] == 10
    assert res.targets["answering"] == 24
    assert res.targets["answered"] > 8
    assert res.after_drain["evicted"] > 0
    assert res.peaks["prefill-directory"]["engine_peers"] <= 8
    assert res.peaks["prefill-directory"]["peers"] <= 8
    assert len(res.abort_acks_ms) == 3


def test_aborts_naming_slowly_answering_addresses_hold_few_handshake_threads() -> None:
    """The same flood, each address answering a second after the handshake's request (slow, not
    dead): every acknowledgement's handshake holds one of the prefill's handshake threads for
    that second. At most MAX_ACK_HANDSHAKES of them are in flight (with a genuine one beside
    them), so every genuine WRITE, each needing a fresh handshake with the decode, is written and
    loaded byte-exact, and nothing is in flight once the flood stopped."""
    bound = 1500
    args = connector_flood.parse_args(
        [
            *("--rounds", "5", "--phases", "2", "--rate", "1000", "--remember", str(bound)),
            *("--kind", "answering", "--mode", "write", "--transfer-timeout", "5"),
            *("--answering", "24", "--max-peers", "8", "--answer-delay", "1"),
        ]
    )
    res = connector_flood.run(args)
    assert res.violations == []
    assert res.baseline_ms["n"] == res.flood_ms["n"] == 10
    assert res.targets["answered"] > 0
    assert (
        res.peaks["prefill-directory"]["inflight"]
        <= connector_flood.pusher_module.MAX_ACK_HANDSHAKES + 1
    )
    assert res.peaks["prefill-acks"]["retries"] > 0  # the others waited for their next try
    assert res.after_drain["inflight"] == 0
    assert len(res.abort_acks_ms) == 3
