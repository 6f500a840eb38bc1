"""The engine facade's edges: the tensors it keeps, a quarantined transfer that outlived its
terminal record, and arguments refused by name rather than by pybind11 or Python. Found by a
review of the engine core (2026-12-07); each test failed before its fix. Loopback only."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc


def _pair(**decode_kwargs):  # type: ignore[no-untyped-def]
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=4)
    ep = mn.Engine("p", "loopback")
    ed = mn.Engine("d", "loopback", **decode_kwargs)
    ep.register_kv_caches(prefill.registrations())
    ed.register_kv_caches(decode.registrations())
    ed.add_peer(ep.local_metadata())
    ep.add_peer(ed.local_metadata())
    return prefill, decode, ep, ed


def test_registering_from_an_iterator_keeps_the_tensors_alive() -> None:
    """register_kv_caches promises "The engine keeps the layers' tensors alive", but it keeps
    tuple(layers) AFTER consuming `layers` for the native call: an iterator (a generator
    expression) leaves nothing kept, and the registered memory is freed while peers may still
    read and write it."""
    cache = kc.build_caches(kc.mixed_model("decode"), num_blocks=4)
    owner = cache.backing
    while isinstance(owner.base, np.ndarray):  # the array that owns the memory
        owner = owner.base
    backing = weakref.ref(owner)
    del owner
    engine = mn.Engine("d", "loopback")
    engine.register_kv_caches(reg for reg in cache.registrations())
    del cache
    gc.collect()
    assert backing() is not None, "registered memory was freed while the engine holds it"


def _quarantined_read_forgotten(ed: mn.Engine) -> None:
    """READ 'a' ends timed out while its batches run (quarantined); a second transfer then
    pushes 'a' out of the terminal history (terminal_history=1) while it is still quarantined."""
    ed.read("a", "p", [0], [0])
    event = ed.wait(["a"], timeout=5)["a"]
    assert (event.state, event.drained) == ("timed_out", False)
    assert ed.quarantined_transfers == 1
    assert ed.seal("b", "p", expected_writes=0) is True
    assert ed.wait(["b"], timeout=5)["b"].state == "done"
    assert ed.quarantined_transfers == 1  # 'a' still quarantined


def test_abort_of_a_quarantined_transfer_is_not_unknown() -> None:
    """Abort says OK (no-op) for ended transfers and NotFound for ids never seen; a transfer
    the engine still holds quarantined (and refuses to reuse) is answered 'no transfer'."""
    _, _, _, ed = _pair(
        options={"loopback_delay_ms": 400}, transfer_timeout=0.05, terminal_history=1
    )
    _quarantined_read_forgotten(ed)
    with pytest.raises(mn.AlreadyExistsError, match="quarantined"):
        ed.read("a", "p", [1], [1])  # the engine knows 'a'
    ed.abort("a")  # raises NotFoundError "no transfer 'a'" before the fix


def test_write_calls_on_a_quarantined_read_id_are_invalid_argument() -> None:
    """A WRITE call on a READ id is InvalidArgument with no change (engine.hpp). Once the READ
    is quarantined and out of the terminal history, write_layer and seal on its id answer False
    (silently, as for an ended WRITE) although the engine still holds it as a READ."""
    _, _, _, ed = _pair(
        options={"loopback_delay_ms": 400}, transfer_timeout=0.05, terminal_history=1
    )
    _quarantined_read_forgotten(ed)
    with pytest.raises(mn.InvalidArgumentError, match="READ"):
        ed.write_layer("a", "dense.0", "p", [1], [1])
    with pytest.raises(mn.InvalidArgumentError, match="READ"):
        ed.seal("a", "p", expected_writes=1)


def test_poll_drained_refuses_a_negative_count_by_name() -> None:
    """poll_events(max_events=-1) is InvalidArgumentError naming max_events (fixed earlier);
    poll_drained(-1) still ends in pybind11's signature dump (TypeError)."""
    engine = mn.Engine("x", "loopback")
    with pytest.raises(mn.InvalidArgumentError, match="max_transfers"):
        engine.poll_drained(-1)


def test_a_negative_cuda_event_is_refused_by_name() -> None:
    _, _, ep, _ = _pair()
    with pytest.raises(mn.InvalidArgumentError, match="cuda_event"):
        ep.write_layer("t", "dense.0", "d", [0], [0], cuda_event=-1)


@pytest.mark.parametrize("call", ["wait", "poll_events", "transfer_timeout"])
def test_a_timeout_beyond_any_float_is_invalid_argument(call: str) -> None:
    """The same class as the fixed listener_handshake_timeout / fetch_metadata case: an int too
    large for a float raises OverflowError instead of InvalidArgumentError naming it."""
    engine = mn.Engine("x", "loopback")
    with pytest.raises(mn.InvalidArgumentError, match="timeout"):
        if call == "wait":
            engine.wait(["a"], timeout=10**400)
        elif call == "poll_events":
            engine.poll_events(timeout=10**400)
        else:
            mn.Engine("y", "loopback", transfer_timeout=10**400)


def test_a_fractional_max_events_is_refused_not_truncated() -> None:
    """seal(expected_writes=1.9) was truncated and is now refused; poll_events(max_events=1.5)
    is still truncated to 1."""
    engine = mn.Engine("x", "loopback")
    with pytest.raises(mn.InvalidArgumentError, match="max_events"):
        engine.poll_events(max_events=1.5)


def test_a_sub_millisecond_transfer_timeout_is_not_called_non_positive() -> None:
    """0.0004 s is positive; the binding truncates it to 0 ms and the error then says the
    timeout 'must be positive'. It should name the real limit (whole milliseconds)."""
    with pytest.raises(mn.InvalidArgumentError, match="millisecond"):
        mn.Engine("x", "loopback", transfer_timeout=0.0004)


def test_registered_memory_outlives_an_engine_collected_as_cyclic_garbage() -> None:
    """An Engine in a reference cycle (a callback that holds it) is freed by the garbage
    collector, which clears objects in its own order: a layer made before the engine could be
    cleared, its memory freed, while the native engine still served it (seen failing, a review
    of the day's fixes). Registered memory now goes only after the native engine."""
    page, blocks, bs, hs = 4096, 64, 16, 64
    spec = mn.CacheSpec(kind="mla", block_size=bs, head_size=hs, dtype_bytes=1)
    raw = np.zeros(blocks * bs * hs + page, dtype=np.uint8)
    start = (-raw.ctypes.data) % page
    mem = raw[start : start + blocks * bs * hs]
    del raw
    base = mem.base
    layer = mn.LayerRegistration(
        "L", mem.reshape(blocks, bs, hs), spec, allocation=(mem.ctypes.data, mem.nbytes)
    )
    del mem
    gc.collect()  # the layer (made first, as a connector makes its KV caches) is the older
    engine = mn.Engine("cyc", "loopback", {})
    engine.register_kv_caches([layer])
    native = weakref.ref(engine._engine)
    seen: list[bool] = []
    weakref.finalize(base, lambda: seen.append(native() is not None))
    engine.cycle = engine  # type: ignore[attr-defined]  # e.g. a callback of the connector's that holds the engine
    del engine, layer, base
    gc.collect()
    assert seen, "the registered memory was never freed"
    assert seen == [False], "the caller's registered memory was freed while the native engine lived"
