"""bench/serve_bench.py against a fake OpenAI-style server: streaming, percentiles, metrics."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from net_support import free_port

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "bench" / "serve_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


METRICS = """# HELP vllm:moriio_native_transfers_total KV transfers
# TYPE vllm:moriio_native_transfers_total counter
vllm:moriio_native_transfers_total{engine="0",model_name="m"} 3.0
vllm:moriio_native_transfers_total{engine="1",model_name="m"} 1.0
vllm:moriio_native_failed_transfers_total{engine="0",model_name="m"} 1.0
vllm:moriio_native_transferred_bytes_total{engine="0",model_name="m"} 4000000.0
vllm:moriio_native_transfer_time_seconds_sum{engine="0",model_name="m"} 0.004
vllm:moriio_native_transfer_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:moriio_native_copy_runs_per_transfer_sum{engine="0",model_name="m"} 40.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
"""


class FakeServer(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` chunks 20 ms apart after a 50 ms first-token delay."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = METRICS.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["stream"] and req["temperature"] == 0.0 and req["ignore_eos"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.05)
        for i in range(req["max_tokens"]):
            if i:
                time.sleep(0.02)
            chunk = {"choices": [{"text": f" t{i}"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join(5)


def test_stream_one_measures_first_token_and_gaps(server: str) -> None:
    bench = load_bench()
    sample = bench.stream_one(server, "m", [5, 6, 7], 5, timeout=30)
    assert sample.tokens == 5 and len(sample.itl_s) == 4
    assert sample.ttft_s >= 0.05
    assert all(gap >= 0.015 for gap in sample.itl_s)
    assert sample.e2e_s >= sample.ttft_s + sum(sample.itl_s)


def test_connector_totals_sum_engines_and_figures(server: str) -> None:
    bench = load_bench()
    before = dict.fromkeys(bench.TRANSFER_SERIES, 0.0)
    after = bench.connector_totals(server)
    assert after["transfers"] == 4 and after["failed"] == 1 and after["runs"] == 40
    figures = bench.transfer_figures(before, after)
    assert figures["transfers"] == 4 and figures["failed"] == 1
    assert figures["avg_transfer_ms"] == 1.0 and figures["GB_per_s"] == 1.0
    assert figures["avg_runs"] == 10.0


def test_main_reports_both_targets_and_ratios(server: str, tmp_path: Path) -> None:
    bench = load_bench()
    out = tmp_path / "serve.json"
    args = ["--pd-url", server, "--single-url", server, "--decode-url", server, "--model", "m"]
    args += ["--requests", "3", "--prompt-tokens", "8", "--max-tokens", "3", "--json", str(out)]
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "moriio-native-serve-bench/1"
    assert report["single"]["requests"] == report["pd"]["requests"] == 3
    assert report["pd"]["tokens"] == 9
    assert report["ratio_pd_over_single"]["ttft_p50"] > 0
    # The fake's counters do not move between the two reads.
    assert report["kv_transfer"]["decode"]["transfers"] == 0
    assert report["machine"]["nproc"] >= 1


def test_percentiles() -> None:
    bench = load_bench()
    assert bench._pct([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert bench._pct([5.0], 0.99) == 5.0
