# ruff: noqa: F811 -- the lifecycle harness's fixtures (sides, model_dir) are imported by name
"""The end-to-end integrity check (``"verify": true``) through vLLM 0.33's real Scheduler.

Each test runs a prefill and a decode instance (the lifecycle harness: real Scheduler, worker
connectors, vLLM's caches, loopback engines, ZMQ on 127.0.0.1). A byte of a destination block
is flipped after the transfer moved it and before the decode compares checksums -- silent
corruption on the way, as a faulty link or a wrong offset would cause -- and the load must
fail: vLLM gets the blocks as load errors and recomputes the request, the stats count a verify
failure. An untouched run passes the check; a pair whose sides disagree on verify is refused.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")

from moriio_native.pd import pusher
from moriio_native.pd.core import WAIT_SLICE_S
from test_vllm_lifecycle import make_pair, model_dir, prompt_of, run_prefill, sides  # noqa: F401
from test_vllm_support import (
    BLOCK_SIZE,
    Side,
    decode_params,
    load,
    pd_request_id,
    prefill_params,
    transfer_id,
)

pytestmark = pytest.mark.vllm

VERIFY = {"verify": True}


class CorruptWhenDone:
    """An engine whose first ``done`` event reaches the worker only after ``corrupt`` ran."""

    def __init__(self, engine: Any, corrupt: Any) -> None:
        self._engine = engine
        self._corrupt = corrupt
        self.fired = False

    def poll_events(self, *args: Any, **kwargs: Any) -> list[Any]:
        events = self._engine.poll_events(*args, **kwargs)
        if not self.fired and any(e.state == "done" for e in events):
            self.fired = True
            self._corrupt()
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def corrupt_on_done(side: Side, corrupt: Any) -> CorruptWhenDone:
    worker = side.worker.worker
    wrapped = CorruptWhenDone(worker._engine, corrupt)
    worker._engine = wrapped
    # The core's events thread may be inside a poll (a 0.1 s slice) of the engine it took
    # before the swap: let that poll end, so every later event passes through the wrapper.
    time.sleep(3 * WAIT_SLICE_S)
    return wrapped


def _int_view(cache: Any) -> Any:
    import torch

    return cache.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[cache.element_size()])


def flip(side: Side, block: int) -> None:
    cell = _int_view(side.caches[side.layer_names[-1]])[block]
    cell[(0,) * cell.dim()] ^= 1


def summed(results: list[Any], key: str) -> int:
    return sum(r.stats.data.get(key, 0) for r in results if r.stats is not None)


@dataclass
class ReadRequest:
    """One READ request between a verifying prefill and decode, prefilled and handed to the
    decode (not loaded yet)."""

    p: Side
    d: Side
    prompt: list[int]
    rid: str
    tid: str
    returned: dict[str, Any]


def verified_read(
    sides: list[Side], model_dir: str, seed: int, d_extra: dict[str, Any] | None = None
) -> ReadRequest:
    """A verifying pair (the decode's ``d_extra`` added) and one request prefilled, held and
    handed to the decode, as vLLM and its proxy would."""
    return held_read(sides, model_dir, seed, VERIFY, d_extra)


def held_read(
    sides: list[Side],
    model_dir: str,
    seed: int,
    extra: dict[str, Any],
    d_extra: dict[str, Any] | None = None,
    **pair: Any,
) -> ReadRequest:
    """A READ pair with ``extra`` on both instances (the decode's ``d_extra`` added; ``pair``:
    more Side settings of both) and one request prefilled, held and handed to the decode."""
    p, d = make_pair(
        sides, model_dir, "read", p_extra=extra, d_extra={**extra, **(d_extra or {})}, **pair
    )
    prompt = prompt_of(40, seed=seed)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    p.step()  # vLLM steps once more for the finished request: its blocks are held from here
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    return ReadRequest(p, d, prompt, rid, tid, returned)


# ---- READ -------------------------------------------------------------------------------------


def test_read_verified_passes(sides: list[Side], model_dir: str) -> None:
    r = verified_read(sides, model_dir, seed=41)
    p, d, prompt, rid = r.p, r.d, r.prompt, r.rid
    first = load(d, rid)
    assert first.scheduled == {rid: 1} and first.invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    assert first.stats is not None
    assert first.stats.data["verified"] == 1 and first.stats.data["verify_failures"] == 0
    assert first.stats.data["transfers"] == 1
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


@pytest.mark.parametrize("loading", ["async", "sync"])
def test_read_corrupted_block_fails_the_load_and_is_recomputed(
    sides: list[Side],
    model_dir: str,
    loading: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = verified_read(sides, model_dir, seed=43, d_extra={"read_loading": loading})
    p, d, prompt, rid, tid, returned = r.p, r.d, r.prompt, r.rid, r.tid, r.returned
    corrupted: list[int] = []

    def corrupt() -> None:  # the READ moved every block; one byte of the second goes bad
        block = d.block_ids(rid)[1]
        corrupted.append(block)
        flip(d, block)

    wrapped = corrupt_on_done(d, corrupt)
    with caplog.at_level(logging.ERROR, logger="moriio_native"):
        first = load(d, rid)
    assert wrapped.fired
    loaded = first.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)]
    assert first.invalid_blocks == set(loaded)
    assert first.scheduled == {rid: len(prompt)}  # vLLM recomputes the whole prompt
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    assert first.stats is not None
    assert first.stats.data["verify_failures"] == 1 and first.stats.data["verified"] == 0
    assert first.stats.data["transfers"] == 0 and first.stats.data["failures"] == 1
    named = f"layer '{d.layer_names[-1]}' block {corrupted[0]}"
    assert f"integrity check failed for transfer {tid}: {named}" in caplog.text
    assert f"{named} (remote block {returned['remote_block_ids'][1]})" in caplog.text
    # The prefill is released all the same, after the check.
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after the check")
    assert p.free_blocks() == p.initial_free
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


def test_a_second_decode_given_a_released_answer_fails_its_load(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A router that hands the prefill's answer to a second decode instance after the first
    read and released it (a retried decode leg): the prefill's blocks are free and hold another
    request's KV by then. Before: the prefill answered the second decode's checksum request
    over those blocks as they were then -- the same bytes its READ took -- so verify passed and
    the second decode generated from another request's KV. Now a prefill answers checksums only
    for a transfer whose blocks it still holds: the load fails and is recomputed."""
    r = verified_read(sides, model_dir, seed=47)
    p, d, prompt, rid, tid, returned = r.p, r.d, r.prompt, r.rid, r.tid, r.returned
    assert load(d, rid).invalid_blocks == set()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free
    for block in returned["remote_block_ids"]:  # another request's KV in the freed blocks
        for layer in p.layer_names:
            _int_view(p.caches[layer])[block].fill_(7)

    again = Side("decode", "kv_consumer", "read", model_dir, salt=3, extra=VERIFY)
    sides.append(again)
    rid2 = pd_request_id(p, again)
    again.add_request(rid2, prompt, params=decode_params(tid, returned), max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        retried = load(again, rid2)
    loaded = retried.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)]
    assert retried.invalid_blocks == set(loaded)
    assert retried.scheduled == {rid2: len(prompt)}  # recomputed
    assert all(again.slot_matches(rid2, range(len(prompt)), again.salt, prompt))
    assert retried.stats is not None and retried.stats.data["verify_failures"] == 1
    assert f"checksums of transfer {tid}" in caplog.text
    assert "no longer held" in caplog.text


@pytest.mark.parametrize("checked", ["verify", "confirm_reads"])
def test_an_answer_naming_another_requests_blocks_fails_its_load(
    sides: list[Side], model_dir: str, checked: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer changed on its way (a router mixing up two requests' answers): the decode's
    READ of request A takes the blocks of request B, held for B on the same prefill. Before:
    the prefill answered the checksum request over the blocks it named -- B's, the same bytes
    the READ took -- so verify passed and A generated from B's KV (without verify nothing
    asked; with confirm_reads the hold check, seen failing with the decode's check taken out).
    Now a prefill answers only for the blocks its answer for that transfer named: the load
    fails and is recomputed."""
    extra = {checked: True}
    p, d = make_pair(sides, model_dir, "read", p_extra=extra, d_extra=extra)
    prompt_a, prompt_b = prompt_of(40, seed=59), prompt_of(40, seed=61)
    rid_a, tid_a = pd_request_id(p, d), transfer_id()
    rid_b, tid_b = pd_request_id(p, d), transfer_id()
    answer_a = run_prefill(p, rid_a, prompt_a, tid_a)
    answer_b = run_prefill(p, rid_b, prompt_b, tid_b)
    p.step()  # both held from here
    mixed = {**answer_a, "remote_block_ids": answer_b["remote_block_ids"]}
    d.add_request(rid_a, prompt_a, params=decode_params(tid_a, mixed), max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        loaded = load(d, rid_a)
    assert loaded.invalid_blocks == set(loaded.blocks[: -(-(len(prompt_a) - 1) // BLOCK_SIZE)])
    assert loaded.scheduled == {rid_a: len(prompt_a)}  # recomputed
    assert all(d.slot_matches(rid_a, range(len(prompt_a)), d.salt, prompt_a))
    failures = "verify_failures" if checked == "verify" else "confirm_failures"
    assert loaded.stats is not None and loaded.stats.data[failures] == 1
    assert "are not among the 3 its answer named" in caplog.text


#: When the late send task comes: past the 1 s the prefill once waited for it, as the next step
#: of a TP-2 prefill under CI load came (its hold check refused, the READ recomputed).
LATE_SEND_TASK_S = 1.5
CHECK_COUNTS = {
    "verify": ("verified", "verify_failures", "checksums"),
    "confirm_reads": ("confirmed_reads", "confirm_failures", "hold check"),
}


@pytest.mark.parametrize("checked", ["verify", "confirm_reads"])
@pytest.mark.parametrize("send_task", ["comes late", "never comes"])
def test_a_checksum_request_before_the_send_task_waits_for_it(
    sides: list[Side],
    model_dir: str,
    send_task: str,
    checked: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode asks for checksums (or a hold check) before the prefill's next step hands
    its worker the send task (the blocks are held by then, but the worker does not know it
    yet): the prefill waits for it (SEND_TASK_WAIT_S) and answers; when it does not come
    within the wait, the load fails and is recomputed -- a check never passes for blocks not
    known to be held."""
    if send_task == "never comes":
        monkeypatch.setattr(pusher, "SEND_TASK_WAIT_S", 1.0)  # the refusal sooner than in 8 s
    passed, failed, asked = CHECK_COUNTS[checked]
    p, d = make_pair(sides, model_dir, "read", p_extra={checked: True}, d_extra={checked: True})
    prompt = prompt_of(40, seed=53)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    stepper = threading.Timer(LATE_SEND_TASK_S, p.step)
    if send_task == "comes late":
        stepper.start()
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        loaded = load(d, rid)
    if send_task == "comes late":
        stepper.join()
    assert loaded.stats is not None
    if send_task == "comes late":
        assert loaded.invalid_blocks == set() and loaded.stats.data[passed] == 1
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    else:
        assert loaded.invalid_blocks and loaded.stats.data[failed] == 1
        assert f"{asked} of transfer {tid}: this rank holds no blocks of it" in caplog.text
        assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


# ---- WRITE ------------------------------------------------------------------------------------


def write_pair(sides: list[Side], model_dir: str, prompt: list[int]) -> tuple[Side, Side, str, str]:
    p, d = make_pair(sides, model_dir, "write", p_extra=VERIFY, d_extra=VERIFY)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    assert d.step().scheduled == {}
    return p, d, rid, tid


def test_write_verified_passes(sides: list[Side], model_dir: str) -> None:
    prompt = prompt_of(45, seed=47)
    p, d, rid, tid = write_pair(sides, model_dir, prompt)
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()
    sent = p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    assert summed(sent, "transfers") == 1
    assert p.free_blocks() == p.initial_free
    got = d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert got[-1].scheduled == {rid: 1}  # only the last prompt token is computed here
    assert summed(got, "verified") == 1 and summed(got, "verify_failures") == 0
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


def test_write_corrupted_block_fails_the_load_and_is_recomputed(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = prompt_of(45, seed=53)
    p, d, rid, tid = write_pair(sides, model_dir, prompt)
    corrupted: list[int] = []

    def corrupt() -> None:  # every write landed in the decode; one byte there goes bad
        block = d.block_ids(rid)[2]
        corrupted.append(block)
        flip(d, block)

    wrapped = corrupt_on_done(p, corrupt)
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()
    sent = p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    assert wrapped.fired and summed(sent, "transfers") == 1
    assert p.free_blocks() == p.initial_free
    with caplog.at_level(logging.ERROR, logger="moriio_native"):
        got = d.run_until(lambda r: rid in r.transfer.failed_recving, what="verify failure")
    assert rid in got[-1].transfer.finished_recving
    invalid = set().union(*(r.invalid_blocks for r in got))
    assert corrupted[0] in invalid and invalid <= set(d.block_ids(rid))
    assert summed(got, "verify_failures") == 1 and summed(got, "verified") == 0
    assert f"layer '{d.layer_names[-1]}' block {corrupted[0]}" in caplog.text
    nxt = d.step()
    assert nxt.scheduled == {rid: len(prompt)}  # recomputed from scratch
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))
    d.run_until(lambda r: rid in r.finished(), what="decode to finish")
    assert d.free_blocks() == d.initial_free


# ---- a pair that disagrees --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "p_verify", "d_verify"),
    [("read", True, False), ("read", False, True), ("write", False, True), ("write", True, False)],
)
def test_sides_that_disagree_on_verify_are_refused_clearly(
    sides: list[Side],
    model_dir: str,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    p_verify: bool,
    d_verify: bool,
) -> None:
    p, d = make_pair(
        sides, model_dir, mode, p_extra={"verify": p_verify}, d_extra={"verify": d_verify}
    )
    prompt = prompt_of(36, seed=59)
    rid, tid = pd_request_id(p, d), transfer_id()
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        if mode == "read":
            returned = run_prefill(p, rid, prompt, tid)
            d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
            first = load(d, rid)
            assert first.invalid_blocks and first.scheduled == {rid: len(prompt)}
        else:
            d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
            got = d.run_until(lambda r: rid in r.transfer.failed_recving, what="refused")
            assert rid in got[-1].transfer.finished_recving
            assert d.step().scheduled == {rid: len(prompt)}
    assert "set the same 'verify' on both instances" in caplog.text
    assert all(d.slot_matches(rid, range(len(prompt)), d.salt, prompt))


@pytest.mark.parametrize("rearranged", ["swapped", "rotated"])
@pytest.mark.parametrize("checked", ["verify", "confirm_reads"])
def test_an_answer_with_its_own_blocks_reordered_fails_its_load(
    sides: list[Side], model_dir: str, checked: str, rearranged: str
) -> None:
    """An answer changed on its way (a proxy that sorts the ids) that names the transfer's own
    blocks in another order: the READ puts the prefill's block j where block i belongs. The
    prefill's check tested only that each block the READ took was among those it answered
    (a set), and verify's checksums are per block over the READ's own pairing: both passed,
    and the decode's slots held other positions' KV (39 of 39 seen, 2026-12-07 review). The
    decode now states the answer as it used it, and the prefill answers only for its own."""
    extra = {checked: True}
    p, d = make_pair(sides, model_dir, "read", p_extra=extra, d_extra=extra)
    prompt = prompt_of(40, seed=67)
    rid, tid = pd_request_id(p, d), transfer_id()
    answer = run_prefill(p, rid, prompt, tid)
    p.step()  # held from here
    ids = list(answer["remote_block_ids"])
    ids = [ids[1], ids[0], *ids[2:]] if rearranged == "swapped" else [*ids[1:], ids[0]]
    d.add_request(rid, prompt, params=decode_params(tid, {**answer, "remote_block_ids": ids}))
    loaded = load(d, rid)
    assert loaded.invalid_blocks == set(loaded.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)])
    failed = "verify_failures" if checked == "verify" else "confirm_failures"
    assert loaded.stats is not None and loaded.stats.data[failed] == 1


def test_a_write_into_reordered_decode_blocks_fails_verify(
    sides: list[Side], model_dir: str
) -> None:
    """WRITE: an announcement reordered on its way (the prefill writes its block 0 into the
    decode's block 1 and back) fails the check: the decode compares in its own announced
    order (checked by the 2026-12-07 review beside the READ case above)."""
    prompt = prompt_of(45, seed=73)
    p, d = make_pair(sides, model_dir, "write", p_extra=VERIFY, d_extra=VERIFY)
    rid, tid = pd_request_id(p, d), transfer_id()
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    assert d.step().scheduled == {}
    pushing = p.worker.worker._core.pusher
    original = pushing.on_remote_blocks

    def reordered(message: Any) -> None:
        first = list(message.block_ids[0])
        i, j = [k for k, b in enumerate(first) if b != 0][:2]
        first[i], first[j] = first[j], first[i]
        original(message.replace(block_ids=(tuple(first), *message.block_ids[1:])))

    pushing.on_remote_blocks = reordered
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    assert rid in p.step().finished()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="writes done")
    got = d.run_until(lambda r: rid in r.scheduled, what="decode to resume")
    assert sum(r.stats.data.get("verify_failures", 0) for r in got if r.stats) == 1
    assert got[-1].scheduled == {rid: len(prompt)}  # recomputed
