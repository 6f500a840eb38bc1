"""The connector's Prometheus metrics on vLLM's ``/metrics`` (``build_prom_metrics``).

vLLM's stat logger calls :meth:`MoRIIONativePromMetrics.observe` in the API server process with
each step's :class:`~moriio_native.vllm.stats.MoRIIONativeStats` payload, summed over the
engine's workers. Every series carries vLLM's labels (``model_name``, ``engine``); the names
follow vLLM's ``vllm:`` style (prometheus_client adds ``_total`` to counters and ``_bucket``/
``_sum``/``_count`` to histograms):

============================================================ ========= ==========================
name                                                          type      what
============================================================ ========= ==========================
``vllm:moriio_native_transfers_total``                        counter   KV transfers completed
``vllm:moriio_native_failed_transfers_total``                 counter   failed/timed out/aborted
``vllm:moriio_native_transferred_bytes_total``                counter   bytes moved
``vllm:moriio_native_handshakes_total``                       counter   metadata handshakes done
``vllm:moriio_native_peers_evicted_total``                    counter   evicted at max_peers
``vllm:moriio_native_peers_refused_total``                    counter   refused at max_peers
``vllm:moriio_native_transferred_groups_total``               counter   KV-cache groups moved
``vllm:moriio_native_transfer_time_seconds``                  histogram first submit -> done
``vllm:moriio_native_transfer_throughput_bytes_per_second``   histogram bytes / transfer time
``vllm:moriio_native_transfer_bytes``                         histogram bytes per transfer
``vllm:moriio_native_copy_runs_per_transfer``                 histogram contiguous copy runs
``vllm:moriio_native_quarantined_blocks_total``               counter   blocks put in quarantine
``vllm:moriio_native_verified_transfers_total``               counter   checksums matched
``vllm:moriio_native_verify_failures_total``                  counter   checksums differed
``vllm:moriio_native_confirmed_reads_total``                  counter   READ holds confirmed
``vllm:moriio_native_confirm_failures_total``                 counter   READ holds unconfirmed
``vllm:moriio_native_open_transfers``                         gauge     transfers open now
============================================================ ========= ==========================

Transfers are counted where the bytes are moved: by the decode in READ mode (it pulls), by the
prefill in WRITE mode (it pushes). Quarantined blocks are counted by the decode, once per block
and transfer, when a transfer into them ends while writes may still land (the stats key
``quarantined_blocks``). Integrity checks (``verify: true``) are counted by the decode, which
compares the two sides' block checksums, and so are READs confirmed with the prefill
(``confirm_reads: true``). Open transfers are those the instance's engines
hold right now (pending, or quarantined until no late write can land), summed over the TP
ranks: 0 on an idle instance; a value that stays above 0 once no request is left is a leaked
transfer.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from moriio_native.vllm.stats import OPEN_TRANSFERS, SAMPLES

PREFIX = "vllm:moriio_native_"

# Seconds: 100 us (shared memory, small prompts) to 10 s (long prompts over a slow fabric).
TIME_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)
# Bytes per second: 10 MB/s to 1 TB/s, a decade per two buckets.
THROUGHPUT_BUCKETS = (*(m * 10.0**e for e in range(7, 12) for m in (1.0, 3.0)), 1e12)
# Bytes per transfer: 4 KiB to 16 GiB, a factor 4 per bucket.
BYTES_BUCKETS = tuple(float(4**i * 4096) for i in range(12))
# Copy runs per transfer: 1 (one contiguous range) to 100k (per-head runs at long contexts).
RUNS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 100000)


def _per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]) -> dict[int, Any]:
    return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}


class MoRIIONativePromMetrics(KVConnectorPromMetrics):
    """The series above, one child per engine. Called from vLLM's stat logger only."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, Any]:
            metric = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            return _per_engine(metric, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> dict[int, Any]:
            metric = self._histogram_cls(
                name=PREFIX + name, documentation=doc, buckets=list(buckets), labelnames=labelnames
            )
            return _per_engine(metric, per_engine_labelvalues)

        self.transfers = counter(
            "transfers", "KV transfers completed by this instance (moriio-native)."
        )
        self.failures = counter(
            "failed_transfers",
            "KV transfers that failed, timed out or were aborted (moriio-native); the request "
            "was recomputed or failed per kv_load_failure_policy.",
        )
        self.bytes = counter("transferred_bytes", "Bytes moved by completed KV transfers.")
        self.handshakes = counter("handshakes", "Metadata handshakes completed with peers.")
        self.peers_evicted = counter(
            "peers_evicted",
            "Peers disconnected to stay within max_peers (the least recently used idle one).",
        )
        self.peers_refused = counter(
            "peers_refused",
            "Handshakes refused at max_peers: every peer that could go was in use.",
        )
        self.groups = counter(
            "transferred_groups",
            "KV-cache groups moved by completed KV transfers, summed over the transfers (2 per "
            "transfer of a model with a Mamba and a full-attention group, 1 with one group).",
        )
        self.time = histogram(
            "transfer_time_seconds",
            "Duration of completed KV transfers, first submit to done.",
            TIME_BUCKETS,
        )
        self.throughput = histogram(
            "transfer_throughput_bytes_per_second",
            "Throughput of completed KV transfers (bytes / transfer time).",
            THROUGHPUT_BUCKETS,
        )
        self.size = histogram("transfer_bytes", "Bytes per completed KV transfer.", BYTES_BUCKETS)
        self.runs = histogram(
            "copy_runs_per_transfer",
            "Contiguous copy runs (descriptors) per completed KV transfer.",
            RUNS_BUCKETS,
        )
        gauge = self._gauge_cls(
            name=PREFIX + "open_transfers",
            documentation="KV transfers the instance's engines hold open now (pending or "
            "quarantined), summed over its TP ranks; 0 once every transfer ended.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.open_transfers = _per_engine(gauge, per_engine_labelvalues)
        # The latest count each TP rank reported, per engine: a payload carries only the ranks
        # whose count changed.
        self._open_by_rank: dict[int, dict[str, int]] = {i: {} for i in per_engine_labelvalues}
        self.quarantined = counter(
            "quarantined_blocks",
            "KV blocks put into quarantine (neither reused nor freed until no late write of an "
            "ended transfer can land in them).",
        )
        self.verified = counter(
            "verified_transfers",
            "KV transfers whose block checksums matched on both sides (verify: true).",
        )
        self.verify_failures = counter(
            "verify_failures",
            "KV transfers whose block checksums differed or could not be compared (verify: "
            "true); the load failed and its blocks were recomputed.",
        )
        self.confirmed_reads = counter(
            "confirmed_reads",
            "READs the prefill confirmed it still held the blocks of (confirm_reads: true).",
        )
        self.confirm_failures = counter(
            "confirm_failures",
            "READs the prefill did not confirm (confirm_reads: true); the load failed and its "
            "blocks were recomputed.",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        self.transfers[engine_idx].inc(data.get("transfers", 0))
        self.failures[engine_idx].inc(data.get("failures", 0))
        self.bytes[engine_idx].inc(data.get("bytes", 0))
        self.handshakes[engine_idx].inc(data.get("handshakes", 0))
        self.peers_evicted[engine_idx].inc(data.get("peers_evicted", 0))
        self.peers_refused[engine_idx].inc(data.get("peers_refused", 0))
        self.groups[engine_idx].inc(data.get("groups", 0))
        for seconds, nbytes, runs in data.get(SAMPLES, ()):
            self.time[engine_idx].observe(seconds)
            self.size[engine_idx].observe(nbytes)
            self.runs[engine_idx].observe(runs)
            if seconds > 0:
                self.throughput[engine_idx].observe(nbytes / seconds)
        self.quarantined[engine_idx].inc(data.get("quarantined_blocks", 0))
        self.verified[engine_idx].inc(data.get("verified", 0))
        self.verify_failures[engine_idx].inc(data.get("verify_failures", 0))
        self.confirmed_reads[engine_idx].inc(data.get("confirmed_reads", 0))
        self.confirm_failures[engine_idx].inc(data.get("confirm_failures", 0))
        ranks = data.get(OPEN_TRANSFERS)
        if ranks:
            latest = self._open_by_rank.setdefault(engine_idx, {})
            latest.update({str(rank): int(n) for rank, n in ranks.items()})
            self.open_transfers[engine_idx].set(sum(latest.values()))


__all__ = ["PREFIX", "MoRIIONativePromMetrics"]
