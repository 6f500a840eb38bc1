"""UCX endpoints and memory across an engine's life, two processes on one host: a peer that
reads from us by push READ, a READ after the owner's engine was destroyed in a living process,
and an engine on its own allocated memory freed once dropped. Found by a review of the UCX
backend (2026-12-07); each failed before its fix (the use after free of a kept endpoint's
handler argument is ucx_backend_test's UcxKeptEndpoint, seen under ASan)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest

import moriio_native as mn

pytestmark = pytest.mark.ucx

PAGE = 4096
BLOCK = 16 * 64
BLOCKS = 1400
TIMEOUT = 30.0


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % PAGE
    return raw[offset : offset + nbytes]


def _layers(buf: np.ndarray) -> list[mn.LayerRegistration]:
    view = buf.reshape(BLOCKS, 16, 64)
    spec = mn.CacheSpec(kind="mla", block_size=16, head_size=64, dtype_bytes=1)
    return [mn.LayerRegistration("L", view, spec, allocation=(buf.ctypes.data, buf.nbytes))]


def _pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def _engines_main(conn: Connection, names: list[str], options: dict[str, str]) -> None:
    """A child that owns one engine per name (each with its own UCX worker) over UCX on small
    host caches and serves commands."""
    engines = {}
    buffers = []
    metadata = {}
    for name in names:
        engines[name] = mn.Engine(name, "ucx", options, transfer_timeout=15.0)
        buf = _aligned(BLOCKS * BLOCK)
        buf[:] = _pattern(buf.size)
        buffers.append(buf)
        metadata[name] = engines[name].register_kv_caches(_layers(buf))
    conn.send((os.getpid(), metadata))
    while True:
        command, arg = conn.recv()
        try:
            if command == "quit":
                conn.send(True)
                return
            if command == "ping":
                conn.send("pong")
            elif command == "add_peer":
                name, meta = arg
                conn.send(engines[name].add_peer(meta))
            elif command == "remove_peer":
                name, peer = arg
                conn.send(engines[name].remove_peer(peer))
            elif command == "sockets":  # this process's open sockets
                conn.send(
                    sum(
                        os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
                        for fd in os.listdir("/proc/self/fd")
                        if os.path.exists(f"/proc/self/fd/{fd}")
                    )
                )
            elif command == "drop":  # the engine and its UCX worker go; the process stays
                del engines[arg]
                import gc

                gc.collect()
                conn.send(True)
            elif command == "read":
                name, tid, peer = arg
                engines[name].read(tid, peer, [0, 1], [2, 3])
                event = engines[name].wait([tid], timeout=TIMEOUT).get(tid)
                conn.send(None if event is None else (event.state, event.message))
        except mn.MoriioError as exc:
            conn.send(exc)


class _EnginesChild:
    def __init__(self, names: list[str], options: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_engines_main, args=(theirs, names, options), daemon=True)
        self.proc.start()
        theirs.close()
        assert self.conn.poll(60), f"{names} did not start"
        self.pid, self.metadata = self.conn.recv()

    def call(self, command: str, arg: object = None, timeout: float = TIMEOUT) -> object:
        self.conn.send((command, arg))
        assert self.conn.poll(timeout), f"no answer to {command} (exit code {self.proc.exitcode})"
        out = self.conn.recv()
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("quit", None))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def test_adding_and_removing_a_peer_that_reads_from_us_leaks_no_endpoint() -> None:
    """B reads from A by push READ (TCP, as between two hosts), so A holds an endpoint back to B
    as B's push reader. A then adds and removes B again and again (remove_idle_peer, a
    handshake's retry): each removal must close A's endpoint to B. Before, each one was kept
    open for good (CloseReleasedEndpoints: the push reader's endpoint reaches the same process),
    a connection and its socket more per round for as long as B lives."""
    options = {"ucx_tls": "tcp", "ucx_direct_copy": "off"}
    a = _EnginesChild(["a"], options)
    b = _EnginesChild(["b"], options)
    try:
        assert b.call("add_peer", ("b", a.metadata["a"])) == "a"
        state, message = b.call("read", ("b", "r-b", "a"))  # type: ignore[misc]
        assert state == "done", message
        counts = []
        for _ in range(6):
            assert a.call("add_peer", ("a", b.metadata["b"])) == "b"
            a.call("remove_peer", ("a", "b"))
            time.sleep(0.3)  # the endpoint closes on A's progress thread after the call
            counts.append(a.call("sockets"))
        assert counts[-1] <= counts[0], f"A's open sockets after each add and remove: {counts}"
    finally:
        b.close()
        a.close()


def _allocated_main(conn: Connection, options: dict[str, str]) -> None:
    """A prefill whose caches live on memory its UCX backend allocated (shared memory a
    same-host peer maps and copies with memcpy); "drop" destroys the engine, and that memory
    with it, while the process lives on."""
    import gc

    engine = mn.Engine("prefill", "ucx", options)
    buf = engine.allocate_host_backing(BLOCKS * BLOCK)
    buf[:] = _pattern(buf.size)
    conn.send((os.getpid(), engine.register_kv_caches(_layers(buf))))
    while (command := conn.recv()) != "quit":
        if command == "drop":
            del engine, buf
            gc.collect()
            conn.send(True)
    conn.send(True)


def test_a_read_from_an_engine_destroyed_in_a_living_process_is_not_done() -> None:
    """The decode READs from a prefill whose KV caches live on backend-allocated shared memory
    (the direct-copy path: memcpy through the decode's mapping of that memory). The prefill's
    engine is then destroyed (its registrations, its allocation and its UCX worker go) while
    its process lives on. A READ from it afterwards reads nothing anyone owns: it must not end
    'done' (on the batched-cma path, with the same caches on plain memory, it fails: the
    prefill's table of registered regions no longer holds the range)."""
    options: dict[str, str] = {}
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_allocated_main, args=(theirs, options), daemon=True)
    child.start()
    try:
        assert ours.poll(60), "the prefill process did not start"
        _pid, metadata = ours.recv()
        engine = mn.Engine("decode", "ucx", options, transfer_timeout=10.0)
        dest = _aligned(BLOCKS * BLOCK)
        engine.register_kv_caches(_layers(dest))
        engine.add_peer(metadata)
        engine.read("r0", "prefill", [0, 1], [2, 3])
        event = engine.wait(["r0"], timeout=TIMEOUT)["r0"]
        assert event.state == "done", event.message
        ours.send("drop")
        assert ours.poll(30) and ours.recv() is True
        dest[:] = 0
        engine.read("r1", "prefill", [4, 5], [6, 7])
        event = engine.wait(["r1"], timeout=TIMEOUT)["r1"]
        assert event.state != "done", (
            "READ from a destroyed engine's memory ended done; bytes landed: "
            f"{int(np.count_nonzero(dest))}"
        )
    finally:
        ours.send("quit")
        child.join(10)
        if child.is_alive():
            child.kill()


def test_an_engine_on_memory_it_allocated_is_freed_once_dropped() -> None:
    """The arrays of ``allocate_host_backing`` kept the Python engine alive and the engine kept
    its registered layers (views of them): a cycle through a ctypes buffer, which the garbage
    collector cannot see, so the engine, its progress thread and its shared memory stayed for
    the process's life."""
    import gc
    import weakref

    engine = mn.Engine("owner", "ucx", {})
    buf = engine.allocate_host_backing(BLOCKS * BLOCK)
    engine.register_kv_caches(_layers(buf))
    dropped = weakref.ref(engine)
    del engine, buf
    gc.collect()
    assert dropped() is None, "an engine registered on memory it allocated was never freed"


def test_registered_memory_of_another_owner_lives_as_long_as_the_engine_serves_it() -> None:
    """An engine registered on its own allocated memory and on a caller's array: once the
    engine object and the caller's array are dropped while the allocated array lives on, the
    native engine still serves both registrations, so the caller's memory must live too. Seen
    failing with the first fix of the cycle above (the allocated arrays kept the native engine
    alone, and the caller's memory was freed under its registration)."""
    import gc
    import weakref

    engine = mn.Engine("owner", "ucx", {})
    buf = engine.allocate_host_backing(BLOCKS * BLOCK)
    other = _aligned(BLOCKS * BLOCK)
    (own,) = _layers(buf)
    theirs = mn.LayerRegistration(
        "M", other.reshape(own.tensor.shape), own.spec, allocation=(other.ctypes.data, other.nbytes)
    )
    layers = [own, theirs]
    engine.register_kv_caches(layers)
    owner = other
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    freed = weakref.ref(owner)
    keeper = weakref.ref(engine._keeper)
    del engine, other, owner, layers, own, theirs
    gc.collect()
    assert keeper() is not None and keeper().native is not None  # the engine still serves
    assert freed() is not None, "registered memory freed while its engine still serves it"
    del buf
    gc.collect()
    assert keeper() is None and freed() is None  # all of it goes once the last array does
