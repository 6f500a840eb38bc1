"""The notify listener's deduplication must not hide a release the prefill's protocol core tells
apart.

In WRITE mode the prefill keeps early releases per decode TP size (pd/pusher.py,
``_EarlyReleases.record(per_size=True)``): a release naming decode rank r of another TP size than
the request's is not counted, and the genuine release of rank r (the request's TP size) that
follows it must still free the request (tests/py/test_pd_prefill_release_sizes.py::
test_a_release_of_another_tp_size_first_does_not_hide_the_genuine_early_release, fixed on the
core alone). ``Release.dedup_key`` was (type, transfer_id, consumer_tp_rank): the listener in
front of the core dropped the genuine release as a duplicate of the other size's, so through the
real channel the core never saw it and the blocks stayed held until abort_timeout.
"""

from __future__ import annotations

import time

from moriio_native.control.channel import NotifyListener, NotifySender
from moriio_native.control.messages import Release
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.pd.pusher import JobState, Pusher
from moriio_native.pd.tasks import SaveTask, SendTask
from test_pd_tp_fanout import DECODE, PortSender, context

LOCAL = "127.0.0.1"
WAIT = 5.0


def _security() -> ControlSecurity:
    return ControlSecurity(MessageAuth(None), PeerAllowlist(["127.0.0.0/8"]))


def _delivered(listener: NotifyListener, sender: NotifySender, messages: list) -> list:
    """What the listener delivers of ``messages`` (a marker release sent after them)."""
    marker = Release("marker")
    for message in [*messages, marker]:
        sender.send(LOCAL, listener.port, message)
    got = []
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        message = listener.get(0.1)
        if message == marker:
            return got
        if message is not None:
            got.append(message)
    raise AssertionError(f"marker not delivered within {WAIT}s; got {got}")


def test_releases_of_one_rank_naming_two_tp_sizes_are_both_delivered() -> None:
    """Two releases of transfer tz by decode rank 1, one naming TP size 4 and one TP size 2, are
    two different notifications for the prefill (it counts only the request's size); copies
    of either are duplicates."""
    other, genuine = (
        Release("tz", consumer_tp_size=4, consumer_tp_rank=1),
        Release("tz", consumer_tp_size=2, consumer_tp_rank=1),
    )
    sec = _security()
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        got = _delivered(listener, sender, [other, genuine, genuine, other])
        assert got == [other, genuine], (got, listener.stats())


def test_the_genuine_release_after_one_of_another_tp_size_frees_the_write_job_end_to_end() -> None:
    """The core's scenario of test_pd_prefill_release_sizes.py, fed through a real notify
    listener: the request's rank 1 job must end released (FAILED: the decode released it),
    not wait PENDING until abort_timeout."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    sec = _security()
    with NotifyListener(0, sec, bind_host=LOCAL) as listener, NotifySender(sec) as sender:
        got = _delivered(
            listener,
            sender,
            [
                Release("tz", consumer_tp_size=4, consumer_tp_rank=1),
                Release("tz", consumer_tp_size=2, consumer_tp_rank=1),  # the genuine one
            ],
        )
    for message in got:
        pusher.on_release(message)
    pusher.begin_step([SaveTask("req-2", "tz", (4, 5, 6), 3, DECODE, remote_tp_size=2)], [])
    pusher.begin_step([], [SendTask("req-2", "tz")])
    assert pusher.job_states()["tz#d1"] is JobState.FAILED, (pusher.job_states(), got)
