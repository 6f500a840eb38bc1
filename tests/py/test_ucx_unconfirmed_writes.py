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

Only a peer whose process is proven gone ends such a WRITE drained (nothing of it can land in
memory anyone owns). A second review (2026-12-06) found that a live peer whose memory this
process may no longer read (it made itself non-dumpable) was taken for dead: any refused read
of its identity counted as its exit.

The same stopped peer shows how long the region check before a region's first put waits for its
answer: the engine's transfer_timeout, not a fixed 5 s (under `vllm serve` at TP 2 on a loaded
2-core machine a restarted prefill's first WRITEs failed so, ahead of their 30 s deadline).
"""

from __future__ import annotations

import ctypes
import errno
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


_LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_DUMPABLE = 4


def _decode_main(conn: Connection, options: dict[str, str]) -> None:
    engine = mn.Engine("decode", "ucx", options)
    buf = _aligned(BLOCKS * BLOCK)
    buf[:] = UNTOUCHED
    conn.send((os.getpid(), engine.register_kv_caches(_layers(buf))))
    while (command := conn.recv()) != "quit":
        if command == "dump":
            conn.send(bytes(buf))
        elif command == "no-dump":  # its memory no longer readable by a process without
            conn.send(_LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0))  # CAP_SYS_PTRACE


@contextmanager
def stopped_decode(
    transfer_timeout: float,
    options: dict[str, str] = OPTIONS,
    non_dumpable: bool = False,
    warm_up: bool = True,
) -> Iterator[tuple[mn.Engine, int, Connection]]:
    """A prefill engine connected to a decode process that is then stopped (SIGSTOP); the
    decode is resumed and ended on the way out, whatever happened. ``non_dumpable``: before
    the stop, the decode makes itself non-dumpable (after the connect proved its identity).
    ``warm_up`` false: nothing moved before the stop, so the decode's region is not confirmed
    yet and the first put waits for its region check."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_decode_main, args=(theirs, options), daemon=True)
    child.start()
    stopped = False
    try:
        assert ours.poll(60), "the decode process did not start"
        pid, metadata = ours.recv()
        engine = mn.Engine("prefill", "ucx", options, transfer_timeout=transfer_timeout)
        source = _aligned(BLOCKS * BLOCK)
        source[:] = SOURCE
        engine.register_kv_caches(_layers(source))
        engine.add_peer(metadata)
        if warm_up:
            _warm_up(engine)
        if non_dumpable:
            ours.send("no-dump")
            assert ours.recv() == 0
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


def _warm_up(engine: mn.Engine) -> None:
    """The connection up and the decode's region confirmed (a region check precedes the first
    put: with the decode stopped it is answered only once it runs again, and no put is posted
    meanwhile). Block 0 is not among those the tests write."""
    engine.read("warm-up", "decode", [0], [0])
    engine.write_layer("warm-up-write", "L", "decode", [0], [0])
    engine.seal("warm-up-write", "decode", expected_writes=1)
    warm = engine.wait(["warm-up", "warm-up-write"], 30)
    assert {tid: event.state for tid, event in warm.items()} == {
        "warm-up": "done",
        "warm-up-write": "done",
    }


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


def test_a_region_check_answered_after_5_s_lets_the_first_write_land() -> None:
    with stopped_decode(transfer_timeout=30.0, warm_up=False) as (engine, pid, conn):
        engine.write_layer("w", "L", "decode", WRITTEN, WRITTEN)
        engine.seal("w", "decode", expected_writes=1)
        time.sleep(7.0)  # past the 5 s a region check used to wait, within transfer_timeout
        os.kill(pid, signal.SIGCONT)
        event = engine.wait(["w"], 30)["w"]
        assert event.state == "done", event
        landed = landed_after_resume(pid, conn)
    assert landed == len(WRITTEN) * BLOCK


def test_a_write_waiting_behind_an_unanswered_check_gets_its_own_timeout() -> None:
    """A WRITE that waits behind the region check another one started 4 s before it: that check
    times out at its 8 s (a review found every batch parked behind it failed with it, this one
    4 s before its own deadline), and this one checks again and lands once the decode runs."""
    with stopped_decode(transfer_timeout=8.0, warm_up=False) as (engine, pid, conn):
        started = time.monotonic()
        engine.write_layer("first", "L", "decode", [1], [1])
        engine.seal("first", "decode", expected_writes=1)
        time.sleep(4.0)
        engine.write_layer("w", "L", "decode", WRITTEN[1:], WRITTEN[1:])
        engine.seal("w", "decode", expected_writes=1)
        time.sleep(max(0.0, started + 9.0 - time.monotonic()))  # the first check has timed out
        os.kill(pid, signal.SIGCONT)
        events = engine.wait(["first", "w"], 30)
        assert events["first"].state != "done", events["first"]
        assert events["w"].state == "done", events["w"]
        landed = landed_after_resume(pid, conn)
    assert landed == len(WRITTEN[1:]) * BLOCK  # nothing of the first moved


CAP_SYS_PTRACE = 19
_CAP_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _set_ptrace_capability(on: bool) -> None:
    """This thread's effective CAP_SYS_PTRACE on or off (threads it starts inherit it)."""
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    assert _LIBC.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
    word, bit = divmod(CAP_SYS_PTRACE, 32)
    if on:
        data[word].effective |= data[word].permitted & (1 << bit)
    else:
        data[word].effective &= ~(1 << bit) & 0xFFFFFFFF
    assert _LIBC.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()


@contextmanager
def without_ptrace_capability() -> Iterator[None]:
    """Engines made inside run without CAP_SYS_PTRACE (as in a default container): a
    non-dumpable process's memory is then refused to them."""
    _set_ptrace_capability(False)
    try:
        yield
    finally:
        _set_ptrace_capability(True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _read_errno(pid: int) -> int:
    """The errno of a 1-byte process_vm_readv of ``pid`` (EFAULT, address 8: permitted)."""
    buf = ctypes.create_string_buffer(1)
    local, remote = _Iovec(ctypes.addressof(buf), 1), _Iovec(8, 1)
    _LIBC.process_vm_readv.restype = ctypes.c_ssize_t
    n = _LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return 0 if n >= 0 else ctypes.get_errno()


@pytest.mark.parametrize("error_handling", ["peer", "none"])
def test_a_live_peer_whose_memory_may_no_longer_be_read_is_not_taken_for_dead(
    error_handling: str,
) -> None:
    """The decode makes itself non-dumpable after the connect, and the prefill holds no
    CAP_SYS_PTRACE: every read of the decode's identity is refused (EPERM), which proves
    nothing about its death. A WRITE to it (stopped, alive), then the peer removed: the WRITE
    ends quarantined, and its bytes do land once the decode resumes. Before, a refused read
    counted as the peer's exit: in PEER mode the WRITE ended drained (its blocks free for
    reuse) and without it the liveness check failed the live peer ("exited with UCX
    operations in flight to it"). Without PEER mode UCX never ends the puts to a stopped peer,
    so there the WRITE ends at its deadline (a short one here), quarantined all the same."""
    options = {**OPTIONS, "ucx_error_handling": error_handling}
    deadline = 30.0 if error_handling == "peer" else 2.0
    with (
        without_ptrace_capability(),
        stopped_decode(deadline, options, non_dumpable=True) as (engine, pid, conn),
    ):
        assert _read_errno(pid) == errno.EPERM, "the decode's memory is still readable"
        assert engine.write_layer("w", "L", "decode", WRITTEN, WRITTEN)
        engine.seal("w", "decode", expected_writes=1)
        time.sleep(1.5)  # the puts are in the decode's socket buffer; a liveness check ran
        engine.remove_peer("decode")
        event = engine.wait(["w"], 30)["w"]
        assert event.state in ("failed", "timed_out") and not event.drained, event
        assert "exited" not in event.message, event
        landed = landed_after_resume(pid, conn)
    assert landed == len(WRITTEN) * BLOCK
