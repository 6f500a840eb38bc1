# ruff: noqa: F811 -- the lifecycle harness's fixtures (sides, model_dir) are imported by name
"""READs confirmed with the prefill (``"confirm_reads": true``, ``verify`` off) through vLLM
0.33's real Scheduler (the lifecycle harness: real Scheduler, worker connectors, vLLM's caches,
loopback engines, ZMQ on 127.0.0.1).

A READ of a prefill answer takes whatever the named prefill blocks hold when it runs. Without
``verify`` nothing told a decode that those blocks had been freed (the answer handed to a second
decode after the first one released it) or were another request's (an answer changed on its
way): the decode generated from another request's KV. With ``confirm_reads`` the prefill
confirms, after the READ and before the load counts, that it still holds the transfer's blocks
and the READ took those its answer named; otherwise the load fails and is recomputed. (An
answer naming another request's blocks: tests/py/test_vllm_verify.py, with verify and with
confirm_reads.)
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from moriio_native.pd import verify
from test_vllm_lifecycle import make_pair, model_dir, prompt_of, run_prefill, sides  # noqa: F401
from test_vllm_support import BLOCK_SIZE, Side, decode_params, load, pd_request_id
from test_vllm_verify import VERIFY, ReadRequest, _int_view, held_read

pytestmark = pytest.mark.vllm

CONFIRM = {"confirm_reads": True}


def prompt_blocks(prompt: list[int]) -> int:
    """Blocks a READ of ``prompt`` loads (every token but the last, which the decode computes)."""
    return -(-(len(prompt) - 1) // BLOCK_SIZE)


def read_and_release(r: ReadRequest) -> None:
    """The first decode reads ``r``'s answer; the prefill then frees the blocks it named."""
    assert load(r.d, r.rid).invalid_blocks == set()
    r.p.run_until(lambda res: r.rid in res.transfer.finished_sending, what="release")
    assert r.p.free_blocks() == r.p.initial_free


def second_decode(
    sides: list[Side], model_dir: str, r: ReadRequest, extra: dict[str, Any], **side: Any
) -> tuple[Side, str, Any]:
    """Another decode instance handed ``r``'s answer (as a router retrying the decode leg
    would), and its load."""
    again = Side("decode", "kv_consumer", "read", model_dir, salt=3, extra=extra, **side)
    sides.append(again)
    rid = pd_request_id(r.p, again)
    again.add_request(rid, r.prompt, params=decode_params(r.tid, r.returned), max_tokens=2)
    return again, rid, load(again, rid)


@pytest.mark.parametrize("loading", ["async", "sync"])
def test_a_confirmed_read_loads_and_releases(
    sides: list[Side], model_dir: str, loading: str
) -> None:
    r = held_read(sides, model_dir, 71, CONFIRM, {"read_loading": loading})
    p, d, prompt, rid = r.p, r.d, r.prompt, r.rid
    first = load(d, rid)
    assert first.scheduled == {rid: 1} and first.invalid_blocks == set()
    assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
    assert first.stats is not None and first.stats.data["transfers"] == 1
    assert first.stats.data["failures"] == 0 and first.stats.data["verify_failures"] == 0
    assert first.stats.data["confirmed_reads"] == 1 and first.stats.data["confirm_failures"] == 0
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free


@pytest.mark.parametrize("checked", ["confirm_reads", "verify"])
def test_a_kept_connection_to_the_prefill_closes_once_idle_with_no_check_coming(
    sides: list[Side], model_dir: str, checked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode keeps its connection to the prefill rank for the next check: with no next
    check it was kept for ever (a descriptor and a ZMQ connection each). The thread that waits
    for the checks closes it once idle past KEPT_IDLE_S."""
    monkeypatch.setattr(verify, "KEPT_IDLE_S", 0.3)
    r = held_read(sides, model_dir, 73, {checked: True})
    assert load(r.d, r.rid).invalid_blocks == set()
    ctx = r.d.worker.worker.core.ctx
    kept = (ctx.confirmer if checked == "confirm_reads" else ctx.verifier)._requests
    assert kept.idle == 1
    r.d.run_until(lambda _result: kept.idle == 0, max_wait=10.0, what="idle connection closed")


def test_a_second_decode_given_a_released_answer_fails_its_load(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A router that hands the prefill's answer to a second decode after the first read and
    released it (a retried decode leg): the prefill's blocks are free and hold another
    request's KV by then. Before: the second decode's READ took them and its load counted."""
    r = held_read(sides, model_dir, 73, CONFIRM)
    p, prompt, tid, returned = r.p, r.prompt, r.tid, r.returned
    read_and_release(r)
    for block in returned["remote_block_ids"]:  # another request's KV in the freed blocks
        for layer in p.layer_names:
            _int_view(p.caches[layer])[block].fill_(7)

    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        again, rid2, retried = second_decode(sides, model_dir, r, CONFIRM)
    loaded = retried.blocks[: prompt_blocks(prompt)]
    assert retried.invalid_blocks == set(loaded)
    assert retried.scheduled == {rid2: len(prompt)}  # recomputed
    assert all(again.slot_matches(rid2, range(len(prompt)), again.salt, prompt))
    assert retried.stats is not None and retried.stats.data["failures"] == 1
    assert retried.stats.data["confirm_failures"] == 1
    assert retried.stats.data["confirmed_reads"] == 0
    assert f"did not confirm the READ of transfer {tid}" in caplog.text
    assert f"hold check of transfer {tid}: its blocks are no longer held" in caplog.text


@pytest.mark.parametrize("checked", ["confirm_reads", "verify"])
def test_a_released_answer_is_refused_after_a_later_request_reused_its_transfer_id(
    sides: list[Side], model_dir: str, checked: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that reuses the transfer id of an answer read and released (a client's retry
    with its own params) is held by the prefill under that id again, in the same blocks,
    refilled. A second decode handed the first, released answer reads them. Before: the
    prefill confirmed the hold (and verify's checksums matched: the same bytes the READ took),
    since the check named only the transfer id and the blocks; the load counted with another
    request's KV. Now the check names the hold the answer stated, and the later answer's
    differs."""
    extra = CONFIRM if checked == "confirm_reads" else VERIFY
    r = held_read(sides, model_dir, 97, extra, max_num_batched_tokens=1024)
    p, d, prompt, tid, returned = r.p, r.d, r.prompt, r.tid, r.returned
    read_and_release(r)
    # A later request under the same transfer id, long enough to be given every free block,
    # those the first answer named among them.
    time.sleep(0.002)  # its answer states a later hold, as any later request's does
    reuse = prompt_of(BLOCK_SIZE * p.initial_free - 1, seed=5)
    rid_b = pd_request_id(p, d)
    run_prefill(p, rid_b, reuse, tid)
    p.step()
    assert set(returned["remote_block_ids"]) <= set(p.block_ids(rid_b))

    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        _, rid2, retried = second_decode(sides, model_dir, r, extra, max_num_batched_tokens=1024)
    assert retried.invalid_blocks == set(retried.blocks[: prompt_blocks(prompt)])
    assert retried.scheduled == {rid2: len(prompt)}  # recomputed
    assert retried.stats is not None
    assert (
        retried.stats.data["confirm_failures" if checked == "confirm_reads" else "verify_failures"]
        == 1
    )
    assert "held for another answer under that transfer id" in caplog.text


def test_a_decode_that_confirms_is_refused_by_a_prefill_that_does_not(
    sides: list[Side], model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The prefill answers no hold checks: the decode's handshake is refused naming the key,
    and the load fails (recomputed) instead of every READ failing its check later."""
    r = held_read(sides, model_dir, 89, {}, CONFIRM)
    p, d, prompt, rid = r.p, r.d, r.prompt, r.rid
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        first = load(d, rid)
    assert first.invalid_blocks == set(first.blocks[: prompt_blocks(prompt)])
    assert first.scheduled == {rid: len(prompt)}
    assert "set 'confirm_reads' on this instance too" in caplog.text
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free
