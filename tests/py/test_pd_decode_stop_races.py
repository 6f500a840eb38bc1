"""The decode side (pd/puller.py): a READ part that completes while its load is failing starts no
check, and a failed or aborted READ forgets only the prefills that failed."""

from __future__ import annotations

from typing import Any

from moriio_native.pd.puller import Puller
from test_pd_decode_failures import HeldConfirmer
from test_pd_tp_fanout import PREFILL as FANOUT_PREFILL
from test_pd_tp_fanout import answer_handshakes, event, peer_at, read_task
from test_pd_tp_fanout import context as fanout_context


def _read(tid: str, sources: int, *, confirm: bool = False, handshake: bool = True) -> Any:
    ctx, directory, _sender, engine = fanout_context("read", producer=False, tp_rank=0, tp_size=1)
    forgotten: list[Any] = []
    directory.forget = lambda peer: forgotten.append(peer)  # type: ignore[method-assign]
    confirmer = HeldConfirmer()
    if confirm:
        ctx.confirmer = confirmer  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task(tid, sources))
    if handshake:
        answer_handshakes(directory, FANOUT_PREFILL, sources, "READ")
    return ctx, directory, engine, puller, confirmer, forgotten


def test_an_abort_racing_a_checked_completion_still_starts_no_check() -> None:
    """confirm_reads, TP 1 -> TP 1. The engine's done event is handled on the event thread:
    on_event reads read.failing (False) under the lock, RELEASES it, then calls _verify_read,
    which takes the lock again to move READING -> VERIFYING. vLLM's abort (abandon_read, the
    scheduler thread) lands in between: it sets read.failing, finds the part READING and only
    aborts it in the engine (too late: it is done; the abort is refused and logged at debug).
    _verify_read then starts the hold confirmation anyway: the aborted load is reported, and
    the prefill released, only when the confirmation comes back (up to transfer_timeout), and
    that verdict is counted in the confirm metrics -- the very case 6fbe8cd fixed, still open
    in a window of two lock sections."""
    ctx, _directory, engine, puller, confirmer, _forgotten = _read("tx-race", 1, confirm=True)
    verify = puller._verify_read

    def abort_in_between(read: Any, part: Any, ev: Any) -> None:
        puller.abandon_read("tx-race", "the request was aborted")  # the scheduler thread
        verify(read, part, ev)

    puller._verify_read = abort_in_between  # type: ignore[method-assign]
    puller.on_event(event("tx-race", "done"))
    try:
        assert ("abort", "tx-race") in engine.calls
        assert "req-1" in ctx.reports.failed_recving, (
            f"aborted load not reported: it waits for a check started after the abort "
            f"({puller.read_states()}, {len(confirmer.pending)} check(s) started)"
        )
    finally:
        for verdict in confirmer.pending:
            verdict(None)


def test_a_request_abort_of_a_posted_read_does_not_forget_the_healthy_prefill() -> None:
    """TP 1 -> TP 1, the READ posted. vLLM aborts the request: abandon_read aborts the READ in
    the engine and the engine's 'aborted' event (drained) ends the part FAILED through
    _end_read_part with peer_failed left True: the prefill's cached handshake is forgotten,
    though it did nothing wrong (6fbe8cd: "a part ended for its load's sake does not forget its
    healthy prefill" -- fixed only for a part VERIFYING). Every aborted request in flight
    (client disconnects) makes the next request to that prefill handshake again."""
    ctx, _directory, engine, puller, _confirmer, forgotten = _read("tx-ab", 1)
    assert any(c[0] == "read" for c in engine.calls)
    puller.abandon_read("tx-ab", "the request was aborted")
    assert ("abort", "tx-ab") in engine.calls
    puller.on_event(event("tx-ab", "aborted"))
    assert "req-1" in ctx.reports.failed_recving
    assert [p for p in forgotten if p is not None] == [], (
        f"a healthy prefill's handshake forgotten on a request abort: {forgotten}"
    )


def test_a_sibling_failure_does_not_forget_the_prefill_of_the_part_aborted_for_it() -> None:
    """Prefill TP 2 -> decode TP 1: p1's READ fails, so p0 (READING) is aborted for the load's
    sake; p0's 'aborted' event ends it FAILED with peer_failed True and prefill rank 0's
    healthy handshake is forgotten along with rank 1's."""
    ctx, _directory, engine, puller, _confirmer, forgotten = _read("tx-sib", 2)
    puller.on_event(event("tx-sib#p1", "failed"))
    assert ("abort", "tx-sib#p0") in engine.calls
    failed_peer = [p for p in forgotten if p is not None]
    assert len(failed_peer) == 1  # rank 1's: it failed
    puller.on_event(event("tx-sib#p0", "aborted"))
    assert "req-1" in ctx.reports.failed_recving
    others = [p for p in forgotten if p is not None and p is not failed_peer[0]]
    assert others == [], (
        f"the healthy prefill rank's handshake forgotten because its sibling failed: "
        f"{[p.key for p in others]}"
    )


def test_a_handshake_that_completes_after_a_sibling_failed_does_not_forget_its_prefill() -> None:
    """Prefill TP 2 -> decode TP 1: p1 fails before p0's handshake completes. p0's handshake
    then answers (healthy); _post_read finds read.failing and raises "another source rank of
    the load failed" into its own except branch, which forgets the handshake it just made (and
    _part_failed forgets it again, logging an ERROR "READ ... not started" against a prefill
    that did nothing wrong)."""
    ctx, directory, _engine, puller, _confirmer, forgotten = _read("tx-late", 2, handshake=False)
    key1, future1 = next((k, f) for k, f in directory.pending if k.handshake_port % 2 == 1)
    directory.pending = [(k, f) for k, f in directory.pending if f is not future1]
    future1.set_result(peer_at(key1, FANOUT_PREFILL, 1, 2, "READ"))
    puller.on_event(event("tx-late#p1", "failed"))
    failed_peer = [p for p in forgotten if p is not None]
    assert len(failed_peer) == 1
    answer_handshakes(directory, FANOUT_PREFILL, 2, "READ")  # p0's healthy prefill answers
    assert "req-1" in ctx.reports.failed_recving
    others = [p for p in forgotten if p is not None and p is not failed_peer[0]]
    assert others == [], (
        f"a healthy prefill's fresh handshake forgotten because its sibling failed: "
        f"{[p.key for p in others]}"
    )
