"""A WRITE over UCX whose puts the transport never confirmed must not be reported as unable to
write any more.

A review (2026-12-05) stopped the decode process (SIGSTOP: alive, not progressing), wrote to it
over UCX's TCP transport and removed the peer: the writer ended the transfer ``failed`` with
``drained`` true ("nothing of it can write any more"), or, past its deadline, reported it by
``poll_drained``, yet all its bytes landed in the decode once it resumed -- into blocks the
decode would have freed and reused on that word. A put's own completion only frees the sender's
buffer, and closing the endpoint cancels only our side: what is in the peer's socket buffer is
applied when the peer gets to it. Now such a batch completes as unconfirmed: its transfer ends
quarantined and is never reported drained.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import numpy as np
import pytest

import moriio_native as mn

pytestmark = pytest.mark.ucx

PAGE = 4096
BLOCK = 16 * 64  # one MLA-like block of 16 tokens x 64 bytes
BLOCKS = 8
# TCP, and no same-host shortcut: the puts go through sockets, as between two hosts.
OPTIONS = {"ucx_tls": "tcp", "ucx_direct_copy": "off"}
SOURCE, UNTOUCHED = 0xAB, 5
WRITTEN = [1, 2, 3]


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % PAGE
    return raw[offset : offset + nbytes]


def _layers(buf: np.ndarray) -> list[mn.LayerRegistration]:
    view = buf.reshape(BLOCKS, 16, 64)
    spec = mn.CacheSpec(kind="mla", block_size=16, head_size=64, dtype_bytes=1)
    return [mn.LayerRegistration("L", view, spec, allocation=(buf.ctypes.data, buf.nbytes))]


def _decode_main(conn: Connection) -> None:
    engine = mn.Engine("decode", "ucx", OPTIONS)
    buf = _aligned(BLOCKS * BLOCK)
    buf[:] = UNTOUCHED
    conn.send((os.getpid(), engine.register_kv_caches(_layers(buf))))
    while conn.recv() == "dump":
        conn.send(bytes(buf))


@contextmanager
def stopped_decode(transfer_timeout: float) -> Iterator[tuple[mn.Engine, int, Connection]]:
    """A prefill engine connected to a decode process that is then stopped (SIGSTOP); the
    decode is resumed and ended on the way out, whatever happened."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_decode_main, args=(theirs,), daemon=True)
    child.start()
    stopped = False
    try:
        assert ours.poll(60), "the decode process did not start"
        pid, metadata = ours.recv()
        engine = mn.Engine("prefill", "ucx", OPTIONS, transfer_timeout=transfer_timeout)
        source = _aligned(BLOCKS * BLOCK)
        source[:] = SOURCE
        engine.register_kv_caches(_layers(source))
        engine.add_peer(metadata)
        # The connection is up before the stop, and the decode's region confirmed (a region
        # check precedes the first put: with the decode stopped it would never be answered,
        # and no put would be posted). Block 0 is not among those the tests write.
        engine.read("warm-up", "decode", [0], [0])
        engine.write_layer("warm-up-write", "L", "decode", [0], [0])
        engine.seal("warm-up-write", "decode", expected_writes=1)
        warm = engine.wait(["warm-up", "warm-up-write"], 30)
        assert {tid: event.state for tid, event in warm.items()} == {
            "warm-up": "done",
            "warm-up-write": "done",
        }
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        wait_stopped(pid)
        yield engine, pid, ours
    finally:
        if stopped:
            os.kill(child.pid or 0, signal.SIGCONT)
        ours.send("quit")
        child.join(10)
        if child.is_alive():
            child.kill()


def wait_stopped(pid: int) -> None:
    """Until ``pid`` is stopped (a signal is delivered asynchronously: a WRITE posted before the
    stop takes effect may complete in full)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s")


def landed_after_resume(pid: int, conn: Connection) -> int:
    """Resumes the decode and returns how many bytes of the WRITE reached its blocks."""
    os.kill(pid, signal.SIGCONT)
    time.sleep(1.0)  # its progress thread applies what its socket holds
    conn.send("dump")
    after = np.frombuffer(conn.recv(), dtype=np.uint8)
    return int((after[WRITTEN[0] * BLOCK : (WRITTEN[-1] + 1) * BLOCK] == SOURCE).sum())


def test_a_write_to_a_stopped_peer_ends_quarantined_when_the_peer_is_removed() -> None:
    with stopped_decode(transfer_timeout=30.0) as (engine, pid, conn):
        assert engine.write_layer("w", "L", "decode", WRITTEN, WRITTEN)
        engine.seal("w", "decode", expected_writes=1)
        time.sleep(0.5)  # the puts are in the decode's socket buffer
        engine.remove_peer("decode")
        event = engine.wait(["w"], 30)["w"]
        assert event.state == "failed" and not event.drained, event
        assert "could not confirm" in event.message
        assert engine.poll_drained() == []
        landed = landed_after_resume(pid, conn)
    # What the quarantine is for: the bytes did land after the writer's event.
    assert landed == len(WRITTEN) * BLOCK


def test_a_timed_out_write_to_a_stopped_peer_is_never_reported_drained() -> None:
    with stopped_decode(transfer_timeout=0.5) as (engine, pid, conn):
        engine.write_layer("w", "L", "decode", WRITTEN, WRITTEN)
        engine.seal("w", "decode", expected_writes=1)
        event = engine.wait(["w"], 30)["w"]
        assert event.state == "timed_out" and not event.drained, event
        engine.remove_peer("decode")
        deadline = time.monotonic() + 3.0
        drained: list[str] = []
        while time.monotonic() < deadline:
            engine.poll_events(timeout=0.05)
            drained += [notice.transfer_id for notice in engine.poll_drained()]
        assert "w" not in drained
        landed = landed_after_resume(pid, conn)
    assert landed == len(WRITTEN) * BLOCK
