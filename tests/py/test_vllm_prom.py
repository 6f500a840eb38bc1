"""The connector's Prometheus metrics (build_prom_metrics) and the stats payload they read."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moriio_native.vllm.connector import MoRIIONativeConnector
from moriio_native.vllm.prom import MoRIIONativePromMetrics
from moriio_native.vllm.stats import MoRIIONativeStats

pytestmark = pytest.mark.vllm

LABELS = ["model_name", "engine"]
ENGINES = {0: ["tiny", "0"], 1: ["tiny", "1"]}


def metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """prometheus_client's classes bound to ``registry`` (vLLM passes its own subclasses)."""

    def bound(base: type) -> type:
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def prom(registry: CollectorRegistry) -> MoRIIONativePromMetrics:
    from types import SimpleNamespace

    vllm_config = SimpleNamespace(kv_transfer_config=None)  # the base class keeps only this
    metrics = MoRIIONativeConnector.build_prom_metrics(
        vllm_config, metric_types(registry), LABELS, ENGINES
    )
    assert isinstance(metrics, MoRIIONativePromMetrics)
    return metrics


def value(registry: CollectorRegistry, name: str, engine: str = "0", **extra: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": engine, **extra})


def two_workers() -> dict[str, Any]:
    """One step's payload, aggregated over two workers as vLLM's output aggregator does."""
    a = MoRIIONativeStats()
    a.record(ok=True, nbytes=2_000_000, seconds=0.002, runs=10, batches=1)
    a.record_handshake()
    a.record_peer_bound(evicted=True)
    b = MoRIIONativeStats()
    b.record_peer_bound(evicted=True)
    b.record_peer_bound(evicted=False)
    b.record(ok=True, nbytes=8_000_000, seconds=0.004, runs=300, batches=2, groups=3)
    b.record(ok=False)
    return a.aggregate(b).data


def test_every_series_exists_before_any_transfer(
    prom: MoRIIONativePromMetrics, registry: CollectorRegistry
) -> None:
    for engine in ("0", "1"):
        for name in (
            "vllm:moriio_native_transfers_total",
            "vllm:moriio_native_failed_transfers_total",
            "vllm:moriio_native_transferred_bytes_total",
            "vllm:moriio_native_handshakes_total",
            "vllm:moriio_native_peers_evicted_total",
            "vllm:moriio_native_peers_refused_total",
            "vllm:moriio_native_transferred_groups_total",
            "vllm:moriio_native_transfer_time_seconds_count",
            "vllm:moriio_native_transfer_throughput_bytes_per_second_count",
            "vllm:moriio_native_transfer_bytes_count",
            "vllm:moriio_native_copy_runs_per_transfer_count",
            "vllm:moriio_native_quarantined_blocks_total",
        ):
            assert value(registry, name, engine) == 0, (name, engine)


def test_observe_counts_and_histograms_per_transfer(
    prom: MoRIIONativePromMetrics, registry: CollectorRegistry
) -> None:
    prom.observe(two_workers(), engine_idx=0)
    assert value(registry, "vllm:moriio_native_transfers_total") == 2
    assert value(registry, "vllm:moriio_native_failed_transfers_total") == 1
    assert value(registry, "vllm:moriio_native_transferred_bytes_total") == 10_000_000
    assert value(registry, "vllm:moriio_native_handshakes_total") == 1
    assert value(registry, "vllm:moriio_native_peers_evicted_total") == 2
    assert value(registry, "vllm:moriio_native_peers_refused_total") == 1
    # One single-group transfer and one of a model with three KV-cache groups; failures none.
    assert value(registry, "vllm:moriio_native_transferred_groups_total") == 4
    assert value(registry, "vllm:moriio_native_transfer_time_seconds_count") == 2
    assert value(registry, "vllm:moriio_native_transfer_time_seconds_sum") == pytest.approx(0.006)
    # 2 ms lands in the 2.5 ms bucket, 4 ms does not.
    assert value(registry, "vllm:moriio_native_transfer_time_seconds_bucket", le="0.0025") == 1
    # 1 GB/s and 2 GB/s: both above 1e9 only for the second.
    hist = "vllm:moriio_native_transfer_throughput_bytes_per_second"
    assert value(registry, hist + "_count") == 2
    assert value(registry, hist + "_sum") == pytest.approx(3e9)
    assert value(registry, hist + "_bucket", le="1e+09") == 1
    assert value(registry, "vllm:moriio_native_copy_runs_per_transfer_bucket", le="16.0") == 1
    assert value(registry, "vllm:moriio_native_copy_runs_per_transfer_sum") == 310
    assert value(registry, "vllm:moriio_native_transfer_bytes_sum") == 10_000_000
    # The other engine's series are untouched.
    assert value(registry, "vllm:moriio_native_transfers_total", "1") == 0
    # Counters accumulate across steps.
    prom.observe(two_workers(), engine_idx=0)
    assert value(registry, "vllm:moriio_native_transfers_total") == 4
    assert value(registry, "vllm:moriio_native_transfer_time_seconds_count") == 4


def test_quarantined_blocks_accumulate_per_engine(
    prom: MoRIIONativePromMetrics, registry: CollectorRegistry
) -> None:
    stats = MoRIIONativeStats()
    stats.record_quarantine(3)
    prom.observe(stats.data, engine_idx=1)
    assert value(registry, "vllm:moriio_native_quarantined_blocks_total", "1") == 3
    assert value(registry, "vllm:moriio_native_quarantined_blocks_total", "0") == 0
    prom.observe(MoRIIONativeStats({"quarantined_blocks": 2, "handshakes": 1}).data, 1)
    assert value(registry, "vllm:moriio_native_quarantined_blocks_total", "1") == 5
    # A payload without the key (a worker that does not report it) adds nothing.
    prom.observe({"transfers": 0}, 1)
    assert value(registry, "vllm:moriio_native_quarantined_blocks_total", "1") == 5


def test_stats_samples_aggregate_and_never_share_lists() -> None:
    a = MoRIIONativeStats()
    a.record(ok=True, nbytes=100, seconds=0.5, runs=2)
    b = MoRIIONativeStats(dict(a.data))
    b.record(ok=True, nbytes=300, seconds=1.5, runs=4)
    assert a.data["samples"] == [[0.5, 100, 2]]  # b's record did not leak into a
    merged = MoRIIONativeStats(dict(a.data)).aggregate(b)
    assert merged.data["samples"] == [[0.5, 100, 2], [0.5, 100, 2], [1.5, 300, 4]]
    assert merged.data["transfers"] == 3 and merged.data["bytes"] == 500
    # The log line keeps its summary keys; the samples are for the histograms only.
    assert merged.reduce()["Num successful transfers"] == 3
    snapshot = a.clone_and_reset()
    assert snapshot.data["samples"] == [[0.5, 100, 2]] and a.data["samples"] == []
    assert a.is_empty() and not snapshot.is_empty()


def test_stats_payload_survives_vllms_serialization() -> None:
    # Workers send the payload to the scheduler process with msgspec/msgpack.
    import msgpack

    a = MoRIIONativeStats({"quarantined_blocks": 2})
    a.record(ok=True, nbytes=4096, seconds=0.001, runs=1)
    wire = msgpack.unpackb(msgpack.packb(a.data))
    back = MoRIIONativeStats(wire)
    assert back.data == a.data


def test_open_transfers_gauge_keeps_each_ranks_latest_count(
    prom: MoRIIONativePromMetrics, registry: CollectorRegistry
) -> None:
    name = "vllm:moriio_native_open_transfers"
    a, b = MoRIIONativeStats(), MoRIIONativeStats()
    a.record_open_transfers(0, 3)
    b.record_open_transfers(1, 2)
    prom.observe(a.aggregate(b).data, engine_idx=0)
    assert value(registry, name) == 5
    # A payload carries only the ranks whose count changed: rank 1 still holds 2.
    only_rank0 = MoRIIONativeStats()
    only_rank0.record_open_transfers(0, 0)
    prom.observe(only_rank0.data, engine_idx=0)
    assert value(registry, name) == 2
    prom.observe({"transfers": 1}, engine_idx=0)  # no gauge in the payload: unchanged
    assert value(registry, name) == 2
    prom.observe(MoRIIONativeStats({"open_transfers": {"1": 0}}).data, engine_idx=0)
    assert value(registry, name) == 0
    assert value(registry, name, "1") == 0  # the other engine never reported


def test_open_transfers_gauge_alone_is_a_payload() -> None:
    stats = MoRIIONativeStats()
    stats.record_open_transfers(0, 0)  # dropping to 0 must reach vLLM too
    assert not stats.is_empty()
    snapshot = stats.clone_and_reset()
    assert snapshot.data["open_transfers"] == {"0": 0} and stats.is_empty()
    assert snapshot.reduce()["Open transfers"] == 0
