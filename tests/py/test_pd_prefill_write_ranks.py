"""Two WRITE defects of the prefill side (pd/pusher.py), found by a review of it (2026-12-07),
each test seen failing before its fix. (1) A WRITE release whose decode TP size contradicts
the request's: READ counts a release only from the decode TP size it expects ("no message can
free blocks a decode rank may still be reading", _record_release); WRITE took any release
naming a rank as that rank's: one naming another TP size aborted the rank's live job and, the
job being "released", its decode rank was told nothing (it waits for its abort_timeout and
recomputes). (2) Decode ranks held back for the TP confirmation (MAX_UNCONFIRMED_JOBS) whose
confirmation came inside begin_step (a cached handshake) were left out of the step: no layer,
no seal, WRITING until abort_timeout. Scripted directory, sender and engine as in
test_pd_tp_fanout.py (no network, no vLLM)."""

from __future__ import annotations

from typing import Any

from moriio_native.control.messages import Release
from moriio_native.pd.pusher import JobState, Pusher
from moriio_native.pd.tasks import SaveTask, SendTask
from test_pd_tp_fanout import DECODE, context, event, final_messages, sealed_write


def test_a_write_release_naming_another_decode_tp_size_leaves_the_job_alone() -> None:
    """Prefill TP 1 -> decode TP 2, both jobs sealed in the engine. A release of decode rank 1
    stating TP size 4 (not the request's 2) is ignored: the job writes on, ends done, and rank
    1 gets its write_done."""
    ctx, sender, engine, pusher = sealed_write("tx", decode_tp=2)
    pusher.on_release(Release("tx", consumer_tp_size=4, consumer_tp_rank=1))
    assert pusher.job_states() == {"tx": JobState.SEALED, "tx#d1": JobState.SEALED}
    assert ("abort", "tx#d1") not in engine.calls
    pusher.begin_step([], [SendTask("req-1", "tx")])
    for tid in ("tx", "tx#d1"):
        pusher.on_event(event(tid, "done"), drained=True)
    assert ctx.reports.done_sending == {"req-1"}
    assert sorted(m[1:3] for m in final_messages(sender)) == [
        ("write_done", "tx"),
        ("write_done", "tx"),
    ]


def test_a_write_release_of_the_requests_size_still_ends_the_job() -> None:
    """The genuine release (the request's TP size) still ends the rank's job, with no final
    message (the decode needs nothing)."""
    _, _sender, engine, pusher = sealed_write("tx", decode_tp=2)
    pusher.on_release(Release("tx", consumer_tp_size=2, consumer_tp_rank=1))
    assert pusher.job_states()["tx#d1"] is JobState.ABORTING
    assert ("abort", "tx#d1") in engine.calls


def test_an_early_write_release_naming_another_decode_tp_size_is_not_counted() -> None:
    """The same release coming before the request's save and send tasks (kept as an early
    release) does not end rank 1's job when the send task comes."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    pusher.on_release(Release("tz", consumer_tp_size=4, consumer_tp_rank=1))
    pusher.begin_step([SaveTask("req-2", "tz", (4, 5, 6), 3, DECODE, remote_tp_size=2)], [])
    pusher.begin_step([], [SendTask("req-2", "tz")])
    assert pusher.job_states() == {"tz": JobState.PENDING, "tz#d1": JobState.PENDING}


def test_held_back_ranks_confirmed_during_the_save_step_get_its_layers_and_seal() -> None:
    """Prefill TP 1 -> decode TP 32: 16 jobs are made at the save task, the other 16 ranks wait
    for a handshake to confirm the decode's TP size (MAX_UNCONFIRMED_JOBS). Decode ranks 0 and
    20 announced before the save task (the decode allocates as the prefill computes), and rank
    0 is handshaken already (an earlier request), so its job connects inside begin_step and
    confirms the size there. Rank 20's job, made then, must receive the forward's layers and
    its seal like any job of the step. Before, begin_step listed the request among the step's
    only after its jobs advanced: the jobs the confirmation made were left out of the step,
    never got a layer nor a seal, and sat WRITING until abort_timeout (then write_failed: the
    decode recomputes)."""
    from concurrent.futures import Future

    from moriio_native.control.messages import RemoteBlocks
    from test_pd_tp_fanout import DENSE, WHOLE, PortSender, peer_at, run_writer

    ctx, _, _, engine = context("write", producer=True, tp_rank=0, tp_size=1, heads=32)

    class Cached:
        """Every decode rank handshaken already: its future is done when asked for."""

        def connect(self, key: Any, notify_port: int, validate: Any, **kw: Any) -> Any:
            future: Future[Any] = Future()
            rank = key.handshake_port - DECODE.handshake_port
            future.set_result(peer_at(key, DECODE, rank, 32, "WRITE"))
            return future

        def find_engine(self, engine_id: str) -> None:
            return None

        def check_current(self, peer: Any) -> None:
            """Never replaced here."""

    ctx.directory = Cached()  # type: ignore[assignment]
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    for rank in (0, 20):
        pusher.on_remote_blocks(
            RemoteBlocks("tx", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    pusher.begin_step([SaveTask("req-1", "tx", (1, 2, 3), 3, DECODE, remote_tp_size=32)], [])
    assert len(pusher.job_states()) == 32  # the size was confirmed inside begin_step
    for layer in DENSE + WHOLE:
        pusher.layer_saved(layer, None)
    pusher.forward_done(list(DENSE + WHOLE), None)
    run_writer(ctx, pusher)
    sealed = {c[1] for c in engine.calls if c[0] == "seal"}
    assert "tx" in sealed
    assert "tx#d20" in sealed, pusher.job_states()["tx#d20"]
    assert pusher.job_states()["tx#d20"] is JobState.SEALED
