"""Connector statistics in vLLM's ``KVConnectorStats`` form.

Each worker accumulates one :class:`MoRIIONativeStats` per logging interval (vLLM fetches it
with ``get_kv_connector_stats`` every step and aggregates across workers). The payload is a
plain dict of numbers so it crosses process boundaries unchanged:

=================== ===============================================================
key                 meaning
=================== ===============================================================
``transfers``       transfers that completed (READ pulls and WRITE pushes)
``failures``        transfers that failed, timed out or were aborted
``bytes``           bytes moved by completed transfers
``seconds``         summed duration of completed transfers (first submit -> done)
``runs``            contiguous copy runs (descriptors) of completed transfers
``batches``         backend batches posted for completed transfers
``handshakes``      metadata handshakes that succeeded
``peers_evicted``   peers (or peer addresses) a rank disconnected to stay within
                    ``max_peers``: the least recently used idle one, to connect another
``peers_refused``   handshakes refused at ``max_peers``: every peer that could go was in
                    use (the request was recomputed)
``groups``          KV-cache groups moved by completed transfers, summed over them: a
                    transfer of a hybrid model's Mamba and full-attention groups counts 2,
                    one of a single-group model 1
``quarantined_blocks`` decode blocks put into quarantine: a transfer into them ended while
                    writes may still land, so they were neither recomputed into nor freed
                    until the writes were proven drained (or the quarantine bound passed)
``verified``        transfers whose block checksums matched on both sides (``verify`` on)
``verify_failures`` transfers whose checksums differed, or could not be compared: the load
                    failed and its blocks were recomputed (counted in ``failures`` too)
``confirmed_reads`` READs the prefill confirmed it still held the blocks of
                    (``confirm_reads`` on, ``verify`` off)
``confirm_failures`` READs it did not confirm (or whose confirmation could not be had): the
                    load failed and its blocks were recomputed (counted in ``failures`` too)
``samples``         per completed transfer ``[seconds, bytes, runs]`` (for histograms)
``open_transfers``  a gauge, per TP rank (``{"<rank>": n}``): transfers the rank's engine
                    holds open (pending or quarantined), sent in every payload while any
                    is open and once more when the count changes to 0
=================== ===============================================================

The counters are summed by ``aggregate``; ``samples`` are concatenated, so the Prometheus
histograms (:mod:`moriio_native.vllm.prom`) see every transfer of every worker; the gauge's
per-rank values are merged (the latest wins), so a rank that did not report keeps its last
value. Unknown keys in a payload are dropped.

Not thread-safe by itself; the worker guards its instance with its own lock.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_COUNTERS = (
    "transfers",
    "failures",
    "bytes",
    "seconds",
    "runs",
    "batches",
    "handshakes",
    "peers_evicted",
    "peers_refused",
    "groups",
    "quarantined_blocks",
    "verified",
    "verify_failures",
    "confirmed_reads",
    "confirm_failures",
)
SAMPLES = "samples"
OPEN_TRANSFERS = "open_transfers"


def _empty() -> dict[str, Any]:
    out: dict[str, Any] = {key: 0.0 if key == "seconds" else 0 for key in _COUNTERS}
    out[SAMPLES] = []
    out[OPEN_TRANSFERS] = {}
    return out


class MoRIIONativeStats(KVConnectorStats):
    """Transfer counters and per-transfer samples of one interval; ``aggregate`` sums and
    concatenates, ``reduce`` summarises."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        merged = _empty()
        for key, value in (data or {}).items():
            if key == SAMPLES:
                # Copied, so two instances built from one payload never share a list.
                merged[SAMPLES] = [list(sample) for sample in value]
            elif key == OPEN_TRANSFERS:
                merged[OPEN_TRANSFERS] = {str(rank): int(n) for rank, n in value.items()}
            elif key in merged:
                merged[key] = value
        super().__init__(data=merged)

    def record(
        self,
        *,
        ok: bool,
        nbytes: int = 0,
        seconds: float = 0.0,
        runs: int = 0,
        batches: int = 0,
        groups: int = 1,
    ) -> None:
        """Count one terminal transfer (``groups``: the KV-cache groups it moved)."""
        if ok:
            self.data["transfers"] += 1
            self.data["groups"] += int(groups)
            self.data["bytes"] += int(nbytes)
            self.data["seconds"] += float(seconds)
            self.data["runs"] += int(runs)
            self.data["batches"] += int(batches)
            self.data[SAMPLES].append([float(seconds), int(nbytes), int(runs)])
        else:
            self.data["failures"] += 1

    def record_transfer(self, event: Any, groups: int = 1) -> None:
        """Count a successful transfer from its engine TransferEvent; ``groups``: the
        KV-cache groups it moved."""
        self.record(
            ok=True,
            nbytes=event.bytes,
            seconds=event.seconds,
            runs=event.runs,
            batches=event.batches,
            groups=groups,
        )

    def record_handshake(self) -> None:
        self.data["handshakes"] += 1

    def record_peer_bound(self, *, evicted: bool) -> None:
        """Count one peer evicted to stay within max_peers, or one handshake refused there."""
        self.data["peers_evicted" if evicted else "peers_refused"] += 1

    def record_quarantine(self, blocks: int) -> None:
        """Count ``blocks`` decode blocks put into quarantine (once per block and transfer)."""
        self.data["quarantined_blocks"] += int(blocks)

    def record_verify(self, *, ok: bool) -> None:
        """Count one integrity check: passed (``ok``) or failed."""
        self.data["verified" if ok else "verify_failures"] += 1

    def record_confirm(self, *, ok: bool) -> None:
        """Count one READ's hold check (``confirm_reads``): confirmed (``ok``) or not."""
        self.data["confirmed_reads" if ok else "confirm_failures"] += 1

    def record_open_transfers(self, rank: int, count: int) -> None:
        """Set TP rank ``rank``'s gauge of open transfers (its engine's pending + quarantined)."""
        self.data[OPEN_TRANSFERS][str(rank)] = int(count)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _COUNTERS:
            self.data[key] += other.data.get(key, 0)
        self.data[SAMPLES].extend(list(sample) for sample in other.data.get(SAMPLES, ()))
        for rank, count in other.data.get(OPEN_TRANSFERS, {}).items():
            self.data[OPEN_TRANSFERS][str(rank)] = int(count)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n = d["transfers"]
        secs = d["seconds"]
        return {
            "Num successful transfers": n,
            "Num failed transfers": d["failures"],
            "Num verified transfers": d["verified"],
            "Num verify failures": d["verify_failures"],
            "Num confirmed reads": d["confirmed_reads"],
            "Num confirm failures": d["confirm_failures"],
            "Total MB transferred": round(d["bytes"] / 2**20, 3),
            "Avg transfer time (ms)": round(1000.0 * secs / n, 3) if n else 0.0,
            "Avg throughput (GB/s)": round(d["bytes"] / secs / 1e9, 3) if secs > 0 else 0.0,
            "Avg runs per transfer": round(d["runs"] / n, 1) if n else 0.0,
            "Avg batches per transfer": round(d["batches"] / n, 2) if n else 0.0,
            "Avg KV-cache groups per transfer": round(d["groups"] / n, 2) if n else 0.0,
            "Handshakes": d["handshakes"],
            "Peers evicted": d["peers_evicted"],
            "Peers refused": d["peers_refused"],
            "Quarantined blocks": d["quarantined_blocks"],
            "Open transfers": sum(d[OPEN_TRANSFERS].values()),
        }

    def is_empty(self) -> bool:
        d = self.data
        return not (any(d[key] for key in _COUNTERS) or d[OPEN_TRANSFERS])

    def clone_and_reset(self) -> MoRIIONativeStats:
        """A copy of the counters; this instance starts a new interval."""
        out = MoRIIONativeStats(dict(self.data))
        self.reset()
        return out


__all__ = ["OPEN_TRANSFERS", "SAMPLES", "MoRIIONativeStats"]
