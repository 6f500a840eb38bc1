"""The engine's timing marks through the Python binding (gpu_bench --timeline reads them): what a
READ on the loopback backend records, in which order, and what a build without them does. No
timing is asserted; in-process engines only (no ports)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import moriio_native as mn
from moriio_native import _native
from moriio_native import kvcache as kc

compiled_in = _native.trace_marks_compiled_in()


@pytest.fixture()
def recorder() -> Iterator[None]:
    _native.trace_marks_disable()
    _native.trace_marks_take()
    yield
    _native.trace_marks_disable()
    _native.trace_marks_take()


@pytest.mark.skipif(compiled_in, reason="this build has the marks compiled in")
def test_a_build_without_marks_refuses_to_enable(recorder: None) -> None:
    with pytest.raises(mn.FailedPreconditionError, match="MORIIO_NATIVE_TRACE_MARKS"):
        _native.trace_marks_enable(16)
    assert _native.trace_marks_take() == ([], 0)


@pytest.mark.skipif(not compiled_in, reason="built without MORIIO_NATIVE_TRACE_MARKS")
def test_a_read_records_its_path_in_order(recorder: None) -> None:
    with pytest.raises(mn.InvalidArgumentError, match="capacity"):
        _native.trace_marks_enable(0)
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=12)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=20)
    ep = mn.Engine("prefill-0", "loopback")
    ed = mn.Engine("decode-0", "loopback")
    meta_p = ep.register_kv_caches(prefill.registrations())
    ep.add_peer(ed.register_kv_caches(decode.registrations()))
    ed.add_peer(meta_p)
    _native.trace_marks_enable(4096)
    ed.read("marks", "prefill-0", [19, 0, 5], [3, 7, 1])
    stamps, dropped = _native.trace_marks_take()
    _native.trace_marks_disable()
    assert ed.wait(["marks"], timeout=10)["marks"].state == "done"
    names = [name for name, _ns, _token, _thread in stamps]
    assert dropped == 0
    head = ["binding_entry", "call_entry", "pairs_checked", "layers_planned", "planned"]
    assert names[:5] == head
    assert names[-1] == "call_exit"
    middle = names[5:-1]
    assert middle and middle == ["piece_cut", "submit_entry", "submit_exit"] * (len(middle) // 3)
    times = [ns for _name, ns, _token, _thread in stamps]
    assert times == sorted(times), "one thread's stamps follow the monotonic clock"
    assert {thread for *_rest, thread in stamps} == {stamps[0][3]}
    tokens = [token for name, _ns, token, _thread in stamps if name == "submit_entry"]
    assert all(tokens) and len(set(tokens)) == len(tokens)
