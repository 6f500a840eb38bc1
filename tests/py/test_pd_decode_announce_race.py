"""The transition (QUARANTINED, UNREACHABLE) -> FAILED (pd/puller.py) is for an announcement the
sender refused before queuing it; it was taken for every UNREACHABLE, so an announcement that may
have left (a give_up raced its send) ended a quarantine while the prefill could still write."""

from __future__ import annotations

from typing import Any

from moriio_native.control.messages import RemoteBlocks
from moriio_native.pd.puller import AwaitState, Puller
from test_pd_decode_refused_announce import announce_through


class RacingBrokenSender:
    """remote_blocks raises something other than a MoriioError (the sender's contract says
    nothing of it: _announce's last ``except Exception`` exists for it, "the message may have
    left: the prefill could write"); vLLM's abort (give_up) reaches the puller while it is
    being sent. Other messages (abort_write) are queued."""

    def __init__(self) -> None:
        self.puller: Puller | None = None
        self.sent: list[Any] = []

    def send(self, host: str, port: int, message: Any) -> None:
        self.sent.append(message)
        if isinstance(message, RemoteBlocks):
            assert self.puller is not None
            self.puller.give_up(message.transfer_id, "request aborted")
            raise RuntimeError("socket state error after the frames were handed to ZMQ (test)")


def test_an_announcement_that_may_have_left_keeps_a_raced_quarantine() -> None:
    """give_up ran between _announce's advance to ANNOUNCED and sender.send: the part went
    QUARANTINED and abort_write went out. remote_blocks then failed with an unexpected error
    (not a refusal before queuing: unsent=False): it may have reached the prefill, which may
    be writing. _announce_failed sees the part QUARANTINED (not ANNOUNCED), skips its
    "quarantine as for an abort" branch and ends the part UNREACHABLE -- which 6fbe8cd made a
    transition from QUARANTINED to FAILED. Before it, the event did not apply and the
    quarantine held. Now the blocks are reported to vLLM (reused) while the prefill may still
    write into them: DESIGN 3.7's guarantee broken."""
    sender = RacingBrokenSender()
    ctx, puller = announce_through(sender)
    assert any(isinstance(m, RemoteBlocks) for m in sender.sent)
    states = puller.await_states()
    assert states == {"tx-1": AwaitState.QUARANTINED}, (
        f"a WRITE whose announcement may have left ended while the prefill may write: "
        f"{states}, failed_recving={ctx.reports.failed_recving}, "
        f"invalid_blocks={sorted(ctx.reports.invalid_blocks)}"
    )
