"""The prefill side (pd/pusher.py) against releases and tasks out of the usual order: releases
naming another decode TP size, a send task without a save task, save tasks in READ mode. Each
test failed before its fix (review of 2026-12-07). Scripted directory, sender and engine as in
test_pd_tp_fanout.py (no network, no vLLM)."""

from __future__ import annotations

import time

from moriio_native.control.messages import Release, RemoteBlocks, WriteFailed
from moriio_native.pd.pusher import JobState, Pusher
from moriio_native.pd.tasks import SaveTask, SendTask
from test_pd_tp_fanout import DECODE, DENSE, PortSender, answer_handshakes, context, final_messages


def test_a_release_of_another_tp_size_does_not_end_an_announced_job_before_its_save_task() -> None:
    """Prefill TP 1 -> decode TP 2. Decode rank 1 announces its blocks before the prefill's save
    task (the usual order in WRITE mode: the decode allocates while the prefill computes), then
    a release naming rank 1 of TP size 4 (not the request's 2) comes. The same release once the
    job is made is ignored (test_a_write_release_naming_another_decode_tp_size_leaves_the_job_
    alone, fixed today); before the save task it fails the orphan job: the job is made FAILED
    and "released", rank 1's announcement is dropped, nothing is written into it and no
    write_failed ever goes to it (it waits for its abort_timeout, then recomputes)."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx", ((20, 21, 22),), "d:8000/dp0/tp1", decode_tp_rank=1))
    pusher.on_release(Release("tx", consumer_tp_size=4, consumer_tp_rank=1))
    pusher.begin_step([SaveTask("req-1", "tx", (4, 5, 6), 3, DECODE, remote_tp_size=2)], [])
    assert pusher.job_states()["tx#d1"] is JobState.CONNECTING, (
        pusher.job_states(),
        final_messages(sender),
    )


def test_a_release_of_another_tp_size_does_not_end_a_held_back_ranks_announced_job() -> None:
    """The same with the request known: prefill TP 1 -> decode TP 32 (32 KV heads), so 16 jobs
    are made at the save task and the other 16 ranks wait for a handshake to confirm the TP
    size (MAX_UNCONFIRMED_JOBS). Rank 20 announced before the save task (an orphan). A release
    naming rank 20 of TP size 64 comes: _release_unconfirmed would refuse it (the plan's size is
    32), but on_release's orphan branch runs first and fails the orphan with no size check.
    When rank 0's handshake confirms TP 32, rank 20's job is made FAILED ("released"): never
    written, never told."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1, heads=32)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(
        RemoteBlocks("tx", ((20, 21, 22),), "d:8000/dp0/tp20", decode_tp_rank=20)
    )
    pusher.begin_step([SaveTask("req-1", "tx", (4, 5, 6), 3, DECODE, remote_tp_size=32)], [])
    assert len(pusher.job_states()) == 16 + 1  # 16 jobs, rank 20's orphan
    pusher.on_release(Release("tx", consumer_tp_size=64, consumer_tp_rank=20))
    pusher.on_remote_blocks(RemoteBlocks("tx", ((30, 31, 32),), "d:8000/dp0/tp0"))
    answer_handshakes(directory, DECODE, 32, "WRITE")  # rank 0: confirms TP 32
    assert len(pusher.job_states()) == 32
    assert pusher.job_states()["tx#d20"] is not JobState.FAILED, final_messages(sender)


def test_a_release_of_another_tp_size_first_does_not_hide_the_genuine_early_release() -> None:
    """Both releases come before the request's save and send tasks: first one naming decode
    rank 1 of TP size 4 (not the request's), then rank 1's genuine one (TP 2). The first is
    (rightly) not counted, but the early-release record keeps only the first release's TP size
    and refuses every later release of another size: the genuine release is dropped, rank 1's
    job waits PENDING for an announcement that never comes, and the request's blocks stay held
    until abort_timeout (120 s) instead of being freed when the request finishes."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_release(Release("tz", consumer_tp_size=4, consumer_tp_rank=1))
    pusher.on_release(Release("tz", consumer_tp_size=2, consumer_tp_rank=1))  # the genuine one
    pusher.begin_step([SaveTask("req-2", "tz", (4, 5, 6), 3, DECODE, remote_tp_size=2)], [])
    pusher.begin_step([], [SendTask("req-2", "tz")])
    assert pusher.job_states()["tz#d1"] is JobState.FAILED, pusher.job_states()


def test_a_finished_write_request_without_a_save_task_is_not_held_until_abort_timeout() -> None:
    """WRITE: a send task (not ``unsaved``) for a request whose save task never came (the
    pusher's own comment: "the request ended before its last prompt chunk"). Its job for this
    rank's index is made without a save task, so it can never write; it still waits PENDING
    until abort_timeout after the request finished (holding vLLM's blocks 120 s), and when it
    ends there the decode rank that announced gets no write_failed (job.save is None, so
    _send_final has no address) even though the send task names the decode."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx-1", ((20, 21),), "d:8000/dp0/tp0"))
    pusher.begin_step([], [SendTask("req-1", "tx-1", peer=DECODE, remote_tp_size=1)])
    freed_at_once = ctx.reports.done_sending == {"req-1"}
    pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    told = [m for _, m in sender.ports if isinstance(m, WriteFailed)]
    assert freed_at_once and told, (
        f"blocks freed at once: {freed_at_once}; write_failed sent: {final_messages(sender)}"
    )


def test_a_save_task_given_to_a_read_mode_prefill_is_refused_not_leaked() -> None:
    """A READ-mode pusher takes SaveTasks (WRITE-only) without a word: each makes a WRITE
    request and job that nothing ever ends (READ send tasks never look at them, no deadline is
    ever set), so they stay in memory for good, count as step jobs (vLLM's save hooks run for
    them) and are listed among the job states. Expected: refused naming the transfer (or at
    least nothing kept)."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    try:
        pusher.begin_step(
            [SaveTask("req-1", "tx-1", (1, 2), 2, DECODE, remote_tp_size=1)],
            [SendTask("req-1", "tx-1", block_ids=(1, 2))],
        )
    except Exception as exc:  # refused: it must name the transfer
        assert "tx-1" in str(exc)
        return
    pusher.forward_done(list(DENSE), None)
    pusher.on_release(Release("tx-1"))
    pusher.check_timeouts(time.monotonic() + 10 * ctx.cfg.abort_timeout)
    assert ctx.reports.done_sending == {"req-1"}
    assert pusher.job_states() == {} and not pusher._requests, pusher.job_states()


def test_releases_of_two_tp_sizes_before_the_save_task_leave_the_job_unwritten() -> None:
    """Before the save task, decode rank 1's announcement is followed by a release naming TP
    size 4 and then rank 1's genuine release (TP 2, the request's). Whichever came first, the
    job must not write into blocks the decode released: with two sizes named, one may be the
    decode's, so the job fails unwritten."""
    for sizes in ((4, 2), (2, 4)):
        ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
        ctx.sender = PortSender()  # type: ignore[assignment]
        pusher = Pusher(ctx)
        pusher.on_remote_blocks(
            RemoteBlocks("tw", ((20, 21, 22),), "d:8000/dp0/tp1", decode_tp_rank=1)
        )
        for size in sizes:
            pusher.on_release(Release("tw", consumer_tp_size=size, consumer_tp_rank=1))
        pusher.begin_step([SaveTask("req-3", "tw", (4, 5, 6), 3, DECODE, remote_tp_size=2)], [])
        assert pusher.job_states()["tw#d1"] is JobState.FAILED, (sizes, pusher.job_states())


def test_two_releases_of_other_tp_sizes_do_not_end_an_announced_job() -> None:
    """Before the save task, decode rank 1 announces, then releases naming rank 1 of TP sizes 4
    and 8 come: neither is the request's (2), so neither is rank 1's, and its job goes on."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tv", ((20, 21, 22),), "d:8000/dp0/tp1", decode_tp_rank=1))
    pusher.on_release(Release("tv", consumer_tp_size=4, consumer_tp_rank=1))
    pusher.on_release(Release("tv", consumer_tp_size=8, consumer_tp_rank=1))
    pusher.begin_step([SaveTask("req-1", "tv", (4, 5, 6), 3, DECODE, remote_tp_size=2)], [])
    assert pusher.job_states()["tv#d1"] is not JobState.FAILED, (
        pusher.job_states(),
        final_messages(sender),
    )


def test_two_releases_of_other_tp_sizes_do_not_silence_a_held_back_rank() -> None:
    """Prefill TP 1 -> decode TP 32 (32 KV heads): 16 jobs are made at the save task, the other
    16 ranks wait for a handshake to confirm TP 32. Held-back rank 20 announced before the save
    task, and releases naming it of TP sizes 64 and 128 (neither the request's) came. When the
    request ends unconfirmed (aborted), rank 20 is owed write_failed like every held-back rank
    that announced."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1, heads=32)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(
        RemoteBlocks("tu", ((20, 21, 22),), "d:8000/dp0/tp20", decode_tp_rank=20)
    )
    pusher.on_release(Release("tu", consumer_tp_size=64, consumer_tp_rank=20))
    pusher.on_release(Release("tu", consumer_tp_size=128, consumer_tp_rank=20))
    pusher.begin_step([SaveTask("req-1", "tu", (4, 5, 6), 3, DECODE, remote_tp_size=32)], [])
    pusher.begin_step([], [SendTask("req-1", "tu", aborted=True)])
    told = [m for _, m in sender.ports if isinstance(m, WriteFailed)]
    assert told, (pusher.job_states(), final_messages(sender))
