"""An aborted READ's blocks come back at once when nothing of it was posted (its prefill
cannot be reached), through vLLM's real Scheduler (tests/py/test_vllm_support.py's Side:
scheduler + worker connector + loopback engine, real ZMQ control plane on 127.0.0.1). Failed
before its fix (review of 2026-12-07): the blocks stayed held until transfer_timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_vllm_support import (
    Side,
    decode_params,
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
def sides() -> Iterator[list[Side]]:
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


def run_prefill(p: Side, rid: str, prompt: list[int], tid: str) -> dict:
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    result = p.step()
    finished = result.finished()
    assert rid in finished
    params = finished[rid].kv_transfer_params
    assert params is not None
    return params


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
