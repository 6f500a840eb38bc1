"""Transfers with segments through the loopback backend: head ranges (heterogeneous TP: a slice,
a gather from two peers), token ranges (prefill block 16 into decode block 64 and back) and
layer groups with their own block ids, in READ and WRITE. Every byte of the decode backing is
compared with plain numpy indexing (segments_support.expected_decode): window cells must hold
the source's bytes, everything else (other heads and tokens of the same blocks, other blocks,
the gaps between layers) must be unchanged. Refusals create no transfer."""

from __future__ import annotations

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc
from segments_support import (
    SCENARIOS,
    Part,
    Scenario,
    expected_decode,
    read_segments,
    write_segments,
    written_layers,
)

TIMEOUT = 10.0


def _connect(scenario: Scenario):  # type: ignore[no-untyped-def]
    decode = scenario.decode.build()
    prefills = [side.build() for side in scenario.prefills]
    ed = mn.Engine("decode", "loopback")
    meta_d = ed.register_kv_caches(decode.registrations())
    engines = []
    for rank, caches in enumerate(prefills):
        ep = mn.Engine(f"prefill-{rank}", "loopback")
        assert ed.add_peer(ep.register_kv_caches(caches.registrations())) == f"prefill-{rank}"
        assert ep.add_peer(meta_d) == "decode"
        engines.append(ep)
    return decode, prefills, ed, engines


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_read_segments_move_exactly_the_windows(scenario: Scenario) -> None:
    decode, prefills, ed, _ = _connect(scenario)
    expected = expected_decode(decode, prefills, scenario.parts)
    before = [p.backing.copy() for p in prefills]
    for rank, parts in enumerate(scenario.parts):
        ed.read_segments(f"read-{rank}", f"prefill-{rank}", read_segments(parts))
    ids = [f"read-{rank}" for rank in range(len(scenario.parts))]
    events = ed.wait(ids, timeout=TIMEOUT)
    for tid in ids:
        assert events[tid].state == "done", events[tid].message
    assert ed.poll_events(timeout=0.05) == []  # one event per transfer
    assert np.array_equal(decode.backing, expected)
    assert not np.array_equal(decode.backing, scenario.decode.build().backing)
    for prefill, old in zip(prefills, before, strict=True):
        assert np.array_equal(prefill.backing, old)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_write_segments_move_exactly_the_windows(scenario: Scenario) -> None:
    decode, prefills, _, engines = _connect(scenario)
    expected = expected_decode(decode, prefills, scenario.parts)
    for ep, parts in zip(engines, scenario.parts, strict=True):
        layers = written_layers(parts, scenario.layer_names())
        for layer in layers:
            assert ep.write_layer("push", layer, "decode", segments=write_segments(parts, layer))
        ep.seal("push", "decode", expected_writes=len(layers))
        event = ep.wait(["push"], timeout=TIMEOUT)["push"]
        assert event.state == "done", event.message
    assert np.array_equal(decode.backing, expected)


def test_events_count_every_window_byte() -> None:
    scenario = next(s for s in SCENARIOS if s.name == "head_slice")
    decode, _, ed, _ = _connect(scenario)
    parts = scenario.parts[0]
    ed.read_segments("bytes", "prefill-0", read_segments(parts))
    event = ed.wait(["bytes"], timeout=TIMEOUT)["bytes"]
    per_block = sum(
        decode.shape(name).block_bytes()
        for part in parts
        for name in (part.layers or scenario.layer_names())
    )
    assert event.bytes == 3 * per_block  # three block pairs, the decode's whole (4-head) blocks


def _refused(ed: mn.Engine, error: type[Exception], match: str, segments) -> None:  # type: ignore[no-untyped-def]
    pending = ed.pending_transfers
    with pytest.raises(error, match=match):
        ed.read_segments("refused", "prefill-0", segments)
    assert ed.pending_transfers == pending
    assert ed.poll_events(timeout=0.05) == []


def test_bad_segments_are_refused_and_create_no_transfer() -> None:
    scenario = next(s for s in SCENARIOS if s.name == "head_slice")
    decode, _, ed, _ = _connect(scenario)
    before = decode.backing.copy()
    # Two segments writing the same local cells: block 2's heads overlap.
    _refused(
        ed,
        mn.InvalidArgumentError,
        r"segments 0 and 1 both write local block 2 of layer 'attn\.0'.*heads \[0,3\) of 4.*"
        r"heads \[2,4\) of 4",
        [
            mn.BlockSegment([2], [1], ["attn.0"], mn.CellWindow(0, 3), mn.CellWindow(4, 3)),
            mn.BlockSegment([2], [2], ["attn.0"], mn.CellWindow(2, 2), mn.CellWindow(6, 2)),
        ],
    )
    # The same block, disjoint head windows: fine (checked below by a successful read).
    ok = [
        mn.BlockSegment([2], [1], ["attn.0"], mn.CellWindow(0, 2), mn.CellWindow(4, 2)),
        mn.BlockSegment([2], [2], ["attn.0"], mn.CellWindow(2, 2), mn.CellWindow(6, 2)),
    ]
    # A remote window outside the peer's 8-head block.
    _refused(
        ed,
        mn.InvalidArgumentError,
        r"segment 0: remote: layer 'attn\.1': window heads \[6,10\) of 8",
        [mn.BlockSegment([1], [1], ["attn.1"], remote_window=mn.CellWindow(6, 4))],
    )
    # A local token window outside the 16-token block.
    _refused(
        ed,
        mn.InvalidArgumentError,
        r"segment 1: layer 'mla\.0': window heads \[0,1\) of 1, tokens \[8,24\) of 16",
        [
            mn.BlockSegment([0], [0], ["attn.0"], remote_window=mn.CellWindow(4)),
            mn.BlockSegment([1], [1], ["mla.0"], mn.CellWindow(token_begin=8, tokens=16)),
        ],
    )
    # Whole blocks of layers whose heads differ, windows that hold other head counts.
    _refused(
        ed,
        mn.IncompatiblePeerError,
        r"segment 0: peer 'prefill-0': layer 'attn\.0'.*hold different content",
        [mn.BlockSegment([1], [1], ["attn.0"])],
    )
    _refused(
        ed,
        mn.IncompatiblePeerError,
        r"the windows hold 4 and 2 heads",
        [mn.BlockSegment([1], [1], ["attn.0"], remote_window=mn.CellWindow(0, 2))],
    )
    # Ids past the peer's registered blocks; an unknown layer.
    _refused(
        ed,
        mn.OutOfRangeError,
        r"segment 0: remote block id 6 out of range for layer 'mla\.0'",
        [mn.BlockSegment([1], [6], ["mla.0"])],
    )
    _refused(
        ed,
        mn.NotFoundError,
        r"segment 0: unknown layer 'nope'",
        [mn.BlockSegment([1], [1], ["nope"])],
    )
    with pytest.raises(mn.InvalidArgumentError, match="segment 0: expected a BlockSegment"):
        ed.read_segments("refused", "prefill-0", [([1], [1])])  # type: ignore[list-item]
    assert np.array_equal(decode.backing, before)
    ed.read_segments("refused", "prefill-0", ok)  # the id was never taken
    assert ed.wait(["refused"], timeout=TIMEOUT)["refused"].state == "done"


def test_write_layer_segment_refusals() -> None:
    scenario = next(s for s in SCENARIOS if s.name == "gather")
    decode, _, _, engines = _connect(scenario)
    ep = engines[0]
    before = decode.backing.copy()
    overlapping = [
        mn.BlockSegment([1], [5], remote_window=mn.CellWindow(0, 4)),
        mn.BlockSegment([2], [5], remote_window=mn.CellWindow(3, 4)),
    ]
    with pytest.raises(
        mn.InvalidArgumentError, match=r"segments 0 and 1 both write remote block 5"
    ):
        ep.write_layer("w", "attn.0", "decode", segments=overlapping)
    assert ep.wait(["w"], timeout=TIMEOUT)["w"].state == "failed"  # a refused layer fails it
    with pytest.raises(mn.InvalidArgumentError, match="not both"):
        ep.write_layer("w2", "attn.0", "decode", [1], [5], segments=overlapping)
    with pytest.raises(mn.InvalidArgumentError, match="required"):
        ep.write_layer("w2", "attn.0", "decode")
    with pytest.raises(mn.InvalidArgumentError, match="segment 0: a write_layer segment names no"):
        ep.write_layer(
            "w3", "attn.0", "decode", segments=[mn.BlockSegment([1], [5], layers=["attn.0"])]
        )
    assert np.array_equal(decode.backing, before)
    assert ep.pending_transfers == 0


def test_plan_block_copies_with_windows_matches_the_engine_reference() -> None:
    prefill = kc.build_caches(
        [kc.LayerShape("a", "separated_nhd", block_size=16, head_size=8, num_heads=8)], 4
    )
    decode = kc.build_caches(
        [kc.LayerShape("a", "interleaved_hnd", block_size=16, head_size=8, num_heads=4)], 4
    )
    kc.fill_random(prefill, 1)
    kc.fill_random(decode, 2)
    lp = mn.describe_layer("a", prefill.views["a"], prefill.shapes[0].spec())
    ld = mn.describe_layer("a", decode.views["a"], decode.shapes[0].spec())
    window = mn.CellWindow(head_begin=4)
    plan = mn.plan_block_copies(ld, lp, [3, 0], [1, 2], remote_window=window)
    assert mn.block_template(ld, lp, mn.CellWindow(), window) is mn.block_template(
        ld, lp, mn.CellWindow(), window
    )
    got = decode.backing.copy()
    d0, p0 = decode.offsets["a"], prefill.offsets["a"]
    for lo, ro, size in plan.runs():
        got[d0 + lo : d0 + lo + size] = prefill.backing[p0 + ro : p0 + ro + size]
    parts = ((Part(None, (3, 0), (1, 2), prefill_window=window),),)
    assert np.array_equal(got, expected_decode(decode, [prefill], parts))
    with pytest.raises(mn.IncompatiblePeerError):
        mn.plan_block_copies(ld, lp, [0], [0])  # whole blocks of 4 and 8 heads
