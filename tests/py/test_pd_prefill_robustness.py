"""The prefill side (pd/pusher.py) when a write fails with an error text no message may carry:
the decode is told, and the writer thread, which posts every job's writes, lives on. Found by
a review of the prefill side (2026-12-06), seen failing before its fix. Scripted directory,
sender and engine as in test_pd_tp_fanout.py (no network, no vLLM)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from moriio_native.control.messages import AbortWrite, Release, RemoteBlocks, WriteFailed
from moriio_native.errors import NotFoundError
from moriio_native.pd.pusher import JobState, Pusher
from moriio_native.pd.tasks import SaveTask, SendTask
from test_pd_tp_fanout import (
    DECODE,
    DENSE,
    PortSender,
    answer_handshakes,
    context,
    event,
    final_messages,
    run_writer,
    sealed_write,
)


class CudaErrorEvent:
    """A layer's CUDA event whose host wait fails as torch reports a CUDA error: a message of
    several lines."""

    cuda_event = 0x1000

    def synchronize(self) -> None:
        raise RuntimeError(
            "CUDA error: an illegal memory access was encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call, so "
            "the stacktrace below might be incorrect.\n"
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
        )

    def query(self) -> bool:
        return True


def test_a_write_failing_with_a_multiline_error_tells_the_decode_and_keeps_the_writer() -> None:
    """The writer's first op for request 1 fails before anything reached the engine (the
    layer's event cannot be waited for, with a CUDA error of several lines). The job completes
    at once (the engine has no transfer of it to abort) and its write_failed carries the error
    made one printable line; the writer lives on and posts request 2. Before, the newline made
    the message's constructor raise inside the writer's error path: the thread ended, request
    1's decode was never told, and no later write of any request was posted (once the writer
    queue filled, feed_writer would have blocked vLLM's step for good)."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    engine.waits_for_device_events = lambda peer: False  # type: ignore[attr-defined]
    posted: set[str] = set()
    write_layer = engine.write_layer

    def recording_write_layer(tid: str, *a: Any, **k: Any) -> bool:
        posted.add(tid)
        return write_layer(tid, *a, **k)

    def abort(tid: str) -> None:
        if tid not in posted:
            raise NotFoundError(f"no transfer '{tid}'")

    engine.write_layer = recording_write_layer  # type: ignore[method-assign]
    engine.abort = abort  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    writer = threading.Thread(target=pusher.writer_loop, daemon=True)
    writer.start()
    try:
        pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
        pusher.on_remote_blocks(RemoteBlocks("tx-1", ((20, 21, 22),), "d:8000/dp0/tp0"))
        answer_handshakes(directory, DECODE, 1, "WRITE")
        pusher.layer_saved(DENSE[0], CudaErrorEvent())
        time.sleep(0.5)
        failed = [m for _, m in sender.ports if isinstance(m, WriteFailed)]

        pusher.begin_step([SaveTask("req-2", "tx-2", (4, 5, 6), 3, DECODE, remote_tp_size=1)], [])
        pusher.on_remote_blocks(RemoteBlocks("tx-2", ((30, 31, 32),), "d:8000/dp0/tp0"))
        answer_handshakes(directory, DECODE, 1, "WRITE")
        for layer in DENSE:
            pusher.layer_saved(layer, None)
        pusher.forward_done(list(DENSE), None)
        time.sleep(0.5)
        assert [m.reason.startswith("write attn") for m in failed] == [True], failed
        assert "CUDA error: an illegal memory access was encountered CUDA kernel" in (
            failed[0].reason
        )
        assert writer.is_alive(), "the writer thread ended"
        assert any(c[0] == "seal" and c[1] == "tx-2" for c in engine.calls)
    finally:
        ctx.stop.set()
        writer.join(2)


def test_an_abort_of_a_job_given_up_undrained_is_not_answered_while_a_sibling_lives() -> None:
    """Prefill TP 1 -> decode TP 2: the job of decode rank 0 ended without the engine
    confirming its writes stopped (given up quarantine_timeout past its deadline) and stays
    among the jobs while rank 1's is still live. A late abort_write from rank 0 gets no
    write_aborted: its writes may still land, and the answer would end that decode's
    quarantine. Before, a terminal job still among the jobs was answered as one that ended
    drained."""
    ctx, sender, _, pusher = sealed_write("tx-s", decode_tp=2)
    assert pusher.job_states() == {"tx-s": JobState.SEALED, "tx-s#d1": JobState.SEALED}
    pusher.begin_step([], [SendTask("req-1", "tx-s")])
    pusher.on_event(event("tx-s", "failed", drained=False), drained=False)
    deadline = pusher._jobs["tx-s"].deadline
    pusher.check_timeouts(deadline + 1)  # rank 1's job: aborted, its event never comes
    pusher.check_timeouts(deadline + ctx.cfg.quarantine_timeout + 1)
    states = pusher.job_states()
    assert states["tx-s"] is JobState.FAILED and states["tx-s#d1"] is JobState.ABORTING
    pusher.on_abort_write(
        AbortWrite("tx-s", "d:8000/dp0/tp0", DECODE.host, DECODE.handshake_port, DECODE.notify_port)
    )
    assert final_messages(sender) == []


def test_a_hold_released_before_its_send_task_drops_its_late_messages() -> None:
    """READ: the decode's release comes before the prefill's send task, so the hold ends the
    moment the task arrives. Its transfer is then marked terminal, as a released or expired
    hold's is: a late release of it is dropped, not kept as an early release of a later
    request reusing the id (which that would free at once). Before, this path alone did not
    mark it."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    terminal: list[str] = []
    ctx.mark_terminal = terminal.append  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    pusher.on_release(Release("tx-T"))  # before the send task: kept as an early release
    assert terminal == []
    pusher.begin_step([], [SendTask("req-A", "tx-T")])
    assert ctx.reports.done_sending == {"req-A"} and terminal == ["tx-T"]


def test_a_reused_id_failed_before_its_first_write_was_posted_still_ends() -> None:
    """A WRITE job of a transfer id the engine remembers ended (a reused id) is failed before
    the writer posted its first write (its decode aborted): nothing of it is in the engine, so
    it completes at once and its request's blocks are freed. Before, it was aborted in the
    engine, which answers an abort of an ended id with OK and no event, and waited in ABORTING
    for good (a review of the _end_spent fix found this second way in)."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = PortSender()  # type: ignore[assignment]
    ended = {"tx-T"}  # the engine remembers an earlier transfer tx-T as ended

    def write_layer(tid: str, *a: Any, **k: Any) -> bool:
        engine.calls.append(("write_layer", tid))
        return tid not in ended

    def write_layers(tid: str, *a: Any, **k: Any) -> bool:
        engine.calls.append(("write_layers", tid))
        return tid not in ended

    def abort(tid: str) -> None:  # real engine: OK (no event) for a terminal id
        engine.calls.append(("abort", tid))

    engine.write_layer = write_layer  # type: ignore[method-assign]
    engine.write_layers = write_layers  # type: ignore[method-assign]
    engine.abort = abort  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-2", "tx-T", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(RemoteBlocks("tx-T", ((20, 21, 22),), "d:8000/dp0/tp0"))
    answer_handshakes(directory, DECODE, 1, "WRITE")
    for layer in DENSE:
        pusher.layer_saved(layer, None)
    pusher.feed_writer()
    assert pusher.job_states() == {"tx-T": JobState.WRITING}
    # The request ends (blocks handed to the workers) and its decode gives up before the writer
    # ran: _fail with submitted > 0 -> engine.abort (OK for the ended id) -> ABORTING.
    pusher.begin_step([], [SendTask("req-2", "tx-T")])
    pusher.on_abort_write(
        AbortWrite("tx-T", "d:8000/dp0/tp0", DECODE.host, DECODE.handshake_port, DECODE.notify_port)
    )
    run_writer(ctx, pusher)
    far = 1e12
    pusher.check_timeouts(far)  # long past abort_timeout and quarantine_timeout
    pusher.check_timeouts(far + 1e6)
    states = pusher.job_states()
    assert states.get("tx-T") in (None, JobState.FAILED), (states, engine.calls)
    assert "req-2" in ctx.reports.done_sending, "the request's blocks are never freed"


@pytest.mark.parametrize("hook", ["handle_preemptions", "begin_step"])
def test_a_dropped_job_draining_after_its_abort_still_tells_the_decode(hook: str) -> None:
    """A WRITE job sealed (its writes in the engine) when vLLM preempted its request: the drop
    aborts it, and the engine ends it with writes still in flight (DRAINING). The next
    timeout passes wait for the drain, then the decode gets its write_failed; nothing is
    reported to vLLM. Before, the dropped request had no deadline (0), so the first pass gave
    the job up undrained and the decode was never told (a review of the drop found it). The
    drop comes through vLLM's handle_preemptions, or through begin_step where a runner calls
    none, and a second delivery changes nothing."""
    ctx, sender, engine, pusher = sealed_write("tx-p")
    assert pusher.job_states()["tx-p"] is JobState.SEALED
    drop = SendTask("req-1", "tx-p", aborted=True, preempted=True)
    if hook == "handle_preemptions":
        pusher.drop_preempted([drop])
    pusher.begin_step([], [drop])
    assert [c for c in engine.calls if c[0] == "abort"] == [("abort", "tx-p")]
    assert pusher.job_states()["tx-p"] is JobState.ABORTING
    pusher.on_event(event("tx-p", "aborted", drained=False), drained=False)
    assert pusher.job_states()["tx-p"] is JobState.DRAINING
    pusher.check_timeouts(time.monotonic())  # the very next step's pass
    assert pusher.job_states()["tx-p"] is JobState.DRAINING
    assert pusher.on_drained("tx-p") == "done"
    assert final_messages(sender) == [(8100, "write_failed", "tx-p", 0)]
    assert not ctx.reports.done_sending
