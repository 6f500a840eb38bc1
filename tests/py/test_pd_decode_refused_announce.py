"""The decode side (pd/puller.py): an announcement the sender refused, racing a give_up, ends
the part instead of leaving it quarantined (nothing was ever sent). Failed before its fix
(review of 2026-12-07). Scripted directory (test_pd_protocol's), no engine, no network, no
vLLM."""

from __future__ import annotations

from typing import Any

from moriio_native.control.messages import AbortWrite, RemoteBlocks
from moriio_native.errors import TransportError
from moriio_native.pd.context import Context
from moriio_native.pd.puller import Puller
from moriio_native.pd.tasks import RecvTask
from test_pd_protocol import PREFILL, context, peer


class RacingRefusingSender:
    """Every message refused before queuing (NotifySender.send's contract: queue full). While
    remote_blocks is being sent -- the part already ANNOUNCED, the lock not held -- vLLM's abort
    reaches the puller (give_up), as it can from the scheduler's thread at any moment."""

    def __init__(self) -> None:
        self.puller: Puller | None = None
        self.refused: list[Any] = []

    def send(self, host: str, port: int, message: Any) -> None:
        self.refused.append(message)
        if isinstance(message, RemoteBlocks) and self.puller is not None:
            self.puller.give_up(message.transfer_id, "request aborted")
        raise TransportError(f"{type(message).__name__}: send queue full (test)")


def announce_through(sender: Any) -> tuple[Context, Puller]:
    """A WRITE-mode decode announcing request req-1 (transfer tx-1) through ``sender``, whose
    ``puller`` is set to the decode's, the prefill handshaken."""
    ctx, directory, _ = context("write", producer=False)
    ctx.sender = sender
    puller = Puller(ctx)
    sender.puller = puller
    task = RecvTask(
        "req-1", "tx-1", PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5), report_done=True
    )
    puller.start(task)
    key, future = directory.pending.pop()
    future.set_result(peer(key))
    return ctx, puller


def test_a_refused_announcement_racing_an_abort_does_not_strand_the_blocks() -> None:
    """give_up ran between _announce's advance to ANNOUNCED and sender.send: the part went
    QUARANTINED and abort_write was sent (refused too: the same full queue). Then remote_blocks
    is refused: it never left, so the prefill cannot write -- the case 5b802cf ends FAILED at
    once. But _announce_failed(unsent=True) only ends a part still ANNOUNCED; (QUARANTINED,
    UNREACHABLE) is no transition, so the part stays quarantined, its blocks held (unreported
    to vLLM) until quarantine_timeout, the prefill (alive, answering probes) never having
    heard of the job."""
    sender = RacingRefusingSender()
    ctx, puller = announce_through(sender)
    assert any(isinstance(m, AbortWrite) for m in sender.refused)  # the race happened
    assert any(isinstance(m, RemoteBlocks) for m in sender.refused)
    states = puller.await_states()
    assert states == {}, f"blocks stranded: {states} (nothing was ever sent to the prefill)"
    assert "req-1" in ctx.reports.failed_recving
