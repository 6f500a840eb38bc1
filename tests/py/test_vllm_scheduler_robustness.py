"""The connector's scheduler half (vllm/scheduler.py) against what vLLM's Scheduler does to a
request around it: a prefix-cache hit measured before the prefill's prompt is cut, a WRITE
prefill request that would run on (and could be preempted) after it handed its blocks over, a
decode request naming a transfer it holds no answer of, a prompt given as embeddings. Found by
a review (2026-12-06), each test seen failing before its fix."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from hybrid_support import NUM_BLOCKS, hybrid_specs
from moriio_native.control.addressing import parse_kv_transfer_params
from moriio_native.control.security import MessageAuth
from test_vllm_support import (
    Side,
    decode_params,
    load,
    pd_request_id,
    prefill_params,
    transfer_id,
    write_model_dir,
)

pytestmark = [pytest.mark.vllm]


def _swa_prefill(model_dir: str, mode: str = "read", **kw) -> Side:
    return Side(
        "p",
        "kv_producer",
        mode,
        model_dir,
        num_blocks=NUM_BLOCKS,
        specs=hybrid_specs(16, mamba=False),
        block_size=16,
        prefix_caching=True,
        hybrid_kv_cache_manager=True,
        **kw,
    )


@pytest.mark.parametrize("mode", ["read", "write"])
def test_truncated_prefill_with_a_full_local_prefix_hit_does_not_crash_the_step(
    tmp_path: Path, mode: str
) -> None:
    """Sliding-window group: the prefill leaves the prompt's last token to the decode. A prompt
    of k*16+1 tokens whose first k*16 tokens are cached (a shared system prompt, a retried
    request) is served. Before, the cut came in get_num_new_matched_tokens, after vLLM
    measured the prefix hit on the whole prompt: nothing was left to compute and vLLM's
    schedule() failed its assertion (num_new_tokens > 0), which ends EngineCore."""
    model_dir = write_model_dir(tmp_path / "model")
    p = _swa_prefill(model_dir, mode)
    try:
        prompt = [(i * 37) % 241 + 3 for i in range(66)]
        rid1 = pd_request_id(p, p) + "-1"
        # Computes 65 tokens: its first 4 blocks stay cached (the sliding window's tail too).
        p.add_request(rid1, prompt, params=prefill_params(transfer_id()), max_tokens=1)
        p.run_until(lambda r: rid1 in r.finished(), what="first prefill")
        rid2 = pd_request_id(p, p) + "-2"
        # 4 whole cached blocks + 1 token: vLLM's local hit is 64 = num_tokens - 1.
        p.add_request(rid2, prompt[:65], params=prefill_params(transfer_id()), max_tokens=1)
        # Must not raise out of vLLM's schedule() (an AssertionError there kills EngineCore).
        p.run_until(lambda r: rid2 in r.finished(), what="second prefill")
    finally:
        p.shutdown()


def test_a_prompt_given_as_embeddings_is_cut_like_one_of_token_ids(tmp_path: Path) -> None:
    """Sliding-window group, a prefill request whose prompt is embeddings (no token ids): its
    last position is left to the decode as for token ids, so the prefill computes N - 1
    positions, the number the decode loads. Before, it was not cut: the prefill computed all N
    while the decode loaded N - 1 and recomputed the last on top (a Mamba state would take
    that token twice)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    model_dir = write_model_dir(tmp_path / "model")
    p = _swa_prefill(model_dir)
    try:
        rid = pd_request_id(p, p)
        n = 40
        request = Request(
            request_id=rid,
            prompt_token_ids=None,
            prompt_embeds=torch.zeros(n, 8),
            sampling_params=SamplingParams(
                max_tokens=4,
                ignore_eos=True,
                extra_args={"kv_transfer_params": prefill_params(transfer_id())},
            ),
            pooling_params=None,
            block_hasher=get_request_block_hasher(p.hash_block_size, p.hash_fn),
        )
        p.scheduler.add_request(request)
        assert request.num_prompt_tokens == n - 1
        assert len(request.prompt_embeds) == n - 1 and len(request.all_token_ids) == n - 1
        assert request.max_tokens == 1
        assert p.scheduler.schedule().num_scheduled_tokens[rid] == n - 1
    finally:
        p.shutdown()


def _prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 13) % 251 + 1 for i in range(n)]


def _tight_write_pair(tmp_path: Path) -> tuple[Side, Side]:
    """A WRITE prefill of 9 blocks, one request ("other", 4 blocks then 5) already running on
    it, and its decode."""
    model_dir = write_model_dir(tmp_path / "model")
    p = Side("prefill", "kv_producer", "write", model_dir, salt=1, num_blocks=9)
    d = Side("decode", "kv_consumer", "write", model_dir, salt=2)
    p.add_request("other", _prompt_of(64, seed=3), max_tokens=100)
    p.step()
    return p, d


def _decode_until_it_runs(p: Side, d: Side, rid: str, prompt: list[int], tid: str) -> None:
    """The decode leg of ``rid``: both sides step until its load ended and it runs."""
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    for _ in range(2000):
        p.step()
        r = d.step()
        if rid in r.scheduled or rid in r.transfer.finished_recving:
            break
    d.run_until(lambda r: rid in r.scheduled, what="decode resumes")


def test_a_write_prefill_request_ends_after_its_first_token_keeping_the_blocks_it_handed_over(
    tmp_path: Path,
) -> None:
    """WRITE prefill asked for 30 tokens: the SaveTask hands its prompt blocks to the workers
    at the last prompt chunk, and the request ends with its first token, its blocks held for
    the writes. Before, it ran on; vLLM preempted it and freed the blocks it had handed over
    (the connector is not asked), another request wrote its KV into one, and the writes,
    posted when the decode announced, carried that KV into the decode as this request's
    (reported good)."""
    p, d = _tight_write_pair(tmp_path)
    try:
        rid, tid = pd_request_id(p, d), transfer_id()
        prompt = _prompt_of(48, seed=7)  # 3 blocks
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=30)
        res = p.step()
        assert res.scheduled[rid] == 48  # last prompt chunk: SaveTask
        assert rid in res.finished()  # its first token ends it
        # "other" runs on and needs more blocks than are free; the held ones are not among
        # those it gets.
        for _ in range(40):
            p.step()
        assert not p.reports["finished_sending"][rid]  # still held for the writes
        _decode_until_it_runs(p, d, rid, prompt, tid)
        assert d.reports["failed_recving"][rid] == 0  # the load was reported good ...
        matches = d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt)
        wrong = [pos for pos, ok in enumerate(matches) if not ok]
        assert wrong == [], f"positions loaded with another request's KV: {wrong}"  # ... and is
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("stray", [False, True])
def test_a_read_decode_request_without_an_answer_releases_another_requests_prefill_blocks(
    tmp_path: Path, stray: bool
) -> None:
    """READ: a decode request naming a prefill and a transfer id but carrying no answer
    (no remote_block_ids: a client's own params) is computed locally and sends no release.
    Before, it sent one: the prefill kept it as an early release and freed the blocks of the
    live request owning that id the moment it finished, and that request's genuine decode
    then READ blocks vLLM had handed to another request, loading its KV as its own. The
    control (``stray`` False) runs without that request."""
    model_dir = write_model_dir(tmp_path / "model")
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, num_blocks=8)
    d = Side("decode", "kv_consumer", "read", model_dir, salt=2)
    try:
        rid, tid = pd_request_id(p, d), transfer_id()
        prompt = _prompt_of(40, seed=5)
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        # Another request naming the same transfer id reaches the decode, without an answer.
        if stray:  # (False: the control, passes)
            other = pd_request_id(p, d)
            d.add_request(other, _prompt_of(20, seed=9), params=decode_params(tid), max_tokens=1)
            d.step()
        time.sleep(0.5)  # the release reaches the prefill
        finished = p.step().finished()
        answer = finished[rid].kv_transfer_params
        # Nothing read the victim's blocks yet; the prefill must keep them (abort_timeout 30 s).
        for _ in range(20):
            p.step()
            time.sleep(0.01)
        freed_early = p.reports["finished_sending"][rid] == 1
        if freed_early:
            # Another prefill request takes the freed blocks (7 usable blocks, it needs 7).
            p.add_request("other", _prompt_of(100, seed=11), max_tokens=1)
            p.run_until(lambda r: "other" in r.finished(), what="other")
        # The genuine decode leg: its READ is accepted and loads what the blocks hold now.
        d.add_request(rid, prompt, params=decode_params(tid, answer), max_tokens=2)
        loaded = load(d, rid)
        wrong = [
            pos
            for pos, ok in enumerate(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
            if not ok
        ]
        assert not freed_early and wrong == [], (
            f"prefill freed the blocks before any read: {freed_early}; load errors: "
            f"{sorted(loaded.invalid_blocks)}; positions holding another request's KV: {wrong}"
        )
    finally:
        p.shutdown()
        d.shutdown()


SECRET = "the-answers-test-secret-0123"


def _answer_as(kind: str, tid: str, answers: dict[str, Any], victim: str, rid: str) -> dict:
    """The prefill's answer for ``rid`` as it reaches the decode: ``genuine``, or forged."""
    returned = dict(answers[rid])
    if kind == "unsigned":
        del returned["remote_answer_tag"]
    elif kind == "another request's blocks":
        returned["remote_block_ids"] = answers[victim]["remote_block_ids"]
    elif kind == "another secret":
        answer = parse_kv_transfer_params(decode_params(tid, returned)).answer_bytes()
        returned["remote_answer_tag"] = MessageAuth("another-secret-0123456789").tag_answer(answer)
    return returned


@pytest.mark.parametrize(
    "kind", ["genuine", "unsigned", "another request's blocks", "another secret"]
)
def test_with_a_secret_the_decode_acts_only_on_answers_its_prefill_signed(
    tmp_path: Path, kind: str
) -> None:
    """READ with auth_secret set: the prefill's answer reaches the decode through the proxy, on
    the same HTTP path as any client's request, so anyone who can send the decode a request can
    write one. A client that saw another request's answer could name that request's blocks and
    have the decode read them, loading another user's KV as its own. The decode now acts only
    on an answer whose tag its prefill made with the secret; any other runs without KV transfer
    (computed locally, no READ, no release). ``genuine``: the control, loaded."""
    model_dir = write_model_dir(tmp_path / "model")
    extra = {"auth_secret": SECRET}
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, extra=extra)
    d = Side("decode", "kv_consumer", "read", model_dir, salt=2, extra=extra)
    try:
        rid, tid = pd_request_id(p, d), transfer_id()
        victim = pd_request_id(p, d)
        prompt = _prompt_of(40, seed=5)
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        p.add_request(victim, _prompt_of(40, seed=6), params=prefill_params(transfer_id()))
        answers: dict[str, Any] = {}

        def both_answered(result: Any) -> bool:
            answers.update({r: out.kv_transfer_params for r, out in result.finished().items()})
            return rid in answers and victim in answers

        p.run_until(both_answered, what="both prefill answers")
        returned = _answer_as(kind, tid, answers, victim, rid)
        d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
        loaded = load(d, rid)
        if kind == "genuine":
            assert loaded.scheduled[rid] == 1, "the genuine answer was not loaded"
            assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
        else:
            assert loaded.scheduled[rid] == len(prompt), (
                f"the decode acted on a forged answer: {loaded.scheduled[rid]} of "
                f"{len(prompt)} tokens computed, the rest loaded"
            )
    finally:
        p.shutdown()
        d.shutdown()


def test_with_a_secret_a_signed_answer_replayed_after_its_release_is_refused(
    tmp_path: Path,
) -> None:
    """READ, auth_secret set on every instance, nothing else configured. A client's request A
    runs as it should (decode D1 reads, releases; the prefill frees A's blocks), then a
    victim's request V is computed into those blocks. The client sends A's genuine, correctly
    signed answer to a second decode D2 with a prompt of its own: the tag matches, so only the
    hold check (confirm_reads) can refuse the READ, and a secret now turns it on by default.
    (The client resends A's own prompt: with another prompt the answer's prompt digest would
    refuse it first.)
    Before (a review, 2026-12-06), D2 read A's block ids, V's KV, and computed the client's
    request on another user's keys and values."""
    model_dir = write_model_dir(tmp_path / "model")
    extra: dict[str, Any] = {"auth_secret": SECRET}
    # 3 usable blocks (and vLLM's null block): V must take the blocks A freed.
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, num_blocks=4, extra=extra)
    d1 = Side("decode1", "kv_consumer", "read", model_dir, salt=2, extra=extra)
    d2 = Side("decode2", "kv_consumer", "read", model_dir, salt=3, extra=extra)
    try:
        rid, tid = pd_request_id(p, d1), transfer_id()
        prompt_a = _prompt_of(40, seed=5)
        p.add_request(rid, prompt_a, params=prefill_params(tid), max_tokens=1)
        answered = p.run_until(lambda r: rid in r.finished(), what="A answered")[-1]
        answer_a = dict(answered.finished()[rid].kv_transfer_params)
        d1.add_request(rid, prompt_a, params=decode_params(tid, answer_a), max_tokens=2)
        # Genuine: 39 of 40 tokens loaded (the prefill steps too: it answers the hold check).
        assert load(d1, rid, before_forward=p.step).scheduled[rid] == 1
        deadline = time.monotonic() + 30
        while not p.reports["finished_sending"][rid]:  # D1 releases, the prefill frees them
            assert time.monotonic() < deadline, "the prefill never freed A's blocks"
            d1.step()
            p.step()
        victim = pd_request_id(p, d1)
        prompt_v = _prompt_of(40, seed=9)
        p.add_request(victim, prompt_v, params=prefill_params(transfer_id()), max_tokens=1)
        answered = p.run_until(lambda r: victim in r.finished(), what="V answered")[-1]
        blocks_v = answered.finished()[victim].kv_transfer_params["remote_block_ids"]
        assert sorted(answer_a["remote_block_ids"]) == sorted(blocks_v)  # V took A's blocks
        replay = pd_request_id(p, d2)
        prompt_b = prompt_a  # the same request again: the answer's prompt digest matches
        d2.add_request(replay, prompt_b, params=decode_params(tid, answer_a), max_tokens=2)
        scheduled = load(d2, replay, before_forward=p.step).scheduled[replay]
        assert scheduled == len(prompt_b), (
            f"D2 acted on a replayed answer: {len(prompt_b) - scheduled} of {len(prompt_b)} "
            "tokens loaded from blocks the prefill gave to another request"
        )
        assert all(d2.slot_matches(replay, range(len(prompt_b) - 1), d2.salt, prompt_b))
    finally:
        p.shutdown()
        d1.shutdown()
        d2.shutdown()


def test_a_write_prefill_request_preempted_after_its_save_drops_its_write(tmp_path: Path) -> None:
    """WRITE prefill: vLLM preempts a request after its SaveTask handed the prompt's blocks to
    the workers (with async scheduling a request is still running then, its one token not yet
    processed; here it is made to run on) and frees those blocks to another request. The
    workers drop its WRITE: the decode is told write_failed and recomputes, never loading the
    other request's KV, and the prefill recomputes the request without handing it over again.
    Before, the SaveTask stood: the writes carried the other request's KV, reported good."""
    p, d = _tight_write_pair(tmp_path)
    try:
        rid, tid = pd_request_id(p, d), transfer_id()
        prompt = _prompt_of(48, seed=7)  # 3 blocks
        request = p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=30)
        request.max_tokens = 30  # running on after its last prompt chunk, as async allows
        assert p.step().scheduled[rid] == 48  # last prompt chunk: SaveTask
        p.run_until(lambda r: rid in (r.output.preempted_req_ids or set()), what="preemption")
        _decode_until_it_runs(p, d, rid, prompt, tid)
        assert d.reports["failed_recving"][rid] == 1  # told write_failed: recomputed
        matches = d.slot_matches(rid, range(len(prompt) - 1), d.salt, prompt)
        assert all(matches), "the decode holds KV it did not compute itself"
        for left in ("other", rid):  # both would run on for many tokens: ended here
            p.abort(left)
        p.run_until(lambda r: not p.scheduler.requests, what="prefill drains")
        assert p.free_blocks() == p.initial_free
        assert not p.reports["finished_sending"][rid]  # vLLM freed them: nothing to report
        assert p.connector.scheduler._dropped == set() and p.connector.scheduler._saved == {}
    finally:
        p.shutdown()
        d.shutdown()


def _answered(p: Side, d: Side, prompt: list[int]) -> tuple[str, str, dict[str, Any]]:
    """A READ request's prefill leg on ``p`` for decode ``d``: its request id, transfer id and
    the prefill's answer."""
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    answered = p.run_until(lambda r: rid in r.finished(), what="the prefill's answer")[-1]
    return rid, tid, dict(answered.finished()[rid].kv_transfer_params)


@pytest.mark.parametrize("loading,signed", [("async", False), ("sync", False), ("async", True)])
def test_a_read_needing_more_tokens_than_the_prefill_computed_is_computed_locally(
    tmp_path: Path, loading: str, signed: bool
) -> None:
    """The prefill computed a prompt of 40 tokens (3 blocks, the last one holding 8); the
    decode's request has those 40 and 6 more (a client's own params, a tokenizer that differs
    between the instances). The answer's 3 blocks cover positions up to 47, so before (a
    review, 2026-12-07) the decode read them and reported 45 tokens loaded: positions 40..44
    held whatever the prefill's block held there (another request's KV), taken as computed,
    with a secret and the hold check too. The answer now states the tokens the prefill
    computed (remote_num_tokens, under its tag), and a request needing more is computed
    locally; its answer's blocks are released."""
    model_dir = write_model_dir(tmp_path / "model")
    extra: dict[str, Any] = {"auth_secret": SECRET} if signed else {}
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, extra=extra)
    d = Side(
        "decode",
        "kv_consumer",
        "read",
        model_dir,
        salt=2,
        extra={**extra, "read_loading": loading},
    )
    try:
        prompt = _prompt_of(40, seed=5)
        rid, tid, returned = _answered(p, d, prompt)
        assert returned["remote_num_tokens"] == len(prompt)
        longer = prompt + _prompt_of(6, seed=6)
        d.add_request(rid, longer, params=decode_params(tid, returned), max_tokens=2)
        scheduled = load(d, rid, before_forward=p.step).scheduled[rid]
        assert scheduled == len(longer), (
            f"{len(longer) - scheduled} tokens taken as loaded, the prefill computed "
            f"{len(prompt)} of the decode's {len(longer)}"
        )
        assert all(d.slot_matches(rid, range(len(longer)), d.salt, longer))
        deadline = time.monotonic() + 30
        while not p.reports["finished_sending"][rid]:  # the decode's release frees them
            assert time.monotonic() < deadline, "the prefill never freed the answer's blocks"
            d.step()
            p.step()
    finally:
        p.shutdown()
        d.shutdown()


def test_a_read_of_a_longer_prompt_leaves_no_uncomputed_position_in_the_prefix_cache(
    tmp_path: Path,
) -> None:
    """As above with 9 more tokens: before, the load covered 48 positions, 3 whole blocks,
    and vLLM cached the last one (positions 32..47) under the decode's token hashes though
    40..47 held bytes the prefill never computed, so a later ordinary request with the same
    prompt, no KV transfer at all, took them from the prefix cache. Every position such a
    request takes from the cache now holds the KV computed for its token."""
    model_dir = write_model_dir(tmp_path / "model")
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1)
    d = Side("decode", "kv_consumer", "read", model_dir, salt=2)
    try:
        prompt = _prompt_of(40, seed=5)
        rid, tid, returned = _answered(p, d, prompt)
        longer = prompt + _prompt_of(9, seed=6)
        d.add_request(rid, longer, params=decode_params(tid, returned), max_tokens=2)
        load(d, rid)
        d.run_until(lambda r: rid in r.finished(), what="the decode request to finish")
        plain = "plain-after"
        d.add_request(plain, longer, max_tokens=2)
        hit = len(longer) - d.step().scheduled[plain]
        assert hit > 0, "the decode's own blocks of the prompt were not cached"
        ours = d.slot_matches(plain, range(hit), d.salt, longer)
        theirs = d.slot_matches(plain, range(hit), p.salt, longer)
        wrong = [pos for pos in range(hit) if not (ours[pos] or theirs[pos])]
        assert not wrong, f"positions {wrong} came from the prefix cache holding no one's KV"
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("required", [True, False])
@pytest.mark.parametrize("key", ["remote_num_tokens", "remote_prompt_digest"])
def test_an_answer_without_its_prompt_keys_is_computed_locally(
    tmp_path: Path, key: str, required: bool
) -> None:
    """An answer without the prompt positions the prefill computed, or their digest (a prefill
    of another connector version, a proxy that drops the key): the decode cannot tell whether
    the answer is for its prompt, so it loads nothing, and says why; unless the decode sets
    ``require_prompt_match`` off (for a proxy that drops the keys), which loads it unchecked."""
    model_dir = write_model_dir(tmp_path / "model")
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1)
    d = Side(
        "decode",
        "kv_consumer",
        "read",
        model_dir,
        salt=2,
        extra={"require_prompt_match": required},
    )
    try:
        prompt = _prompt_of(40, seed=5)
        rid, tid, returned = _answered(p, d, prompt)
        del returned[key]
        d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
        assert load(d, rid).scheduled[rid] == (len(prompt) if required else 1)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("signed", [False, True])
def test_a_genuine_answer_paired_with_another_prompt_of_its_length_is_computed_locally(
    tmp_path: Path, signed: bool
) -> None:
    """A client that can send requests to the decode directly pairs its own genuine answer
    (prompt A, signed when the instances have a secret, its blocks still held) with another
    prompt B of the same length. Before (2026-12-07), the decode loaded A's KV as B's, and
    cached B's blocks holding it: a later ordinary request with prompt B, from anyone, took
    A's keys and values from the prefix cache. The answer's prompt digest now differs from
    B's: B is computed locally, and its cached blocks hold B's own KV."""
    model_dir = write_model_dir(tmp_path / "model")
    extra: dict[str, Any] = {"auth_secret": SECRET} if signed else {}
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, extra=extra)
    d = Side("decode", "kv_consumer", "read", model_dir, salt=2, extra=extra)
    try:
        prompt_a = _prompt_of(48, seed=5)
        rid, tid, returned = _answered(p, d, prompt_a)
        prompt_b = _prompt_of(48, seed=9)
        d.add_request(rid, prompt_b, params=decode_params(tid, returned), max_tokens=2)
        scheduled = load(d, rid, before_forward=p.step).scheduled[rid]
        assert scheduled == len(prompt_b), (
            f"{len(prompt_b) - scheduled} positions of prompt B loaded from prompt A's blocks"
        )
        d.run_until(lambda r: rid in r.finished(), what="the decode request to finish")
        plain = "plain-after"
        d.add_request(plain, prompt_b, max_tokens=2)
        hit = len(prompt_b) - d.step().scheduled[plain]
        assert hit > 0, "the decode's own blocks of prompt B were not cached"
        assert all(d.slot_matches(plain, range(hit), d.salt, prompt_b))
    finally:
        p.shutdown()
        d.shutdown()


def _mamba_side(model_dir: str, name: str, role: str, mode: str, salt: int) -> Side:
    """Full attention + Mamba (hybrid_support's model without its sliding-window layers)."""
    from hybrid_support import SWA_LAYERS

    specs = {k: v for k, v in hybrid_specs(16).items() if k not in SWA_LAYERS}
    return Side(
        name,
        role,
        mode,
        model_dir,
        num_blocks=40,
        salt=salt,
        specs=specs,
        block_size=16,
        prefix_caching=False,
        hybrid_kv_cache_manager=True,
    )


def test_a_read_taking_fewer_tokens_than_a_mamba_state_holds_is_computed_locally(
    tmp_path: Path,
) -> None:
    """The prefill computed 89 tokens (a prompt of 90, its last left to the decode); the
    decode's request carries that answer with the first 89 tokens as its prompt: the same
    tokens, so the prompt digest over them matches, but the decode takes 88 as computed while
    the Mamba state holds all 89, and would compute token 88 again on top of it. Before (a
    review, 2026-12-07) it loaded; a Mamba state now needs the decode to take exactly the
    prefill's tokens as computed."""
    model_dir = write_model_dir(tmp_path / "model")
    p = _mamba_side(model_dir, "p", "kv_producer", "read", 1)
    d = _mamba_side(model_dir, "d", "kv_consumer", "read", 2)
    try:
        prompt = _prompt_of(90, seed=3)
        rid, tid = pd_request_id(p, d), transfer_id()
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        returned = p.step().finished()[rid].kv_transfer_params
        assert returned["remote_num_tokens"] == 89
        short = prompt[:89]
        d.add_request(rid, short, params=decode_params(tid, returned), max_tokens=2)
        scheduled = load(d, rid).scheduled[rid]
        assert scheduled == len(short), (
            f"{len(short) - scheduled} tokens taken as computed on a Mamba state of 89"
        )
    finally:
        p.shutdown()
        d.shutdown()


def test_a_write_of_a_mamba_state_for_fewer_tokens_than_it_holds_fails(tmp_path: Path) -> None:
    """WRITE: the decode's prompt is the prefill's first 60 tokens, so it announces 59 tokens
    to load; the prefill computed 89 and its Mamba state holds all of them. Before (a review,
    2026-12-07) the state was written and the decode told write_done, to resume at token 59 on
    the state of 89; the prefill now fails such a write (the decode recomputes)."""
    model_dir = write_model_dir(tmp_path / "model")
    p = _mamba_side(model_dir, "p", "kv_producer", "write", 1)
    d = _mamba_side(model_dir, "d", "kv_consumer", "write", 2)
    try:
        prompt = _prompt_of(90, seed=3)
        rid, tid = pd_request_id(p, d), transfer_id()
        d.add_request(rid, prompt[:60], params=decode_params(tid), max_tokens=2)
        d.step()  # announces its blocks
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        p.run_until(lambda r: rid in r.transfer.finished_sending, what="the prefill's end")
        ended = d.run_until(lambda r: rid in r.transfer.finished_recving, what="the load's end")
        assert rid in ended[-1].transfer.failed_recving, "a Mamba state of 89 tokens loaded for 59"
    finally:
        p.shutdown()
        d.shutdown()
