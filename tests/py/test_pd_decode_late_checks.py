"""The decode side (pd/puller.py) when a READ part's hold confirmation or checksum check no
longer counts (its load failed or was aborted): no check started for it, no late verdict counted
or logged as a failure, no healthy prefill forgotten. Each test failed before its fix (review of
2026-12-07)."""

from __future__ import annotations

import logging
from typing import Any

from moriio_native.control.messages import Release
from moriio_native.pd.puller import Puller
from test_pd_decode_failures import HeldConfirmer
from test_pd_tp_fanout import PREFILL as FANOUT_PREFILL
from test_pd_tp_fanout import answer_handshakes, event, read_task
from test_pd_tp_fanout import context as fanout_context


class CountingStats:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.confirms: list[bool] = []

    def record_confirm(self, *, ok: bool) -> None:
        self.confirms.append(ok)
        self.inner.record_confirm(ok=ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _two_part_read(tid: str) -> tuple[Any, Any, Any, Puller, HeldConfirmer]:
    ctx, directory, sender, engine = fanout_context("read", producer=False, tp_rank=0, tp_size=1)
    confirmer = HeldConfirmer()
    ctx.confirmer = confirmer  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task(tid, 2))
    answer_handshakes(directory, FANOUT_PREFILL, 2, "READ")
    return ctx, sender, engine, puller, confirmer


def test_a_part_done_after_its_sibling_failed_does_not_start_a_check() -> None:
    """p1 fails (drained) while p0 is READING: _stop_other_parts aborts p0 in the engine, but
    p0's READ had finished (its done event is already queued: the abort comes too late). The
    done event then starts p0's hold confirmation (on_event -> _verify_read does not look at
    read.failing), and the failed load is reported -- and both prefill ranks released -- only
    when that confirmation comes back (up to transfer_timeout). 5b802cf's aim ("a failed READ
    no longer waits for a sibling part's check") is missed whenever the abort loses this race."""
    ctx, sender, engine, puller, confirmer = _two_part_read("tx-r1")
    puller.on_event(event("tx-r1#p1", "failed"))  # p0 READING: aborted in the engine
    assert ("abort", "tx-r1#p0") in engine.calls
    puller.on_event(event("tx-r1#p0", "done"))  # the abort came too late
    try:
        assert "req-1" in ctx.reports.failed_recving, (
            f"failed load not reported: waits for a check whose verdict cannot count "
            f"({puller.read_states()}, {len(confirmer.pending)} check(s) started)"
        )
        assert any(isinstance(m, Release) for m in sender.sent), "the prefill is not released"
    finally:
        for verdict in confirmer.pending:
            verdict(None)


def test_an_aborted_read_whose_part_completes_does_not_start_a_check() -> None:
    """vLLM aborts the request (abandon_read) while p0 and p1 are READING: both are aborted in
    the engine; p1's abort takes (failed event), p0's READ had finished (done event queued). p0
    goes on to a hold confirmation nobody needs: the aborted load is reported (and the prefill
    released) only when it comes back, though 5b802cf ends checking parts at once."""
    ctx, _sender, _engine, puller, confirmer = _two_part_read("tx-r2")
    puller.abandon_read("tx-r2", "request aborted")
    puller.on_event(event("tx-r2#p1", "failed"))
    puller.on_event(event("tx-r2#p0", "done"))
    try:
        assert "req-1" in ctx.reports.failed_recving, (
            f"aborted load not reported: waits for a check ({puller.read_states()}, "
            f"{len(confirmer.pending)} check(s) started)"
        )
    finally:
        for verdict in confirmer.pending:
            verdict(None)


def test_a_late_verdict_for_a_part_ended_unchecked_is_not_counted_or_logged_as_a_failure(
    caplog: Any,
) -> None:
    """p0 is VERIFYING (hold confirmation asked); p1 fails: 5b802cf ends p0 at once ("not
    checked"), the load is reported failed and both prefill ranks are RELEASED. The prefill,
    released, then answers p0's confirmation with "not held" (it freed the blocks because we
    told it to). _end_checked_read still counts that verdict as a failed confirmation
    (stats.record_confirm(ok=False), the operators' confirm-failure metric) and logs it at
    ERROR naming the request -- an integrity alarm caused by our own release."""
    ctx, sender, _engine, puller, confirmer = _two_part_read("tx-r3")
    stats = CountingStats(ctx.stats)
    ctx.stats = stats  # type: ignore[assignment]
    puller.on_event(event("tx-r3#p0", "done"))
    assert len(confirmer.pending) == 1  # p0 VERIFYING
    puller.on_event(event("tx-r3#p1", "failed"))
    assert "req-1" in ctx.reports.failed_recving  # p0 ended "not checked" (the fix)
    assert any(isinstance(m, Release) for m in sender.sent)
    with caplog.at_level(logging.ERROR, logger="moriio_native"):
        confirmer.pending.pop()("prefill rank 0 no longer holds blocks [10, 11, 12]")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert stats.confirms == [] and errors == [], (
        f"a verdict that no longer counts was recorded/logged as a failure: "
        f"confirms={stats.confirms}, errors={errors}"
    )


class HeldVerifier:
    """verify's checker (Verifier.check_read) whose prefill checksums have not come yet."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def check_read(
        self, transfer_id: str, peer: Any, local: Any, remote: Any, verdict: Any, *a: Any
    ) -> None:
        self.pending.append(verdict)


class CountingVerifyStats(CountingStats):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.verifies: list[bool] = []

    def record_verify(self, *, ok: bool) -> None:
        self.verifies.append(ok)
        self.inner.record_verify(ok=ok)


def test_a_late_checksum_verdict_after_an_abort_is_not_counted_as_a_mismatch(caplog: Any) -> None:
    """verify, READ, TP 1 -> TP 1. The READ is done (VERIFYING: the prefill's checksums of its
    blocks asked). vLLM aborts the request: 5b802cf's abandon_read ends the part at once
    ("not checked"), reports the load and RELEASES the prefill, which frees -- and may reuse --
    the blocks whose checksums it is computing. Its answer then differs from ours: the verdict
    ("checksum mismatch") is counted by stats.record_verify(ok=False), the operators'
    verify-failure (corruption) metric, and logged at ERROR naming the request, though the
    bytes were never in doubt and the load's outcome was already settled."""
    ctx, directory, sender, _engine = fanout_context("read", producer=False, tp_rank=0, tp_size=1)
    verifier = HeldVerifier()
    ctx.verifier = verifier  # type: ignore[assignment]
    stats = CountingVerifyStats(ctx.stats)
    ctx.stats = stats  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task("tx-v", 1))
    answer_handshakes(directory, FANOUT_PREFILL, 1, "READ")
    puller.on_event(event("tx-v", "done"))
    assert len(verifier.pending) == 1, puller.read_states()  # VERIFYING
    puller.abandon_read("tx-v", "request aborted")
    assert "req-1" in ctx.reports.failed_recving  # ended "not checked" (the fix)
    assert any(isinstance(m, Release) for m in sender.sent)
    with caplog.at_level(logging.ERROR, logger="moriio_native"):
        verifier.pending.pop()("checksum mismatch in layer attn.0 block 10")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert stats.verifies == [] and errors == [], (
        f"a verdict that no longer counts was recorded/logged as a mismatch: "
        f"verifies={stats.verifies}, errors={errors}"
    )


def test_a_request_abort_during_a_check_does_not_forget_the_healthy_prefill() -> None:
    """verify, READ, TP 1 -> TP 1: the READ is done (VERIFYING) and vLLM aborts the request.
    5b802cf's abandon_read ends the part MISMATCH; _end_read_part then treats it as a peer
    failure and forgets the prefill's cached handshake ("a prefill that restarted under the
    same address is reached at its new transport address") -- though nothing about the prefill
    failed. Every request aborted (or failing on another rank) during a check makes the next
    request to that healthy prefill handshake again."""
    ctx, directory, _sender, _engine = fanout_context("read", producer=False, tp_rank=0, tp_size=1)
    forgotten: list[Any] = []
    directory.forget = lambda peer: forgotten.append(peer)  # type: ignore[method-assign]
    verifier = HeldVerifier()
    ctx.verifier = verifier  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task("tx-f", 1))
    answer_handshakes(directory, FANOUT_PREFILL, 1, "READ")
    puller.on_event(event("tx-f", "done"))
    assert len(verifier.pending) == 1  # VERIFYING
    puller.abandon_read("tx-f", "request aborted")
    assert "req-1" in ctx.reports.failed_recving
    assert [p for p in forgotten if p is not None] == [], (
        f"a healthy prefill's handshake forgotten on a request abort: {forgotten}"
    )
