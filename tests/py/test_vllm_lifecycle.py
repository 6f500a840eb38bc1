"""Full request lifecycles through vLLM 0.33's real Scheduler with MoRIIONativeConnector.

Each test builds a prefill and a decode instance (real Scheduler + worker connector + caches
from vLLM's allocator, loopback engines, real ZMQ control plane on 127.0.0.1), plays the
proxy between them, and checks what a user would notice: the tokens vLLM schedules, the KV
bytes that arrive (and those that must not be touched), and the blocks vLLM frees.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import test_vllm_support as support_module
from moriio_native.control.messages import now_ms
from moriio_native.errors import FailedPreconditionError
from moriio_native.vllm import scheduler as scheduler_module
from test_pd_protocol import break_first_call
from test_vllm_support import (
    BLOCK_SIZE,
    LAYERS_DENSE,
    Side,
    backing_of,
    decode_params,
    dense_specs,
    load,
    mla_specs,
    pd_request_id,
    prefill_params,
    transfer_id,
    write_model_dir,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(Path(tmp_path_factory.mktemp("model")))


@pytest.fixture
def sides(model_dir: str) -> Iterator[list[Side]]:
    made: list[Side] = []
    yield made
    for side in made:
        side.shutdown()


def make_pair(sides: list[Side], model_dir: str, mode: str, **kw: object) -> tuple[Side, Side]:
    p_extra = dict(kw.pop("p_extra", {}) or {})  # type: ignore[call-overload]
    d_extra = dict(kw.pop("d_extra", {}) or {})  # type: ignore[call-overload]
    p = Side("prefill", "kv_producer", mode, model_dir, salt=1, extra=p_extra, **kw)  # type: ignore[arg-type]
    sides.append(p)
    d = Side("decode", "kv_consumer", mode, model_dir, salt=2, extra=d_extra, **kw)  # type: ignore[arg-type]
    sides.append(d)
    return p, d


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 13) % 251 + 1 for i in range(n)]


def run_prefill(p: Side, rid: str, prompt: list[int], tid: str, remote_tp_size: int = 1) -> dict:
    """Prefill leg: one step computes the prompt and finishes the request (max_tokens=1)."""
    p.add_request(rid, prompt, params=prefill_params(tid, remote_tp_size), max_tokens=1)
    result = p.step()
    assert result.scheduled == {rid: len(prompt)}
    finished = result.finished()
    assert rid in finished
    params = finished[rid].kv_transfer_params
    assert params is not None
    return params


LOADING = pytest.mark.parametrize("loading", ["async", "sync"])


# ---- READ -------------------------------------------------------------------------------------


@LOADING
def test_read_prefill_then_decode(sides: list[Side], model_dir: str, loading: str) -> None:
    p, d = make_pair(sides, model_dir, "read", d_extra={"read_loading": loading})
    prompt = prompt_of(40)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    n_blocks = -(-len(prompt) // BLOCK_SIZE)
    # The prefill keeps its blocks for the decode and says where they are.
    assert returned["do_remote_prefill"] is True and returned["transfer_id"] == tid
    assert returned["remote_block_ids"] == p.block_ids(rid)[:n_blocks]
    assert returned["remote_engine_id"] == f"127.0.0.1:{p.handshake_port}"
    assert p.free_blocks() == p.initial_free - n_blocks
    assert p.connector.has_pending_block_frees()  # vLLM may wait for them instead of preempting

    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=3)
    first = load(d, rid)
    # Only the last prompt token is computed locally; the rest was loaded before the forward.
    assert first.scheduled == {rid: 1}
    assert (first.steps == 1) == (loading == "sync")
    assert first.invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    assert d.slot_matches(rid, range(len(prompt) - 1, len(prompt)), d.salt, prompt) == [True]
    assert first.stats is not None and first.stats.data["transfers"] == 1
    assert first.stats.data["bytes"] == n_blocks * sum(s.page_size_bytes for s in d.specs.values())

    # The decode's release frees the prefill's blocks (reported once, then nothing held).
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free
    assert rid not in p.scheduler.requests
    assert not p.connector.has_pending_block_frees()

    results = d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert all(r.scheduled.get(rid, 1) == 1 for r in results)
    assert d.free_blocks() == d.initial_free


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_requests_with_invalid_params_leave_nothing_once_finished(
    sides: list[Side], model_dir: str, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests whose kv_transfer_params are invalid (no transfer_id) run as ordinary ones and
    leave nothing behind: every block back, and not their ids either. The scheduler side logs
    bad params once per request by remembering its id; request_finished forgot it first and
    then parsed the params again, which remembered it for good (50 ids after 50 requests).
    Each request's params are parsed once (vLLM asks about a waiting request every step, and
    params may name up to 2^20 block ids: before, every hook parsed them again)."""
    parsed: list[object] = []
    parse = scheduler_module.parse_kv_transfer_params

    def counted(raw: object) -> object:
        parsed.append(raw)
        return parse(raw)

    monkeypatch.setattr(scheduler_module, "parse_kv_transfer_params", counted)
    side = Side("s", role, "read", model_dir)
    sides.append(side)
    initial = side.free_blocks()
    bad = {"do_remote_prefill": role == "kv_consumer", "do_remote_decode": role == "kv_producer"}
    for i in range(50):
        side.add_request(f"bad-{i}", [i % 7 + 1] * 20, params=dict(bad), max_tokens=1)
    side.run_until(lambda r: not side.scheduler.requests, what="every request finished")
    assert side.free_blocks() == initial
    assert side.connector.scheduler._invalid_logged == set()
    assert len(parsed) == 50
    assert side.connector.scheduler._parsed == {}


def test_listeners_bind_only_the_instance_address(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "read")
    for side in (p, d):
        worker = side.worker.worker
        for listener in (worker._server, worker._listener):
            assert listener._endpoint.startswith("tcp://127.0.0.1:"), listener._endpoint


def test_read_prefix_hit_loads_only_missing_blocks(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(70, seed=3)
    # The decode computed the first 2 blocks' worth of this prompt itself earlier.
    d.add_request("warm", prompt[:40], max_tokens=1)
    d.run_until(lambda r: "warm" in r.finished(), what="warm-up")
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)

    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    first = load(d, rid)
    assert first.scheduled == {rid: 1}
    cached = 2 * BLOCK_SIZE
    # The cached prefix keeps the decode's own KV; only the rest came from the prefill.
    assert all(d.slot_matches(rid, range(cached), d.salt, prompt))
    assert all(d.slot_matches(rid, range(cached, len(prompt) - 1), p.salt, prompt))
    loaded_blocks = -(-len(prompt) // BLOCK_SIZE) - 2
    per_block = sum(s.page_size_bytes for s in d.specs.values())
    assert first.stats.data["bytes"] == loaded_blocks * per_block
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


def test_read_full_prefix_hit_is_notify_only(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(33, seed=5)  # 32 tokens to load = exactly the 2 cached blocks
    d.add_request("warm", [*prompt[:32], 99], max_tokens=1)
    d.run_until(lambda r: "warm" in r.finished(), what="warm-up")
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)

    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    first = d.step()
    assert first.scheduled == {rid: 1}
    assert first.stats is None or first.stats.data["transfers"] == 0
    assert all(d.slot_matches(rid, range(32), d.salt, prompt))
    # Nothing was read, but the prefill still gets its release.
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


def test_read_decode_aborted_before_scheduling_releases_prefill(
    sides: list[Side], model_dir: str
) -> None:
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(20, seed=7)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    assert p.free_blocks() < p.initial_free

    d.add_request(rid, prompt, params=decode_params(tid, returned))
    d.abort(rid)
    d.step()  # carries the release to the worker
    assert d.free_blocks() == d.initial_free
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after abort")
    assert p.free_blocks() == p.initial_free


@LOADING
def test_read_failed_load_is_recomputed(sides: list[Side], model_dir: str, loading: str) -> None:
    p, d = make_pair(sides, model_dir, "read", d_extra={"read_loading": loading})
    prompt = prompt_of(40, seed=9)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    # A block id the prefill never had: the engine refuses the read before moving anything.
    bad = dict(returned)
    bad["remote_block_ids"] = [p.num_blocks + 5, *returned["remote_block_ids"][1:]]
    d.add_request(rid, prompt, params=decode_params(tid, bad), max_tokens=2)
    first = load(d, rid)
    loaded = first.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)]
    assert first.invalid_blocks == set(loaded)
    # vLLM rolls the request back and computes the whole prompt itself.
    assert first.scheduled == {rid: len(prompt)}
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    # The prefill is released all the same.
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after failure")
    assert p.free_blocks() == p.initial_free


@pytest.mark.parametrize("where", ["live part", "ended part"])
def test_read_whose_event_handling_raises_still_ends(
    sides: list[Side], model_dir: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defect in the decode's handling of the engine's event must still end the load and
    release the prefill, instead of leaving the request waiting for its KV for good (a merge
    once made the stats sink raise there). Raised while the READ part was still live, the
    load fails and vLLM recomputes it (the part's bookkeeping is not trusted); raised after the
    part reached ``done`` (the engine's event said done and drained), it is loaded."""
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(40, seed=21)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    puller = d.worker.worker._core.puller
    if where == "live part":
        end_part = puller._end_read_part
        calls = []

        def broken(*args: Any, **kwargs: Any) -> None:
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("the part's bookkeeping broke")
            end_part(*args, **kwargs)

        monkeypatch.setattr(puller, "_end_read_part", broken)
    else:

        def broken_sink(event: Any, groups: int = 1) -> None:
            raise RuntimeError("the stats sink broke")

        monkeypatch.setattr(d.worker.worker._core.ctx.stats, "record_transfer", broken_sink)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    first = load(d, rid)
    if where == "live part":
        assert first.invalid_blocks == set(first.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)])
        assert first.scheduled == {rid: len(prompt)}
        assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    else:
        assert first.invalid_blocks == set()
        assert first.scheduled == {rid: 1}
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after the error")
    assert p.free_blocks() == p.initial_free
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


def restart_prefill(sides: list[Side], p: Side, model_dir: str, salt: int = 3) -> Side:
    """``p`` restarts on the same host and ports (same engine id, new transport metadata and a
    new incarnation per rank); the old process's engine and memory are gone."""
    return restart(sides, p, model_dir, salt)


def restart(sides: list[Side], old: Side, model_dir: str, salt: int) -> Side:
    """``old`` (either role) restarts as :func:`restart_prefill` describes."""
    ports = {"handshake_port": old.handshake_port, "notify_port": old.notify_port}
    sides.remove(old)
    old.shutdown()
    for connector in old.workers:
        connector.worker._engine = None
    restarted = Side(
        old.name,
        old.role,
        old.mode,
        model_dir,
        salt=salt,
        specs=old.specs,
        tp_size=old.tp_size,
        extra={**old.extra, **ports},
    )
    sides.append(restarted)
    del old, connector
    gc.collect()
    return restarted


def test_read_from_a_prefill_restarted_under_the_same_address(
    sides: list[Side], model_dir: str
) -> None:
    """Before: the decode's cached handshake outlived the prefill it named, so the first
    request after the restart was READ from the dead instance's transport and recomputed. The
    request now names the incarnation that computed it: the decode handshakes again first."""
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(40, seed=13)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid, run_prefill(p, rid, prompt, tid)))
    assert load(d, rid).invalid_blocks == set()  # the first prefill served it: handshake cached
    p = restart_prefill(sides, p, model_dir)
    for seed in (14, 15):  # the first request after the restart, and the next
        prompt = prompt_of(40, seed=seed)  # no prefix cache hit on either side
        rid, tid = pd_request_id(p, d), transfer_id()
        params = run_prefill(p, rid, prompt, tid)
        d.add_request(rid, prompt, params=decode_params(tid, params), max_tokens=2)
        loaded = load(d, rid)
        assert loaded.invalid_blocks == set(), f"seed {seed}: recomputed"
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
        assert loaded.stats is not None and loaded.stats.data["failures"] == 0


def test_read_computed_before_the_prefill_restarted_is_recomputed(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill that restarted after computing a request holds other bytes under its block
    ids: the decode must not READ them from the live instance at the same address, whether it
    meets that instance first (no cached handshake) or holds its handshake already."""
    p, d = make_pair(sides, model_dir, "read")
    computed = []
    for seed in (21, 22):  # two requests the first process computed
        prompt = prompt_of(40, seed=seed)
        rid, tid = pd_request_id(p, d), transfer_id()
        computed.append((rid, tid, prompt, run_prefill(p, rid, prompt, tid)))
    old = computed[0][3]["remote_incarnations"]
    p = restart_prefill(sides, p, model_dir)

    def refused(rid: str, tid: str, prompt: list[int], returned: dict, fresh: str = "") -> None:
        caplog.clear()
        d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
        with caplog.at_level(logging.ERROR, logger="moriio_native.pd.puller"):
            loaded = load(d, rid)
        assert loaded.invalid_blocks, f"{tid}: a request computed by the old process was loaded"
        assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))  # recomputed
        why = [r.getMessage() for r in caplog.records if tid in r.getMessage()]
        assert any(
            f"is incarnation {fresh}" in m
            and f"computed by incarnation {old[0]}" in m
            and "restarted after computing it" in m
            and "127.0.0.1" in m
            for m in why
        ), why

    # No cached handshake: the fresh one names another incarnation.
    refused(*computed[0])
    # The fresh handshake stays cached: the next request of the new process loads.
    prompt = prompt_of(40, seed=24)
    rid, tid = pd_request_id(p, d), transfer_id()
    params = run_prefill(p, rid, prompt, tid)
    new = params["remote_incarnations"]
    assert new != old
    d.add_request(rid, prompt, params=decode_params(tid, params), max_tokens=2)
    assert load(d, rid).invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    # The cached handshake names the new incarnation, the request the old: handshaken again,
    # and refused all the same.
    refused(*computed[1], fresh=new[0])


def test_read_without_prefill_incarnations_is_recomputed(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill answer without ``remote_incarnations`` (an older prefill, or a proxy that drops
    the key) is refused before any READ, with the reason, and the prefill is released."""
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(40, seed=31)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    assert len(returned["remote_incarnations"]) == 1
    params = {**decode_params(tid, returned), "remote_incarnations": None}
    d.add_request(rid, prompt, params=params, max_tokens=2)
    with caplog.at_level(logging.ERROR, logger="moriio_native.pd.puller"):
        loaded = load(d, rid)
    assert loaded.invalid_blocks
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    assert any(
        tid in r.getMessage() and "names no prefill incarnation" in r.getMessage()
        for r in caplog.records
    )
    assert loaded.stats is not None and loaded.stats.data.get("transfers", 0) == 0
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after the refusal")
    assert p.free_blocks() == p.initial_free


def test_read_without_prefill_incarnations_is_loaded_when_not_required(
    sides: list[Side], model_dir: str
) -> None:
    """``require_incarnation: false`` (for a proxy that drops the key): such a request is read
    from the prefill that answers the handshake, as before incarnations existed."""
    p, d = make_pair(sides, model_dir, "read", d_extra={"require_incarnation": "false"})
    prompt = prompt_of(40, seed=32)
    rid, tid = pd_request_id(p, d), transfer_id()
    params = {**decode_params(tid, run_prefill(p, rid, prompt, tid)), "remote_incarnations": None}
    d.add_request(rid, prompt, params=params, max_tokens=2)
    assert load(d, rid).invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))


def test_read_after_the_prefill_freed_the_blocks_is_recomputed(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a READ-mode prefill frees a request's blocks abort_timeout after it finished,
    with no release, and a decode that got to the request later still READ those block ids --
    by then free, or another request's -- and loaded whatever they held as this request's KV.
    Now the prefill's answer states until when it holds them (``remote_hold_until_ms``, its
    clock), and the decode reads only if its READ ends, with transfer_timeout and a second to
    spare, before then; otherwise it recomputes, with the reason logged. A request read in
    time loads as before."""
    hold_s, transfer_s = 3.0, 0.5
    p, d = make_pair(
        sides,
        model_dir,
        "read",
        p_extra={"abort_timeout": hold_s},
        d_extra={"transfer_timeout": transfer_s},
    )
    in_time = prompt_of(40, seed=41)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, in_time, tid)
    assert returned["remote_hold_until_ms"] >= now_ms() + hold_s * 1000 - 500
    d.add_request(rid, in_time, params=decode_params(tid, returned), max_tokens=2)
    assert load(d, rid).invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(in_time) - 1), p.salt, in_time))

    late = prompt_of(40, seed=42)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, late, tid)
    # No decode released it: the prefill frees its blocks at abort_timeout.
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="the prefill freeing")
    assert p.free_blocks() == p.initial_free
    d.add_request(rid, late, params=decode_params(tid, returned), max_tokens=2)
    with caplog.at_level(logging.ERROR, logger="moriio_native.pd.puller"):
        loaded = load(d, rid)
    assert loaded.invalid_blocks, "the decode loaded blocks the prefill had freed"
    assert all(d.slot_matches(rid, range(len(late)), d.salt, late))  # recomputed
    assert any(
        tid in r.getMessage() and "not reading blocks it may free" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert loaded.stats is not None and loaded.stats.data.get("transfers", 0) == 0


def test_bad_handshake_metadata_is_logged_and_changes_nothing(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM hands the scheduler what its workers returned: another set of ranks (or another
    connector's metadata) is logged, never raised into vLLM's engine start, and the workers'
    incarnations set before stay."""
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(24, seed=35)
    rid, tid = pd_request_id(p, d), transfer_id()
    before = run_prefill(p, rid, prompt, tid)["remote_incarnations"]
    assert before == [p.worker.worker.core.incarnation]
    with caplog.at_level(logging.ERROR, logger="moriio_native.vllm.scheduler"):
        for bad in ({0: None}, {}, {0: p.worker.get_handshake_metadata(), 1: None}):
            p.connector.set_xfer_handshake_metadata(bad)
    assert caplog.text.count("expected one RankIncarnation for each TP rank [0]") == 3
    rid, tid = pd_request_id(p, d), transfer_id()
    assert run_prefill(p, rid, prompt_of(24, seed=36), tid)["remote_incarnations"] == before


def test_read_tp2_each_rank_names_its_incarnation_across_a_restart(
    sides: list[Side], model_dir: str
) -> None:
    """TP 2: each prefill rank has its own incarnation; after a restart both decode ranks
    handshake again before reading (loaded at once), and a request the old ranks computed is
    recomputed on both."""
    p, d = across_tp_pair(sides, model_dir, "read", 2, 2, "dense")
    prompt = prompt_of(40, seed=41)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid, remote_tp_size=2)
    first = returned["remote_incarnations"]
    assert len(first) == 2 and len(set(first)) == 2
    d.add_request(rid, prompt, params=decode_params(tid, returned, remote_tp_size=2))
    assert load(d, rid).invalid_blocks == set()
    stale_prompt = prompt_of(40, seed=42)
    stale_rid, stale_tid = pd_request_id(p, d), transfer_id()
    stale = run_prefill(p, stale_rid, stale_prompt, stale_tid, remote_tp_size=2)
    p = restart_prefill(sides, p, model_dir)
    prompt = prompt_of(40, seed=43)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid, remote_tp_size=2)
    assert not set(returned["remote_incarnations"]) & set(first)
    d.add_request(rid, prompt, params=decode_params(tid, returned, remote_tp_size=2))
    assert load(d, rid).invalid_blocks == set(), "recomputed after the restart"
    for rank in range(2):
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt, rank, rank))
    d.add_request(stale_rid, stale_prompt, params=decode_params(stale_tid, stale, 2))
    assert load(d, stale_rid).invalid_blocks
    for rank in range(2):
        got = d.slot_matches(stale_rid, range(len(stale_prompt)), d.salt, stale_prompt, rank, rank)
        assert all(got), rank


def test_read_peer_outside_allowlist_is_not_dialled(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(
        sides,
        model_dir,
        "read",
        d_extra={"allowed_peers": ["10.9.9.0/24"]},
        p_extra={"abort_timeout": 2},
    )
    prompt = prompt_of(24, seed=11)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=1)
    first = load(d, rid)
    assert first.invalid_blocks  # refused before any connection: the blocks are recomputed
    server = p.worker.worker._server
    assert server is not None and server.stats()["received"] == 0
    assert p.worker.worker._listener.stats()["received"] == 0
    # The prefill frees its blocks after its abort_timeout instead.
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="abort timeout")
    assert p.free_blocks() == p.initial_free


@pytest.mark.parametrize("mode", ["read", "write"])
def test_instances_accepting_only_allowed_peers_serve_each_other(
    sides: list[Side], model_dir: str, mode: str
) -> None:
    """With accept_only_allowed_peers on both instances and each other's address allowed, a
    request moves as without it: every connection each makes to the other is accepted."""
    accept = {"allowed_peers": ["127.0.0.1/32"], "accept_only_allowed_peers": True}
    p, d = make_pair(sides, model_dir, mode, p_extra=accept, d_extra=accept)
    prompt = prompt_of(40, seed=17)
    rid, tid = pd_request_id(p, d), transfer_id()
    if mode == "read":
        returned = run_prefill(p, rid, prompt, tid)
        d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=3)
    else:
        d.add_request(rid, prompt, params=decode_params(tid), max_tokens=3)
        d.step()  # remote_blocks goes out
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        p.step()
    assert load(d, rid).invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="the prefill's blocks freed")
    assert p.free_blocks() == p.initial_free


def test_a_decode_outside_an_accept_only_prefills_networks_is_never_read(
    sides: list[Side], model_dir: str
) -> None:
    """The prefill accepts connections only from 127.0.0.2: the decode's handshake from
    127.0.0.1 is closed at accept, unread; the decode recomputes, the prefill frees its blocks
    at its abort_timeout."""
    p, d = make_pair(
        sides,
        model_dir,
        "read",
        p_extra={
            "allowed_peers": ["127.0.0.2/32"],
            "accept_only_allowed_peers": True,
            "abort_timeout": 2,
        },
        d_extra={"transfer_timeout": 2},
    )
    prompt = prompt_of(24, seed=19)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=1)
    assert load(d, rid).invalid_blocks  # the handshake timed out: recomputed
    server = p.worker.worker._server
    assert server is not None and server.stats()["received"] == 0
    assert p.worker.worker._listener.stats()["received"] == 0
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="abort timeout")
    assert p.free_blocks() == p.initial_free


# ---- WRITE ------------------------------------------------------------------------------------


def test_write_prefill_and_decode_concurrently(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "write")
    prompt = prompt_of(45, seed=13)
    rid, tid = pd_request_id(p, d), transfer_id()
    # The proxy sends both legs at once; the decode allocates and waits.
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=3)
    first = d.step()
    assert first.scheduled == {}
    assert d.free_blocks() == d.initial_free - 3
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    result = p.step()
    assert rid in result.finished()
    # Prefill blocks stay until the writes are done.
    res = p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    assert p.free_blocks() == p.initial_free
    assert sum(r.stats.data["transfers"] for r in res if r.stats) == 1

    got = d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert got[-1].scheduled == {rid: 1}  # the last prompt token is recomputed
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


@pytest.mark.parametrize("where", ["live job", "ended job"])
def test_write_whose_event_handling_raises_still_ends(
    sides: list[Side], model_dir: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review. Before: an exception while the prefill handled its WRITE's engine
    event was logged and the job left as it was. Raised before the job ended, it stayed in the
    engine's states with no deadline left (the engine had nothing to abort); raised after (at
    the stats sink), the request's count of live jobs was never lowered and no write_done
    sent. Either way the prefill held its blocks for good, and the decode waited out its
    abort_timeout. Now a live job fails (the decode is told write_failed and recomputes), an
    ended one still sends its write_done first (the decode loads), and the blocks are freed."""
    p, d = make_pair(sides, model_dir, "write")  # abort_timeout 30 s: not what frees them
    pusher = p.worker.worker._core.pusher
    if where == "live job":
        calls = break_first_call(monkeypatch, pusher, "on_event")
    else:
        calls = break_first_call(monkeypatch, p.worker.worker._core.ctx.stats, "record_transfer")
    prompt = prompt_of(45, seed=5)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()
    p.run_until(
        lambda r: rid in r.transfer.finished_sending,
        max_wait=10.0,
        what="the prefill's blocks freed after the error",
    )
    assert calls, "the injected fault never ran"
    assert p.free_blocks() == p.initial_free
    loaded = load(d, rid)
    if where == "live job":
        assert loaded.invalid_blocks
        assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))  # recomputed
    else:
        assert loaded.invalid_blocks == set()
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))


# ---- two live requests carrying one transfer id -----------------------------------------------
# Both instances keep a transfer's state by its id alone. A second live request with the id of
# another (a retried or duplicated request, a client's own params) took over the first one's
# records or was dropped: the prefill stranded blocks past abort_timeout, the decode waited for
# good, and a synchronous READ computed on blocks that were never loaded. The second now runs
# as an ordinary request, and the first as if alone.


def test_a_prefill_request_reusing_a_live_transfer_id_runs_without_transfer(
    sides: list[Side], model_dir: str
) -> None:
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(40, seed=1)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    held = p.initial_free - p.free_blocks()
    again = pd_request_id(p, d)
    p.add_request(again, prompt_of(40, seed=2), params=prefill_params(tid), max_tokens=1)
    finished = p.run_until(lambda r: again in r.finished(), what="the second request")[-1]
    assert finished.finished()[again].kv_transfer_params is None  # nothing for a decode to read
    assert p.initial_free - p.free_blocks() == held  # its blocks freed at once

    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    assert load(d, rid).invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert p.free_blocks() == p.initial_free and d.free_blocks() == d.initial_free


@LOADING
def test_a_decode_request_reusing_a_live_transfer_id_is_computed_locally(
    sides: list[Side], model_dir: str, loading: str
) -> None:
    p, d = make_pair(sides, model_dir, "read", d_extra={"read_loading": loading})
    prompt, other = prompt_of(40, seed=11), prompt_of(40, seed=12)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    again = pd_request_id(p, d)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    d.add_request(again, other, params=decode_params(tid, returned), max_tokens=2)
    computed: dict[str, int] = {}

    def both_ran(r: Any) -> bool:
        for req, n in r.scheduled.items():
            computed.setdefault(req, n)
        return rid in computed and again in computed

    d.run_until(both_ran, what="both requests to run")
    assert computed == {rid: 1, again: len(other)}  # the second computes its whole prompt
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    d.run_until(lambda r: not d.scheduler.requests, what="decode to finish")
    assert p.free_blocks() == p.initial_free and d.free_blocks() == d.initial_free


def test_a_decode_request_reusing_the_id_of_an_aborted_load_still_running_is_recomputed(
    sides: list[Side], model_dir: str
) -> None:
    """The scheduler side frees a transfer id when its request ends, but an aborted READ may
    still run on the workers (its batches in flight). A request that takes the id meanwhile
    fails its load at once (recomputed) instead of being dropped by the workers, which left it
    waiting for good; the aborted one ends as before and the prefill gets its release."""
    p, d = make_pair(
        sides, model_dir, "read", d_extra={"engine_options": {"loopback_delay_ms": "1500"}}
    )
    prompt = prompt_of(40, seed=21)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    d.step()  # the READ starts; each batch takes 1.5 s
    d.abort(rid)
    again = pd_request_id(p, d)  # the same prompt: its answer is for it (remote_prompt_digest)
    d.add_request(again, prompt, params=decode_params(tid, returned), max_tokens=2)
    second = load(d, again)
    assert second.invalid_blocks  # its load failed at once: recomputed
    assert all(d.slot_matches(again, range(len(prompt)), d.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release of the aborted READ")
    d.run_until(lambda r: not d.scheduler.requests, what="decode to finish")
    d.run_until(lambda r: d.free_blocks() == d.initial_free, what="the aborted load's blocks")
    assert p.free_blocks() == p.initial_free


def test_a_write_decode_request_reusing_a_live_transfer_id_is_computed_locally(
    sides: list[Side], model_dir: str
) -> None:
    p, d = make_pair(sides, model_dir, "write")
    prompt, other = prompt_of(45, seed=7), prompt_of(45, seed=8)
    rid, tid = pd_request_id(p, d), transfer_id()
    again = pd_request_id(p, d)
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.add_request(again, other, params=decode_params(tid), max_tokens=2)
    assert d.step().scheduled == {again: len(other)}  # the first waits for the writes
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    got = d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert got[-1].scheduled[rid] == 1
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    d.run_until(lambda r: not d.scheduler.requests, what="decode to finish")
    assert p.free_blocks() == p.initial_free and d.free_blocks() == d.initial_free


def write_request(p: Side, d: Side, seed: int) -> bool:
    """One WRITE request, both legs at once; whether the decode got the prefill's bytes (else
    it recomputed them after a reported load error). Both sides end with every block free."""
    prompt = prompt_of(45, seed=seed)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="the prefill's job ended")
    failed: list[bool] = []

    def resumed(r: Any) -> bool:
        failed.append(rid in r.transfer.failed_recving)
        return rid in r.scheduled

    d.run_until(resumed, what="decode to resume")
    loaded = not any(failed) and all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    if not loaded:
        assert any(failed) and all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert p.free_blocks() == p.initial_free and d.free_blocks() == d.initial_free
    return loaded


def test_write_after_an_unnoticed_decode_restart_is_loaded(
    sides: list[Side], model_dir: str
) -> None:
    """WRITE: the first request after a decode restart under the same address that neither
    side noticed (each caches the other's handshake) is loaded: the prefill handshakes the
    decode again when remote_blocks names another decode incarnation."""
    p, d = make_pair(sides, model_dir, "write")
    assert write_request(p, d, seed=51)
    d = restart(sides, d, model_dir, salt=4)
    assert write_request(p, d, seed=52), "the first request after the decode restarted"
    assert write_request(p, d, seed=53)


def test_write_after_an_unnoticed_prefill_restart_is_announced_again_and_loaded(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """WRITE: the decode's cached handshake names the prefill process before the restart, and
    so does its remote_blocks: the new process writes nothing for it (only the process the
    decode handshook may write for an announcement, so that its death ends the writes) and
    answers misaddressed, keeping the job; the decode handshakes the new process and announces
    its blocks to it, which writes them. Before: that request was recomputed."""
    p, d = make_pair(sides, model_dir, "write")
    assert write_request(p, d, seed=51)
    p = restart(sides, p, model_dir, salt=3)
    with caplog.at_level(logging.WARNING, logger="moriio_native.pd"):
        assert write_request(p, d, seed=52), "the first request after the prefill restarted"
    assert "asking the decode to announce its blocks again" in caplog.text
    assert "announcing the blocks to the new process" in caplog.text
    assert write_request(p, d, seed=53)


def test_write_into_a_decode_restarted_after_announcing_is_refused(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode announced its blocks, then restarted under the same address before the
    prefill wrote: the process answering there now never announced them (its blocks of those
    ids hold other data), so the prefill writes nothing into it and frees its blocks."""
    p, d = make_pair(sides, model_dir, "write")
    # The prefill holds no handshake of the decode yet (with one of the announcing process, it
    # would write into that process's dead endpoint and fail: safe too).
    prompt = prompt_of(45, seed=62)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()  # remote_blocks goes out
    pusher = p.worker.worker.core.pusher
    wait = time.monotonic() + 20
    while tid not in pusher.job_states():  # the announcement's orphan job
        assert time.monotonic() < wait, "the prefill never got remote_blocks"
        time.sleep(0.01)
    d = restart(sides, d, model_dir, salt=4)
    before = backing_of(d).clone()
    with caplog.at_level(logging.WARNING, logger="moriio_native.pd.pusher"):
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        p.run_until(lambda r: rid in r.transfer.finished_sending, what="the refused job ended")
    assert any(
        tid in r.getMessage() and "the decode restarted since; not writing" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    assert p.free_blocks() == p.initial_free
    assert torch.equal(backing_of(d), before)  # not one byte written into the new process


def test_write_prefix_hit_announces_only_missing_tail(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "write")
    prompt = prompt_of(60, seed=17)
    d.add_request("warm", prompt[:35], max_tokens=1)
    d.run_until(lambda r: "warm" in r.finished(), what="warm-up")
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.step()
    res = p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    per_block = sum(s.page_size_bytes for s in p.specs.values())
    moved = sum(r.stats.data["bytes"] for r in res if r.stats)
    layers = len(p.specs)
    assert moved == (4 - 2) * per_block, (moved, per_block, layers)
    d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert all(d.slot_matches(rid, range(32), d.salt, prompt))
    assert all(d.slot_matches(rid, range(32, len(prompt) - 1), p.salt, prompt))


def test_write_decode_aborted_while_waiting_frees_once(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "write")
    prompt = prompt_of(30, seed=19)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=3)
    d.step()
    held = d.initial_free - d.free_blocks()
    assert held == 2
    d.abort(rid)
    # The prefill may still be writing into those blocks: vLLM keeps them until we report.
    assert d.free_blocks() == d.initial_free - held
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.step()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    d.run_until(lambda r: rid in r.transfer.finished_recving, what="write_done after abort")
    assert d.free_blocks() == d.initial_free
    assert rid not in d.scheduler.requests
    for _ in range(3):  # nothing is freed twice
        d.step()
    assert d.free_blocks() == d.initial_free


def test_write_decode_aborted_before_scheduling_releases_prefill(
    sides: list[Side], model_dir: str
) -> None:
    p, d = make_pair(sides, model_dir, "write")
    prompt = prompt_of(30, seed=23)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()
    assert p.free_blocks() < p.initial_free
    d.add_request(rid, prompt, params=decode_params(tid))
    d.abort(rid)
    d.step()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


def test_write_prefill_failure_makes_decode_recompute(sides: list[Side], model_dir: str) -> None:
    p, d = make_pair(sides, model_dir, "write")
    prompt = prompt_of(36, seed=29)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    engine = p.worker.worker.engine

    def broken_write(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("injected transport failure")

    # Both posts fail: a layer at a time, and several at once (layers computed before the
    # decode's blocks reached the prefill).
    engine.write_layer = broken_write  # type: ignore[method-assign]
    engine.write_layers = broken_write  # type: ignore[method-assign]
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.step()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="failed job reported")
    assert p.free_blocks() == p.initial_free
    res = d.run_until(lambda r: rid in r.transfer.failed_recving, what="write_failed")
    assert rid in res[-1].transfer.finished_recving
    nxt = d.step()
    assert nxt.scheduled == {rid: len(prompt)}  # recomputed from scratch
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))


@pytest.mark.parametrize("announced", ["before", "after"])
def test_write_prefill_aborted_mid_prefill_decode_recomputes_at_once(
    sides: list[Side], model_dir: str, announced: str
) -> None:
    """The prefill's request is aborted before its last prompt chunk (nothing was handed to
    the workers; its blocks are freed at once), with the decode's announcement before or
    after the abort. Before: the prefill's workers never heard of the abort, and the decode
    held its blocks for its abort_timeout (600 s here, beyond the test's wait). Now the
    scheduler tells the workers, which answer the decode write_failed: it recomputes at
    once."""
    p, d = make_pair(
        sides, model_dir, "write", d_extra={"abort_timeout": 600}, max_num_batched_tokens=32
    )
    prompt = prompt_of(80, seed=31)
    rid, tid = pd_request_id(p, d), transfer_id()
    if announced == "before":
        d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
        d.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert p.step().scheduled == {rid: 32}  # first chunk only
    p.abort(rid)
    p.step()
    assert p.free_blocks() == p.initial_free  # nothing was handed over: freed at once
    if announced == "after":
        d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    res = d.run_until(lambda r: rid in r.transfer.failed_recving, max_wait=60, what="write_failed")
    assert rid in res[-1].transfer.finished_recving
    assert d.step().scheduled == {rid: 32}  # recomputing (chunked)
    for _ in range(3):  # the prefill reports nothing for the request vLLM freed
        assert not p.step().transfer.finished_sending
    assert p.free_blocks() == p.initial_free


def test_write_announced_after_the_prefill_gave_up_is_recomputed_at_once(
    sides: list[Side], model_dir: str
) -> None:
    """The decode leg reaches the decode only after the prefill's job gave up on it (the
    prefill's abort_timeout passed without remote_blocks; its blocks are free). Before: the
    prefill's listener dropped the late announcement (its transfer was terminal), and the
    decode held its blocks for its own abort_timeout (120 s by default; 600 s here, beyond
    the test's wait) before recomputing. Now the prefill answers write_failed at once: the
    decode recomputes, writing nothing of the prefill's, and frees every block."""
    p, d = make_pair(
        sides,
        model_dir,
        "write",
        p_extra={"abort_timeout": 5},
        d_extra={"abort_timeout": 600},
    )
    prompt = prompt_of(40, seed=37)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="the prefill gave up")
    assert p.free_blocks() == p.initial_free
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    res = d.run_until(lambda r: rid in r.transfer.failed_recving, max_wait=60, what="write_failed")
    assert rid in res[-1].transfer.finished_recving
    assert d.step().scheduled == {rid: len(prompt)}  # recomputed from scratch
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


def test_write_announced_after_the_forward_posts_every_layer_in_one_call(
    sides: list[Side], model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode's blocks arrive after the prefill's forward (the decode leg came later):
    every layer is pending at once, and the prefill posts them in ONE write_layers call (one
    plan, a few batches) instead of a write_layer per layer; the decode gets every byte and
    both sides free every block."""
    import moriio_native as mn

    p, d = make_pair(sides, model_dir, "write")
    posted: list[list[str]] = []
    real = mn.Engine.write_layers

    def write_layers(self: Any, tid: str, layers: list[str], *a: Any, **k: Any) -> bool:
        posted.append(list(layers))
        return real(self, tid, layers, *a, **k)

    monkeypatch.setattr(mn.Engine, "write_layers", write_layers)
    prompt = prompt_of(45, seed=53)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()  # the forward ran; no decode blocks known yet
    assert posted == []
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()  # allocates and announces its blocks
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    assert len(posted) == 1 and sorted(posted[0]) == sorted(p.layer_names)
    d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert p.free_blocks() == p.initial_free and d.free_blocks() == d.initial_free


def test_write_posts_each_layer_only_after_its_event(
    sides: list[Side], model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each layer's write waits for the CUDA event recorded after that layer; here a
    stand-in event holds the writer until the test lets it go."""
    p, d = make_pair(sides, model_dir, "write")
    gate = threading.Event()
    synchronized: list[int] = []

    class HeldEvent:
        def synchronize(self) -> None:
            synchronized.append(1)
            gate.wait(60)

    monkeypatch.setattr(p.worker.worker, "_record_event", lambda tensor: HeldEvent())
    prompt = prompt_of(40, seed=37)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.step()
    deadline = time.monotonic() + 20
    while not synchronized and time.monotonic() < deadline:
        time.sleep(0.01)
    assert synchronized  # the writer is waiting on the first layer's event
    for _ in range(3):
        assert not p.step().transfer.finished_sending
        assert not d.step().transfer.finished_recving
    assert not any(d.slot_matches(rid, range(len(prompt)), p.salt, prompt))  # nothing written
    gate.set()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes after the events")
    assert len(synchronized) == len(p.layer_names)
    d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))


def test_unplannable_load_is_recomputed_not_guessed(
    sides: list[Side], model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If block lists ever disagree with the token counts, nothing is moved: the blocks are
    reported failed (vLLM recomputes) and the prefill is released."""
    p, d = make_pair(sides, model_dir, "read")
    prompt = prompt_of(40, seed=41)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    real = d.connector.scheduler.update_state_after_alloc

    class Short:
        def __init__(self, blocks: object) -> None:
            self.ids = blocks.get_block_ids()  # type: ignore[attr-defined]

        def get_block_ids(self) -> tuple[list[int], ...]:
            return (self.ids[0][:1],)  # one block where three are needed

    monkeypatch.setattr(
        d.connector.scheduler,
        "update_state_after_alloc",
        lambda request, blocks, n: real(request, Short(blocks), n),
    )
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=1)
    first = load(d, rid)
    assert first.invalid_blocks == {first.blocks[0]}
    assert first.stats is not None and first.stats.data["transfers"] == 0
    assert first.scheduled == {rid: len(prompt)}
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


# ---- tensor parallelism -----------------------------------------------------------------------
# Two TP ranks per instance, each with its own caches holding other bytes (see rank_salt), as
# each rank holds its own shard of the heads. Rank r must pair with the peer's rank r: its own
# handshake and notify ports, its own shard, its own release or write_done.


def test_write_tp2_each_prefill_rank_writes_its_decode_rank(
    sides: list[Side], model_dir: str
) -> None:
    p, d = make_pair(sides, model_dir, "write", tp_size=2)
    prompt = prompt_of(45, seed=6)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid, remote_tp_size=2), max_tokens=3)
    assert d.step().scheduled == {}
    p.add_request(rid, prompt, params=prefill_params(tid, remote_tp_size=2), max_tokens=1)
    assert rid in p.step().finished()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="both ranks' writes done")
    assert p.free_blocks() == p.initial_free

    got = d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert got[-1].scheduled == {rid: 1}
    for rank in (0, 1):
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt, rank=rank)), rank
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


# READ across TP ranks: decode rank r reads prefill rank r mod P (rank r when the sizes are
# equal; different sizes need caches every rank holds whole), and every prefill rank, read or
# not, frees its blocks once its decode ranks released.


def across_tp_pair(
    sides: list[Side],
    model_dir: str,
    mode: str,
    prefill_tp: int,
    decode_tp: int,
    caches: str = "mla",
) -> tuple[Side, Side]:
    """A prefill and a decode with these TP sizes, MLA caches (``caches="mla"``) or the dense
    ones (``"dense"``), and an abort_timeout far beyond the test: a prefill rank that misses a
    release keeps its blocks (and run_until fails) instead of a timeout freeing them."""
    specs = mla_specs() if caches == "mla" else dense_specs()
    extra = {"abort_timeout": 600}
    made = []
    for name, role, salt, tp in (
        ("prefill", "kv_producer", 1, prefill_tp),
        ("decode", "kv_consumer", 2, decode_tp),
    ):
        side = Side(name, role, mode, model_dir, salt=salt, specs=specs, tp_size=tp, extra=extra)
        sides.append(side)
        made.append(side)
    return made[0], made[1]


@pytest.mark.parametrize(
    ("caches", "prefill_tp", "decode_tp"),
    [("dense", 2, 2), ("mla", 2, 1), ("mla", 1, 2), ("mla", 4, 2)],
)
def test_read_across_tp_ranks(
    sides: list[Side], model_dir: str, caches: str, prefill_tp: int, decode_tp: int
) -> None:
    # Equal sizes pair rank r with rank r (any caches); MLA caches also pair across sizes.
    p, d = across_tp_pair(sides, model_dir, "read", prefill_tp, decode_tp, caches)
    prompt = prompt_of(40, seed=7)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid, remote_tp_size=decode_tp)

    params = decode_params(tid, returned, remote_tp_size=prefill_tp)
    d.add_request(rid, prompt, params=params, max_tokens=3)
    first = load(d, rid)
    assert first.scheduled == {rid: 1}
    assert first.invalid_blocks == set()
    for rank in range(decode_tp):
        source = rank % prefill_tp
        got = d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt, rank, source)
        assert all(got), (rank, source)
    assert first.stats is not None and first.stats.data["transfers"] == decode_tp  # one per rank

    p.run_until(lambda r: rid in r.transfer.finished_sending, what="every prefill rank released")
    assert p.free_blocks() == p.initial_free
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


def test_read_split_heads_across_tp_sizes_is_recomputed(sides: list[Side], model_dir: str) -> None:
    # The prefill's TP 2 ranks each hold both KV heads of the 2-head model: not vLLM's split,
    # so its head ranges are unknown and the handshake across TP sizes is refused.
    p, d = across_tp_pair(sides, model_dir, "read", 2, 1, "dense")
    prompt = prompt_of(40, seed=8)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid, remote_tp_size=1)
    d.add_request(rid, prompt, params=decode_params(tid, returned, remote_tp_size=2), max_tokens=2)
    first = load(d, rid)
    assert first.invalid_blocks == set(first.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)])
    assert first.scheduled == {rid: len(prompt)}  # computed locally, nothing guessed
    # Both prefill ranks are released all the same.
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after refusal")
    assert p.free_blocks() == p.initial_free


def _head_slot_specs(num_kv_heads: int) -> dict[str, Any]:
    """Dense layers whose page keeps each head's K and V in separate head slots (vLLM 0.33's
    FlashInfer NVFP4 page: ``num_head_slots = 2 * num_kv_heads``, K of head h in slot h, V in
    slot H + h), with fp16 content so the fake forward fills it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {
        name: FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=num_kv_heads,
            head_size=16,
            dtype=torch.float16,
            num_head_slots=2 * num_kv_heads,
            state_content_bytes=16 * 2,
        )
        for name in LAYERS_DENSE
    }


@pytest.mark.parametrize("mode", ["read", "write"])
def test_pages_with_a_slot_per_k_and_v_head_across_tp_sizes_are_recomputed(
    sides: list[Side], model_dir: str, mode: str
) -> None:
    """A page that keeps each head's K and V in separate slots holds vLLM's share of the KV
    heads per rank, but a head range is not one range of its slots: a decode rank's head
    window, applied to the slot axis, took its heads' K slots and never their V slots. Before
    (a review, 2026-12-07) a prefill TP 1 -> decode TP 2 READ was reported loaded with every V
    cell of both decode ranks never written. Such pages are now refused across TP sizes
    (recomputed), as pages of unknown head ranges are."""
    p = Side("prefill", "kv_producer", mode, model_dir, salt=1, specs=_head_slot_specs(2))
    sides.append(p)
    d = Side("decode", "kv_consumer", mode, model_dir, salt=2, specs=_head_slot_specs(1), tp_size=2)
    sides.append(d)
    prompt = prompt_of(40, seed=12)
    rid, tid = pd_request_id(p, d), transfer_id()
    if mode == "read":
        returned = run_prefill(p, rid, prompt, tid, remote_tp_size=2)
        d.add_request(rid, prompt, params=decode_params(tid, returned, remote_tp_size=1))
        first = load(d, rid)
    else:
        p.add_request(rid, prompt, params=prefill_params(tid, remote_tp_size=2), max_tokens=1)
        assert rid in p.step().finished()
        d.add_request(rid, prompt, params=decode_params(tid, remote_tp_size=1), max_tokens=2)
        first = load(d, rid, before_forward=p.step)
    assert first.scheduled == {rid: len(prompt)}, "loaded from pages moved by the wrong slots"
    deadline = time.monotonic() + 30
    while p.free_blocks() != p.initial_free:
        assert time.monotonic() < deadline, f"the prefill's blocks were never freed ({mode})"
        d.step()
        p.step()


def test_a_write_across_tp_and_block_sizes_fails_its_job_not_the_forward(
    sides: list[Side], model_dir: str
) -> None:
    """Prefill TP 1 with 16-token blocks, decode TP 2 with 32-token blocks, WRITE: neither the
    handshake nor the TP plan refuses the pair, and a layer's write cannot be planned (the
    head windows of the TP change meet the token windows of the block-size change) only when
    the prefill stages it, inside the worker's save_kv_layer hook. Before (a review,
    2026-12-07) that FailedPreconditionError went up into vLLM's forward, which would end the
    engine. Now the job fails, the decode recomputes, and the prefill's blocks are freed."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def dense(heads: int, block_size: int) -> dict[str, Any]:
        return {
            name: FullAttentionSpec(
                block_size=block_size, num_kv_heads=heads, head_size=16, dtype=torch.float16
            )
            for name in LAYERS_DENSE
        }

    p = Side("prefill", "kv_producer", "write", model_dir, salt=1, specs=dense(2, 16))
    sides.append(p)
    d = Side(
        "decode",
        "kv_consumer",
        "write",
        model_dir,
        salt=2,
        specs=dense(1, 32),
        tp_size=2,
        block_size=32,
    )
    sides.append(d)
    for seed in (1, 2):  # the second request finds the handshake cached
        prompt = prompt_of(40, seed=seed)
        rid, tid = pd_request_id(p, d), transfer_id()
        d.add_request(rid, prompt, params=decode_params(tid, remote_tp_size=1), max_tokens=2)
        assert rid not in d.step().scheduled  # it announces its blocks to the prefill
        p.add_request(rid, prompt, params=prefill_params(tid, remote_tp_size=2), max_tokens=1)
        deadline = time.monotonic() + 30
        while True:  # the prefill's steps run its forward: nothing may raise from them
            p.step()
            scheduled = d.step().scheduled
            if rid in scheduled:
                break
            assert time.monotonic() < deadline, "the decode never went on"
        assert scheduled[rid] == len(prompt), "loaded from writes that were refused"
        while rid not in p.reports["finished_sending"]:
            assert time.monotonic() < deadline, "the prefill never freed the request's blocks"
            d.step()
            p.step()
    assert p.free_blocks() == p.initial_free


def test_write_mla_across_tp_sizes_loads_and_frees_every_prefill_rank(
    sides: list[Side], model_dir: str
) -> None:
    # The MLA-only model across TP sizes in WRITE: decode rank 0 takes the whole caches from
    # prefill rank 0; prefill rank 1, which no decode rank needs, frees on its own.
    p, d = across_tp_pair(sides, model_dir, "write", 2, 1)
    prompt = prompt_of(40, seed=9)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid, remote_tp_size=1), max_tokens=1)
    assert rid in p.step().finished()
    d.add_request(rid, prompt, params=decode_params(tid, remote_tp_size=2), max_tokens=2)
    got = d.run_until(lambda r: rid in r.scheduled, what="the decode to resume")
    assert got[-1].scheduled == {rid: 1}  # loaded: only the last prompt token is computed
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt, 0, 0))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="both prefill ranks freed")
    assert p.free_blocks() == p.initial_free
    assert p.rank_reports[0]["finished_sending"][rid] == 1
    assert p.rank_reports[1]["finished_sending"][rid] == 1


def test_write_backpressure_on_a_full_writer_queue_does_not_deadlock(
    sides: list[Side], model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 12 defect 6: the prefill computes before the decode's blocks arrive, so their
    arrival queues every layer's write and the seal at once -- more than a writer queue of one
    entry holds. The thread queueing them must wait for room without holding the lock the
    writer thread takes after each get."""
    import moriio_native.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "_WRITER_QUEUE", 1)
    p, d = make_pair(sides, model_dir, "write")
    prompt = prompt_of(40, seed=41)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()  # computed; nothing to write to yet
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()  # announces the blocks: the prefill queues both layers and the seal
    sent = threading.Event()

    def prefill_steps() -> None:
        p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
        sent.set()

    threading.Thread(target=prefill_steps, daemon=True).start()
    assert sent.wait(60), "the prefill worker deadlocked on its full writer queue"
    d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))


# ---- quarantine (issue 12 defect 3) -------------------------------------------------------------
# A delayed loopback backend (each batch sleeps 1.5 s) with a 0.4 s transfer timeout makes the
# engine end the transfer at 0.8 s while its batches are in flight (drained=False). The tests
# watch from the outside: while the writer's engine still counts the transfer as quarantined,
# vLLM must not have been told the load ended (no load error, no finished/failed receive, blocks
# still allocated); afterwards the blocks are recomputed and freed normally.

DELAYED = {"transfer_timeout": 0.4, "engine_options": {"loopback_delay_ms": "1500"}}


class DrainNoticeFirst:
    """An engine whose undrained terminal events reach the worker only after their drain notice
    (the two come from separate queues, so this order happens; here it is forced)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._held: dict[str, Any] = {}
        self._drained: set[str] = set()

    def poll_events(self, *args: Any, **kwargs: Any) -> list[Any]:
        ready = [self._held.pop(tid) for tid in list(self._held) if tid in self._drained]
        for event in self._engine.poll_events(*args, **kwargs):
            if event.drained:
                ready.append(event)
            else:
                self._held[event.transfer_id] = event
        return ready

    def poll_drained(self, *args: Any, **kwargs: Any) -> list[Any]:
        notices = self._engine.poll_drained(*args, **kwargs)
        self._drained.update(n.transfer_id for n in notices)
        return notices

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def drain_notices_first(side: Side) -> None:
    worker = side.worker.worker
    worker._engine = DrainNoticeFirst(worker._engine)


def delayed_read(
    sides: list[Side], model_dir: str, d_extra: dict[str, Any], notice_first: bool
) -> tuple[Side, Side, str, list[int]]:
    """A prefilled request whose decode READ (over the delayed loopback) ends quarantined."""
    p, d = make_pair(sides, model_dir, "read", d_extra=d_extra)
    if notice_first:
        drain_notices_first(d)
    prompt = prompt_of(40, seed=3)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    returned = p.step().finished()[rid].kv_transfer_params
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    return p, d, rid, prompt


def recomputed_after_the_drain(p: Side, d: Side, rid: str, prompt: list[int]) -> None:
    """After a quarantined READ drained: the decode recomputed the request (its own bytes),
    the prefill got its release, and every block comes back once the request finishes."""
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after the drain")
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


@pytest.mark.parametrize("notice_first", [False, True], ids=["event_first", "notice_first"])
def test_read_quarantined_blocks_are_reported_only_after_the_drain(
    sides: list[Side], model_dir: str, notice_first: bool
) -> None:
    """Asynchronous READ: the steps go on while the READ is quarantined, and none of them
    reports the load (finished/failed receiving, load error) before the engine's drain."""
    p, d, rid, prompt = delayed_read(sides, model_dir, DELAYED, notice_first)
    engine = d.worker.worker.engine
    n_load = -(-(len(prompt) - 1) // BLOCK_SIZE)
    saw_quarantine, steps_in_quarantine, quarantined_blocks = False, 0, 0
    invalid: set[int] = set()
    loaded: list[int] = []
    deadline = time.monotonic() + 60
    while True:
        result = d.step()
        if not loaded:
            loaded = d.block_ids(rid)[:n_load]
        # Read after the step: a quarantine still open now was open when the step reported.
        quarantined = engine.quarantined_transfers
        reported = bool(result.invalid_blocks) or rid in result.transfer.finished_recving
        assert not (reported and quarantined), "load reported before the drain"
        saw_quarantine = saw_quarantine or bool(quarantined)
        steps_in_quarantine += bool(quarantined)
        invalid |= result.invalid_blocks
        if result.stats is not None:
            quarantined_blocks += result.stats.data["quarantined_blocks"]
        if rid in result.scheduled:
            break
        assert time.monotonic() < deadline, "the quarantined READ never ended"
        time.sleep(0.005)
    assert saw_quarantine, "the READ never ended quarantined (is the delay long enough?)"
    assert steps_in_quarantine >= 1  # the steps did not wait for the drain
    assert invalid == set(loaded)  # a load error, once it drained
    # Counted as quarantined only when the worker learned of the end before the drain.
    assert quarantined_blocks == (0 if notice_first else len(loaded))
    assert result.scheduled == {rid: len(prompt)}  # recomputed, after the drain
    recomputed_after_the_drain(p, d, rid, prompt)


@pytest.mark.parametrize("notice_first", [False, True], ids=["event_first", "notice_first"])
def test_sync_read_quarantined_blocks_are_reported_only_after_the_drain(
    sides: list[Side], model_dir: str, notice_first: bool
) -> None:
    """Synchronous READ: the step waits for the drain -- also past quarantine_timeout (here
    shorter than the drain), where it used to raise into vLLM's step."""
    extra = {**DELAYED, "read_loading": "sync", "quarantine_timeout": 0.2}
    p, d, rid, prompt = delayed_read(sides, model_dir, extra, notice_first)
    engine = d.worker.worker.engine
    results: list = []
    stepper = threading.Thread(target=lambda: results.append(d.step()), daemon=True)
    stepper.start()
    saw_quarantine = False
    while stepper.is_alive():
        returned_now = not stepper.is_alive()
        quarantined = engine.quarantined_transfers
        # The step (which reports load errors to vLLM) must not end while the READ is
        # quarantined: vLLM would recompute into blocks the transport may still write.
        assert not (returned_now and quarantined), "load reported before the drain"
        saw_quarantine = saw_quarantine or bool(quarantined)
        time.sleep(0.005)
    stepper.join(30)
    assert saw_quarantine, "the READ never ended quarantined (is the delay long enough?)"
    assert engine.quarantined_transfers == 0
    first = results[0]
    loaded = d.block_ids(rid)[: -(-(len(prompt) - 1) // BLOCK_SIZE)]
    assert first.invalid_blocks == set(loaded)  # a load error, now that it drained
    # Counted as quarantined only when the worker learned of the end before the drain.
    quarantined_blocks = 0 if notice_first else len(loaded)
    assert first.stats is not None and first.stats.data["quarantined_blocks"] == quarantined_blocks
    second = d.step()
    assert second.scheduled == {rid: len(prompt)}  # recomputed, after the drain
    recomputed_after_the_drain(p, d, rid, prompt)


@pytest.mark.parametrize("notice_first", [False, True], ids=["event_first", "notice_first"])
def test_write_quarantined_blocks_are_freed_only_after_the_prefill_drained(
    sides: list[Side], model_dir: str, notice_first: bool
) -> None:
    p, d = make_pair(sides, model_dir, "write", p_extra=DELAYED, d_extra={"abort_timeout": 1})
    if notice_first:
        drain_notices_first(p)
    prompt = prompt_of(40, seed=5)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    held = d.initial_free - d.free_blocks()
    assert held == 3
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.step()
    p_engine = p.worker.worker.engine
    saw_quarantine = False
    quarantined_blocks = 0
    deadline = time.monotonic() + 60
    while True:
        result = d.step()
        if result.stats is not None:
            quarantined_blocks += result.stats.data["quarantined_blocks"]
        freed = rid in result.transfer.finished_recving
        # Read after the step: a quarantine still open now was open when the step ended.
        quarantined = p_engine.quarantined_transfers
        saw_quarantine = saw_quarantine or bool(quarantined)
        if freed:
            assert not quarantined, "decode blocks handed back while the prefill still writes"
            assert rid in result.transfer.failed_recving  # recomputed, not used
            break
        assert d.free_blocks() == d.initial_free - held, "blocks freed before the drain"
        assert not result.scheduled, "recomputing into blocks that may still be written"
        assert time.monotonic() < deadline, "the quarantine never ended"
        time.sleep(0.01)
    assert saw_quarantine, "the WRITE never ended quarantined (is the delay long enough?)"
    assert quarantined_blocks == held
    nxt = d.step()
    assert nxt.scheduled == {rid: len(prompt)}  # recomputed from scratch, after the drain
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="prefill blocks after drain")
    assert p.free_blocks() == p.initial_free
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


# ---- asynchronous READ (issue 17) ---------------------------------------------------------------


def test_read_from_a_prefill_that_never_answers_costs_only_its_own_request(
    sides: list[Side], model_dir: str
) -> None:
    """The decode batch keeps producing tokens while a new request's READ waits on a prefill
    that never answers (a socket that accepts and stays silent); that request alone waits,
    then gets a load error after transfer_timeout and is recomputed, its blocks freed once."""
    import socket

    from moriio_native.control.addressing import ZmqAddress, format_request_id
    from moriio_native.vllm.prompt_digest import prompt_digest
    from net_support import free_port
    from test_prompt_digest import as_request

    d = Side("decode", "kv_consumer", "read", model_dir, salt=2, extra={"transfer_timeout": 3})
    sides.append(d)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        dead_port = silent.getsockname()[1]
        dead = ZmqAddress("127.0.0.1", dead_port, free_port())
        rid, tid = format_request_id(dead, d.zmq_address()), transfer_id()
        prompt = prompt_of(40, seed=21)
        n_load = -(-(len(prompt) - 1) // BLOCK_SIZE)
        answer = {
            "remote_engine_id": f"127.0.0.1:{dead_port}",
            "remote_block_ids": list(range(n_load)),
            "transfer_id": tid,
            "remote_incarnations": ["ab" * 16],
            "remote_num_tokens": len(prompt),
            "remote_prompt_digest": prompt_digest(as_request(rid, prompt), len(prompt)),
        }
        running = 0
        d.add_request("running-0", prompt_of(20, seed=22), max_tokens=64)
        d.step()  # its prompt
        d.add_request(rid, prompt, params=decode_params(tid, answer), max_tokens=2)
        tokens_while_waiting = 0
        load_errors: list[set[int]] = []
        loaded: list[int] = []
        deadline = time.monotonic() + 60
        while True:
            result = d.step()
            if result.invalid_blocks:
                load_errors.append(result.invalid_blocks)
            if not loaded and rid in d.scheduler.requests:
                loaded = d.block_ids(rid)[:n_load]
            if rid in result.scheduled:
                break
            # A running request got its next token in a step in which rid was still waiting.
            tokens_while_waiting += sum(
                1 for r, n in result.scheduled.items() if r.startswith("running") and n == 1
            )
            if f"running-{running}" in result.finished():
                running += 1
                d.add_request(f"running-{running}", prompt_of(20, seed=23 + running), max_tokens=64)
            assert time.monotonic() < deadline, "the waiting request was never recomputed"
    # On the synchronous path the step that starts the READ stalls for transfer_timeout and
    # no running request moves meanwhile.
    assert tokens_while_waiting >= 2, "the batch stalled while one request's READ waited"
    assert result.scheduled[rid] == len(prompt)  # recomputed from scratch, nothing loaded
    assert load_errors == [set(loaded)]  # reported once, after the handshake timed out
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="the recomputed request to finish")
    d.abort(f"running-{running}")
    d.step()
    assert d.free_blocks() == d.initial_free  # every block freed, none twice


def _full_and_sliding_specs() -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kv = {"num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
    return {
        "model.layers.0.self_attn.attn": FullAttentionSpec(block_size=BLOCK_SIZE, **kv),
        "model.layers.1.self_attn.attn": SlidingWindowSpec(
            block_size=BLOCK_SIZE, sliding_window=32, **kv
        ),
    }


@pytest.fixture
def one_group_transferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's planned KV-cache config with its sliding-window group out of KV transfer
    (``enable_kv_transfer`` off, as HiSparse's replica groups): two groups, one transferred."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    make = support_module.make_kv_cache_config

    def planned(*args: Any, **kwargs: Any) -> Any:
        config = make(*args, **kwargs)
        config.kv_cache_groups = [
            dataclasses.replace(g, enable_kv_transfer=False)
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
            else g
            for g in config.kv_cache_groups
        ]
        return config

    monkeypatch.setattr(support_module, "make_kv_cache_config", planned)


@pytest.mark.usefixtures("one_group_transferred")
def test_a_failed_load_beside_a_group_without_transfer_is_recomputed(
    sides: list[Side], model_dir: str
) -> None:
    """Two KV-cache groups in vLLM, one transferred: a failed READ is reported per request and
    recomputed. Before, the worker counted only the transferred group and reported the failed
    blocks too, and vLLM's _handle_invalid_blocks raised RuntimeError (block-level errors with
    more than one group), ending the engine."""
    kw: dict[str, Any] = dict(
        specs=_full_and_sliding_specs(), hybrid_kv_cache_manager=True, prefix_caching=False
    )
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, **kw)
    sides.append(p)
    d = Side("decode", "kv_consumer", "read", model_dir, salt=2, **kw)
    sides.append(d)
    assert len(d.kv_cache_config.kv_cache_groups) == 2
    prompt = prompt_of(40, seed=9)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    returned = p.step().finished()[rid].kv_transfer_params
    bad = dict(returned)  # a block id the prefill never had: the READ is refused, the load fails
    bad["remote_block_ids"] = [p.num_blocks + 5, *returned["remote_block_ids"][1:]]
    d.add_request(rid, prompt, params=decode_params(tid, bad), max_tokens=2)
    first = load(d, rid)
    assert first.scheduled == {rid: len(prompt)}  # the whole prompt recomputed


@pytest.mark.usefixtures("one_group_transferred")
def test_sync_loading_beside_a_group_without_transfer_is_refused(model_dir: str) -> None:
    """read_loading 'sync' reports a failed load by its blocks alone, which vLLM takes with
    one KV-cache group in all: with a second group, even one not transferred, the connector
    refuses it at start (before: only several transferred groups were refused, and a failed
    synchronous load then raised in vLLM)."""
    kw: dict[str, Any] = dict(
        specs=_full_and_sliding_specs(), hybrid_kv_cache_manager=True, prefix_caching=False
    )
    refused = r"'sync' with 2 KV-cache groups \(1 of them transferred\)"
    with pytest.raises(FailedPreconditionError, match=refused):
        Side("decode", "kv_consumer", "read", model_dir, extra={"read_loading": "sync"}, **kw)


def test_a_write_request_reusing_an_ended_transfer_id_still_frees_the_prefills_blocks(
    sides: list[Side], model_dir: str
) -> None:
    """R1 (transfer T) is written to decode d1 and ends; past the prefill's abort_timeout (its
    records of R1 gone), R2 reuses T (a client's own params, or a router's retry) towards
    another decode d2. The prefill's engine still remembers T as ended and refuses R2's first
    write: the job fails at once (d2 is told write_failed and recomputes) and R2's blocks are
    freed. Before, the refusal was ignored, the seal and the abort were no-ops for an ended
    id, no engine event came, and the job waited in ABORTING for good, its blocks held."""
    abort_s = 3.0
    p, d1 = make_pair(sides, model_dir, "write", p_extra={"abort_timeout": abort_s})
    d2 = Side("decode2", "kv_consumer", "write", model_dir, salt=4)
    sides.append(d2)
    tid = transfer_id()
    prompt = prompt_of(45, seed=3)
    rid = pd_request_id(p, d1)
    d1.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d1.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="R1 written")
    d1.run_until(lambda r: rid in r.finished(), what="d1 to finish")
    assert p.free_blocks() == p.initial_free
    end = time.monotonic() + abort_s + 1.5  # the prefill's records of R1 expire
    while time.monotonic() < end:
        p.step()
        time.sleep(0.05)
    other = prompt_of(45, seed=4)
    rid2 = pd_request_id(p, d2)
    d2.add_request(rid2, other, params=decode_params(tid), max_tokens=2)
    d2.step()
    p.add_request(rid2, other, params=prefill_params(tid), max_tokens=1)
    assert rid2 in p.step().finished()
    p.run_until(lambda r: rid2 in r.transfer.finished_sending, max_wait=abort_s, what="R2 freed")
    assert p.free_blocks() == p.initial_free
    failed = d2.run_until(lambda r: rid2 in r.transfer.failed_recving, what="d2 told")
    assert failed[-1].transfer.failed_recving == {rid2}  # recomputed, not loaded


def test_a_failed_sync_read_aborted_before_its_recompute_leaves_no_garbage_in_the_prefix_cache(
    sides: list[Side], model_dir: str
) -> None:
    """read_loading 'sync': vLLM caches a synchronously loaded request's full blocks in its
    prefix cache when it schedules it. The READ fails (its blocks reported as load errors);
    with kv_load_failure_policy 'recompute' vLLM leaves them cached, trusting the request to
    recompute them in its next step, and the client aborts it first. Before, a later request
    with the same prompt and no KV transfer took the failed READ's blocks from the prefix
    cache: 32 positions holding no one's KV taken as computed. Now the connector evicts a
    failed load's blocks from the prefix cache when they are reported. (Found by a review,
    2026-12-07.)"""
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1)
    sides.append(p)
    d = Side("decode", "kv_consumer", "read", model_dir, salt=2, extra={"read_loading": "sync"})
    sides.append(d)
    prompt = [(5 * 31 + i * 13) % 251 + 1 for i in range(40)]
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    finished = p.step().finished()
    assert rid in finished
    answer = dict(finished[rid].kv_transfer_params)
    # A block id the prefill never had: the engine refuses the READ before moving anything.
    answer["remote_block_ids"] = [p.num_blocks + 5, *answer["remote_block_ids"][1:]]
    d.add_request(rid, prompt, params=decode_params(tid, answer), max_tokens=2)
    first = d.step()
    assert first.scheduled == {rid: 1}  # 39 tokens loaded synchronously ...
    assert first.invalid_blocks  # ... and reported failed: vLLM is to recompute them
    d.abort(rid)  # before the step that would have recomputed them
    d.step()
    again = "plain-" + transfer_id()
    d.add_request(again, prompt, max_tokens=2)  # the same prompt, no KV transfer
    cached = len(prompt) - d.step().scheduled[again]  # positions from the prefix cache
    held = d.slot_matches(again, range(cached), d.salt, prompt)
    assert [pos for pos, ok in enumerate(held) if not ok] == []


def steps_until_freed(side: Side, within: float) -> float:
    """Step ``side`` until every block is free again; the seconds it took (inf: not within)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        side.step()
        if side.free_blocks() == side.initial_free:
            return time.monotonic() - start
        time.sleep(0.01)
    return float("inf")


def test_read_aborted_while_its_prefill_cannot_be_reached_frees_its_blocks_promptly(
    sides: list[Side], model_dir: str
) -> None:
    """An async READ whose prefill does not answer (gone, frozen) is still handshaking: no
    engine operation of it was posted, so nothing can land in its blocks. The client aborts
    the request; its decode blocks should be back at once, not after transfer_timeout."""
    p, d = make_pair(
        sides, model_dir, "read", d_extra={"transfer_timeout": 60, "abort_timeout": 120}
    )
    prompt = prompt_of(40, seed=3)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    p.shutdown()  # the prefill is gone: its handshake never answers
    sides.remove(p)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    d.step()
    held = d.initial_free - d.free_blocks()
    assert held > 0, "the READ should be in flight (WAITING_FOR_REMOTE_KVS)"
    states = d.worker.worker.core.puller.read_states()
    assert {str(s) for s in states.values()} == {str(states[tid])} and "CONNECTING" in str(
        states[tid]
    ), states  # nothing of it was posted to the engine: nothing can land
    d.abort(rid)
    took = steps_until_freed(d, within=5.0)
    assert took < 5.0, (
        f"{held} blocks of an aborted READ that never posted anything (state "
        f"{states[tid]}) are still held 5 s after the abort (until transfer_timeout, 60 s)"
    )
