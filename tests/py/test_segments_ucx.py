"""Transfers with segments over UCX between real processes: every scenario of segments_support
(head slice, gather from two prefill ranks, block size 16 -> 64 and 64 -> 16, layer groups with
their own ids), READ and WRITE. This process is the decode; each prefill rank is a child
process holding its caches (rebuilt here from the same seed to compute the expected bytes).
Every byte of the decode backing is compared: window cells hold the source's bytes, all else is
unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection

import numpy as np
import pytest

import moriio_native as mn
from process_support import PipeChild
from segments_support import (
    SCENARIOS,
    Part,
    Scenario,
    Side,
    expected_decode,
    read_segments,
    write_segments,
    written_layers,
)

pytestmark = pytest.mark.ucx

TIMEOUT = 60.0  # hang guard for one step, not a performance bound


def _prefill_main(conn: Connection, engine_id: str, side: Side, layer_names: list[str]) -> None:
    """A prefill rank: registers its caches, then serves READs and runs the WRITEs it is sent."""
    engine = mn.Engine(engine_id, "ucx")
    caches = side.build()
    conn.send(engine.register_kv_caches(caches.registrations()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "add_peer":
                conn.send(engine.add_peer(arg))
            elif cmd == "write":
                tid, peer, parts = arg
                layers = written_layers(parts, layer_names)
                for layer in layers:
                    engine.write_layer(tid, layer, peer, segments=write_segments(parts, layer))
                engine.seal(tid, peer, expected_writes=len(layers))
                event = engine.wait([tid], timeout=TIMEOUT).get(tid)
                conn.send(None if event is None else (event.state, event.message))
            elif cmd == "quit":
                conn.send(True)
                return
        except mn.MoriioError as exc:  # report, keep serving
            conn.send(exc)


class Prefill(PipeChild):
    def __init__(self, engine_id: str, side: Side, layer_names: list[str]) -> None:
        super().__init__(engine_id, _prefill_main, (engine_id, side, layer_names), TIMEOUT)
        self.engine_id = engine_id
        self.metadata: bytes = self.answer()


@contextlib.contextmanager
def _ranks(scenario: Scenario) -> Iterator[list[Prefill]]:
    ranks = [
        Prefill(f"prefill-{rank}", side, scenario.layer_names())
        for rank, side in enumerate(scenario.prefills)
    ]
    try:
        yield ranks
    finally:
        assert [rank.stop() for rank in ranks] == [0] * len(ranks)


@pytest.fixture(params=SCENARIOS, ids=lambda s: s.name)
def world(request: pytest.FixtureRequest) -> Iterator[tuple[Scenario, list[Prefill]]]:
    with _ranks(request.param) as ranks:
        yield request.param, ranks


def _decode(scenario: Scenario, ranks: Sequence[Prefill]):  # type: ignore[no-untyped-def]
    decode = scenario.decode.build()
    engine = mn.Engine("decode", "ucx")
    meta = engine.register_kv_caches(decode.registrations())
    for rank in ranks:
        assert engine.add_peer(rank.metadata) == rank.engine_id
        assert rank.call("add_peer", meta) == "decode"
    replicas = [side.build() for side in scenario.prefills]  # same seeds: the ranks' bytes
    return decode, engine, replicas


def test_read_segments_over_ucx(world: tuple[Scenario, list[Prefill]]) -> None:
    scenario, ranks = world
    decode, engine, replicas = _decode(scenario, ranks)
    expected = expected_decode(decode, replicas, scenario.parts)
    assert not np.array_equal(decode.backing, expected)
    for rank, parts in zip(ranks, scenario.parts, strict=True):
        engine.read_segments(f"r-{rank.engine_id}", rank.engine_id, read_segments(parts))
    ids = [f"r-{rank.engine_id}" for rank in ranks]
    events = engine.wait(ids, timeout=TIMEOUT)
    for tid in ids:
        assert (events[tid].kind, events[tid].state) == ("read", "done"), events[tid].message
    np.testing.assert_array_equal(decode.backing, expected)


def test_write_segments_over_ucx(world: tuple[Scenario, list[Prefill]]) -> None:
    scenario, ranks = world
    decode, _engine, replicas = _decode(scenario, ranks)
    expected = expected_decode(decode, replicas, scenario.parts)
    for rank, parts in zip(ranks, scenario.parts, strict=True):
        state, message = rank.call("write", (f"w-{rank.engine_id}", "decode", parts))
        assert state == "done", message
    np.testing.assert_array_equal(decode.backing, expected)


def test_overlapping_write_segments_are_refused_in_the_writer() -> None:
    scenario = next(s for s in SCENARIOS if s.name == "gather")
    with _ranks(scenario) as ranks:
        decode, _engine, _ = _decode(scenario, ranks)
        before = decode.backing.copy()
        overlapping = (
            Part(("attn.0",), (5,), (1,), decode_window=mn.CellWindow(0, 4)),
            Part(("attn.0",), (5,), (2,), decode_window=mn.CellWindow(2, 4)),
        )
        with pytest.raises(mn.InvalidArgumentError, match="both write remote block 5"):
            ranks[0].call("write", ("w-bad", "decode", overlapping))
        np.testing.assert_array_equal(decode.backing, before)
