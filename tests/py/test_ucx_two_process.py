"""The UCX backend through the Engine between two real processes.

Each process carves a mixed model (dense separated 5-D, dense interleaved, key-only latent
[N, B, D], standardized [B, H, N, C] views, kernel-block splits, padded pages) out of ONE shared
host backing, with a different physical layout on each side. Metadata travels through a
multiprocessing Pipe. READ and WRITE go over UCX in both directions, and every byte of the
destination backing -- gaps and untouched blocks included -- is compared with what plain numpy
indexing says it must be; the source backing must be unchanged.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.layout import geometry_of
from process_support import PipeChild

pytestmark = pytest.mark.ucx

NUM_BLOCKS = {"prefill": 12, "decode": 20}
SEEDS = {"prefill": 11, "decode": 22}
TIMEOUT = 60.0  # hang guard for one step, not a performance bound


def _caches(role: str, engine: mn.Engine | None = None) -> kc.KvCacheSet:
    """`role`'s caches; on memory the engine's backend allocated when `engine` is given."""
    caches = kc.build_caches(
        kc.mixed_model(role),  # type: ignore[arg-type]
        num_blocks=NUM_BLOCKS[role],
        allocate=engine.allocate_host_backing if engine else None,
    )
    kc.fill_random(caches, SEEDS[role])
    return caches


class GpuMirror:
    """A KvCacheSet's exact layout on ONE CUDA backing: every layer view at the same offset, with
    the same shape and strides, inside a device copy of the host backing."""

    def __init__(self, caches: kc.KvCacheSet) -> None:
        import torch

        self.caches = caches
        self.backing = torch.from_numpy(caches.backing).to("cuda")

    def registrations(self) -> list[mn.LayerRegistration]:
        host, dev = self.caches.backing.ctypes.data, self.backing.data_ptr()
        out = []
        for reg in self.caches.registrations():
            g = geometry_of(reg.tensor)
            gpu_view = mn.TensorGeometry(
                g.shape, g.strides, g.element_size, g.data_ptr - host + dev
            )
            out.append(
                mn.LayerRegistration(
                    reg.name,
                    gpu_view,
                    reg.spec,
                    allocation=(dev, self.backing.numel()),
                    memory="cuda",
                    device=0,
                )
            )
        return out

    def to_host(self) -> np.ndarray:
        return self.backing.cpu().numpy()


def _child_main(
    conn: Connection, role: str, options: dict[str, str], cuda: bool = False, allocate: bool = False
) -> None:
    """The other process: owns `role`'s caches (host, mirrored on the GPU, or on memory its UCX
    backend allocated) and engine; serves commands from the test."""
    engine = mn.Engine(f"{role}-child", "ucx", options)
    caches = _caches(role, engine if allocate else None)
    gpu = GpuMirror(caches) if cuda else None
    conn.send(engine.register_kv_caches(gpu.registrations() if gpu else caches.registrations()))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "add_peer":
                conn.send(engine.add_peer(arg))
            elif cmd == "dump":
                conn.send(gpu.to_host().tobytes() if gpu else caches.backing.tobytes())
            elif cmd == "refill":
                kc.fill_random(caches, SEEDS[role])
                if gpu:
                    gpu.backing.copy_(torch_from(caches.backing))
                conn.send(True)
            elif cmd == "read":
                tid, peer, local, remote = arg
                engine.read(tid, peer, local, remote)
                event = engine.wait([tid], timeout=TIMEOUT).get(tid)
                conn.send(None if event is None else (event.state, event.message, event.bytes))
            elif cmd == "quit":
                conn.send(True)
                return
        except mn.MoriioError as exc:  # report, keep serving
            conn.send(exc)


def torch_from(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(array)


class Child(PipeChild):
    """The test's handle on the other process."""

    def __init__(
        self, role: str, options: dict[str, str], cuda: bool = False, allocate: bool = False
    ) -> None:
        super().__init__(f"{role}-child", _child_main, (role, options, cuda, allocate), TIMEOUT)
        self.engine_id = f"{role}-child"
        self.metadata: bytes = self.answer()

    def backing(self) -> np.ndarray:
        return np.frombuffer(self.call("dump"), dtype=np.uint8)


# Default: cma zero-copy on this VM. posix,self: no cma, so UCX emulates RMA with active
# messages that only progress while the passive side's progress thread runs (emulation allowed
# explicitly: the backend disables it by default on machines with a CUDA driver).
OPTION_SETS = {
    "default": {},
    "emulated_rma": {"ucx_tls": "posix,self", "ucx_config": "PROTO_EMULATION_ENABLE=y"},
}


@pytest.fixture(params=list(OPTION_SETS), ids=list(OPTION_SETS))
def options(request: pytest.FixtureRequest) -> dict[str, str]:
    return dict(OPTION_SETS[request.param])


@pytest.fixture()
def prefill_child(options: dict[str, str]) -> Iterator[Child]:
    child = Child("prefill", options)
    yield child
    assert child.stop() == 0


@pytest.fixture()
def decode_child(options: dict[str, str]) -> Iterator[Child]:
    child = Child("decode", options)
    yield child
    assert child.stop() == 0


def test_decode_reads_from_prefill_process(prefill_child: Child, options: dict[str, str]) -> None:
    decode = _caches("decode")
    engine = mn.Engine("decode-0", "ucx", options)
    engine.register_kv_caches(decode.registrations())
    assert engine.add_peer(prefill_child.metadata) == "prefill-child"
    prefill_replica = _caches("prefill")  # same seed: the child's bytes

    local, remote = [19, 0, 5, 6, 7, 12], [3, 7, 1, 11, 0, 2]
    expected = kc.expected_after_copy(decode, prefill_replica, local, remote)
    assert not np.array_equal(decode.backing, expected)  # the transfer has something to do
    engine.read("req-r1", "prefill-child", local, remote)
    event = engine.wait(["req-r1"], timeout=TIMEOUT)["req-r1"]
    assert (event.kind, event.state) == ("read", "done"), event.message
    assert event.bytes == len(local) * prefill_replica.total_block_bytes()
    np.testing.assert_array_equal(decode.backing, expected)
    np.testing.assert_array_equal(prefill_child.backing(), prefill_replica.backing)

    # A second read into the same blocks from other remote blocks, only two layers.
    expected = kc.expected_after_copy(
        decode, prefill_replica, [0, 1], [10, 9], layers=["dense.2", "indexer.0"]
    )
    engine.read("req-r2", "prefill-child", [0, 1], [10, 9], layers=["dense.2", "indexer.0"])
    assert engine.wait(["req-r2"], timeout=TIMEOUT)["req-r2"].state == "done"
    np.testing.assert_array_equal(decode.backing, expected)


@pytest.mark.parametrize("call", ["write_layer", "write_layers"])
def test_prefill_writes_layer_by_layer_into_decode_process(
    decode_child: Child, options: dict[str, str], call: str
) -> None:
    """Every layer pushed, by a write_layer each or by one write_layers call (the layers
    batched together), then sealed: the decode process holds exactly the expected bytes."""
    prefill = _caches("prefill")
    engine = mn.Engine("prefill-0", "ucx", options)
    engine.register_kv_caches(prefill.registrations())
    assert engine.add_peer(decode_child.metadata) == "decode-child"
    decode_replica = _caches("decode")

    local, remote = [0, 1, 2, 11, 4], [2, 4, 8, 19, 0]
    expected = kc.expected_after_copy(decode_replica, prefill, remote, local)
    assert not np.array_equal(decode_replica.backing, expected)
    names = [shape.name for shape in prefill.shapes]
    if call == "write_layers":
        assert engine.write_layers("req-w", names, "decode-child", local, remote) is True
    else:
        for name in names:
            assert engine.write_layer("req-w", name, "decode-child", local, remote) is True
    engine.seal("req-w", "decode-child", expected_writes=len(names))
    event = engine.wait(["req-w"], timeout=TIMEOUT)["req-w"]
    assert (event.kind, event.state) == ("write", "done"), event.message
    assert event.bytes == len(local) * prefill.total_block_bytes()
    np.testing.assert_array_equal(decode_child.backing(), expected)
    np.testing.assert_array_equal(prefill.backing, _caches("prefill").backing)


def test_child_pulls_while_this_process_only_waits(
    decode_child: Child, options: dict[str, str]
) -> None:
    """This process (prefill) is the passive target: its Python thread blocks in a pipe read
    while the decode process reads from it."""
    prefill = _caches("prefill")
    engine = mn.Engine("prefill-0", "ucx", options)
    meta = engine.register_kv_caches(prefill.registrations())
    assert decode_child.call("add_peer", meta) == "prefill-0"
    decode_replica = _caches("decode")

    local, remote = [3, 4, 18, 9], [11, 0, 6, 5]
    expected = kc.expected_after_copy(decode_replica, prefill, local, remote)
    state, message, nbytes = decode_child.call("read", ("req-c", "prefill-0", local, remote))
    assert state == "done", message
    assert nbytes == len(local) * prefill.total_block_bytes()
    np.testing.assert_array_equal(decode_child.backing(), expected)


def test_bad_remote_blocks_fail_before_anything_moves(
    prefill_child: Child, options: dict[str, str]
) -> None:
    decode = _caches("decode")
    engine = mn.Engine("decode-0", "ucx", options)
    engine.register_kv_caches(decode.registrations())
    engine.add_peer(prefill_child.metadata)
    before = decode.backing.copy()
    with pytest.raises(mn.OutOfRangeError, match="remote block id 12"):
        engine.read("req-bad", "prefill-child", [0], [12])
    assert engine.poll_events(timeout=0.1) == []
    np.testing.assert_array_equal(decode.backing, before)


def _shared_memory_mappings() -> set[str]:
    """This process's mappings of shared-memory segments (sysv and /dev/shm), one line each."""
    with open("/proc/self/maps") as maps:
        return {line for line in maps if "/SYSV" in line or "/dev/shm/" in line}


def _mapped_since(before: set[str]) -> set[str]:
    """The shared-memory mappings added since ``before`` once they are gone, or those left after
    TIMEOUT (the backend closes a removed peer's endpoint on its thread after the call)."""
    deadline = time.monotonic() + TIMEOUT
    while (left := _shared_memory_mappings() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


@pytest.fixture()
def host_decode_engine() -> Iterator[mn.Engine]:
    """A decode engine over UCX on host caches, which live as long as the test."""
    decode = _caches("decode")
    engine = mn.Engine("decode-0", "ucx")
    engine.register_kv_caches(decode.registrations())
    yield engine


def _read_through_a_new_endpoint(
    engine: mn.Engine, child: Child, tid: str, before: set[str]
) -> None:
    """Adds ``child`` as a peer of ``engine`` and reads two blocks from it: its endpoint then
    maps the child's shared-memory segments, mappings ``before`` did not hold."""
    engine.add_peer(child.metadata)
    engine.read(tid, "prefill-child", [0, 1], [2, 3])
    assert engine.wait([tid], timeout=TIMEOUT)[tid].state == "done"
    assert _shared_memory_mappings() - before, "the endpoint mapped nothing to check"


@pytest.mark.parametrize("ending", ["removed", "killed, then removed"])
def test_removing_a_same_host_peer_closes_its_endpoint(
    ending: str, host_decode_engine: mn.Engine
) -> None:
    """A same-host peer's endpoint maps the peer's shared-memory segments into this process
    (and, with CUDA memory, its GPU memory). Removing the peer closes the endpoint, so they
    leave this process, also when the peer was killed first, and repeated adds and removals do
    not accumulate them. Before, UCX refused the forced close of an endpoint without
    peer-failure detection (every same-host one) and nothing was closed until the engine went:
    two segments stayed per add, and on the H200 a killed peer's 24 GiB of GPU memory stayed
    allocated (docs/reliability.md)."""
    engine = host_decode_engine
    child = Child("prefill", {})
    try:
        before = _shared_memory_mappings()
        for round_ in range(3):
            _read_through_a_new_endpoint(engine, child, f"req-ep-{round_}", before)
            if ending != "removed":
                child.proc.kill()
                child.proc.join(TIMEOUT)
            engine.remove_peer("prefill-child")
            assert _mapped_since(before) == set()
            if ending != "removed":
                break
    finally:
        child.stop()


def test_a_same_host_peer_that_dies_idle_is_failed_and_its_endpoint_closed(
    host_decode_engine: mn.Engine,
) -> None:
    """A same-host peer killed while nothing is in flight to it: without a remove_peer, the
    backend finds it gone (its liveness check, which covered only peers with operations in
    flight), closes its endpoint (its segments leave this process: on a GPU, the peer's memory
    is freed) and fails what is asked of it next, instead of reading or writing memory nobody
    owns any more."""
    engine = host_decode_engine
    child = Child("prefill", {})
    try:
        before = _shared_memory_mappings()
        _read_through_a_new_endpoint(engine, child, "req-idle-0", before)
        child.proc.kill()
        child.proc.join(TIMEOUT)
        assert _mapped_since(before) == set()
        engine.read("req-idle-1", "prefill-child", [0, 1], [2, 3])
        event = engine.wait(["req-idle-1"], timeout=TIMEOUT)["req-idle-1"]
        assert event.state == "failed", event
        assert "exited" in event.message, event
    finally:
        child.stop()


def _write_and_wait(
    engine: mn.Engine, tid: str, names: list[str], local: list[int], remote: list[int]
) -> None:
    assert engine.write_layers(tid, names, "decode-child", local, remote) is True
    engine.seal(tid, "decode-child", expected_writes=len(names))
    event = engine.wait([tid], timeout=TIMEOUT)[tid]
    assert event.state == "done", event.message


# UCX detects the peer's failure itself (PEER mode) and moves bytes over TCP only, as between
# two hosts: nothing but the connection tells this process that the peer is gone. TCP has no
# zero-copy put: UCX emulates it, which the backend allows only when asked on machines with a
# CUDA driver.
PEER_MODE_TCP = {
    "ucx_tls": "tcp",
    "ucx_error_handling": "peer",
    "ucx_direct_copy": "off",
    "ucx_config": "PROTO_EMULATION_ENABLE=y",
}


def test_a_write_to_a_same_host_peer_killed_mid_write_ends_drained() -> None:
    """A WRITE posted to a decode process that no longer answers (stopped), which is then
    killed: its puts were never confirmed, so on another host they might still land. On this
    host the decode's process is proven gone (its identity no longer reads back), so nothing of
    them can land in memory anyone owns: the WRITE fails drained and the prefill may reuse its
    blocks at once. Before, it ended unconfirmed (destination quarantined, never drained), and
    the connector kept the prefill's blocks for abort_timeout plus quarantine_timeout (12 s in
    the fault harness, 5 minutes by default)."""
    child = Child("decode", PEER_MODE_TCP)
    try:
        prefill = _caches("prefill")
        engine = mn.Engine("prefill-0", "ucx", PEER_MODE_TCP)
        engine.register_kv_caches(prefill.registrations())
        engine.add_peer(child.metadata)
        names = [shape.name for shape in prefill.shapes]
        local, remote = list(range(12)), list(range(12))
        _write_and_wait(engine, "req-connects", names, local, remote)  # the connection is up
        os.kill(child.proc.pid, signal.SIGSTOP)
        assert engine.write_layers("req-killed", names, "decode-child", local, remote) is True
        engine.seal("req-killed", "decode-child", expected_writes=len(names))
        assert engine.poll_events(timeout=0.5) == [], "the WRITE ended before its peer died"
        child.proc.kill()
        child.proc.join(TIMEOUT)
        event = engine.wait(["req-killed"], timeout=TIMEOUT)["req-killed"]
        assert event.state == "failed", event
        assert event.drained, event.message
        assert engine.quarantined_transfers == 0
    finally:
        child.stop()


def test_both_sides_on_backend_allocated_memory_read_and_write() -> None:
    """Backings allocated by UCX (shared memory): the peer maps them and copies with memcpy."""
    child = Child("prefill", {}, allocate=True)
    try:
        engine = mn.Engine("decode-0", "ucx")
        decode = _caches("decode", engine)
        engine.register_kv_caches(decode.registrations())
        engine.add_peer(child.metadata)
        child.call("add_peer", engine.local_metadata())
        prefill_replica = _caches("prefill")
        local, remote = [19, 0, 5, 6], [3, 7, 1, 11]
        expected = kc.expected_after_copy(decode, prefill_replica, local, remote)
        engine.read("alloc-r", "prefill-child", local, remote)
        assert engine.wait(["alloc-r"], timeout=TIMEOUT)["alloc-r"].state == "done"
        np.testing.assert_array_equal(decode.backing, expected)
        # WRITE from this process into the child's allocated memory.
        expected_child = kc.expected_after_copy(prefill_replica, decode, [2, 4], [0, 19])
        for shape in decode.shapes:
            assert engine.write_layer("alloc-w", shape.name, "prefill-child", [0, 19], [2, 4])
        engine.seal("alloc-w", "prefill-child", expected_writes=len(decode.shapes))
        assert engine.wait(["alloc-w"], timeout=TIMEOUT)["alloc-w"].state == "done"
        np.testing.assert_array_equal(child.backing(), expected_child)
    finally:
        assert child.stop() == 0


def test_unavailable_library_is_reported_not_raised_at_import() -> None:
    infos = {i.name: i for i in mn.available_backends({"ucx_library_path": "/no/such/ucx/lib"})}
    assert infos["ucx"].available is False
    assert "/no/such/ucx/lib" in infos["ucx"].reason
    with pytest.raises(mn.BackendUnavailableError, match="/no/such/ucx/lib"):
        mn.Engine("x", "ucx", {"ucx_library_path": "/no/such/ucx/lib"})


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize("stamps", ["on", "off"])
def test_mixed_layouts_in_gpu_memory_read_and_write(stamps: str) -> None:
    """Both processes hold their caches in CUDA memory (one device backing each, same mixed
    layouts as above): READ and WRITE over UCX (CUDA IPC on one node; the transposing cell kernel
    for the layer pairs of different axis orders, and for the others the stamping kernel, or with
    ucx_stamps off the gather/scatter kernel over the engine's runs), every byte of both backings
    checked."""
    options = {"ucx_stamps": stamps}
    prefill_child = Child("prefill", options, cuda=True)
    try:
        decode = _caches("decode")
        gpu = GpuMirror(decode)
        engine = mn.Engine("decode-0", "ucx", options)
        engine.register_kv_caches(gpu.registrations())
        assert engine.add_peer(prefill_child.metadata) == "prefill-child"
        prefill_replica = _caches("prefill")

        local, remote = [19, 0, 5, 6, 7, 12], [3, 7, 1, 11, 0, 2]
        expected = kc.expected_after_copy(decode, prefill_replica, local, remote)
        engine.read("req-gr", "prefill-child", local, remote)
        event = engine.wait(["req-gr"], timeout=TIMEOUT)["req-gr"]
        assert (event.kind, event.state) == ("read", "done"), event.message
        # dense.0-2 pair different axis orders (runs of single 16-byte cells): they move as
        # cells, one submit_cells per layer's geometry (three different ones).
        assert event.cell_batches == 3, event
        # The other layers in stamped batches (the stamping kernel), or none with it off.
        want_stamped = event.batches - 3 if stamps == "on" else 0
        assert event.stamped_batches == want_stamped, event
        assert event.batches > 3, event
        np.testing.assert_array_equal(gpu.to_host(), expected)
        np.testing.assert_array_equal(prefill_child.backing(), prefill_replica.backing)

        # WRITE back: decode pushes its (now updated) blocks into the prefill process.
        decode.backing[:] = gpu.to_host()
        engine.add_peer(prefill_child.metadata)  # same metadata again: a no-op
        expected_remote = kc.expected_after_copy(prefill_replica, decode, [4, 8], [2, 18])
        for shape in decode.shapes:
            assert engine.write_layer("req-gw", shape.name, "prefill-child", [2, 18], [4, 8])
        engine.seal("req-gw", "prefill-child", expected_writes=len(decode.shapes))
        event = engine.wait(["req-gw"], timeout=TIMEOUT)["req-gw"]
        assert (event.kind, event.state) == ("write", "done"), event.message
        assert event.cell_batches == 3, event  # one batch per layer
        want_stamped = len(decode.shapes) - 3 if stamps == "on" else 0
        assert event.stamped_batches == want_stamped, event
        np.testing.assert_array_equal(prefill_child.backing(), expected_remote)
    finally:
        assert prefill_child.stop() == 0


@pytest.fixture()
def cuda_decode_child() -> Iterator[Child]:
    """The decode process with its caches on the GPU (default options)."""
    child = Child("decode", {}, cuda=True)
    yield child
    assert child.stop() == 0


def _gpu_prefill_of(
    decode_child: Child, options: dict[str, str]
) -> tuple[kc.KvCacheSet, GpuMirror, mn.Engine]:
    """This process as a prefill with its caches on the GPU, `decode_child` added as a peer."""
    prefill = _caches("prefill")
    gpu = GpuMirror(prefill)
    engine = mn.Engine("prefill-0", "ucx", options)
    engine.register_kv_caches(gpu.registrations())
    assert engine.add_peer(decode_child.metadata) == "decode-child"
    return prefill, gpu, engine


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize("direct_copy", ["auto", "off"])
@pytest.mark.parametrize("call", ["write_layer", "write_layers"])
def test_each_layer_write_waits_for_its_cuda_event(
    cuda_decode_child: Child, call: str, direct_copy: str
) -> None:
    """``write_layer(..., cuda_event=...)`` right after enqueuing the work that produces the
    layer (here: ~0.1 s of spinning, then the new bytes copied in), as the vLLM connector does
    when the engine says it can: every layer's copy waits for its event, so the decode process
    receives the new bytes, never the ones that were there when the call came (without the
    events this test fails: the copies run during the spin). ``write_layers``: every layer in
    one call behind one event, each of its batches waiting for it. Direct copy ``auto``: the
    peer's memory is mapped into this process and the kernel waits on the GPU; ``off`` (the
    path of a peer on another node, over RDMA): the copies are UCX operations, which the
    progress thread posts once it saw the event complete (before, such a peer took no event)."""
    import torch

    prefill, gpu, engine = _gpu_prefill_of(cuda_decode_child, {"ucx_direct_copy": direct_copy})
    assert engine.waits_for_device_events("decode-child")
    produced = _caches("prefill")
    kc.fill_random(produced, 99)
    produced_on_gpu = torch_from(produced.backing).to("cuda")
    torch.cuda.synchronize()

    local, remote = [0, 1, 2, 11, 4], [2, 4, 8, 19, 0]
    # A first WRITE, without events, makes what the copies set up lazily (some of it
    # synchronises the whole device, which would order the copies below by accident).
    names = [shape.name for shape in prefill.shapes]
    if call == "write_layers":
        assert engine.write_layers("req-warm", names, "decode-child", [5], [5])
    else:
        for name in names:
            assert engine.write_layer("req-warm", name, "decode-child", [5], [5])
    engine.seal("req-warm", "decode-child", expected_writes=len(names))
    assert engine.wait(["req-warm"], timeout=TIMEOUT)["req-warm"].state == "done"
    warmed = _caches("decode")
    warmed.backing[:] = kc.expected_after_copy(warmed, prefill, [5], [5])
    expected = kc.expected_after_copy(warmed, produced, remote, local)
    torch.cuda._sleep(200_000_000)  # about 0.1 s at the H200's clock
    gpu.backing.copy_(produced_on_gpu)
    events = [torch.cuda.Event() for _ in (names if call == "write_layer" else [call])]
    if call == "write_layers":
        events[0].record()
        assert engine.write_layers(
            "req-ev", names, "decode-child", local, remote, events[0].cuda_event
        )
    else:
        for name, ev in zip(names, events, strict=True):
            ev.record()
            assert engine.write_layer("req-ev", name, "decode-child", local, remote, ev.cuda_event)
    engine.seal("req-ev", "decode-child", expected_writes=len(names))
    event = engine.wait(["req-ev"], timeout=TIMEOUT)["req-ev"]
    assert (event.kind, event.state) == ("write", "done"), event.message
    np.testing.assert_array_equal(cuda_decode_child.backing(), expected)


def _prefill_over_ucx_operations(decode_child: Child) -> tuple[kc.KvCacheSet, mn.Engine, str]:
    """This process as a prefill whose copies to `decode_child` are UCX operations
    (``ucx_direct_copy`` off: the path to a peer on another node), after one WRITE without an
    event (what the copies set up lazily); and its first layer's name."""
    prefill, _, engine = _gpu_prefill_of(decode_child, {"ucx_direct_copy": "off"})
    first = prefill.shapes[0].name
    assert engine.write_layer("req-warm", first, "decode-child", [5], [5])
    engine.seal("req-warm", "decode-child", expected_writes=1)
    assert engine.wait(["req-warm"], timeout=TIMEOUT)["req-warm"].state == "done"
    return prefill, engine, first


def _event_after_half_a_second() -> Any:
    """A CUDA event recorded on a side stream after about 0.5 s of spinning (a producer)."""
    import torch

    producer, ev = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(1_000_000_000)
        ev.record(producer)
    return ev


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs torch with a CUDA GPU")
def test_a_write_waiting_for_its_event_holds_up_no_other_transfer(
    cuda_decode_child: Child,
) -> None:
    """With the copies as UCX operations (``ucx_direct_copy`` off, as to a peer on another
    node) a layer whose event has not completed posts nothing, and only it waits: a transfer
    without an event to the same peer, called after it, ends ``done`` while the producer (a
    side stream spinning ~0.5 s) still runs; the first ends ``done`` once it finished; the
    decode holds both transfers' bytes."""
    prefill, engine, first = _prefill_over_ucx_operations(cuda_decode_child)
    ev = _event_after_half_a_second()
    assert engine.write_layer("req-waits", first, "decode-child", [0, 1], [2, 3], ev.cuda_event)
    engine.seal("req-waits", "decode-child", expected_writes=1)
    assert engine.write_layer("req-free", first, "decode-child", [2, 4], [8, 19])
    engine.seal("req-free", "decode-child", expected_writes=1)
    free = engine.wait(["req-free"], timeout=TIMEOUT)["req-free"]
    assert (free.kind, free.state) == ("write", "done"), free.message
    assert not ev.query(), "the producer finished first: the test proves nothing"
    waited = engine.wait(["req-waits"], timeout=TIMEOUT)["req-waits"]
    assert (waited.kind, waited.state) == ("write", "done"), waited.message
    assert ev.query()
    decode = _caches("decode")
    decode.backing[:] = cuda_decode_child.backing()
    for local, remote in (([5], [5]), ([0, 1], [2, 3]), ([2, 4], [8, 19])):
        moved = kc.expected_after_copy(decode, prefill, remote, local, layers=[first])
        np.testing.assert_array_equal(decode.backing, moved)  # those blocks hold the prefill's


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs torch with a CUDA GPU")
def test_a_write_waiting_for_its_event_ends_once_when_its_peer_is_removed(
    cuda_decode_child: Child,
) -> None:
    """With the copies as UCX operations (``ucx_direct_copy`` off) a layer waiting for its
    event is parked in the engine; removing the peer meanwhile ends the transfer at once (not
    after the producer's ~0.5 s), exactly once, and the parked batch never posts: once the
    producer finished, the decode's blocks still hold what they held."""
    _, engine, first = _prefill_over_ucx_operations(cuda_decode_child)
    before = cuda_decode_child.backing().copy()
    ev = _event_after_half_a_second()
    assert engine.write_layer("req-parked", first, "decode-child", [0, 1], [2, 3], ev.cuda_event)
    engine.seal("req-parked", "decode-child", expected_writes=1)
    engine.remove_peer("decode-child")
    ended = engine.wait(["req-parked"], timeout=TIMEOUT)["req-parked"]
    assert ended.state in ("failed", "aborted"), ended
    assert not ev.query(), "the producer finished first: the test proves nothing"
    ev.synchronize()
    assert engine.poll_events(timeout=0.2) == []  # no second event for it
    np.testing.assert_array_equal(cuda_decode_child.backing(), before)
