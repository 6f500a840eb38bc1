# ruff: noqa: F811 -- the lifecycle harness's fixtures (sides, model_dir) are imported by name
"""READs confirmed with the prefill (``"confirm_reads": true``, ``verify`` off) through vLLM
0.33's real Scheduler (the lifecycle harness: real Scheduler, worker connectors, vLLM's caches,
loopback engines, ZMQ on 127.0.0.1).

A READ of a prefill answer takes whatever the named prefill blocks hold when it runs. Without
``verify`` nothing told a decode that those blocks had been freed (the answer handed to a second
decode after the first one released it) or were another request's (an answer changed on its
way): the decode generated from another request's KV. With ``confirm_reads`` the prefill
confirms, after the READ and before the load counts, that it still holds the transfer's blocks
and the READ took those its answer named; otherwise the load fails and is recomputed.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from test_vllm_lifecycle import make_pair, model_dir, prompt_of, run_prefill, sides  # noqa: F401
from test_vllm_support import BLOCK_SIZE, Side, decode_params, load, pd_request_id, transfer_id
from test_vllm_verify import _int_view

pytestmark = pytest.mark.vllm

CONFIRM = {"confirm_reads": True}


def prompt_blocks(prompt: list[int]) -> int:
    """Blocks a READ of ``prompt`` loads (every token but the last, which the decode computes)."""
    return -(-(len(prompt) - 1) // BLOCK_SIZE)


@pytest.mark.parametrize("loading", ["async", "sync"])
def test_a_confirmed_read_loads_and_releases(
    sides: list[Side], model_dir: str, loading: str
) -> None:
    p, d = make_pair(
        sides, model_dir, "read", p_extra=CONFIRM, d_extra={**CONFIRM, "read_loading": loading}
    )
    prompt = prompt_of(40, seed=71)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    p.step()  # its blocks are held from here
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    first = load(d, rid)
    assert first.scheduled == {rid: 1} and first.invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    assert first.stats is not None and first.stats.data["transfers"] == 1
    assert first.stats.data["failures"] == 0 and first.stats.data["verify_failures"] == 0
    assert first.stats.data["confirmed_reads"] == 1 and first.stats.data["confirm_failures"] == 0
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


def test_a_second_decode_given_a_released_answer_fails_its_load(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A router that hands the prefill's answer to a second decode after the first read and
    released it (a retried decode leg): the prefill's blocks are free and hold another
    request's KV by then. Before: the second decode's READ took them and its load counted."""
    p, d = make_pair(sides, model_dir, "read", p_extra=CONFIRM, d_extra=CONFIRM)
    prompt = prompt_of(40, seed=73)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    p.step()
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    assert load(d, rid).invalid_blocks == set()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free
    for block in returned["remote_block_ids"]:  # another request's KV in the freed blocks
        for layer in p.layer_names:
            _int_view(p.caches[layer])[block].fill_(7)

    again = Side("decode", "kv_consumer", "read", model_dir, salt=3, extra=CONFIRM)
    sides.append(again)
    rid2 = pd_request_id(p, again)
    again.add_request(rid2, prompt, params=decode_params(tid, returned), max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        retried = load(again, rid2)
    loaded = retried.blocks[: prompt_blocks(prompt)]
    assert retried.invalid_blocks == set(loaded)
    assert retried.scheduled == {rid2: len(prompt)}  # recomputed
    assert all(again.slot_matches(rid2, range(len(prompt)), again.salt, prompt))
    assert retried.stats is not None and retried.stats.data["failures"] == 1
    assert retried.stats.data["confirm_failures"] == 1
    assert retried.stats.data["confirmed_reads"] == 0
    assert f"did not confirm the READ of transfer {tid}" in caplog.text
    assert f"hold check of transfer {tid}: its blocks are no longer held" in caplog.text


def test_an_answer_naming_another_requests_blocks_fails_its_load(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer changed on its way (a router mixing up two requests' answers): the READ of
    request A takes the blocks of request B, held for B on the same prefill. Before: the load
    counted and A generated from B's KV."""
    p, d = make_pair(sides, model_dir, "read", p_extra=CONFIRM, d_extra=CONFIRM)
    prompt_a, prompt_b = prompt_of(40, seed=79), prompt_of(40, seed=83)
    rid_a, tid_a = pd_request_id(p, d), transfer_id()
    rid_b, tid_b = pd_request_id(p, d), transfer_id()
    answer_a = run_prefill(p, rid_a, prompt_a, tid_a)
    answer_b = run_prefill(p, rid_b, prompt_b, tid_b)
    p.step()  # both held from here
    mixed = {**answer_a, "remote_block_ids": answer_b["remote_block_ids"]}
    d.add_request(rid_a, prompt_a, params=decode_params(tid_a, mixed), max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        loaded = load(d, rid_a)
    assert loaded.invalid_blocks == set(loaded.blocks[: prompt_blocks(prompt_a)])
    assert loaded.scheduled == {rid_a: len(prompt_a)}  # recomputed
    assert all(d.slot_matches(rid_a, range(len(prompt_a)), d.salt, prompt_a))
    assert loaded.stats is not None and loaded.stats.data["confirm_failures"] == 1
    assert f"hold check of transfer {tid_a}: blocks" in caplog.text
    assert "are not among the 3 its answer named" in caplog.text


def test_a_decode_that_confirms_is_refused_by_a_prefill_that_does_not(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The prefill answers no hold checks: the decode's handshake is refused naming the key,
    and the load fails (recomputed) instead of every READ failing its check later."""
    p, d = make_pair(sides, model_dir, "read", p_extra={}, d_extra=CONFIRM)
    prompt = prompt_of(40, seed=89)
    rid, tid = pd_request_id(p, d), transfer_id()
    returned = run_prefill(p, rid, prompt, tid)
    p.step()
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        first = load(d, rid)
    assert first.invalid_blocks == set(first.blocks[: prompt_blocks(prompt)])
    assert first.scheduled == {rid: len(prompt)}
    assert "set 'confirm_reads' on this instance too" in caplog.text
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free
