"""The standalone Python API (engine.py, layout.py, memory.py, verify.py and the bindings they
call) given bad input: each test is one defect found by a review of that API (2026-12-07),
seen failing before its fix. Loopback only, no GPU, no network."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native import verify
from moriio_native.layout import block_template, describe_layer

SPEC = mn.CacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=2)


def _pair() -> tuple[mn.Engine, mn.Engine]:
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=4)
    ep = mn.Engine("p", "loopback")
    ed = mn.Engine("d", "loopback")
    ep.register_kv_caches(prefill.registrations())
    ed.register_kv_caches(decode.registrations())
    ep.add_peer(ed.local_metadata())
    ep._test_keep = (prefill, decode, ed)  # type: ignore[attr-defined]
    return ep, ed


@pytest.fixture()
def ctrl_c_raises() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: a pytest-xdist worker
    ignores SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _CtrlC:
    """The native engine as wait() sees it when Ctrl-C comes: SIGINT delivered as native poll
    call number ``on_call`` returns (the handler only sets a flag, as in real life, and Python
    raises KeyboardInterrupt at its next check), or, with ``on_call`` None, as the first call
    that took events returns (the native poll checks for signals only while it took none, so
    Ctrl-C and an event in one 100 ms slice come back together)."""

    def __init__(self, native: object, on_call: int | None = None) -> None:
        self._native = native
        self._on_call = on_call
        self._calls = 0
        self.fired = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._native, name)

    def poll_events_into(self, out: list, max_events: int, timeout: float) -> int:
        self._calls += 1
        if self._calls == self._on_call:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        taken = self._native.poll_events_into(out, max_events, timeout)
        if self._on_call is None and taken and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return taken


# --- 1. A tensor on a GPU registered as host memory -------------------------------------------


class _CudaClaimingTensor:
    """What the facade reads of a torch CUDA tensor (``is_cuda``, ``device``, shape, strides,
    storage), over host memory so the test runs anywhere: the facade never asks."""

    def __init__(self, inner: torch.Tensor) -> None:
        self._inner = inner
        self.shape = inner.shape
        self.is_cuda = True
        self.device = torch.device("cuda", 0)

    def stride(self):  # type: ignore[no-untyped-def]
        return self._inner.stride()

    def element_size(self) -> int:
        return self._inner.element_size()

    def data_ptr(self) -> int:
        return self._inner.data_ptr()

    def untyped_storage(self):  # type: ignore[no-untyped-def]
        return self._inner.untyped_storage()


def test_a_gpu_tensor_registered_with_the_default_host_memory_is_refused() -> None:
    """LayerRegistration.memory defaults to "host" and nothing compares it with the torch
    tensor's device: a CUDA tensor registered without memory="cuda" is registered as host
    memory (the loopback backend then memcpys device pointers on the host; UCX maps them as
    host memory). The facade holds the tensor and must refuse the contradiction, naming the
    layer, before anything is registered."""
    tensor = _CudaClaimingTensor(torch.zeros(2, 10, 4, 2, 8, dtype=torch.int16))
    engine = mn.Engine("d", "loopback")
    with pytest.raises(mn.InvalidArgumentError, match=r"model\.layers\.0"):
        engine.register_kv_caches([mn.LayerRegistration("model.layers.0", tensor, SPEC)])


# --- 2. Engine numbers truncated, or refused by pybind11 rather than by name ------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"terminal_history": 1.9},  # int() -> 1
        {"terminal_history": True},  # -> 1
        {"terminal_history": "7"},  # int("7")
        {"page_size": 4096.9},  # int() -> 4096
    ],
)
def test_engine_counts_that_are_no_integer_are_refused_not_truncated(kwargs: dict) -> None:
    with pytest.raises(mn.InvalidArgumentError, match=next(iter(kwargs))):
        mn.Engine("x", "loopback", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"page_size": -1}, "page_size"),
        ({"terminal_history": 2**70}, "terminal_history"),
    ],
)
def test_engine_counts_out_of_range_are_refused_by_name(kwargs: dict, name: str) -> None:
    """Not pybind11's "incompatible constructor arguments" TypeError listing its signature."""
    with pytest.raises(mn.InvalidArgumentError, match=name):
        mn.Engine("x", "loopback", **kwargs)


def test_seal_and_poll_counts_past_64_bits_are_refused_by_name() -> None:
    engine = mn.Engine("x", "loopback")
    with pytest.raises(mn.InvalidArgumentError, match="expected_writes"):
        engine.seal("t", "nobody", expected_writes=2**63)
    with pytest.raises(mn.InvalidArgumentError, match="max_events"):
        engine.poll_events(max_events=2**64)
    with pytest.raises(mn.InvalidArgumentError, match="nbytes"):
        engine.allocate_host_backing(-1)


# --- 3. A bad tensor is refused without naming the layer --------------------------------------


def test_a_tensor_that_is_none_is_refused_naming_the_layer() -> None:
    """geometry_of raises a bare TypeError ("expected a TensorGeometry ..., got list" or
    "numpy array strides must be whole elements") with no layer name: registering 60 layers,
    the caller cannot tell which one was wrong."""
    engine = mn.Engine("x", "loopback")
    with pytest.raises((TypeError, mn.InvalidArgumentError), match=r"model\.layers\.7"):
        engine.register_kv_caches(
            [mn.LayerRegistration("model.layers.7", [0] * 10, SPEC, allocation=(4096, 4096))]
        )
    odd = np.lib.stride_tricks.as_strided(
        np.zeros(10000, np.int16), (2, 10, 4, 2, 8), (1281, 128, 32, 16, 2)
    )
    with pytest.raises((TypeError, mn.InvalidArgumentError), match=r"model\.layers\.3"):
        describe_layer("model.layers.3", odd, SPEC)


# --- 4. verify: block ids truncated ------------------------------------------------------------


def test_verify_refuses_fractional_and_bool_block_ids_as_checksum_host_does() -> None:
    """checksum_host refuses 1.5 ("block_ids must be integers"); LayerChecksums.compute and
    checksum_torch truncate it to block 1 (and take True as block 1), answering a checksum
    of a block nobody asked for."""
    cache = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    kc.fill_random(cache, seed=3)
    checksums = verify.LayerChecksums.for_registrations(cache.registrations())
    with pytest.raises(mn.InvalidArgumentError):
        checksums.compute([1.9])
    with pytest.raises(mn.InvalidArgumentError):
        checksums.compute([True])
    reg = cache.registrations()[0]
    tensor = torch.from_numpy(np.ascontiguousarray(cache.views[reg.name]))
    layout = describe_layer(reg.name, tensor, reg.spec)
    with pytest.raises(mn.InvalidArgumentError):
        verify.checksum_torch(layout, tensor, [1.5])


@pytest.mark.parametrize(
    "window",
    [
        verify.CellWindow(head_begin=True, heads=True),  # taken as heads [1, 2)
        verify.CellWindow(heads=1.0),  # resolve() passes it; pybind11's TypeError follows
    ],
)
def test_verify_windows_refuse_bools_and_floats_as_layout_windows_do(window) -> None:
    """layout.CellWindow refuses True and 1.0 by name (an earlier fix); verify.CellWindow, the
    window of the checksums, resolves them as they come."""
    cache = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    reg = cache.registrations()[0]
    array = np.ascontiguousarray(cache.views[reg.name])
    layout = describe_layer(reg.name, array, reg.spec)
    with pytest.raises(mn.InvalidArgumentError, match="head"):
        verify.checksum_host(layout, array.view(np.uint8).reshape(-1), [0], window)


# --- 5. BlockTemplate.block_offsets overflows int64 --------------------------------------------


def test_block_offsets_that_overflow_int64_are_refused_not_wrapped() -> None:
    """local_shift + origin + id * block_stride is computed in int64 without a check: a shift
    near 2**63 answers a NEGATIVE offset (signed overflow, undefined behaviour in C++)."""
    a = describe_layer("L", np.zeros((2, 10, 4, 2, 8), np.int16), SPEC)
    b = describe_layer("L", np.zeros((10, 2, 2, 4, 8), np.int16), SPEC, "interleaved")
    tmpl = block_template(a, b)
    with pytest.raises(mn.OutOfRangeError, match=r"layer 'L'.*past int64"):
        tmpl.block_offsets(mn.BlockPairs([0, 9], [2, 3]), 2**63 - 1, 0)


# --- 6. wait() interrupted drops the events it had taken ---------------------------------------


def test_events_wait_took_are_not_lost_when_it_is_interrupted(ctrl_c_raises: None) -> None:
    """wait() takes every event that arrives (each is delivered once) and keeps those of other
    transfers in a local dict it returns at the end. Interrupted (Ctrl-C while it waits for the
    next slice), the dict was dropped: those transfers' only terminal event was delivered to
    nobody, and a caller polling for them waited for ever."""
    ep, _ = _pair()
    assert ep.seal("other", "d", expected_writes=0) is True  # done at once: its event is queued
    ep._engine = _CtrlC(ep._engine, on_call=2)  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        ep.wait(["mine"], timeout=5)
    assert ep._engine.fired
    events = {e.transfer_id: e for e in ep.poll_events(timeout=0.5)}
    assert "other" in events, "the terminal event of 'other' was taken by wait() and lost"


# --- 7. A second write_layer of a layer with OTHER blocks is dropped silently --------------------


def test_a_layer_written_again_with_other_blocks_is_not_dropped_silently(
    pair: tuple[kc.KvCacheSet, kc.KvCacheSet, mn.Engine, mn.Engine],
) -> None:
    """write_layer is idempotent per (transfer, layer) so a retry is harmless -- but it compared
    the layer only, not what it moves: a second call for the same layer with OTHER block ids
    answered False like a repeat, moved nothing, and the transfer still ended ``done`` after the
    seal, with the decode's blocks of the second call never written. Now the same call again is
    a repeat, and another write of the layer is refused, changing nothing."""
    prefill, decode, ep, _ = pair
    assert ep.write_layer("t", "dense.0", "decode-0", [0], [0]) is True
    assert ep.write_layer("t", "dense.0", "decode-0", [0], [0]) is False  # a repeat
    with pytest.raises(mn.InvalidArgumentError, match=r"'dense\.0' was scheduled before with"):
        ep.write_layer("t", "dense.0", "decode-0", [1], [1])
    # Refused, changing nothing: the transfer ends with the first write, which landed.
    ep.seal("t", "decode-0", expected_writes=1)
    assert ep.wait(["t"], timeout=5)["t"].state == "done"
    assert kc.blocks_match(decode, prefill, [0], [0], layers=["dense.0"])
    assert not kc.blocks_match(decode, prefill, [1], [1], layers=["dense.0"])


def test_a_layer_written_again_to_another_peer_is_refused() -> None:
    """The same blocks of a scheduled layer to another peer are another write, not a repeat:
    refused, the transfer going on with the first."""
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=4)
    ep = mn.Engine("p", "loopback")
    ed = mn.Engine("d", "loopback")
    ed2 = mn.Engine("d2", "loopback")
    ep.register_kv_caches(prefill.registrations())
    ed.register_kv_caches(decode.registrations())
    ed2.register_kv_caches(decode.registrations())
    ep.add_peer(ed.local_metadata())
    ep.add_peer(ed2.local_metadata())
    assert ep.write_layer("t", "dense.0", "d", [0], [0]) is True
    with pytest.raises(mn.InvalidArgumentError, match="scheduled before with other"):
        ep.write_layer("t", "dense.0", "d2", [0], [0])
    ep.seal("t", "d", expected_writes=1)
    assert ep.wait(["t"], timeout=5)["t"].state == "done"


# --- 8. memory.allocate_*_backing: no integer check --------------------------------------------


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((True,), "nbytes"),  # one page for True
        ((1.5,), "nbytes"),  # numpy's "expected a sequence of integers ... got '8192.0'"
        ((4096, 4096.0), "page_size"),  # "unsupported operand type(s) for &"
    ],
)
def test_allocate_host_backing_refuses_non_integers_by_name(args: tuple, name: str) -> None:
    with pytest.raises(mn.InvalidArgumentError, match=name):
        mn.allocate_host_backing(*args)


# --- 9. Public native constructors take True as 1 -------------------------------------------------


def test_public_native_constructors_refuse_bools_as_cache_spec_does() -> None:
    """CacheSpec refuses True by name (an earlier fix), and CellWindow does; but mn.BlockTemplate
    (exported) takes a window tuple straight to pybind11, whose int64 caster takes True as 1
    (heads [1, 2) here), and so does TensorGeometry's element_size."""
    a = describe_layer("L", np.zeros((2, 10, 4, 2, 8), np.int16), SPEC)
    with pytest.raises(mn.InvalidArgumentError):
        mn.BlockTemplate(a, a, (True, 1, 0, None), (0, 1, 0, None))
    with pytest.raises((mn.InvalidArgumentError, TypeError)):
        mn.TensorGeometry([2, 10, 4, 2, 8], [640, 64, 16, 8, 1], True, 1)


# --- reviews of the fixes above ------------------------------------------------------------


def test_events_the_native_poll_returned_as_ctrl_c_came_are_not_lost(ctrl_c_raises: None) -> None:
    """The first fix kept the events wait() stored in ``seen`` when it is interrupted, but not
    the ones the native poll returned in the very call the interrupt lands after: that list was
    dropped by the KeyboardInterrupt before wait() iterated it (a review of the fix). The native
    poll now appends them to wait()'s own list before it returns."""
    ep, _ = _pair()
    assert ep.seal("other", "d", expected_writes=0) is True  # done at once: its event is queued
    ep._engine = _CtrlC(ep._engine)  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        ep.wait(["mine"], timeout=5)
    assert ep._engine.fired
    events = {e.transfer_id: e for e in ep.poll_events(timeout=0.5)}
    assert "other" in events, "the terminal event of 'other' was taken by wait() and lost"


def test_a_bad_window_is_not_taken_for_a_repeat_of_a_whole_block_write() -> None:
    """WriteDigest added a window's ``heads``/``tokens`` as ``value_or(-1)``: None (the whole
    block) and -1 digested alike (a review of the fix). A write of a scheduled layer with the
    invalid window heads=-1, tokens=-1 was then answered as a repeat -- False, no error --
    before the window was checked."""
    ep, _ = _pair()
    assert ep.write_layer("t", "dense.0", "d", segments=[mn.BlockSegment([0], [0])]) is True
    bad = mn.BlockSegment([0], [0], local_window=mn.CellWindow(heads=-1, tokens=-1))
    with pytest.raises(mn.InvalidArgumentError):
        ep.write_layer("t", "dense.0", "d", segments=[bad])


@pytest.mark.parametrize(
    "element_size",
    [np.array(2.0), np.array([2]), np.zeros((1, 1), np.int64)],
    ids=["0-d float array", "1-element array", "2-d array"],
)
def test_strict_int_refuses_arrays_by_name_not_with_numpy_type_error(element_size) -> None:
    """StrictInt promises InvalidArgument naming the argument for anything that is no integer,
    but every numpy array passed its PyIndex_Check (ndarray has __index__) and
    PyNumber_Index's own TypeError ("only integer scalar arrays can be converted to a scalar
    index") escapes, naming nothing; the same in shapes, strides and windows."""
    with pytest.raises(mn.InvalidArgumentError, match=r"TensorGeometry\.element_size"):
        mn.TensorGeometry([2, 10, 4, 2, 8], [640, 64, 16, 8, 1], element_size, 0)


def test_tensor_geometry_data_ptr_keeps_its_uint64_range() -> None:
    """data_ptr was a uint64 (pybind11's caster); StrictInt reads it as int64, so an address
    with bit 63 set (a tagged pointer) is refused as not fitting 64 bits -- which it does."""
    g = mn.TensorGeometry([2, 10, 4, 2, 8], [640, 64, 16, 8, 1], 2, 2**63 + 4096)
    assert g.data_ptr == 2**63 + 4096


def test_block_ids_holding_an_array_are_refused_by_name() -> None:
    """The same numpy TypeError escaped from block ids given as a list holding an array."""
    ep, _ = _pair()
    with pytest.raises(
        mn.InvalidArgumentError, match=r"must be integers, got .*ndarray.* at position 1"
    ):
        ep.write_layer("t", "dense.0", "d", [0, np.array([1, 2])], [0, 1])
