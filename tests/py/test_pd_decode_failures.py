"""The decode side (pd/puller.py) when a load fails: an announcement the sender refused,
a load the scheduler could not plan, a sibling part waiting for its check. Each test failed
before its fix (review of 2026-12-07). Scripted directory and sender (test_pd_protocol's), no
engine, no network, no vLLM."""

from __future__ import annotations

from typing import Any

from moriio_native.control.messages import Release, RemoteBlocks
from moriio_native.errors import TransportError
from moriio_native.pd.puller import Puller
from moriio_native.pd.tasks import RecvTask
from test_pd_protocol import PREFILL, context, peer


class RefusingSender:
    """NotifySender.send's contract: a raise means nothing was queued (send queue full,
    allowlist refusal, closed sender). Every message to the prefill is refused."""

    def __init__(self) -> None:
        self.refused: list[Any] = []

    def send(self, host: str, port: int, message: Any) -> None:
        self.refused.append(message)
        raise TransportError(f"{type(message).__name__}: send queue full (test)")


def test_an_announcement_that_was_never_queued_does_not_strand_the_blocks_in_quarantine() -> None:
    """remote_blocks raised in send (so it never left this process): the prefill cannot write
    into our blocks, yet the part is quarantined as if it could; abort_write fails the same way,
    the prefill (alive, answering probes) never heard of the job, so the blocks stay held until
    quarantine_timeout (300 s by default) instead of being recomputed into at once."""
    ctx, directory, _ = context("write", producer=False)
    sender = RefusingSender()
    ctx.sender = sender  # type: ignore[assignment]
    puller = Puller(ctx)
    task = RecvTask(
        "req-1", "tx-1", PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5), report_done=True
    )
    puller.start(task)
    key, future = directory.pending.pop()
    future.set_result(peer(key))
    assert any(isinstance(m, RemoteBlocks) for m in sender.refused)
    states = puller.await_states()
    assert states == {}, f"blocks stranded: {states} (nothing was ever sent to the prefill)"
    assert "req-1" in ctx.reports.failed_recving
    assert {4, 5} <= ctx.reports.invalid_blocks


def test_a_load_the_scheduler_could_not_plan_is_failed_naming_why(caplog: Any) -> None:
    """The scheduler hands the workers a RecvTask with ``error`` set when vLLM's block ids do
    not fit the KV-cache groups (vllm/scheduler.py: hybrid.select's ValueError, not logged
    there). The puller fails the load and releases the prefill, but says why nowhere: no log
    line, no ``reports.failures`` entry (which every other failed load gets, and which the
    demo shows as the failure). The operator sees a request recomputed for no stated reason."""
    ctx, _, sender = context("write", producer=False)
    puller = Puller(ctx)
    why = "group 1 (sliding, window 128): 3 block ids for 5 blocks of tokens [0, 300)"
    task = RecvTask(
        "req-9",
        "tx-9",
        PREFILL,
        "p:7000",
        0,
        1,
        local_block_ids=(4, 5),
        report_done=True,
        error=why,
    )
    with caplog.at_level("DEBUG", logger="moriio_native"):
        puller.start(task)
    assert "req-9" in ctx.reports.failed_recving
    assert any(isinstance(m, Release) for m in sender.sent)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert why in ctx.reports.failures.get("req-9", "") or why in logged, (
        f"the refusal names no reason: failures={ctx.reports.failures!r}, log={logged!r}"
    )


class HeldConfirmer:
    """confirm_reads' checker whose prefill has not answered yet: verdicts are held until the
    test gives them (a prefill answers within transfer_timeout, else the check fails then)."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def confirm(
        self, transfer_id: str, peer: Any, ids: Any, hold: int, verdict: Any, *a: Any
    ) -> None:
        self.pending.append(verdict)


def test_a_failed_part_does_not_wait_for_a_sibling_parts_hold_confirmation() -> None:
    """Prefill TP 2 -> decode TP 1, confirm_reads on. Part p0's READ is done in the engine and
    waits for prefill rank 0's hold confirmation (VERIFYING: nothing of it can write any more);
    part p1 fails (drained). The load's outcome is settled (failed) and no operation of it can
    land, yet it is reported only once p0's confirmation comes back -- up to transfer_timeout
    later when that prefill rank is slow -- so vLLM keeps the request's blocks and both prefill
    ranks keep theirs (no release) meanwhile. A READ part that completes is aborted at once
    when another fails (_stop_other_parts); one being confirmed is simply waited for."""
    from test_pd_tp_fanout import PREFILL as FANOUT_PREFILL
    from test_pd_tp_fanout import answer_handshakes, event, read_task
    from test_pd_tp_fanout import context as fanout_context

    ctx, directory, sender, _ = fanout_context("read", producer=False, tp_rank=0, tp_size=1)
    confirmer = HeldConfirmer()
    ctx.confirmer = confirmer  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task("tx-c", 2))
    answer_handshakes(directory, FANOUT_PREFILL, 2, "READ")
    puller.on_event(event("tx-c#p0", "done"))
    assert len(confirmer.pending) == 1  # p0 is VERIFYING
    puller.on_event(event("tx-c#p1", "failed"))  # drained: nothing of p1 lands any more
    try:
        assert "req-1" in ctx.reports.failed_recving, (
            f"load not reported though settled failed and drained: {puller.read_states()}"
        )
        assert any(isinstance(m, Release) for m in sender.sent), "the prefill is not released"
    finally:
        for verdict in confirmer.pending:
            verdict(None)
