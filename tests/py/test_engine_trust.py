"""What an engine event promises about the bytes (issue 12 defects 2 and 3), on loopback.

* A WRITE is ``done`` only with every layer its seal named; a refused layer fails it; "nothing
  to send" is said explicitly (``expected_writes=0``); write calls on a READ id are errors.
* No byte of a transfer lands after its terminal event -- unless the event says
  ``drained=False`` (quarantined), and then none after ``poll_drained`` reported it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc

DELAY_MS = 1500  # each loopback batch sleeps this long before it copies
TIMEOUT_S = 0.4  # transfer_timeout: the event comes after 2 x 0.4 s, batches still in flight
WATCH_S = 2.0  # how long destination bytes are watched after the last promise


def make_pair(
    writer_delay_ms: int = 0, reader_delay_ms: int = 0, timeout: float = 30.0
) -> tuple[kc.KvCacheSet, kc.KvCacheSet, mn.Engine, mn.Engine]:
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=8)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=8)
    kc.fill_random(prefill, seed=1)
    kc.fill_random(decode, seed=2)
    ep = mn.Engine(
        "prefill-0",
        "loopback",
        options={"loopback_delay_ms": writer_delay_ms},
        transfer_timeout=timeout,
    )
    ed = mn.Engine(
        "decode-0",
        "loopback",
        options={"loopback_delay_ms": reader_delay_ms},
        transfer_timeout=timeout,
    )
    ep.register_kv_caches(prefill.registrations())
    ed.register_kv_caches(decode.registrations())
    ed.add_peer(ep.local_metadata())
    ep.add_peer(ed.local_metadata())
    return prefill, decode, ep, ed


# ---- defect 2: WRITE completion -----------------------------------------------------------------


def test_a_refused_layer_fails_the_write_so_the_seal_cannot_make_it_done() -> None:
    prefill, _, ep, _ = make_pair()
    names = [s.name for s in prefill.shapes]
    assert ep.write_layer("w", names[0], "decode-0", [0], [1]) is True
    with pytest.raises(mn.OutOfRangeError, match="remote block id 99"):
        ep.write_layer("w", names[1], "decode-0", [0], [99])
    ep.seal("w", "decode-0", expected_writes=2)
    event = ep.wait(["w"], timeout=10)["w"]
    assert (event.kind, event.state) == ("write", "failed")
    assert "remote block id 99" in event.message
    assert ep.write_layer("w", names[2], "decode-0", [0], [1]) is False  # refused from now on
    assert ep.poll_events(timeout=0.1) == []  # exactly one event


def test_a_seal_names_its_writes_and_nothing_to_send_is_explicit() -> None:
    prefill, decode, ep, _ = make_pair(writer_delay_ms=50)
    names = [s.name for s in prefill.shapes]
    # A seal of an id never written waits for the writes it names...
    ep.seal("early", "decode-0", expected_writes=2)
    with pytest.raises(mn.InvalidArgumentError, match="'early' was sealed for 2 writes, not 3"):
        ep.seal("early", "decode-0", expected_writes=3)
    assert ep.wait(["early"], timeout=0.3) == {}
    expected = kc.expected_after_copy(decode, prefill, [3], [2], layers=names[:2])
    for name in names[:2]:
        assert ep.write_layer("early", name, "decode-0", [2], [3]) is True
    event = ep.wait(["early"], timeout=10)["early"]
    assert (event.state, event.batches) == ("done", 2)
    assert np.array_equal(decode.backing, expected)
    # ...and "nothing to send" is said, not the default of an unknown id.
    ep.seal("nothing", "decode-0", expected_writes=0)
    assert ep.wait(["nothing"], timeout=5)["nothing"].state == "done"


def test_write_layer_and_seal_on_a_read_id_are_errors_naming_it() -> None:
    prefill, _, _, ed = make_pair(reader_delay_ms=100)
    name = prefill.shapes[0].name
    ed.read("r", "prefill-0", [0], [1])
    with pytest.raises(mn.InvalidArgumentError, match="'r' is a READ"):
        ed.write_layer("r", name, "prefill-0", [0], [1])
    with pytest.raises(mn.InvalidArgumentError, match="'r' is a READ"):
        ed.seal("r", "prefill-0", expected_writes=0)
    assert ed.wait(["r"], timeout=10)["r"].state == "done"  # the READ is untouched
    with pytest.raises(mn.InvalidArgumentError, match="'r' is a READ"):
        ed.seal("r", "prefill-0", expected_writes=0)


# ---- defect 3: no byte after the terminal event ------------------------------------------------


def _watch_unchanged(backing: np.ndarray, snapshot: np.ndarray, seconds: float) -> int:
    """Bytes of ``backing`` that differ from ``snapshot`` at any point within ``seconds``."""
    worst = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        worst = max(worst, int((backing != snapshot).sum()))
        time.sleep(0.02)
    return worst


@pytest.mark.parametrize("kind", ["read", "write"])
def test_no_byte_lands_after_the_event_unless_quarantined_and_none_after_the_drain(
    kind: str,
) -> None:
    delays = {"writer_delay_ms": DELAY_MS} if kind == "write" else {"reader_delay_ms": DELAY_MS}
    prefill, decode, ep, ed = make_pair(timeout=TIMEOUT_S, **delays)
    names = [s.name for s in prefill.shapes][:2]
    if kind == "read":
        engine = ed
        expected = kc.expected_after_copy(decode, prefill, [0, 1], [2, 3])
        ed.read("t", "prefill-0", [0, 1], [2, 3])
    else:
        engine = ep
        expected = kc.expected_after_copy(decode, prefill, [0, 1], [2, 3], layers=names)
        for name in names:
            ep.write_layer("t", name, "decode-0", [2, 3], [0, 1])
        ep.seal("t", "decode-0", expected_writes=len(names))
    event = engine.wait(["t"], timeout=10)["t"]
    at_event = decode.backing.copy()
    assert event.state == "timed_out"
    # Batches sleep 1.5 s, the event comes at 0.8 s: it must say the destination may change.
    assert event.drained is False, "timed out with batches in flight, but not quarantined"
    assert "quarantined" in event.message and "quarantined" in repr(event)
    assert engine.quarantined_transfers == 1
    drained: list[mn.DrainedTransfer] = []
    until = time.monotonic() + 10 * DELAY_MS / 1000
    while not drained and time.monotonic() < until:
        drained = engine.poll_drained()
        time.sleep(0.01)
    assert [(d.transfer_id, d.kind, d.peer) for d in drained] == [
        ("t", kind, "prefill-0" if kind == "read" else "decode-0")
    ]
    at_drain = decode.backing.copy()
    assert np.array_equal(at_drain, expected)  # drained: every operation has finished
    assert not np.array_equal(at_event, at_drain)  # bytes did land after the quarantined event
    assert _watch_unchanged(decode.backing, at_drain, WATCH_S) == 0
    assert engine.poll_drained() == [] and engine.quarantined_transfers == 0  # exactly once
    assert engine.poll_events(timeout=0.05) == []


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_transfer_that_drains_in_time_ends_drained_and_nothing_lands_later(kind: str) -> None:
    # One batch of 0.6 s against a 0.4 s deadline: past the deadline the event waits for the
    # batch (within the second period) and is final.
    delays = {"writer_delay_ms": 600} if kind == "write" else {"reader_delay_ms": 600}
    prefill, decode, ep, ed = make_pair(timeout=TIMEOUT_S, **delays)
    name = prefill.shapes[0].name
    if kind == "read":
        engine = ed
        ed.read("t", "prefill-0", [0], [2], layers=[name])
    else:
        engine = ep
        ep.write_layer("t", name, "decode-0", [2], [0])
        ep.seal("t", "decode-0", expected_writes=1)
    event = engine.wait(["t"], timeout=10)["t"]
    at_event = decode.backing.copy()
    assert (event.state, event.drained) == ("timed_out", True)
    assert _watch_unchanged(decode.backing, at_event, WATCH_S) == 0
    assert engine.poll_drained() == [] and engine.quarantined_transfers == 0
