"""What an operator reads and relies on: the connector's statistics and log line, near-miss
config keys, the short-secret refusal, the benchmarks' and the demo's exit codes. Found by a
review of the operator surface (2026-12-07); each test failed before its fix.

Each test states a promise of the docs (stats.py, prom.py, docs/vllm.md) and checks it against
the code. No network, no vLLM engine: the protocol core runs over the scripted peer directory,
sender and engine of test_pd_tp_fanout.py, with the connector's real MoRIIONativeStats as its
stats sink; the log path is vLLM's own KVConnectorLogging.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from moriio_native.pd.puller import AwaitState, Puller, ReadState
from moriio_native.pd.tasks import RecvTask
from moriio_native.vllm.connector import MoRIIONativeConnector
from moriio_native.vllm.stats import MoRIIONativeStats
from test_pd_tp_fanout import (
    PREFILL,
    answer_handshakes,
    context,
    event,
    read_task,
)

pytestmark = pytest.mark.vllm


def real_stats(ctx: Any) -> MoRIIONativeStats:
    stats = MoRIIONativeStats()
    ctx.stats = stats
    return stats


# ---- quarantined_blocks: "once per block and transfer" -------------------------------------


def test_a_read_from_two_prefill_ranks_counts_its_quarantined_blocks_once() -> None:
    """stats.py: ``record_quarantine`` counts decode blocks put into quarantine "once per block
    and transfer"; prom.py: "Quarantined blocks are counted by the decode, once per block and
    transfer". A TP-1 decode reading from a TP-2 prefill reads each of its 3 blocks in two
    parts (a head window from each prefill rank); both parts end with operations in flight
    (a partitioned link), so the 3 blocks are quarantined -- once."""
    ctx, directory, _, _ = context("read", producer=False, tp_rank=0, tp_size=1)
    stats = real_stats(ctx)
    puller = Puller(ctx)
    task = read_task("tx-q", 2)  # local blocks (3, 4, 5)
    puller.start(task)
    assert answer_handshakes(directory, PREFILL, 2, "READ") == [0, 1]
    puller.on_event(event("tx-q#p0", "timed_out", drained=False))
    puller.on_event(event("tx-q#p1", "timed_out", drained=False))
    assert puller.read_states() == {"tx-q": ReadState.QUARANTINED}
    puller.on_drained("tx-q#p0", 0.5)
    puller.on_drained("tx-q#p1", 0.5)
    assert ctx.reports.failed_recving == {"req-1"}
    assert ctx.reports.invalid_blocks == {3, 4, 5}
    # Three decode blocks were quarantined, by one transfer.
    assert stats.data["quarantined_blocks"] == len(task.local_block_ids), stats.data


def test_a_write_from_two_prefill_ranks_counts_its_quarantined_blocks_once() -> None:
    """The same in WRITE mode: a TP-1 decode announced its 2 blocks to both ranks of a TP-2
    prefill and gave up waiting; both writers may still write, so the 2 blocks are
    quarantined until each confirms -- 2 blocks, not 4."""
    ctx, directory, _, _ = context("write", producer=False, tp_rank=0, tp_size=1)
    stats = real_stats(ctx)
    puller = Puller(ctx)
    task = RecvTask("req-1", "tx-w", PREFILL, "p:7000", 0, 2, (4, 5), report_done=True)
    puller.start(task)
    answer_handshakes(directory, PREFILL, 2, "WRITE")
    puller.give_up("tx-w", "test gave up")
    assert puller.await_states() == {"tx-w": AwaitState.QUARANTINED}
    puller.on_write_result("tx-w", ok=False, writer_rank=0)
    puller.on_write_result("tx-w", ok=False, writer_rank=1)
    assert ctx.reports.failed_recving == {"req-1"}
    assert stats.data["quarantined_blocks"] == len(task.local_block_ids), stats.data


# ---- the "KV Transfer metrics" log line's "Open transfers" ---------------------------------


def logging_of_the_connector() -> Any:
    """vLLM's KVConnectorLogging (the "KV Transfer metrics" log line) for this connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging = KVConnectorLogging(None)
    logging.connector_cls = MoRIIONativeConnector
    return logging


class FakeRank:
    """What WorkerSide.get_stats reads of a worker: its engine's open-transfer counts, its
    core's lock, its stats and the gauge it last sent. ``get_stats`` is the real method."""

    def __init__(self, tp_rank: int) -> None:
        import threading
        from types import SimpleNamespace

        from moriio_native.vllm.worker import WorkerSide

        self.tp_rank = tp_rank
        self._engine = SimpleNamespace(pending_transfers=0, quarantined_transfers=0)
        self._core = SimpleNamespace(lock=threading.RLock())
        self._stats = MoRIIONativeStats()
        self._open_reported = 0
        self.get_stats = WorkerSide.get_stats.__get__(self)


def one_step(log: Any, ranks: list[FakeRank]) -> None:
    """One engine step: every rank's get_stats, aggregated as vLLM's KVOutputAggregator does
    (the first payload is the accumulator), handed to the logger."""
    payloads = [p for p in (rank.get_stats() for rank in ranks) if p is not None]
    if not payloads:
        return
    total = payloads[0]
    for other in payloads[1:]:
        total = total.aggregate(other)
    log.observe(total.to_dict())


def test_the_log_lines_open_transfers_counts_ranks_whose_count_did_not_change() -> None:
    """stats.py: ``open_transfers`` is a gauge per TP rank, "sent when it changed since the
    rank's last payload"; reduce() reports "Open transfers" as the sum over the interval's
    payloads. vLLM resets its log accumulator after every log line, so a later line sums only
    the ranks whose count changed during its interval. TP 2: rank 0 holds 3 transfers open the
    whole time (quarantined, or leaked); rank 1 opens one: the line says 1, not 4."""
    log = logging_of_the_connector()
    lines: list[str] = []

    def capture(fmt: str, *args: Any) -> None:
        lines.append(fmt % args)

    rank0, rank1 = FakeRank(0), FakeRank(1)
    rank0._engine.quarantined_transfers = 3
    one_step(log, [rank0, rank1])
    log.log(capture)
    assert "Open transfers=3" in lines[-1]
    rank1._engine.pending_transfers = 1
    rank1._stats.record(ok=True, nbytes=4096, seconds=0.001, runs=1)
    one_step(log, [rank0, rank1])
    log.log(capture)
    assert "Open transfers=4" in lines[-1], lines[-1]


def test_the_log_line_says_no_transfer_is_open_while_one_is() -> None:
    """TP 1: a transfer stays open (quarantined) across a logging interval in which another
    completes. The rank's count did not change, so its payload carries no gauge, and the line
    reads "Open transfers=0"."""
    log = logging_of_the_connector()
    lines: list[str] = []

    def capture(fmt: str, *args: Any) -> None:
        lines.append(fmt % args)

    rank = FakeRank(0)
    rank._engine.quarantined_transfers = 1
    one_step(log, [rank])
    log.log(capture)
    assert "Open transfers=1" in lines[-1]
    rank._stats.record(ok=True, nbytes=4096, seconds=0.001, runs=1)
    one_step(log, [rank])
    log.log(capture)
    assert "Open transfers=1" in lines[-1], lines[-1]


# ---- near-miss keys of kv_connector_extra_config --------------------------------------------


@pytest.mark.parametrize("key", ["AUTH_SECRET", "Auth_Secret", "MODE", "Mode", "mdoe", "VERIFY"])
def test_a_near_miss_of_a_known_key_is_refused_whatever_its_case(key: str) -> None:
    """configuration.md / vllm.md: "a near miss of a known key (`auth_secert`, `verfy`) is
    refused naming the key it resembles", because such a typo leaves the key it meant at its
    default without a word (no authentication, for auth_secret). A key in capitals (as the
    environment variable MORIIO_NATIVE_AUTH_SECRET is spelled) or with two letters swapped in
    a short key is such a near miss too."""
    from moriio_native.errors import InvalidArgumentError
    from moriio_native.vllm.config import ConnectorConfig

    value = "s" * 32 if "secret" in key.lower() else "read"
    with pytest.raises(InvalidArgumentError, match="did you mean"):
        ConnectorConfig.from_extra_config({key: value}, role="kv_consumer")


# ---- exit codes of the benchmark entry points ----------------------------------------------


def test_the_planning_benchmark_module_exits_1_when_the_planners_disagree(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``moriio-native bench`` exits 1 "when a transfer's bytes or the planners' runs disagree"
    (configuration.md), and ``python -m moriio_native.bench.transfer`` exits 1 when a row is
    not verified. ``python -m moriio_native.bench.planning`` (the entry point
    docs/benchmarks.md runs) printed "same runs: NO" and exited 0: a script gating on it
    passed a planner that emits other runs than the reference."""
    from moriio_native.bench import planning

    real = planning.python_plan

    def wrong(*args: Any, **kwargs: Any) -> Any:
        local, remote, sizes = real(*args, **kwargs)
        return local, remote, [s + 1 for s in sizes]  # the reference disagrees

    monkeypatch.setattr(planning, "python_plan", wrong)
    argv = ["--presets", "llama3-8b", "--contexts", "1024", "--no-issue-cases", "--no-vllm"]
    code = planning.main([*argv, "--min-time", "0.001", "--json"])
    import json

    results = json.loads(capsys.readouterr().out)
    assert [r["matches_python"] for r in results] == [False]
    assert code == 1


@pytest.mark.parametrize(
    "argv",
    [["--in-flight", "0"], ["--verify-every", "0"], ["--max-blocks", "0"], ["--transfers", "-5"]],
    ids=["in-flight-0", "verify-every-0", "max-blocks-0", "transfers-negative"],
)
def test_the_soak_benchmark_refuses_a_bad_count_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """``python -m moriio_native.bench.soak`` checks two of its options before it starts the
    prefill process (parser.error, exit 2), not these: --in-flight 0 posts nothing and spins
    until --timeout (600 s by default), then reports "0 transfers not terminal within 600s";
    --verify-every 0 dies of a ZeroDivisionError at the first completion, --max-blocks 0 of
    numpy's "high <= 0", each after the prefill process started (and a 30 s join of it)."""
    from moriio_native.bench import soak

    def started(args: Any) -> Any:
        raise AssertionError(f"the soak started with {argv}")

    monkeypatch.setattr(soak, "soak", started)
    with pytest.raises(SystemExit) as exc:
        soak.main(argv)
    assert exc.value.code == 2


# ---- the demo's verdict ---------------------------------------------------------------------


def test_a_demo_whose_prefill_has_one_spare_block_passes_in_read_mode() -> None:
    """``--num-blocks`` must exceed ``--blocks-per-request`` ("so some blocks stay untouched");
    5 blocks for requests of 4 is accepted. In READ mode the decode sends its release after
    each READ and asks for the next prefill at once; the prefill worker answered that request
    before it took the release, found 1 block free, and the demo reported "verification:
    FAILED" (exit 1: "a mismatch or failed transfer", with the UCX hint on ucx) for a run in
    which every byte arrived and every block came back."""
    from moriio_native.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        preset="llama3-8b",
        layers=1,
        requests=20,
        mode="read",
        backend="loopback",
        blocks_per_request=4,
        num_blocks=5,
        timeout=10.0,
    )
    result = run_demo(cfg)
    stats = result.modes["read"]
    assert not stats.failures, stats.failures
    assert result.ok and stats.verified == 20


def test_a_decode_that_cannot_build_its_caches_is_a_demo_that_could_not_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """troubleshooting.md: "exit code 3, `demo could not run: ...` | it never started: ... or a
    worker that failed to build its caches (memory ...)". The prefill worker's failure is so;
    the decode's (this process) escaped as numpy's MemoryError: a traceback and exit 1, the
    code of "a mismatch or failed transfer"."""
    from moriio_native import cli

    argv = ["demo", "--preset", "llama3-8b", "--num-blocks", "10000000", "--backend", "loopback"]
    assert cli.main(argv) == 3
    assert "demo could not run" in capsys.readouterr().out


def test_a_short_secret_is_refused_with_the_words_troubleshooting_quotes() -> None:
    """troubleshooting.md: "`auth_secret is N bytes; use at least 16 random bytes` | at
    startup: a short secret is refused". The connector refused it first, in other words
    ("kv_connector_extra_config.auth_secret must be at least 16 bytes", after a dump of its
    parsed dict), so an operator searching the page for the line found nothing."""
    from moriio_native.errors import InvalidArgumentError
    from moriio_native.vllm.config import ConnectorConfig

    with pytest.raises(InvalidArgumentError) as exc:
        ConnectorConfig.from_extra_config({"auth_secret": "short"}, role="kv_consumer")
    assert "auth_secret is 5 bytes; use at least 16 random bytes" in str(exc.value)
    assert "short" not in str(exc.value)


@pytest.mark.parametrize("key", ["UCX_TLS", "Ucx_Tls", "ucx-tls"])
def test_a_backend_option_in_another_spelling_is_refused_naming_the_key(key: str) -> None:
    """UCX_TLS (spelled as UCX's own environment variable) was neither passed to the backend
    nor refused, so ucx_tls stayed at its default (seen failing with the first version of the
    near-miss check)."""
    from moriio_native.errors import InvalidArgumentError
    from moriio_native.vllm.config import ConnectorConfig

    with pytest.raises(InvalidArgumentError, match="did you mean 'ucx_tls'"):
        ConnectorConfig.from_extra_config({key: "tcp"}, role="kv_consumer")
