"""Engine behaviour through the loopback backend: a mixed model on ONE shared backing per side,
different physical layouts and block counts on the two sides, READ and WRITE verified byte for
byte over the whole backing (so bytes outside the requested blocks must be unchanged too)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.vllm.config import BACKEND_OPTION_KEYS


def test_mixed_model_has_every_generation() -> None:
    shapes = kc.mixed_model("prefill") + kc.mixed_model("decode")
    generations = {s.generation for s in shapes}
    assert {
        "separated_nhd",
        "separated_hnd",
        "interleaved_nhd",
        "interleaved_hnd",
        "standardized",
        "latent",
        "latent_standardized",
    } <= generations
    assert len(kc.mixed_model("prefill")) >= 6


def test_read_pulls_exact_bytes(pair) -> None:
    prefill, decode, _, ed = pair
    local, remote = [19, 0, 5, 6], [3, 7, 1, 11]
    expected = kc.expected_after_copy(decode, prefill, local, remote)
    ed.read("req-read", "prefill-0", local, remote)
    events = ed.wait(["req-read"], timeout=10)
    event = events["req-read"]
    assert (event.kind, event.state) == ("read", "done")
    assert event.bytes == len(local) * prefill.total_block_bytes()
    assert np.array_equal(decode.backing, expected)


def test_read_of_selected_layers_touches_only_them(pair) -> None:
    prefill, decode, _, ed = pair
    expected = kc.expected_after_copy(decode, prefill, [4], [2], layers=["mla.0"])
    ed.read("req-some", "prefill-0", [4], [2], layers=["mla.0"])
    assert ed.wait(["req-some"], timeout=10)["req-some"].state == "done"
    assert np.array_equal(decode.backing, expected)


def test_write_pushes_each_layer_and_completes_once_after_seal(pair) -> None:
    prefill, decode, ep, _ = pair
    local, remote = [0, 1, 2, 11], [2, 4, 8, 19]
    expected = kc.expected_after_copy(decode, prefill, remote, local)
    for shape in prefill.shapes:
        assert ep.write_layer("req-w", shape.name, "decode-0", local, remote) is True
    # A layer scheduled twice is refused and moves nothing more.
    assert ep.write_layer("req-w", prefill.shapes[0].name, "decode-0", local, remote) is False
    assert ep.wait(["req-w"], timeout=0.3) == {}  # not sealed: no completion yet
    ep.seal("req-w", "decode-0", expected_writes=len(prefill.shapes))
    events = ep.wait(["req-w"], timeout=10)
    assert events["req-w"].state == "done"
    assert events["req-w"].bytes == len(local) * prefill.total_block_bytes()
    assert np.array_equal(decode.backing, expected)
    assert ep.poll_events(timeout=0.2) == []  # exactly one event
    # Late writes and seals for the finished transfer are ignored.
    assert ep.write_layer("req-w", prefill.shapes[1].name, "decode-0", local, remote) is False
    ep.seal("req-w", "decode-0", expected_writes=len(prefill.shapes))
    assert ep.poll_events(timeout=0.1) == []


def test_write_layers_pushes_several_layers_in_one_call(pair) -> None:
    prefill, decode, ep, _ = pair
    local, remote = [0, 1, 2, 11], [2, 4, 8, 19]
    expected = kc.expected_after_copy(decode, prefill, remote, local)
    names = [shape.name for shape in prefill.shapes]
    assert ep.write_layers("req-wl", names[:-1], "decode-0", local, remote) is True
    assert ep.write_layers("req-wl", names[:-1], "decode-0", local, remote) is False  # a retry
    ep.seal("req-wl", "decode-0", expected_writes=len(names))
    assert ep.wait(["req-wl"], timeout=0.3) == {}  # one sealed layer not written yet
    assert ep.write_layers("req-wl", names[-1:], "decode-0", local, remote) is True
    event = ep.wait(["req-wl"], timeout=10)["req-wl"]
    assert event.state == "done"
    assert event.bytes == len(local) * prefill.total_block_bytes()
    assert event.batches < len(names)  # the first call's layers shared batches
    assert np.array_equal(decode.backing, expected)
    assert ep.poll_events(timeout=0.2) == []  # exactly one event


def test_write_layers_refusal_names_the_layer_and_fails_the_transfer(pair) -> None:
    prefill, decode, ep, _ = pair
    before = decode.backing.copy()
    with pytest.raises(mn.InvalidArgumentError, match="no layers"):
        ep.write_layers("req-none", [], "decode-0", [0], [0])
    assert ep.poll_events(timeout=0.1) == []  # nothing created
    first = prefill.shapes[0].name
    with pytest.raises(mn.NotFoundError, match="'nope'"):
        ep.write_layers("req-bad", [first, "nope"], "decode-0", [0], [0])
    assert ep.wait(["req-bad"], timeout=5)["req-bad"].state == "failed"
    assert np.array_equal(decode.backing, before)


def test_seal_saying_nothing_to_send_completes_immediately(pair) -> None:
    _, _, ep, _ = pair
    ep.seal("req-empty", "decode-0", expected_writes=0)
    event = ep.wait(["req-empty"], timeout=5)["req-empty"]
    assert (event.kind, event.state, event.bytes) == ("write", "done", 0)


def test_seal_naming_an_unknown_peer_starts_nothing(pair) -> None:
    """Before: a seal with a misspelt peer made a WRITE nothing could ever write (waiting for
    its deadline), and with 0 writes reported it done at once to a peer that does not exist."""
    _, _, ep, _ = pair
    for writes in (0, 2):
        with pytest.raises(mn.NotFoundError, match=f"ghost-{writes}.*unknown peer 'nobody'"):
            ep.seal(f"ghost-{writes}", "nobody", expected_writes=writes)
    assert ep.pending_transfers == 0
    assert ep.poll_events(timeout=0.05) == []


def test_wait_refuses_a_nan_timeout_and_polls_once_at_zero(pair) -> None:
    """Before: ``wait(ids, timeout=nan)`` never returned (no deadline ever passed), spinning a
    core; and a timeout of 0 returned without looking at the events at all."""
    _, _, ep, _ = pair
    with pytest.raises(mn.InvalidArgumentError, match=r"timeout.*nan"):
        ep.wait(["req-n"], timeout=float("nan"))
    ep.seal("req-0", "decode-0", expected_writes=0)
    time.sleep(0.05)  # the event is queued: a wait of 0 must still return it
    assert ep.wait(["req-0"], timeout=0)["req-0"].state == "done"


@pytest.mark.parametrize("poll_timeout", [0.0, 0.001])
def test_a_daemon_thread_in_a_native_call_at_exit_does_not_abort_the_process(
    poll_timeout: float,
) -> None:
    """Before: a daemon thread polling events (as the connector's events thread does) made the
    process abort at interpreter exit ("terminate called without an active exception",
    SIGABRT): CPython ends such a thread with pthread_exit when it takes the GIL back during
    finalization, and that unwinding started in pybind11's gil_scoped_release destructor."""
    script = textwrap.dedent(
        f"""
        import threading, time
        import moriio_native as mn
        engine = mn.Engine("solo", "loopback")
        def loop():
            while True:
                engine.poll_events(timeout={poll_timeout})
        threading.Thread(target=loop, daemon=True).start()
        time.sleep(0.3)
        """
    )
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-500:])


def test_empty_read_is_notify_only(pair) -> None:
    _, decode, _, ed = pair
    before = decode.backing.copy()
    ed.read("req-none", "prefill-0", [], [5, 6])
    assert ed.wait(["req-none"], timeout=5)["req-none"].state == "done"
    assert np.array_equal(decode.backing, before)


@pytest.mark.parametrize(
    ("local", "remote", "error", "text"),
    [
        ([0, 1, 2], [0, 1], mn.InvalidArgumentError, "longer than remote"),
        ([20], [0], mn.OutOfRangeError, "local block id 20"),
        ([0], [12], mn.OutOfRangeError, "remote block id 12"),
        ([-1], [0], mn.OutOfRangeError, "negative"),
        ([1, 1], [2, 3], mn.InvalidArgumentError, "duplicate local"),
        ([1, 2], [3, 3], mn.InvalidArgumentError, "duplicate remote"),
    ],
)
def test_bad_block_ids_fail_the_call_and_create_nothing(pair, local, remote, error, text) -> None:
    _, decode, _, ed = pair
    before = decode.backing.copy()
    with pytest.raises(error, match=text):
        ed.read("req-bad", "prefill-0", local, remote)
    assert ed.pending_transfers == 0
    assert ed.poll_events(timeout=0.05) == []
    assert np.array_equal(decode.backing, before)
    # The id was never used, so it is still free.
    ed.read("req-bad", "prefill-0", [0], [0])
    assert ed.wait(["req-bad"], timeout=5)["req-bad"].state == "done"


def test_unknown_peer_layer_and_duplicate_transfer(pair) -> None:
    _, _, ep, ed = pair
    with pytest.raises(mn.NotFoundError, match="unknown peer 'nobody'"):
        ed.read("req-x", "nobody", [0], [0])
    with pytest.raises(mn.NotFoundError, match="unknown layer 'nope'"):
        ep.write_layer("req-x", "nope", "decode-0", [0], [0])
    ed.read("req-dup", "prefill-0", [0], [0])
    with pytest.raises(mn.AlreadyExistsError, match="req-dup"):
        ed.read("req-dup", "prefill-0", [1], [1])
    assert ed.wait(["req-dup"], timeout=5)["req-dup"].state == "done"


def test_abort_and_timeout_release_transfers() -> None:
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=4)
    ep = mn.Engine("p", "loopback")
    ed = mn.Engine("d", "loopback", options={"loopback_delay_ms": 300}, transfer_timeout=0.1)
    ep.register_kv_caches(prefill.registrations())
    ed.register_kv_caches(decode.registrations())
    ed.add_peer(ep.local_metadata())
    # Deadline: the loopback worker sleeps past the 0.1 s timeout.
    ed.read("req-slow", "p", [0], [0])
    event = ed.wait(["req-slow"], timeout=5)["req-slow"]
    assert event.state == "timed_out"
    assert "in flight" in event.message
    # Abort of a WRITE before seal: one aborted event, later writes refused.
    ep.add_peer(ed.local_metadata())
    assert ep.write_layer("req-a", "dense.0", "d", [0], [1]) is True
    ep.abort("req-a")
    event = ep.wait(["req-a"], timeout=5)["req-a"]
    assert event.state == "aborted"
    assert ep.write_layer("req-a", "dense.1", "d", [0], [1]) is False
    with pytest.raises(mn.NotFoundError):
        ep.abort("never-started")


def _with_dense1(**fields: int) -> list[kc.LayerShape]:
    """The decode model with layer dense.1 changed to other ``fields``."""
    changed = dict(block_size=16, head_size=8, num_heads=2) | fields
    return [
        s if s.name != "dense.1" else kc.LayerShape("dense.1", "interleaved_nhd", **changed)
        for s in kc.mixed_model("decode")
    ]


def test_incompatible_peer_names_the_layer() -> None:
    """Cells that cannot pair (another head size) fail the handshake, naming the layer."""
    mine = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    theirs = kc.build_caches(_with_dense1(head_size=16), num_blocks=4)
    a = mn.Engine("a", "loopback")
    b = mn.Engine("b", "loopback")
    a.register_kv_caches(mine.registrations())
    meta_b = b.register_kv_caches(theirs.registrations())
    with pytest.raises(mn.IncompatiblePeerError, match=r"dense\.1.*K=16B.*K=32B"):
        a.add_peer(meta_b)
    assert a.peers() == []


def test_peer_with_other_heads_pairs_through_windows_only() -> None:
    """Other head counts (heterogeneous TP) pass the handshake; whole blocks of that layer are
    refused naming both layouts, with no transfer created."""
    mine = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    theirs = kc.build_caches(_with_dense1(num_heads=4), num_blocks=4)
    a = mn.Engine("a", "loopback")
    b = mn.Engine("b", "loopback")
    a.register_kv_caches(mine.registrations())
    assert a.add_peer(b.register_kv_caches(theirs.registrations())) == "b"
    with pytest.raises(mn.IncompatiblePeerError, match=r"dense\.1.*heads=2.*heads=4"):
        a.read("whole", "b", [0], [0])
    assert a.pending_transfers == 0
    assert a.poll_events(timeout=0.05) == []
    others = [s.name for s in kc.mixed_model("prefill") if s.name != "dense.1"]
    a.read("others", "b", [0], [0], layers=others)
    assert a.wait(["others"], timeout=10)["others"].state == "done"


def test_peer_missing_a_layer_is_incompatible() -> None:
    mine = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    theirs = kc.build_caches(kc.mixed_model("decode")[:-1], num_blocks=4)
    a, b = mn.Engine("a", "loopback"), mn.Engine("b", "loopback")
    a.register_kv_caches(mine.registrations())
    with pytest.raises(mn.IncompatiblePeerError, match=r"no layer 'mla\.0'"):
        a.add_peer(b.register_kv_caches(theirs.registrations()))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m[: len(m) // 2],
        lambda m: b"",
        lambda m: b"\x93\x01\x02",
        lambda m: m + b"\x00",
    ],
)
def test_malformed_metadata_is_rejected_without_state_change(pair, mutate) -> None:
    _, _, _, ed = pair
    peers_before = ed.peers()
    with pytest.raises(mn.InvalidArgumentError, match=r"msgpack|metadata"):
        ed.add_peer(mutate(ed.local_metadata()))
    assert ed.peers() == peers_before


def test_metadata_fields_are_validated(pair) -> None:
    import msgpack

    _, _, ep, ed = pair
    meta = msgpack.unpackb(ep.local_metadata())

    def rejected(doc: dict, error: type[Exception], text: str) -> None:
        with pytest.raises(error, match=text):
            ed.add_peer(msgpack.packb(doc))

    other = dict(meta, engine_id="other")
    rejected(dict(other, version=2), mn.IncompatiblePeerError, "version 2")
    rejected(dict(other, backend="ucx"), mn.IncompatiblePeerError, "backend 'ucx'")
    bad_offset = dict(
        other,
        layers=[dict(meta["layers"][0], offset=meta["regions"][0]["size"]), *meta["layers"][1:]],
    )
    rejected(bad_offset, mn.InvalidArgumentError, "exceed region")
    params = list(meta["layers"][0]["params"])
    params[1] = 1 << 62
    huge = dict(other, layers=[dict(meta["layers"][0], params=params), *meta["layers"][1:]])
    rejected(huge, mn.InvalidArgumentError, "num_blocks")
    rejected(
        dict(other, layers=meta["layers"] + meta["layers"][:1]), mn.InvalidArgumentError, "twice"
    )
    assert ed.peers() == ["prefill-0"]


def test_register_twice_and_layer_outside_allocation() -> None:
    cache = kc.build_caches(kc.mixed_model("prefill"), num_blocks=4)
    e = mn.Engine("x", "loopback")
    regs = cache.registrations()
    bad = [
        mn.LayerRegistration(r.name, r.tensor, r.spec, (r.allocation[0], 64)) if i == 2 else r
        for i, r in enumerate(regs)
    ]
    with pytest.raises(mn.InvalidArgumentError, match=r"dense\.2.*inside its allocation"):
        e.register_kv_caches(bad)
    e.register_kv_caches(regs)  # the failed call left nothing registered
    with pytest.raises(mn.FailedPreconditionError, match="registered already"):
        e.register_kv_caches(regs)


def test_unknown_backend_and_available_backends() -> None:
    with pytest.raises(mn.NotFoundError, match="unknown backend 'carrier-pigeon'"):
        mn.Engine("x", "carrier-pigeon")
    names = {b.name: b for b in mn.available_backends()}
    assert names["loopback"].available
    assert {"ucx", "mori"} <= set(names)
    for b in names.values():
        assert b.available or b.reason


def test_misspelt_option_is_refused_and_other_backends_keys_are_ignored() -> None:
    with pytest.raises(
        mn.InvalidArgumentError,
        match=r"unknown option 'loopback_delay' for backend loopback; "
        r"known: loopback_cells, loopback_delay_ms",
    ):
        mn.Engine("x", "loopback", options={"loopback_delay": 5})
    with pytest.raises(mn.InvalidArgumentError, match="unknown option 'qp_per_transfr'"):
        mn.Engine("x", "loopback", options={"qp_per_transfr": 2})
    # One map for every backend, as the vLLM connector passes it for backend "auto".
    shared = {"ucx_tls": "sm,self", "mori_port": 1, "qp_per_transfer": 2, "progress_mode": "busy"}
    assert mn.Engine("x", "loopback", options=shared).backend == "loopback"
    if {b.name: b for b in mn.available_backends()}["ucx"].available:
        with pytest.raises(
            mn.InvalidArgumentError, match="unknown option 'ucx_tsl' for backend ucx"
        ):
            mn.Engine("x", "ucx", options={"ucx_tsl": "sm,self"})


def test_waits_for_device_events_is_asked_per_peer_and_names_an_unknown_one() -> None:
    """What the vLLM connector asks before passing a layer's CUDA event to ``write_layer``
    instead of waiting for it on the host: a property of the peer (the loopback backend never
    copies on a GPU; the UCX GPU tests check both answers); an unknown peer is named."""
    prefill, decode = mn.Engine("p", "loopback"), mn.Engine("d", "loopback")
    caches = {role: kc.build_caches(kc.mixed_model(role), 4) for role in ("prefill", "decode")}
    prefill.register_kv_caches(caches["prefill"].registrations())
    decode.register_kv_caches(caches["decode"].registrations())
    peer = prefill.add_peer(decode.local_metadata())
    assert prefill.waits_for_device_events(peer) is False
    with pytest.raises(mn.NotFoundError, match="nobody"):
        prefill.waits_for_device_events("nobody")


def test_every_key_the_connector_passes_through_is_accepted() -> None:
    # The connector passes these unprefixed keys to whichever backend it picks; the core must
    # know each as a shared key (kSharedBackendOptionKeys), or every backend would refuse it.
    for key in BACKEND_OPTION_KEYS:
        assert mn.Engine("x", "loopback", options={key: "1"}).backend == "loopback", key


def test_backend_without_allocation_refuses_clearly() -> None:
    with pytest.raises(mn.FailedPreconditionError, match="'loopback' does not allocate"):
        mn.Engine("x", "loopback").allocate_host_backing(4096)


def test_non_integer_block_ids_are_refused_not_truncated(pair) -> None:
    _, decode, _, ed = pair
    before = decode.backing.copy()
    with pytest.raises(mn.InvalidArgumentError, match=r"local_blocks must be integers"):
        ed.read("req-float", "prefill-0", np.array([1.7]), [2])
    assert ed.pending_transfers == 0
    assert np.array_equal(decode.backing, before)


def test_peer_region_larger_than_any_address_space_is_refused(pair) -> None:
    import msgpack

    _, _, ep, ed = pair
    meta = msgpack.unpackb(ep.local_metadata())
    region = dict(meta["regions"][0], size=1 << 62)
    doc = dict(meta, engine_id="other", regions=[region, *meta["regions"][1:]])
    with pytest.raises(mn.InvalidArgumentError, match="oversized"):
        ed.add_peer(msgpack.packb(doc))
    assert ed.peers() == ["prefill-0"]


def test_choose_backend_is_one_order_per_role() -> None:
    from moriio_native.engine import AUTO_BACKENDS, choose_backend

    available = {info.name for info in mn.available_backends() if info.available}
    for role, order in AUTO_BACKENDS.items():
        usable = [name for name in order if name in available]
        if usable:
            assert choose_backend("auto", role=role) == usable[0]  # type: ignore[arg-type]
        else:
            with pytest.raises(mn.BackendUnavailableError, match="backend=auto"):
                choose_backend("auto", role=role)  # type: ignore[arg-type]
    assert "loopback" not in AUTO_BACKENDS["serve"]  # it cannot connect two instances
    assert choose_backend("loopback", role="serve") == "loopback"  # named: taken as asked
    with pytest.raises(mn.InvalidArgumentError, match="unknown backend 'ucz'"):
        choose_backend("ucz", role="local")
    with pytest.raises(mn.InvalidArgumentError, match="role must be serve or local"):
        choose_backend("auto", role="cluster")  # type: ignore[arg-type]
