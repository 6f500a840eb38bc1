"""The control-plane benchmark runs end to end: every exchange answered and checked."""

from __future__ import annotations

import argparse

from moriio_native.bench import control


def test_every_exchange_is_measured_with_and_without_hmac() -> None:
    args = argparse.Namespace(iterations=20, handshakes=5, blocks=16, metadata_bytes=1000)
    for hmac in (False, True):
        rows = control.measure(hmac, args)
        assert [r.exchange for r in rows] == [
            "raw zmq echo",
            "remote_blocks -> write_done",
            "handshake",
            "hold check",
            "hold check, late",
        ]
        assert [r.samples for r in rows] == [20, 20, 5, 5, 5]
        assert all(r.hmac is hmac and 0 < r.p50_us <= r.p99_us <= r.max_us for r in rows)
