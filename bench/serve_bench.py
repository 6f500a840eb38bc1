"""Serving benchmark: TTFT and inter-token latency through a P/D router vs one plain instance.

Sends the same fixed set of greedy, streamed completions (token-id prompts, fixed seed, no two
alike so no prefix cache helps) first to one plain ``vllm serve`` instance (the baseline) and
then through the P/D router, one request at a time or ``--concurrency`` at once, and reports
per target: time to first token (TTFT) and inter-token latency (ITL) p50/p99, end-to-end
latency, and the P/D/plain ratios. The KV transfer figures come from the connector's own
Prometheus series (``vllm:moriio_native_*``) on the prefill's and the decode's ``/metrics``,
read before and after the P/D run. The report names the machine and the date; ``--json``
writes it as JSON too. Needs the standard library and moriio-native (for the machine record),
plus a running deployment.

    python bench/serve_bench.py --pd-url http://127.0.0.1:10001 \\
        --single-url http://127.0.0.1:8000 --prefill-url http://127.0.0.1:20005 \\
        --decode-url http://127.0.0.1:40005 --model Qwen/Qwen3-8B \\
        --requests 32 --prompt-tokens 1024 --max-tokens 64

On this project's CPU machine tests/e2e/bench_cpu.py starts the deployment (tiny model) and
runs this script against it: a smoke figure. The same command runs on a GPU node against a
real deployment.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX = "vllm:moriio_native_"
TRANSFER_SERIES = {
    "transfers": PREFIX + "transfers_total",
    "failed": PREFIX + "failed_transfers_total",
    "bytes": PREFIX + "transferred_bytes_total",
    "seconds": PREFIX + "transfer_time_seconds_sum",
    "runs": PREFIX + "copy_runs_per_transfer_sum",
}


@dataclass
class Sample:
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    tokens: int


@dataclass
class TargetResult:
    name: str
    url: str
    requests: int
    tokens: int
    wall_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(1000 * _pct(values, 0.50), 2),
        "p99": round(1000 * _pct(values, 0.99), 2),
        "mean": round(1000 * statistics.fmean(values), 2) if values else float("nan"),
    }


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(count)]


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
    """One streamed greedy completion; token arrival times from the server-sent events."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if any(c.get("text") for c in chunk.get("choices", ())):
                arrivals.append(time.perf_counter())
            usage = chunk.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or tokens)
    end = time.perf_counter()
    if not arrivals:
        raise RuntimeError(f"{url}: a streamed completion returned no token")
    # ITL is measured per streamed chunk, as a client sees it (a chunk may carry more than one
    # token when the server coalesces them).
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return Sample(arrivals[0] - start, gaps, end - start, tokens or len(arrivals))


def run_target(
    name: str, url: str, args: argparse.Namespace, batch: list[list[int]]
) -> TargetResult:
    # Two warm-up requests (not counted, prompts of their own): connections, handshakes,
    # first-call allocations.
    for warm in prompts(2, args.prompt_tokens, args.vocab, args.seed + 1000 + len(name)):
        stream_one(url, args.model, warm, 2, args.timeout)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        samples = list(
            pool.map(lambda p: stream_one(url, args.model, p, args.max_tokens, args.timeout), batch)
        )
    wall = time.perf_counter() - start
    return TargetResult(
        name=name,
        url=url,
        requests=len(samples),
        tokens=sum(s.tokens for s in samples),
        wall_s=round(wall, 3),
        ttft_ms=_summary_ms([s.ttft_s for s in samples]),
        itl_ms=_summary_ms([g for s in samples for g in s.itl_s]),
        e2e_ms=_summary_ms([s.e2e_s for s in samples]),
    )


def connector_totals(url: str) -> dict[str, float]:
    """The connector's transfer counters on ``url``/metrics, summed over engines."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(TRANSFER_SERIES, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(PREFIX):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, series in TRANSFER_SERIES.items():
            if name == series:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def transfer_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in TRANSFER_SERIES}
    n, secs = d["transfers"], d["seconds"]
    return {
        "transfers": int(n),
        "failed": int(d["failed"]),
        "MiB": round(d["bytes"] / 2**20, 3),
        "avg_transfer_ms": round(1000 * secs / n, 3) if n else float("nan"),
        "GB_per_s": round(d["bytes"] / secs / 1e9, 3) if secs > 0 else float("nan"),
        "avg_runs": round(d["runs"] / n, 1) if n else float("nan"),
    }


def machine() -> dict[str, Any]:
    """The same machine record as ``moriio-native bench`` (CPU, cores, versions), plus the host."""
    from moriio_native.cli import _machine

    return {"host": platform.node(), **_machine()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pd-url", required=True, help="the P/D router (or proxy)")
    parser.add_argument("--single-url", required=True, help="one plain instance (baseline)")
    parser.add_argument("--prefill-url", help="the prefill instance (its /metrics)")
    parser.add_argument("--decode-url", help="the decode instance (its /metrics)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1000, help="prompt token ids < this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--label", default="", help="free text for the report (deployment)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.prompt_tokens < 2 or args.max_tokens < 2:
        parser.error("--requests >= 1, --prompt-tokens >= 2 and --max-tokens >= 2 are needed")

    # Different prompts for the two targets: neither run may hit the other's prefix cache.
    single = run_target(
        "single",
        args.single_url,
        args,
        prompts(args.requests, args.prompt_tokens, args.vocab, args.seed),
    )
    meters = [u for u in (args.prefill_url, args.decode_url) if u]
    before = {u: connector_totals(u) for u in meters}
    pd = run_target(
        "pd",
        args.pd_url,
        args,
        prompts(args.requests, args.prompt_tokens, args.vocab, args.seed + 1),
    )
    transfers = {
        role: transfer_figures(before[u], connector_totals(u))
        for role, u in (("prefill", args.prefill_url), ("decode", args.decode_url))
        if u
    }
    report = {
        "schema": "moriio-native-serve-bench/1",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "label": args.label,
        "settings": {
            k: getattr(args, k)
            for k in ("model", "requests", "prompt_tokens", "max_tokens", "concurrency", "seed")
        },
        "single": asdict(single),
        "pd": asdict(pd),
        "ratio_pd_over_single": {
            "ttft_p50": round(pd.ttft_ms["p50"] / single.ttft_ms["p50"], 3),
            "ttft_p99": round(pd.ttft_ms["p99"] / single.ttft_ms["p99"], 3),
            "itl_p50": round(pd.itl_ms["p50"] / single.itl_ms["p50"], 3),
            "itl_p99": round(pd.itl_ms["p99"] / single.itl_ms["p99"], 3),
        },
        "kv_transfer": transfers,
    }
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def print_report(r: dict[str, Any]) -> None:
    m, s = r["machine"], r["settings"]
    print(f"serving benchmark, {r['date']}, {m['host']}: {m['cpu']}, {m['nproc']} cores")
    if r["label"]:
        print(f"deployment: {r['label']}")
    print(
        f"model {s['model']}, {s['requests']} requests of {s['prompt_tokens']} prompt tokens, "
        f"{s['max_tokens']} output tokens, concurrency {s['concurrency']}"
    )
    head = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50")
    print(f"{'target':8} " + " ".join(f"{h:>10}" for h in head) + "  (ms)")
    for name in ("single", "pd"):
        t = r[name]
        print(
            f"{name:8} {t['ttft_ms']['p50']:10.2f} {t['ttft_ms']['p99']:10.2f} "
            f"{t['itl_ms']['p50']:10.2f} {t['itl_ms']['p99']:10.2f} {t['e2e_ms']['p50']:10.2f}"
        )
    q = r["ratio_pd_over_single"]
    print(
        f"P/D / single: TTFT p50 {q['ttft_p50']}x, p99 {q['ttft_p99']}x; "
        f"ITL p50 {q['itl_p50']}x, p99 {q['itl_p99']}x"
    )
    for role, t in r["kv_transfer"].items():
        print(
            f"KV transfers counted by the {role}: {t['transfers']} ({t['failed']} failed), "
            f"{t['MiB']} MiB, {t['avg_transfer_ms']} ms avg, {t['GB_per_s']} GB/s, "
            f"{t['avg_runs']} runs avg"
        )


if __name__ == "__main__":
    raise SystemExit(main())
