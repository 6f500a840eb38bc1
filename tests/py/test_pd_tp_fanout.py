"""The puller and the pusher across different TP sizes, against a scripted peer directory,
sender and engine (no network, no vLLM): one part per source rank, the load's end once every
part ended, releases and WRITE jobs counted by the head plan."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from moriio_native.control.addressing import ZmqAddress, parse_kv_transfer_params
from moriio_native.control.channel import NotifyListener, NotifySender
from moriio_native.control.messages import (
    AbortWrite,
    HandshakeResponse,
    InvalidMessageError,
    KvGroup,
    Misaddressed,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    decode,
    encode,
    now_ms,
)
from moriio_native.control.ports import rank_port
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.errors import FailedPreconditionError, InvalidArgumentError, TransportError
from moriio_native.pd import puller as puller_module
from moriio_native.pd import pusher as pusher_module
from moriio_native.pd.context import HOLD_MARGIN_S, Context
from moriio_native.pd.core import PdCore
from moriio_native.pd.groups import GroupedBlocks
from moriio_native.pd.peers import HANDSHAKE_THREADS, Handshake, Peer, PeerKey
from moriio_native.pd.puller import AwaitState, Puller, ReadState
from moriio_native.pd.pusher import SEND_TASK_WAIT_S, JobState, Pusher
from moriio_native.pd.tasks import RecvTask, SaveTask, SendTask
from test_pd_protocol import Directory, Sender, break_first_call, notify_core, quarantined_await
from test_pd_protocol import context as protocol_context

PREFILL = ZmqAddress("127.0.0.1", 7000, 7100)
# When a prefill's handshake answers by its clock, and how long its answers hold the blocks
# after that (far longer than any test): READs are checked against that hold.
PREFILL_ANSWERED_MS = 5_000_000
PREFILL_HOLD_UNTIL_MS = PREFILL_ANSWERED_MS + 3_600_000
DECODE = ZmqAddress("127.0.0.1", 8000, 8100)
DENSE = ("attn.0", "attn.1")
WHOLE = ("mla",)


class Engine:
    """Records what the core asks; every call succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def read(self, tid: str, peer: str, local: Any, remote: Any) -> None:
        self.calls.append(("read", tid, peer))

    def read_segments(self, tid: str, peer: str, segments: Any) -> None:
        self.calls.append(("read_segments", tid, peer, list(segments)))

    def abort(self, tid: str) -> None:
        self.calls.append(("abort", tid))

    def remove_peer(self, peer: str) -> None:
        self.calls.append(("remove_peer", peer))

    def write_layer(self, tid: str, layer: str, peer: str, *a: Any, **k: Any) -> bool:
        handle = a[2] if len(a) > 2 else k.get("cuda_event", 0)
        self.calls.append(("write_layer", tid, layer, peer, k.get("segments"), handle))
        return True

    def write_layers(self, tid: str, layers: list[str], peer: str, *a: Any, **k: Any) -> bool:
        handle = a[2] if len(a) > 2 else k.get("cuda_event", 0)
        self.calls.append(("write_layers", tid, tuple(layers), peer, handle))
        return True

    def seal(self, tid: str, peer: str, *, expected_writes: int) -> bool:
        self.calls.append(("seal", tid, peer, expected_writes))
        return True


def context(
    mode: str, *, producer: bool, tp_rank: int, tp_size: int, heads: int = 8
) -> tuple[Context, Directory, Sender, Engine]:
    engine = Engine()
    base = PREFILL if producer else DECODE
    ctx, directory, sender = protocol_context(
        mode,
        producer=producer,
        engine=engine,
        engine_id=f"{'p' if producer else 'd'}:{base.handshake_port}/dp0/tp{tp_rank}",
        handshake_port=base.handshake_port,
        notify_port=base.notify_port,
        tp_rank=tp_rank,
        tp_size=tp_size,
        split_layers=DENSE,
        whole_layers=WHOLE,
        total_kv_heads=heads,
    )
    ctx.incarnation = incarnation(tp_rank)  # what its rank's handshake answers (peer_at)
    return ctx, directory, sender, engine


def incarnation(rank: int) -> str:
    """The incarnation of the test's peer rank ``rank``."""
    return f"{rank + 1:032x}"


def peer_at(
    key: PeerKey,
    base: ZmqAddress,
    rank: int,
    tp: int,
    mode: str,
    *,
    answered_ms: int = PREFILL_ANSWERED_MS,
) -> Peer:
    """Rank ``rank``'s handshake, answered at ``answered_ms`` by its clock, asked for now."""
    name = "p" if base is PREFILL else "d"
    engine_id = f"{name}:{base.handshake_port}/dp0/tp{rank}"
    response = HandshakeResponse(
        engine_id,
        b"meta",
        0,
        rank,
        1,
        tp,
        mode,
        total_kv_heads=8,
        incarnation=incarnation(rank),
        answered_ms=answered_ms,
    )
    notify = rank_port(base.notify_port, 0, rank, tp)
    return Peer(Handshake(key, engine_id, response, asked_at=time.monotonic()), notify)


def answer_handshakes(directory: Directory, base: ZmqAddress, tp: int, mode: str) -> list[int]:
    """Complete every pending handshake with the rank its port names; the ranks, in order."""
    ranks = []
    while directory.pending:
        key, future = directory.pending.pop(0)
        rank = key.handshake_port - base.handshake_port
        ranks.append(rank)
        future.set_result(peer_at(key, base, rank, tp, mode))
    return ranks


def event(tid: str, state: str = "done", drained: bool = True) -> Any:
    return SimpleNamespace(transfer_id=tid, state=state, message="", drained=drained)


def read_task(tid: str, tp: int) -> RecvTask:
    return RecvTask(
        "req-1",
        tid,
        PREFILL,
        "p:7000",
        0,
        tp,
        (3, 4, 5),
        (10, 11, 12),
        report_done=True,
        remote_incarnations=tuple(incarnation(r) for r in range(tp)),
        remote_hold_until_ms=PREFILL_HOLD_UNTIL_MS,
    )


def releases_sent(sender: Sender) -> list[int]:
    """The notify ports the releases went to, as prefill ranks of TP 4 (base 7100)."""
    return sorted(
        port - PREFILL.notify_port
        for port, m in getattr(sender, "ports", [])
        if isinstance(m, Release)
    )


class PortSender(Sender):
    def __init__(self) -> None:
        super().__init__()
        self.ports: list[tuple[int, Any]] = []

    def send(self, host: str, port: int, message: Any) -> None:
        super().send(host, port, message)
        self.ports.append((port, message))


def test_a_gather_read_is_one_transfer_per_source_and_ends_with_the_last() -> None:
    # Decode TP 2 rank 1 over prefill TP 4: heads [4,8) come from prefill ranks 2 and 3.
    ctx, directory, _, engine = context("read", producer=False, tp_rank=1, tp_size=2)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task("tx-1", 4))
    assert answer_handshakes(directory, PREFILL, 4, "READ") == [2, 3]
    posted = [c for c in engine.calls if c[0] == "read_segments"]
    assert [c[1] for c in posted] == ["tx-1#p2", "tx-1#p3"]
    windows = [
        [
            (s.local_window.head_begin, s.remote_window.head_begin, s.local_window.heads)
            for s in c[3]
        ]
        for c in posted
    ]
    # Rank 2 gives local heads [0,2) and the whole MLA cache; rank 3 local heads [2,4).
    assert windows[0][0] == (0, 0, 2) and windows[1] == [(2, 0, 2)]
    assert [s.layers for s in posted[0][3]] == [DENSE, WHOLE]
    # The peer directory never evicts the peers of parts still reading.
    assert puller.peers_in_use() == {"p:7000/dp0/tp2", "p:7000/dp0/tp3"}
    puller.on_event(event("tx-1#p2"))
    assert puller.read_states() == {"tx-1": ReadState.READING}
    assert puller.peers_in_use() == {"p:7000/dp0/tp3"}
    assert not ctx.reports.done_recving and not releases_sent(sender)
    puller.on_event(event("tx-1#p3"))
    assert puller.read_states() == {}
    assert puller.peers_in_use() == set()
    assert ctx.reports.done_recving == {"req-1"} and not ctx.reports.failed_recving
    assert releases_sent(sender) == [2, 3]


# The prefill's clock when it answered the handshakes of the hold tests (ms since the epoch):
# the decode's own clock is never compared with it.
@pytest.mark.parametrize(
    ("spare_ms", "posted"),
    [(-50, False), (-(30 + HOLD_MARGIN_S) * 1000, False), (5_000, True)],
    ids=["just-short", "expired", "enough"],
)
def test_a_read_is_posted_only_while_the_prefill_holds_its_blocks_for_all_of_it(
    caplog: pytest.LogCaptureFixture, spare_ms: float, posted: bool
) -> None:
    """Before: a decode READ whenever it got to a request, also after the prefill's
    abort_timeout had passed, when the prefill may have given the blocks to another request:
    the READ loaded that request's bytes as this one's. Now a READ is posted only if it ends,
    with transfer_timeout (30 s here) and HOLD_MARGIN_S to spare, before the prefill's stated
    hold ends, by the prefill's clock as its handshake bounds it; else the load fails (recomputed)
    and the prefill is released."""
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    puller = Puller(ctx)
    needed_ms = (ctx.cfg.transfer_timeout + HOLD_MARGIN_S) * 1000
    hold_until = PREFILL_ANSWERED_MS + int(needed_ms + spare_ms)
    puller.start(dataclasses.replace(read_task("tx-h", 1), remote_hold_until_ms=hold_until))
    key, future = directory.pending.pop()
    with caplog.at_level(logging.ERROR, logger="moriio_native.pd.puller"):
        future.set_result(peer_at(key, PREFILL, 0, 1, "READ", answered_ms=PREFILL_ANSWERED_MS))
    reads = [c for c in engine.calls if c[0] == "read"]
    if posted:
        assert reads and puller.read_states() == {"tx-h": ReadState.READING}
        return
    assert not reads, "a READ was posted that the prefill's hold does not cover"
    assert puller.read_states() == {}
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {3, 4, 5}
    assert releases_sent(sender) == [0]
    assert any(
        "tx-h" in r.getMessage() and "holds the request's blocks for" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_read_without_a_stated_hold_is_refused_unless_the_hold_is_not_required() -> None:
    """A review found the check silently off for a prefill answer without
    ``remote_hold_until_ms`` (a proxy that drops the key): read whenever it came. Now it is
    refused (recomputed) by default, naming the key; ``require_hold`` off reads it as before."""
    for required in (True, False):
        ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
        ctx.cfg = dataclasses.replace(ctx.cfg, require_hold=required)
        puller = Puller(ctx)
        puller.start(dataclasses.replace(read_task("tx-n", 1), remote_hold_until_ms=None))
        key, future = directory.pending.pop()
        future.set_result(peer_at(key, PREFILL, 0, 1, "READ"))
        reads = [c[1] for c in engine.calls if c[0] == "read"]
        assert reads == ([] if required else ["tx-n"]), required
        if required:
            assert ctx.reports.failed_recving == {"req-1"}


def test_a_handshake_answer_stating_no_time_cannot_bound_the_hold() -> None:
    """A review found an answer with ``answered_ms`` 0 (the field's default) bounding the
    prefill's clock near 1970, so that any stated hold passed: a hold that ended an hour ago
    was read. Now such an answer cannot vouch for a hold: refused (recomputed)."""
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    expired = now_ms() - 3_600_000
    puller.start(dataclasses.replace(read_task("tx-0", 1), remote_hold_until_ms=expired))
    key, future = directory.pending.pop()
    future.set_result(peer_at(key, PREFILL, 0, 1, "READ", answered_ms=0))
    assert not [c for c in engine.calls if c[0] == "read"]
    assert ctx.reports.failed_recving == {"req-1"}


def test_a_read_posted_later_than_its_check_allowed_is_aborted() -> None:
    """A review found the check made before the post only: the engine's deadline starts inside
    the post, so a pause between them (the lock, planning, a collection) let a READ outlive the
    hold by the pause. Now the hold is checked again once the READ is posted, and a READ that
    may outlive it is aborted (its load fails, recomputed)."""
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    real_read = engine.read

    def slow_read(*args: Any) -> None:
        time.sleep(0.3)  # the pause, inside the post: the deadline starts after it
        real_read(*args)

    engine.read = slow_read  # type: ignore[method-assign]
    puller = Puller(ctx)
    needed_ms = (ctx.cfg.transfer_timeout + HOLD_MARGIN_S) * 1000
    hold_until = PREFILL_ANSWERED_MS + int(needed_ms) + 100  # the first check passes
    puller.start(dataclasses.replace(read_task("tx-l", 1), remote_hold_until_ms=hold_until))
    key, future = directory.pending.pop()
    future.set_result(peer_at(key, PREFILL, 0, 1, "READ"))
    assert [c[0:2] for c in engine.calls] == [("read", "tx-l"), ("abort", "tx-l")]


def test_a_released_answer_is_not_read_again() -> None:
    """A review found a prefill answer readable after this decode released it: the release
    lets the prefill free the blocks at once, and a later request carrying the same answer (a
    retried request) passed the hold check and loaded whatever the blocks held by then. Now a
    rank refuses an answer it released until its hold surely ended (recomputed); another
    answer under the same transfer id (a new hold) is read."""
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    puller.start(read_task("tx-r", 1))
    key, future = directory.pending.pop()
    future.set_result(peer_at(key, PREFILL, 0, 1, "READ"))
    puller.on_event(event("tx-r"))  # read and released
    assert ctx.reports.done_recving == {"req-1"} and not ctx.reports.failed_recving
    puller.start(read_task("tx-r", 1))  # the same answer again
    assert not directory.pending and ctx.reports.failed_recving == {"req-1"}
    assert [c[1] for c in engine.calls if c[0] == "read"] == ["tx-r"]
    renewed = PREFILL_HOLD_UNTIL_MS + 1
    puller.start(dataclasses.replace(read_task("tx-r", 1), remote_hold_until_ms=renewed))
    key, future = directory.pending.pop()
    future.set_result(peer_at(key, PREFILL, 0, 1, "READ"))
    assert [c[1] for c in engine.calls if c[0] == "read"] == ["tx-r", "tx-r"]


def test_a_read_that_completed_after_the_hold_ended_is_not_used() -> None:
    """A review found the check after the post useless against a READ that completed before
    it (the usual case: a READ takes milliseconds, and an abort of an ended transfer changes
    nothing): a pause between the check and the post longer than the hold's spare let a READ
    run wholly after the prefill's hold ended, and the load was reported good. Now a READ's
    completion is checked against the hold too: one that may have ended after it is not used
    (recomputed)."""
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    ctx.cfg = dataclasses.replace(ctx.cfg, transfer_timeout=0.2)
    puller = Puller(ctx)
    needed_ms = (ctx.cfg.transfer_timeout + HOLD_MARGIN_S) * 1000
    hold_until = PREFILL_ANSWERED_MS + int(needed_ms) + 100  # the first check passes
    real_read = engine.read

    def paused_then_done(*args: Any) -> None:
        time.sleep(1.6)  # before the engine starts: the hold ends meanwhile
        real_read(*args)
        puller.on_event(event("tx-h"))  # done at once, before the post returns

    engine.read = paused_then_done  # type: ignore[method-assign]
    puller.start(dataclasses.replace(read_task("tx-h", 1), remote_hold_until_ms=hold_until))
    key, future = directory.pending.pop()
    future.set_result(peer_at(key, PREFILL, 0, 1, "READ"))
    assert ctx.reports.failed_recving == {"req-1"}
    assert "completed when the prefill's hold" in ctx.reports.failures["req-1"]


def test_a_refused_retry_sends_no_release_and_keeps_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review found the refusal of a released answer releasing the prefill again and
    recording the answer afresh without a handshake (by this rank's clock, 60 s of slack),
    which replaced the record bounded by the handshake: with this rank's clock more than 60 s
    ahead of the prefill's, a third try of the same answer was read. Now a refusal sends
    nothing and a record is never shortened."""
    monkeypatch.setattr(puller_module, "now_ms", lambda: PREFILL_ANSWERED_MS + 64_000)
    ctx, directory, sender, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    ctx.cfg = dataclasses.replace(ctx.cfg, transfer_timeout=0.2)
    puller = Puller(ctx)
    task = dataclasses.replace(
        read_task("tx-s", 1), remote_hold_until_ms=PREFILL_ANSWERED_MS + 5_000
    )
    puller.start(task)
    key, future = directory.pending.pop()
    future.set_result(peer_at(key, PREFILL, 0, 1, "READ"))
    puller.on_event(event("tx-s"))  # read and released: the prefill may free the blocks
    releases = sum(isinstance(m, Release) for m in sender.sent)
    puller.start(task)  # a retry: refused
    assert sum(isinstance(m, Release) for m in sender.sent) == releases
    time.sleep(1.2)  # past the 60 s-slack record a refusal wrote before
    puller.start(task)  # a third try, inside the hold the answer states
    assert not directory.pending
    assert [c[1] for c in engine.calls if c[0] == "read"] == ["tx-s"]


def test_a_write_aborted_naming_another_rank_does_not_take_the_genuine_ones_place() -> None:
    """A review found the listener deduplicating write_aborted by transfer and writer alone,
    before the core looked at the rank it names: one steered here naming another rank, though
    ignored, made the genuine one a duplicate, and the rank kept its blocks quarantined until
    quarantine_timeout. Now the rank it names is part of its key."""
    puller, ctx, _ = quarantined_await()
    core = notify_core(ctx, puller)
    plain = ControlSecurity(MessageAuth(None), PeerAllowlist(["127.0.0.1"]))
    with NotifyListener(0, plain, bind_host="127.0.0.1") as listener, NotifySender(plain) as out:
        out.send("127.0.0.1", listener.port, WriteAborted("tx-1", "d:9/dp0/tp1"))  # steered
        out.send("127.0.0.1", listener.port, WriteAborted("tx-1", ctx.cfg.engine_id))
        for _ in range(2):
            message = listener.get(5.0)
            assert message is not None, "a write_aborted was dropped"
            PdCore._on_message(core, message)
    assert puller.await_states() == {}


def test_an_expired_hold_drops_its_late_messages() -> None:
    """A review found a release that came after the hold expired kept as an early release of
    the next request reusing the transfer id, which freed that request's blocks the moment its
    send task arrived, while its answer stated a full hold. Now an expired hold marks its
    transfer terminal, as a released one does: its late messages are dropped."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    terminal: list[str] = []
    ctx.mark_terminal = terminal.append  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    pusher.begin_step([], [SendTask("req-A", "tx-T")])
    pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    assert ctx.reports.done_sending == {"req-A"} and terminal == ["tx-T"]


def test_a_transfer_id_naming_another_requests_part_is_refused_where_it_enters() -> None:
    """A review found a request whose transfer id was another request's part id ("tx#p0": the
    part of request "tx" read from prefill rank 0) taking over that part: the part's
    completion reported the second request loaded though nothing was read into its blocks
    (and its own READ was posted after it ended), or the first request's end dropped the
    second's part, which then never ended. '#' is now reserved: refused in kv_transfer_params
    (the request runs without KV transfer), in every control message (dropped at the schema)
    and in the core's tasks, so no request id can name a part."""
    with pytest.raises(InvalidArgumentError, match=r"'transfer_id' = 'tx#p0': .*'#' \(reserved"):
        parse_kv_transfer_params({"transfer_id": "tx#p0"})
    with pytest.raises(InvalidArgumentError, match=r"RecvTask of request req-1: .*'tx#p0'"):
        read_task("tx#p0", 1)
    with pytest.raises(InvalidArgumentError, match=r"SendTask of request req-B: .*'tx#d1'"):
        SendTask("req-B", "tx#d1")
    with pytest.raises(InvalidMessageError, match=r"'tx#p0'.*reserved"):
        decode(encode(Release("tx#p0")), (Release,), max_bytes=4096)

    # The parts of one request still get their own ids, none of which a request may carry.
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    puller.start(read_task("tx", 2))
    answer_handshakes(directory, PREFILL, 2, "READ")
    assert [c[1] for c in engine.calls if c[0] == "read_segments"] == ["tx#p0", "tx#p1"]


def test_checksums_are_answered_only_while_the_read_hold_lasts() -> None:
    """verify's checksum answer is worth something only over blocks still held: the prefill
    answered for released blocks (another request's KV by then, matching what a second
    decode's READ took; found 2026-12-05). The hold is asked of the pusher: held while the send task
    holds it (once every decode rank released, no more), never when it expired, was aborted or
    was released before its send task came, and a transfer not known yet is waited for; and
    only for blocks the transfer's answer named."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    answer = (1, 2, 3)
    pusher.begin_step([], [SendTask("req-A", "tx-A", block_ids=answer)])
    assert pusher.held_for_checksums("tx-A", (3, 1), 0, answer) is None
    # Only the blocks the answer named (an answer changed on its way names others) ...
    assert pusher.held_for_checksums("tx-A", (2, 7, 9), 0, answer) == (
        "blocks [7, 9] (2 in all) are not among the 3 its answer named"
    )
    # ... and only under the answer as given: the decode loads block i of the prompt from its
    # i-th block, so the same blocks in another order put every position's KV elsewhere.
    for used in ((3, 2, 1), (2, 1, 3), ()):
        assert "or these in another order" in str(
            pusher.held_for_checksums("tx-A", (3, 1), 0, used)
        )
    pusher.on_release(Release("tx-A", consumer_tp_size=2, consumer_tp_rank=0))
    assert pusher.held_for_checksums("tx-A", (), 0, answer) is None  # decode rank 1 still reads
    pusher.on_release(Release("tx-A", consumer_tp_size=2, consumer_tp_rank=1))
    assert pusher.held_for_checksums("tx-A", (), 0, answer) == (
        "its blocks are no longer held: released"
    )

    pusher.begin_step([], [SendTask("req-B", "tx-B")])
    pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    assert "no longer held: expired" in str(pusher.held_for_checksums("tx-B", ()))
    pusher.begin_step([], [SendTask("req-C", "tx-C", aborted=True)])
    assert pusher.held_for_checksums("tx-C", ()) == "its blocks are no longer held: aborted"
    pusher.on_release(Release("tx-D", consumer_tp_size=1))
    pusher.begin_step([], [SendTask("req-D", "tx-D")])
    assert pusher.held_for_checksums("tx-D", ()) == "its blocks are no longer held: released"

    # Known (held, or its hold ended): answered without a wait, on the server's reading thread.
    assert all(pusher.hold_known(t) for t in ("tx-A", "tx-B", "tx-C", "tx-D"))
    gone: list[str] = []
    pusher.when_hold_known("tx-D", lambda: gone.append("tx-D"))
    assert gone == ["tx-D"]  # known: at once

    # Not known yet: refused as not come within the wait, so a request waits first, without a
    # thread, until its send task comes, its hold ends, the wait is over or the core stops.
    assert not pusher.hold_known("tx-E")
    assert pusher.held_for_checksums("tx-E", ()) == (
        f"this rank holds no blocks of it (none within {SEND_TASK_WAIT_S:g}s)"
    )
    asked = time.monotonic()
    for tid in ("tx-E", "tx-F", "tx-G", "tx-H"):
        pusher.when_hold_known(tid, lambda tid=tid: gone.append(tid))
    pusher.begin_step([], [SendTask("req-E", "tx-E")])
    pusher.on_release(Release("tx-F", consumer_tp_size=1))  # early: the hold ends at its task
    pusher.begin_step([], [SendTask("req-F", "tx-F")])
    assert gone == ["tx-D", "tx-E", "tx-F"]
    assert pusher.held_for_checksums("tx-E", ()) is None
    pusher.check_timeouts(asked + SEND_TASK_WAIT_S - 0.5)
    assert gone == ["tx-D", "tx-E", "tx-F"]  # still within the wait
    pusher.check_timeouts(time.monotonic() + SEND_TASK_WAIT_S + 1)
    assert gone == ["tx-D", "tx-E", "tx-F", "tx-G", "tx-H"]
    pusher.when_hold_known("tx-I", lambda: gone.append("tx-I"))
    ctx.stop.set()
    pusher.stop_hold_waits()
    assert gone[-1] == "tx-I"
    assert pusher.held_for_checksums("tx-I", ()) == "this rank is shutting down"

    write, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    assert "runs WRITE mode" in str(Pusher(write).held_for_checksums("tx-A", ()))
    Pusher(write).when_hold_known("tx-A", lambda: gone.append("write"))
    assert gone[-1] == "write"  # nothing to wait for in WRITE mode


def test_the_prefills_clock_is_bounded_by_its_handshake_alone() -> None:
    """The bound grows with the time since the handshake was asked for (and the clocks' rate
    tolerance), whatever the decode's own wall clock reads."""
    response = HandshakeResponse("p:7000/dp0/tp0", b"meta", answered_ms=1_000_000)
    asked = Handshake(PeerKey("h", 1), "p", response, asked_at=100.0)
    assert asked.clock_at_most(100.0) == 1_000_000
    assert asked.clock_at_most(160.0) == 1_000_000 + 60_000 + 6  # 60 s at 100 ppm


def test_a_failed_part_stops_the_other_and_the_blocks_wait_for_its_drain() -> None:
    ctx, directory, _, engine = context("read", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    puller.start(read_task("tx-2", 2))
    answer_handshakes(directory, PREFILL, 2, "READ")
    # Part 0 ends with operations in flight: quarantined; part 1 is aborted.
    puller.on_event(event("tx-2#p0", "failed", drained=False))
    assert ("abort", "tx-2#p1") in engine.calls
    puller.on_event(event("tx-2#p1", "aborted"))
    assert puller.read_states() == {"tx-2": ReadState.QUARANTINED}
    assert not ctx.reports.invalid_blocks  # part 0 may still write them
    puller.on_drained("tx-2#p0", 0.5)
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {3, 4, 5}


def test_write_await_needs_every_writer() -> None:
    # Decode TP 1 over prefill TP 2: both prefill ranks write, each announced to.
    ctx, directory, sender, _ = context("write", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    puller.start(RecvTask("req-1", "tx-3", PREFILL, "p:7000", 0, 2, (4, 5), report_done=True))
    answer_handshakes(directory, PREFILL, 2, "WRITE")
    announced = [m for m in sender.sent if isinstance(m, RemoteBlocks)]
    assert len(announced) == 2 and {m.decode_tp_rank for m in announced} == {0}
    # Announced: both prefill ranks may be writing into our blocks, so they stay connected.
    assert puller.peers_in_use() == {"p:7000/dp0/tp0", "p:7000/dp0/tp1"}
    puller.on_write_result("tx-3", ok=True, writer_rank=1)
    assert puller.await_states() == {"tx-3": AwaitState.ANNOUNCED}
    puller.on_write_result("tx-3", ok=True, writer_rank=5)  # no such writer: ignored
    puller.on_write_result("tx-3", ok=True, writer_rank=0)
    assert ctx.reports.done_recving == {"req-1"} and not ctx.reports.failed_recving


def test_one_failed_writer_aborts_the_others_and_waits_for_their_ack() -> None:
    ctx, directory, sender, _ = context("write", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    puller.start(RecvTask("req-1", "tx-4", PREFILL, "p:7000", 0, 2, (4, 5), report_done=True))
    answer_handshakes(directory, PREFILL, 2, "WRITE")
    puller.on_write_result("tx-4", ok=False, writer_rank=0)
    aborts = [m for m in sender.sent if isinstance(m, AbortWrite)]
    assert len(aborts) == 1 and (aborts[0].decode_tp_rank, aborts[0].decode_tp_size) == (0, 1)
    assert puller.await_states() == {"tx-4": AwaitState.QUARANTINED}
    assert not ctx.reports.done_recving  # writer 1 may still write
    puller.on_write_result("tx-4", ok=False, writer_rank=1)  # its write_aborted
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}


def test_held_read_blocks_wait_for_every_reader_once() -> None:
    # Prefill TP 1 rank 0, decode TP 2: both decode ranks read it.
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    pusher.begin_step([], [SendTask("req-1", "tx-5")])
    pusher.on_release(Release("tx-5", consumer_tp_size=2, consumer_tp_rank=0))
    pusher.on_release(Release("tx-5", consumer_tp_size=2, consumer_tp_rank=0))  # again
    pusher.on_release(Release("tx-5", consumer_tp_size=4, consumer_tp_rank=1))  # other size
    assert not ctx.reports.done_sending
    pusher.on_release(Release("tx-5", consumer_tp_size=2, consumer_tp_rank=1))
    assert ctx.reports.done_sending == {"req-1"}


def test_releases_before_the_send_task_count_as_after_it_and_expire() -> None:
    """Releases that come before the request's send task count as they would after it (the
    TP size of the first, each reading rank once, others ignored), and are forgotten after
    abort_timeout: the blocks then wait for releases that come later."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    pusher.on_release(Release("tx-1", consumer_tp_size=2, consumer_tp_rank=0))
    pusher.on_release(Release("tx-1", consumer_tp_size=2, consumer_tp_rank=0))  # again
    pusher.on_release(Release("tx-1", consumer_tp_size=4, consumer_tp_rank=1))  # other size
    pusher.begin_step([], [SendTask("req-1", "tx-1")])
    assert not ctx.reports.done_sending  # decode rank 1 has not released yet
    pusher.on_release(Release("tx-1", consumer_tp_size=2, consumer_tp_rank=1))
    assert ctx.reports.done_sending == {"req-1"}
    for rank in (0, 1):
        pusher.on_release(Release("tx-2", consumer_tp_size=2, consumer_tp_rank=rank))
    pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    for rank in (0, 1):
        pusher.on_release(Release("tx-3", consumer_tp_size=2, consumer_tp_rank=rank))
    pusher.begin_step([], [SendTask("req-2", "tx-2"), SendTask("req-3", "tx-3")])
    assert ctx.reports.done_sending == {"req-1", "req-3"}  # tx-2's releases expired


def test_early_releases_of_many_decode_ranks_all_count() -> None:
    """4,096 decode ranks (replicated KV heads: each reads this prefill rank) release before
    the send task, once each and some twice: every rank counts once, so the send task frees the
    blocks at once; one rank short, it waits."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    size = 4096
    for rank in [*range(size), 7, 4095, 0]:
        pusher.on_release(Release("tx-all", consumer_tp_size=size, consumer_tp_rank=rank))
    for rank in range(1, size):  # rank 0 missing
        pusher.on_release(Release("tx-short", consumer_tp_size=size, consumer_tp_rank=rank))
    pusher.begin_step([], [SendTask("req-all", "tx-all"), SendTask("req-short", "tx-short")])
    assert ctx.reports.done_sending == {"req-all"}
    pusher.on_release(Release("tx-short", consumer_tp_size=size, consumer_tp_rank=0))
    assert ctx.reports.done_sending == {"req-all", "req-short"}


def test_early_releases_are_bounded_in_bytes_as_well_as_in_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record costs a bit per rank of its decode TP size: past MAX_EARLY_RELEASE_BYTES of
    them the oldest records are forgotten, however few they are."""
    monkeypatch.setattr(pusher_module, "MAX_EARLY_RELEASE_BYTES", 64 << 10)
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    for i in range(9):  # 8 KiB of bitmap each
        pusher.on_release(Release(f"tx-{i}", consumer_tp_size=1 << 16, consumer_tp_rank=i))
    assert len(pusher._early_releases) == 8
    assert pusher._early_releases.pop("tx-0") == []  # the oldest, forgotten
    kept = pusher._early_releases.pop("tx-8")
    assert [(r.consumer_tp_size, r.consumer_tp_rank) for r in kept] == [(1 << 16, 8)]


def test_releases_before_the_send_task_work_out_no_plan_per_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any sender may release a transfer the prefill does not know yet, naming any TP size up
    to 65,536, and a TP plan of that size takes O(size) to work out: such releases are kept
    without a plan (a bit each) and checked against one plan when the send task comes. The
    plan of a size is made once while it stays among the context's last PLAN_CACHE."""
    ctx, _, _, _ = context("read", producer=True, tp_rank=0, tp_size=1)
    made: list[tuple[int, int, int]] = []
    make = pusher_module.TpPlan.make

    def counting_make(prefill_tp: int, decode_tp: int, total: int, whole: bool) -> Any:
        made.append((prefill_tp, decode_tp, total))
        return make(prefill_tp, decode_tp, total, whole)

    monkeypatch.setattr(pusher_module.TpPlan, "make", staticmethod(counting_make))
    pusher = Pusher(ctx)
    for i in range(200):
        pusher.on_release(Release(f"flood-{i}", consumer_tp_size=1 << 16, consumer_tp_rank=i))
    for rank in range(8):
        pusher.on_release(Release("tx-1", consumer_tp_size=8, consumer_tp_rank=rank))
    assert made == []
    pusher.begin_step([], [SendTask("req-1", "tx-1")])
    assert ctx.reports.done_sending == {"req-1"}
    assert len(made) == 1  # one plan for the send task's eight ranks
    assert ctx.tp_plan("decode", 8, prefill=True) is ctx.tp_plan("decode", 8, prefill=True)
    assert len(made) == 1


def test_unused_prefill_rank_is_released_by_its_assigned_decode_rank() -> None:
    # 2 KV heads, prefill TP 4 -> decode TP 2: decode rank 1 reads head 1 from prefill rank 3;
    # prefill rank 1 holds a replica nobody reads and is released by decode rank 1 only.
    ctx, _, _, _ = context("read", producer=True, tp_rank=1, tp_size=4, heads=2)
    pusher = Pusher(ctx)
    pusher.begin_step([], [SendTask("req-1", "tx-6")])
    pusher.on_release(Release("tx-6", consumer_tp_size=2, consumer_tp_rank=0))
    assert not ctx.reports.done_sending  # decode rank 0 does not release us
    pusher.on_release(Release("tx-6", consumer_tp_size=2, consumer_tp_rank=1))
    assert ctx.reports.done_sending == {"req-1"}


def test_a_prefill_rank_writes_one_job_per_decode_rank_and_frees_after_both() -> None:
    # Prefill TP 1 -> decode TP 2: heads [0,4) to decode rank 0, [4,8) to rank 1.
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    save = SaveTask("req-1", "tx-7", (1, 2, 3), 3, DECODE, remote_tp_size=2)
    pusher.begin_step([save], [])
    for rank in (0, 1):
        pusher.on_remote_blocks(
            RemoteBlocks("tx-7", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    assert answer_handshakes(directory, DECODE, 2, "WRITE") == [0, 1]
    for layer in (*DENSE, *WHOLE):
        pusher.layer_saved(layer, None)
    pusher.forward_done([*DENSE, *WHOLE], None)
    run_writer(ctx, pusher)
    writes = {(c[1], c[2]): c[4] for c in engine.calls if c[0] == "write_layer"}
    assert set(writes) == {(tid, layer) for tid in ("tx-7", "tx-7#d1") for layer in DENSE + WHOLE}
    for tid, begin in (("tx-7", 0), ("tx-7#d1", 4)):
        for layer in DENSE:
            (segment,) = writes[(tid, layer)]
            assert (segment.local_window.head_begin, segment.local_window.heads) == (begin, 4)
            assert segment.remote_window.head_begin == 0
        assert writes[(tid, "mla")] is None  # whole blocks: this rank is the MLA source
    seals = sorted((c[1], c[3]) for c in engine.calls if c[0] == "seal")
    assert seals == [("tx-7", 3), ("tx-7#d1", 3)]
    pusher.on_event(event("tx-7"), drained=True)
    pusher.begin_step([], [SendTask("req-1", "tx-7")])
    assert not ctx.reports.done_sending  # the job for decode rank 1 is still writing
    pusher.on_event(event("tx-7#d1"), drained=True)
    assert ctx.reports.done_sending == {"req-1"}
    done = [(port, m) for port, m in sender.ports if isinstance(m, WriteDone)]
    assert sorted(port for port, _ in done) == [DECODE.notify_port, DECODE.notify_port + 1]
    assert all(m.transfer_id == "tx-7" and m.num_writers == 1 for _, m in done)


class LayerEvent:
    """A stand-in for the CUDA event recorded after a layer's compute: a handle, and a count
    of the host waits on it."""

    def __init__(self, handle: int) -> None:
        self.cuda_event = handle
        self.host_waits = 0

    def synchronize(self) -> None:
        self.host_waits += 1

    def query(self) -> bool:
        """Whether the work before the event completed (a real event's non-blocking check)."""
        return self.completed

    completed = True


@pytest.mark.parametrize("device_waits", [True, False])
def test_layers_computed_before_the_decode_blocks_arrive_go_in_one_engine_call(
    device_waits: bool,
) -> None:
    """The decode's blocks arrive after the forward (a short prompt): every layer is pending
    at once, and the writer posts the ones already computed in ONE ``write_layers`` call (one
    plan, a few batches) instead of a call per layer. Layers whose event has not completed
    yet go in one call per event with its handle, so their copies still wait for it on the
    GPU (here the two layers whose save hook did not run share the event recorded after the
    forward); for a peer whose copies cannot wait on the GPU every event is waited for on the
    host first and all go in the one call. Prefill TP 1 -> decode TP 1, whole blocks."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    engine.waits_for_device_events = lambda peer: device_waits  # type: ignore[attr-defined]
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-7", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    saved = LayerEvent(0x1000)
    pusher.layer_saved("attn.0", saved)
    after_forward = LayerEvent(0x2000)
    after_forward.completed = False  # the forward's tail is still running on the GPU
    pusher.forward_done([*DENSE, *WHOLE], after_forward)
    pusher.on_remote_blocks(RemoteBlocks("tx-7", ((20, 21, 22),), "d:8000/dp0/tp0"))
    assert answer_handshakes(directory, DECODE, 1, "WRITE") == [0]
    pusher.feed_writer()  # what a handshake completed on its own thread does
    run_writer(ctx, pusher)
    posts = [c for c in engine.calls if c[0] in ("write_layers", "write_layer", "seal")]
    if device_waits:
        assert posts == [
            ("write_layers", "tx-7", ("attn.0",), "d:8000/dp0/tp0", 0),
            ("write_layers", "tx-7", ("attn.1", "mla"), "d:8000/dp0/tp0", 0x2000),
            ("seal", "tx-7", "d:8000/dp0/tp0", 3),
        ]
        assert pusher._jobs["tx-7"].device_events == [after_forward]
    else:
        assert posts == [
            ("write_layers", "tx-7", ("attn.0", "attn.1", "mla"), "d:8000/dp0/tp0", 0),
            ("seal", "tx-7", "d:8000/dp0/tp0", 3),
        ]
        assert pusher._jobs["tx-7"].device_events == []
    waits = [saved.host_waits, after_forward.host_waits]
    assert waits == ([0, 0] if device_waits else [1, 2])  # per layer, as before


def test_a_writes_op_failing_after_the_engine_took_its_first_call_waits_for_those_writes() -> None:
    """A "writes" op posts the layers already computed in one call, then those still computing
    in one call per event. When the engine takes the first call (its batches in flight) and
    the next one raises (here the engine refuses the event, as it does for a layer it cannot
    order by one), the job has writes in the engine: it is aborted there, and the decode is
    told, and the prefill's blocks freed, only at the transfer's terminal event, after those
    writes drained. Before, the job counted as having nothing in the engine: write_failed went
    at once while the first call's batches could still land in the decode's blocks."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    engine.waits_for_device_events = lambda peer: True  # type: ignore[attr-defined]
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    write_layers = engine.write_layers

    def refusing_the_event(tid: str, layers: list[str], peer: str, *args: Any) -> bool:
        taken = write_layers(tid, layers, peer, *args)
        if len(args) > 2 and args[2]:
            raise FailedPreconditionError(f"transfer '{tid}': not in GPU memory")
        return taken

    engine.write_layers = refusing_the_event  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-7", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    pusher.layer_saved("attn.0", LayerEvent(0x1000))
    after_forward = LayerEvent(0x2000)
    after_forward.completed = False
    pusher.forward_done([*DENSE, *WHOLE], after_forward)
    pusher.on_remote_blocks(RemoteBlocks("tx-7", ((20, 21, 22),), "d:8000/dp0/tp0"))
    answer_handshakes(directory, DECODE, 1, "WRITE")
    pusher.feed_writer()
    run_writer(ctx, pusher)
    posted = [c[2] for c in engine.calls if c[0] == "write_layers"]
    assert posted == [("attn.0",), ("attn.1", "mla")]
    assert ("abort", "tx-7") in engine.calls
    assert pusher.job_states()["tx-7"] is JobState.ABORTING
    pusher.begin_step([], [SendTask("req-1", "tx-7")])
    told = [m for _, m in sender.ports if isinstance(m, WriteFailed)]
    assert not told and not ctx.reports.done_sending  # the first call's writes may still land
    pusher.on_event(event("tx-7", "aborted"), drained=True)
    told = [m for _, m in sender.ports if isinstance(m, WriteFailed)]
    assert [m.transfer_id for m in told] == ["tx-7"] and "not in GPU memory" in told[0].reason
    assert ctx.reports.done_sending == {"req-1"}


def test_a_job_with_nothing_to_post_whose_seal_the_engine_ignores_ends() -> None:
    """A job whose writes were all empty goes to the engine with its seal alone. When the
    engine remembers the transfer id as ended (a reused id), it ignores the seal and no event
    ever comes: the job fails at once, its decode is told and its blocks are freed, as for a
    first write the engine refuses. Before, the seal's answer was not looked at and the job
    waited in SEALED for good."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    ended = "tx-8"
    seal = engine.seal

    def remembering_it_ended(tid: str, peer: str, *, expected_writes: int) -> bool:
        return seal(tid, peer, expected_writes=expected_writes) and tid != ended

    engine.seal = remembering_it_ended  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", ended, (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(RemoteBlocks(ended, ((20, 21, 22),), "d:8000/dp0/tp0"))
    answer_handshakes(directory, DECODE, 1, "WRITE")
    pusher.forward_done([], LayerEvent(0x1000))  # no layer of this job to write
    run_writer(ctx, pusher)
    assert [c for c in engine.calls if c[0] != "seal"] == []
    assert pusher.job_states()[ended] is JobState.FAILED
    assert final_messages(sender) == [(DECODE.notify_port, "write_failed", ended, 0)]
    pusher.begin_step([], [SendTask("req-1", ended)])
    assert ctx.reports.done_sending == {"req-1"}
    assert ended not in pusher.job_states()


@pytest.mark.parametrize("device_waits", [True, False])
def test_layer_copies_wait_for_their_events_on_the_gpu_when_the_engine_can(
    device_waits: bool,
) -> None:
    """With an engine that honours CUDA events for the decode rank's peer (UCX and its copy
    plugin, the peer's memory mapped: one node), each layer's write carries the handle of the
    event recorded after that layer's compute and the writer never waits on the host, so a
    layer's copy starts when its compute ends, not when the writer thread sees it; the events
    stay referenced until the job's transfer drained (the backend may still enqueue a wait for
    one), then are let go. Any other peer (another node, another backend) gets each event
    synchronised on the host and no handle (a handle would fail the transfer there). Prefill
    TP 1 -> decode TP 2: segments for the split layers, whole blocks for the MLA layer."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    asked: list[str] = []

    def waits_for_device_events(peer: str) -> bool:
        asked.append(peer)
        return device_waits

    engine.waits_for_device_events = waits_for_device_events  # type: ignore[attr-defined]
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-7", (1, 2, 3), 3, DECODE, remote_tp_size=2)], [])
    for rank in (0, 1):
        pusher.on_remote_blocks(
            RemoteBlocks("tx-7", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    assert answer_handshakes(directory, DECODE, 2, "WRITE") == [0, 1]
    events = {layer: LayerEvent(0x1000 + i) for i, layer in enumerate(DENSE)}
    for layer, ev in events.items():
        pusher.layer_saved(layer, ev)
    after_forward = LayerEvent(0x2000)  # the layers whose save hook did not run
    pusher.forward_done([*DENSE, *WHOLE], after_forward)
    run_writer(ctx, pusher)
    handles = {(c[1], c[2]): c[5] for c in engine.calls if c[0] == "write_layer"}
    assert len(handles) == 2 * len(DENSE + WHOLE)
    expected = {**{layer: ev.cuda_event for layer, ev in events.items()}, "mla": 0x2000}
    for (_, layer), handle in handles.items():
        assert handle == (expected[layer] if device_waits else 0)
    waits = [ev.host_waits for ev in (*events.values(), after_forward)]
    assert waits == ([0, 0, 0] if device_waits else [2, 2, 2])  # one per job and layer
    assert set(asked) == {"d:8000/dp0/tp0", "d:8000/dp0/tp1"}  # asked per decode rank
    held = {tid: len(j.device_events) for tid, j in pusher._jobs.items()}
    assert held == ({"tx-7": 3, "tx-7#d1": 3} if device_waits else {"tx-7": 0, "tx-7#d1": 0})
    pusher.on_event(event("tx-7"), drained=True)
    assert {tid: len(j.device_events) for tid, j in pusher._jobs.items()} == {
        "tx-7": 0,
        "tx-7#d1": held["tx-7#d1"],
    }
    # Ended with copies still in flight: held while the job drains, let go once it drained.
    pusher.on_event(event("tx-7#d1", "timed_out", drained=False), drained=False)
    assert pusher.job_states()["tx-7#d1"] is JobState.DRAINING
    assert len(pusher._jobs["tx-7#d1"].device_events) == held["tx-7#d1"]
    assert pusher.on_drained("tx-7#d1") == "done"
    assert len(pusher._jobs["tx-7#d1"].device_events) == 0


@pytest.mark.parametrize("abort_first", [False, True])
def test_a_write_never_reported_drained_ends_after_the_quarantine_telling_nothing(
    abort_first: bool,
) -> None:
    """Writes the transport could not confirm are never reported drained (a review found them
    landing after a drained report): such a job holds the request's blocks until
    quarantine_timeout past its deadline, then ends, so those blocks are freed here -- never
    held for good -- but it tells the decode nothing, then or on a later abort_write: any final
    message would end the decode's quarantine (the second review found write_failed, and
    write_aborted for an abort_write, sent at the give-up), and its writes may still land."""
    ctx, sender, _, pusher = sealed_write("tx-q")
    assert pusher.job_states()["tx-q"] is JobState.SEALED  # its writes are in the engine
    pusher.begin_step([], [SendTask("req-1", "tx-q")])
    pusher.on_event(event("tx-q", "failed", drained=False), drained=False)
    abort = AbortWrite(
        "tx-q", "d:8000/dp0/tp0", DECODE.host, DECODE.handshake_port, DECODE.notify_port
    )
    if abort_first:
        pusher.on_abort_write(abort)
    assert pusher.job_states()["tx-q"] is JobState.DRAINING
    deadline = pusher._jobs["tx-q"].deadline
    pusher.check_timeouts(deadline + ctx.cfg.quarantine_timeout - 1)
    assert pusher.job_states()["tx-q"] is JobState.DRAINING and not ctx.reports.done_sending
    pusher.check_timeouts(deadline + ctx.cfg.quarantine_timeout + 1)
    assert "tx-q" not in pusher.job_states()
    assert ctx.reports.done_sending == {"req-1"}
    if not abort_first:
        pusher.on_abort_write(abort)
    assert final_messages(sender) == []


def sealed_write(tid: str, decode_tp: int = 1) -> tuple[Context, PortSender, Engine, Pusher]:
    """A WRITE prefill rank (TP 1) with request req-1 (transfer ``tid``) sealed in its engine
    for each of ``decode_tp`` decode ranks: announced, handshaken, every layer posted behind a
    CUDA event the engine waits for, the seal posted. (ctx, its sender, engine, pusher)."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    engine.waits_for_device_events = lambda peer: True  # type: ignore[attr-defined]
    pusher = Pusher(ctx)
    save = SaveTask("req-1", tid, (1, 2, 3), 3, DECODE, remote_tp_size=decode_tp)
    pusher.begin_step([save], [])
    for rank in range(decode_tp):
        pusher.on_remote_blocks(
            RemoteBlocks(tid, ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    answer_handshakes(directory, DECODE, decode_tp, "WRITE")
    pusher.forward_done(DENSE, LayerEvent(0x1000))
    run_writer(ctx, pusher)
    return ctx, sender, engine, pusher


def final_messages(sender: PortSender) -> list[tuple[int, str, str, int]]:
    """(port, type, transfer id, writer rank) of every final message sent, in order."""
    return [
        (port, m.TYPE, m.transfer_id, m.writer_rank)
        for port, m in sender.ports
        if isinstance(m, (WriteDone, WriteFailed, WriteAborted))
    ]


@pytest.mark.parametrize("unreachable", [0, 1])
def test_a_decode_rank_that_cannot_be_handshaken_is_told_write_failed(unreachable: int) -> None:
    """Before: a WRITE job whose decode rank could not be handshaken ended FAILED without a
    message (it had no handshaken peer to send one to), and that decode rank waited its
    abort_timeout (120 s) holding its blocks. Now the decode rank that announced gets one
    write_failed at the notify port of its rank at the request's decode address (nothing was
    posted to the engine, so nothing can land), naming the rank, its address and the failure,
    and ends its load at once; the other decode rank's job writes on, and the prefill's
    blocks are freed once both jobs ended (prefill TP 1 -> decode TP 2)."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    decodes = []
    for rank in (0, 1):  # each decode rank handshakes the prefill and announces its blocks
        dctx, ddirectory, dsender, _ = context("write", producer=False, tp_rank=rank, tp_size=2)
        puller = Puller(dctx)
        puller.start(RecvTask("req-1", "tx-1", PREFILL, "p:7000", 0, 1, (4, 5), report_done=True))
        answer_handshakes(ddirectory, PREFILL, 1, "WRITE")
        (announced,) = [m for m in dsender.sent if isinstance(m, RemoteBlocks)]
        pusher.on_remote_blocks(announced)
        decodes.append((dctx, puller))
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, remote_tp_size=2)], [])
    jobs = {0: "tx-1", 1: "tx-1#d1"}
    other = 1 - unreachable
    [(key, future)] = [p for p in directory.pending if p[0].handshake_port == 8000 + unreachable]
    directory.pending.remove((key, future))
    future.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
    assert answer_handshakes(directory, DECODE, 2, "WRITE") == [other]

    assert final_messages(sender) == [(8100 + unreachable, "write_failed", "tx-1", 0)]
    (failed,) = [m for m in sender.sent if isinstance(m, WriteFailed)]
    assert f"decode rank {unreachable} at 127.0.0.1:{8000 + unreachable}" in failed.reason
    assert "cannot be handshaken: handshake with" in failed.reason
    assert "timed out after 30s" in failed.reason
    assert pusher.job_states() == {
        jobs[unreachable]: JobState.FAILED,
        jobs[other]: JobState.WRITING,
    }
    # The decode rank takes it (by transfer id and writer rank) and recomputes now.
    dctx, puller = decodes[unreachable]
    puller.on_write_result(failed.transfer_id, ok=False, writer_rank=failed.writer_rank)
    assert dctx.reports.failed_recving == {"req-1"} and dctx.reports.invalid_blocks == {4, 5}
    assert decodes[other][1].await_states() == {"tx-1": AwaitState.ANNOUNCED}

    pusher.forward_done([*DENSE, *WHOLE], None)
    run_writer(ctx, pusher)
    assert {c[1] for c in engine.calls if c[0] in ("write_layer", "seal")} == {jobs[other]}
    pusher.begin_step([], [SendTask("req-1", "tx-1")])
    assert not ctx.reports.done_sending  # the other decode rank's job is still writing
    pusher.on_event(event(jobs[other]), drained=True)
    assert ctx.reports.done_sending == {"req-1"}
    assert sorted(final_messages(sender)) == sorted(
        [(8100 + unreachable, "write_failed", "tx-1", 0), (8100 + other, "write_done", "tx-1", 0)]
    )


def test_a_job_that_ends_before_its_handshake_answers_sends_one_write_failed() -> None:
    """The request is aborted while the decode rank's handshake is still out: nothing was
    posted, so its write_failed goes to the rank's notify port at once, and the handshake that
    answers later neither writes nor sends a second final message."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx-4", ((20, 21),), "d:8000/dp0/tp0"))
    pusher.begin_step([SaveTask("req-4", "tx-4", (1, 2), 2, DECODE, remote_tp_size=1)], [])
    assert pusher.job_states() == {"tx-4": JobState.CONNECTING}
    pusher.begin_step([], [SendTask("req-4", "tx-4", aborted=True)])
    assert final_messages(sender) == [(8100, "write_failed", "tx-4", 0)]
    assert ctx.reports.done_sending == {"req-4"}
    answer_handshakes(directory, DECODE, 1, "WRITE")
    pusher.forward_done([*DENSE, *WHOLE], None)
    run_writer(ctx, pusher)
    assert final_messages(sender) == [(8100, "write_failed", "tx-4", 0)] and not engine.calls


def test_blocks_that_do_not_pair_with_the_prompt_are_told_write_failed() -> None:
    """The decode announced more blocks than the prompt has: the job fails before any
    handshake (docs/protocol.md section 7 said `write_failed`, but none went out), and that
    decode rank is told so at its notify port, with both counts."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx-6", ((20, 21, 22),), "d:8000/dp0/tp0"))
    pusher.begin_step([SaveTask("req-6", "tx-6", (1, 2), 2, DECODE, remote_tp_size=1)], [])
    assert final_messages(sender) == [(8100, "write_failed", "tx-6", 0)]
    (failed,) = [m for m in sender.sent if isinstance(m, WriteFailed)]
    assert "3 blocks, the prompt has 2" in failed.reason
    assert not directory.pending and not engine.calls


def test_the_write_failed_of_an_unhandshaken_decode_rank_arrives_authenticated() -> None:
    """Over the real notify channel, with a shared secret: the write_failed for decode rank 1
    of TP 2, whose handshake failed, reaches the listener on that rank's notify port (base + 1)
    signed, as the decode's listener accepts it."""
    secure = ControlSecurity(MessageAuth("a shared secret of 32 bytes!!!!!"), PeerAllowlist())
    secure.allowlist.learn("127.0.0.1")
    with (
        NotifyListener(0, secure, bind_host="127.0.0.1") as listener,
        NotifySender(secure) as notify,
    ):
        decode = ZmqAddress("127.0.0.1", 8000, listener.port - 1)
        ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
        ctx.sender = notify
        pusher = Pusher(ctx)
        pusher.on_remote_blocks(
            RemoteBlocks("tx-5", ((20, 21),), "d:8000/dp0/tp1", decode_tp_rank=1)
        )
        pusher.begin_step([SaveTask("req-5", "tx-5", (1, 2), 2, decode, remote_tp_size=2)], [])
        [(key, future)] = directory.pending
        future.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
        received = listener.get(5.0)
        assert listener.stats()["dropped_auth"] == 0
    assert isinstance(received, WriteFailed), received
    assert (received.transfer_id, received.writer_rank) == ("tx-5", 0)
    assert "decode rank 1 at 127.0.0.1:8001 cannot be handshaken" in received.reason


class FailedDirectory(Directory):
    """Every handshake failed recently: connect answers with the remembered error at once, as
    the real directory does within a failure's backoff (the callback runs inline, under the
    caller's lock)."""

    def answer(self, key: PeerKey) -> Future[Peer]:
        future: Future[Peer] = Future()
        future.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
        return future


def test_a_write_failed_the_allowlist_refuses_is_logged_not_raised_into_the_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The write_failed of an unhandshaken decode rank goes through the allowlist like every
    message: to a host it refuses nothing is sent, and the refusal is logged; it never raises
    into the step that failed the job (vLLM's), and the job still fails and frees the blocks."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.directory = FailedDirectory()  # type: ignore[assignment]
    ctx.sender = NotifySender(ControlSecurity(MessageAuth(None), PeerAllowlist()))
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx-2", ((20, 21),), "d:8000/dp0/tp0"))
    with caplog.at_level("WARNING", logger="moriio_native"):
        pusher.begin_step([SaveTask("req-2", "tx-2", (1, 2), 2, DECODE, remote_tp_size=1)], [])
    assert pusher.job_states() == {"tx-2": JobState.FAILED}
    refused = [r.getMessage() for r in caplog.records if "write_failed not sent" in r.getMessage()]
    assert len(refused) == 1 and "'127.0.0.1' is not in the allowlist" in refused[0], refused
    pusher.begin_step([], [SendTask("req-2", "tx-2")])
    assert ctx.reports.done_sending == {"req-2"}
    ctx.sender.close()


def test_a_decode_that_restarted_since_announcing_gets_no_write_failed() -> None:
    """The handshake answers, but as another incarnation than the one that announced the
    blocks: that process is gone and nobody waits for this job, so nothing is written and no
    final message goes to the process at the address (it never knew the transfer)."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(
        RemoteBlocks("tx-3", ((20, 21),), "d:8000/dp0/tp0", decode_incarnation="ab" * 16)
    )
    pusher.begin_step([SaveTask("req-3", "tx-3", (1, 2), 2, DECODE, remote_tp_size=1)], [])
    answer_handshakes(directory, DECODE, 1, "WRITE")  # answers as incarnation(0)
    assert pusher.job_states() == {"tx-3": JobState.FAILED}
    assert not final_messages(sender) and not engine.calls
    pusher.begin_step([], [SendTask("req-3", "tx-3")])
    assert ctx.reports.done_sending == {"req-3"}


# The incarnation of a process restarted at prefill rank 0's address after the decode's
# handshake (the test's ranks answer as incarnation(rank)).
PREDECESSOR = "ab" * 16


def misaddressed_job(tid: str) -> tuple[Context, Directory, PortSender, Engine, Pusher]:
    """A WRITE prefill rank (TP 1, incarnation(0)) whose job of request req-1 (transfer
    ``tid``) got remote_blocks addressed to PREDECESSOR and was handshaken with the decode."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", tid, (1, 2), 2, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(
        RemoteBlocks(tid, ((20, 21),), "d:8000/dp0/tp0", prefill_incarnation=PREDECESSOR)
    )
    answer_handshakes(directory, DECODE, 1, "WRITE")
    return ctx, directory, sender, engine, pusher


def test_an_announcement_addressed_to_a_predecessor_is_asked_for_again_then_written() -> None:
    """Before: the restarted prefill failed the job (write_failed) and the decode recomputed
    the request. Now it writes nothing, keeps the job and answers misaddressed at the decode
    rank's notify port; the announcement addressed to it is written."""
    ctx, directory, sender, engine, pusher = misaddressed_job("tx-1")
    engine.waits_for_device_events = lambda peer: True  # type: ignore[attr-defined]
    assert pusher.job_states() == {"tx-1": JobState.PENDING}
    assert not engine.calls and not final_messages(sender)
    port, asked = sender.ports[-1]
    assert port == DECODE.notify_port and isinstance(asked, Misaddressed)
    assert (asked.transfer_id, asked.writer_rank) == ("tx-1", 0)
    assert (asked.writer_incarnation, asked.addressed_incarnation) == (incarnation(0), PREDECESSOR)
    pusher.on_remote_blocks(
        RemoteBlocks("tx-1", ((20, 21),), "d:8000/dp0/tp0", prefill_incarnation=incarnation(0))
    )
    answer_handshakes(directory, DECODE, 1, "WRITE")
    assert pusher.job_states() == {"tx-1": JobState.WRITING}
    pusher.forward_done(DENSE, LayerEvent(0x1000))
    run_writer(ctx, pusher)
    posts = [c[:3] for c in engine.calls if c[0] in ("write_layers", "seal")]
    assert posts == [("write_layers", "tx-1", DENSE), ("seal", "tx-1", "d:8000/dp0/tp0")]


def test_a_job_that_ended_during_its_handshake_asks_for_no_announcement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request ended (aborted) while the decode rank was being handshaken: when the
    handshake shows the announcement was addressed to a predecessor, the job stays ended, and
    no misaddressed asks for an announcement nobody would write."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2), 2, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(
        RemoteBlocks("tx-1", ((20, 21),), "d:8000/dp0/tp0", prefill_incarnation=PREDECESSOR)
    )
    pusher.begin_step([], [SendTask("req-1", "tx-1", aborted=True)])
    with caplog.at_level(logging.ERROR, logger="moriio_native.pd.pusher"):
        answer_handshakes(directory, DECODE, 1, "WRITE")
    assert not any(isinstance(m, Misaddressed) for m in sender.sent)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all("was addressed to prefill incarnation" in e for e in errors), errors
    assert ctx.reports.done_sending == {"req-1"} and not engine.calls


def test_a_job_that_ends_while_waiting_again_answers_the_announcement_write_failed() -> None:
    """misaddressed went out, then the request ended before the decode announced again: the
    announcement that comes later is told write_failed at once, nothing written."""
    ctx, _, sender, engine, pusher = misaddressed_job("tx-1")
    pusher.begin_step([], [SendTask("req-1", "tx-1", aborted=True)])
    assert ctx.reports.done_sending == {"req-1"} and not final_messages(sender)
    pusher.on_remote_blocks(
        RemoteBlocks("tx-1", ((20, 21),), "d:8000/dp0/tp0", prefill_incarnation=incarnation(0))
    )
    assert final_messages(sender) == [(DECODE.notify_port, "write_failed", "tx-1", 0)]
    assert not engine.calls


def test_a_second_misaddressed_announcement_fails_the_job() -> None:
    """One request is announced again at most once: a second announcement addressed to
    another process than this one ends the job failed, nothing written, write_failed told."""
    _, directory, sender, engine, pusher = misaddressed_job("tx-1")
    pusher.on_remote_blocks(
        RemoteBlocks("tx-1", ((20, 21),), "d:8000/dp0/tp0", prefill_incarnation="cd" * 16)
    )
    answer_handshakes(directory, DECODE, 1, "WRITE")
    assert pusher.job_states() == {"tx-1": JobState.FAILED}
    assert not engine.calls
    assert final_messages(sender) == [(DECODE.notify_port, "write_failed", "tx-1", 0)]
    assert sum(isinstance(m, Misaddressed) for m in sender.sent) == 1


class IncarnationDirectory(Directory):
    """Records the incarnation each handshake was asked for, and whether it asked to be
    retried in the background after a remembered failure (recover)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.recover: list[bool] = []
        self.forgotten: list[Peer | None] = []

    def connect(self, key: PeerKey, notify_port: int, validate: Any, **kw: Any) -> Future[Peer]:
        self.asked.append(kw.get("incarnation", ""))
        self.recover.append(kw.get("recover", False))
        return self.answer(key)

    def forget(self, peer: Peer | None) -> None:
        self.forgotten.append(peer)


def announced_await(tid: str) -> tuple[Context, IncarnationDirectory, Sender, Puller]:
    """A WRITE decode rank (TP 1) whose await of req-1 (transfer ``tid``, blocks 4 and 5)
    announced to prefill rank 0, handshaken as incarnation(0)."""
    ctx, _, sender, _ = context("write", producer=False, tp_rank=0, tp_size=1)
    ctx.directory = directory = IncarnationDirectory()  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(RecvTask("req-1", tid, PREFILL, "p:7000", 0, 1, (4, 5), report_done=True))
    answer_handshakes(directory, PREFILL, 1, "WRITE")
    assert puller.await_states() == {tid: AwaitState.ANNOUNCED}
    return ctx, directory, sender, puller


def answer_as(directory: Directory, new_incarnation: str, rank: int = 0, tp: int = 1) -> None:
    """Complete the first pending handshake, of prefill rank ``rank`` of ``tp``, as a process
    of ``new_incarnation``."""
    key, future = directory.pending.pop(0)
    assert key.handshake_port == PREFILL.handshake_port + rank
    peer = peer_at(key, PREFILL, rank, tp, "WRITE")
    response = msgspec.structs.replace(peer.response, incarnation=new_incarnation)
    handshake = Handshake(key, peer.engine_peer, response, asked_at=time.monotonic())
    future.set_result(Peer(handshake, peer.notify_port))


def announcements(sender: Sender) -> list[str]:
    """The prefill incarnation each remote_blocks sent was addressed to, in order."""
    return [m.prefill_incarnation for m in sender.sent if isinstance(m, RemoteBlocks)]


def test_a_misaddressed_answer_makes_the_decode_announce_to_the_new_process_once() -> None:
    """The decode forgets the stale handshake, handshakes the rank naming the incarnation
    that answered, announces the same blocks to it, and loads what it writes; a second
    misaddressed (the rank restarted again) fails the load instead of a third announcement."""
    ctx, directory, sender, puller = announced_await("tx-1")
    new = "ef" * 16
    puller.on_misaddressed(Misaddressed("tx-1", new, incarnation(0)))
    assert puller.await_states() == {"tx-1": AwaitState.CONNECTING}
    assert directory.asked == ["", new]
    assert directory.recover == [True, True]  # requests: a remembered failure is retried
    assert [p.response.incarnation for p in directory.forgotten if p] == [incarnation(0)]
    answer_as(directory, new)
    assert announcements(sender) == [incarnation(0), new]
    blocks = [m.block_ids for m in sender.sent if isinstance(m, RemoteBlocks)]
    assert blocks[0] == blocks[1] == ((4, 5),)
    assert puller.await_states() == {"tx-1": AwaitState.ANNOUNCED}
    puller.on_misaddressed(Misaddressed("tx-1", "12" * 16, new))
    assert announcements(sender) == [incarnation(0), new]
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}
    # That process kept its job for an announcement that will not come: it is released.
    assert isinstance(sender.sent[-1], Release)


def test_a_misaddressed_answer_then_written_loads_the_request() -> None:
    ctx, directory, _, puller = announced_await("tx-1")
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0)))
    answer_as(directory, "ef" * 16)
    puller.on_write_result("tx-1", ok=True, writer_rank=0)
    assert ctx.reports.done_recving == {"req-1"} and not ctx.reports.failed_recving


def test_announcing_again_to_yet_another_process_fails_and_releases_it() -> None:
    """The handshake after misaddressed answers as neither process (the rank restarted once
    more): nothing is announced to it, the load fails and the rank is released."""
    ctx, directory, sender, puller = announced_await("tx-1")
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0)))
    answer_as(directory, "34" * 16)
    assert announcements(sender) == [incarnation(0)]
    assert isinstance(sender.sent[-1], Release)
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}


def test_a_give_up_while_announcing_again_announces_nothing_and_releases() -> None:
    """The request is aborted (or its abort_timeout passes) while the decode handshakes the new
    process: the part fails at once (nothing was announced to it), the rank is released, and
    the handshake's late answer announces nothing."""
    ctx, directory, sender, puller = announced_await("tx-1")
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0)))
    puller.give_up("tx-1", "request aborted")
    assert ctx.reports.failed_recving == {"req-1"} and isinstance(sender.sent[-1], Release)
    answer_as(directory, "ef" * 16)
    assert announcements(sender) == [incarnation(0)]


def test_a_give_up_before_the_new_handshake_starts_makes_none() -> None:
    ctx, directory, _, puller = announced_await("tx-1")
    forget = directory.forget

    def forget_then_give_up(peer: Peer | None) -> None:  # a give_up on another thread, here
        forget(peer)
        puller.give_up("tx-1", "request aborted")

    directory.forget = forget_then_give_up  # type: ignore[method-assign]
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0)))
    assert ctx.reports.failed_recving == {"req-1"} and directory.asked == [""]


def test_a_failed_handshake_of_the_new_process_fails_the_load_and_releases_it() -> None:
    ctx, directory, sender, puller = announced_await("tx-1")
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0)))
    _, future = directory.pending.pop(0)
    future.set_exception(TransportError("handshake timed out"))
    assert announcements(sender) == [incarnation(0)] and isinstance(sender.sent[-1], Release)
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}


def test_one_restarted_writer_of_two_is_announced_again_and_alone_released() -> None:
    """Decode TP 1 over prefill TP 2, rank 1 restarted: only its part is announced again, at
    its own port, while rank 0 writes as usual; when rank 1 restarted once more, only it is
    released and the load fails (recomputed)."""
    ctx, _, _, _ = context("write", producer=False, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    ctx.directory = directory = IncarnationDirectory()  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(RecvTask("req-1", "tx-1", PREFILL, "p:7000", 0, 2, (4, 5), report_done=True))
    answer_handshakes(directory, PREFILL, 2, "WRITE")
    new = "ef" * 16
    puller.on_misaddressed(Misaddressed("tx-1", new, incarnation(1), writer_rank=1))
    puller.on_write_result("tx-1", ok=True, writer_rank=0)
    answer_as(directory, new, rank=1, tp=2)
    announced = [
        (port - PREFILL.notify_port, m.prefill_incarnation)
        for port, m in sender.ports
        if isinstance(m, RemoteBlocks)
    ]
    assert announced == [(0, incarnation(0)), (1, incarnation(1)), (1, new)]
    puller.on_misaddressed(Misaddressed("tx-1", "12" * 16, new, writer_rank=1))
    released = [port - PREFILL.notify_port for port, m in sender.ports if isinstance(m, Release)]
    assert released == [1] and ctx.reports.failed_recving == {"req-1"}


def test_each_of_two_decode_ranks_is_asked_again_and_the_one_announced_written() -> None:
    """Prefill TP 1 writing decode TP 2, both announcements addressed to a predecessor: each
    job answers misaddressed at its own rank; rank 1 then releases (its job alone fails) and
    rank 0 announces again, which is written and told write_done."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    engine.waits_for_device_events = lambda peer: True  # type: ignore[attr-defined]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, remote_tp_size=2)], [])

    def announce(rank: int, addressed: str) -> None:
        blocks = RemoteBlocks(
            "tx-1",
            ((20, 21, 22),),
            f"d:8000/dp0/tp{rank}",
            decode_tp_rank=rank,
            prefill_incarnation=addressed,
        )
        pusher.on_remote_blocks(blocks)

    announce(0, PREDECESSOR)
    announce(1, PREDECESSOR)
    answer_handshakes(directory, DECODE, 2, "WRITE")
    asked = [port - DECODE.notify_port for port, m in sender.ports if isinstance(m, Misaddressed)]
    assert asked == [0, 1]
    assert pusher.job_states() == {"tx-1": JobState.PENDING, "tx-1#d1": JobState.PENDING}
    pusher.forward_done([*DENSE, *WHOLE], LayerEvent(0x1000))
    pusher.on_release(Release("tx-1", consumer_tp_size=2, consumer_tp_rank=1))
    assert pusher.job_states()["tx-1#d1"] is JobState.FAILED
    announce(0, incarnation(0))
    answer_handshakes(directory, DECODE, 2, "WRITE")
    pusher.feed_writer()  # what a handshake completed on its own thread does
    run_writer(ctx, pusher)
    assert [c[1] for c in engine.calls if c[0] == "seal"] == ["tx-1"]
    pusher.on_event(event("tx-1"), drained=True)
    assert final_messages(sender) == [(DECODE.notify_port, "write_done", "tx-1", 0)]


def test_a_misaddressed_not_naming_our_announcement_is_ignored() -> None:
    """Only the incarnation we announced to can have refused it: a message naming another one
    (stray, or forged without a secret) ends nothing and announces nothing."""
    ctx, directory, sender, puller = announced_await("tx-1")
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, "56" * 16))
    puller.on_misaddressed(Misaddressed("tx-9", "ef" * 16, incarnation(0)))
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0), writer_rank=3))
    assert puller.await_states() == {"tx-1": AwaitState.ANNOUNCED}
    assert directory.asked == [""] and len(sender.sent) == 1
    assert not ctx.reports.failed_recving


def test_a_misaddressed_answer_to_a_quarantined_await_ends_the_quarantine() -> None:
    """We gave up after announcing and quarantined the blocks; the answer says the process
    there wrote nothing, and nothing will be announced to it: the blocks are free."""
    ctx, _, sender, puller = announced_await("tx-1")
    puller.give_up("tx-1", "test gave up")
    assert puller.await_states() == {"tx-1": AwaitState.QUARANTINED}
    puller.on_misaddressed(Misaddressed("tx-1", "ef" * 16, incarnation(0)))
    assert puller.await_states() == {}
    assert announcements(sender) == [incarnation(0)]
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}


def end_request_before_announcement(
    ended: str,
) -> tuple[Context, PortSender, Directory, Engine, Pusher]:
    """Prefill TP 1 -> decode TP 2: the request's save task came, then its jobs ended FAILED
    (``ended``: the request was aborted, or no announcement came within abort_timeout) before
    either decode rank announced its blocks; the request ended with them."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, remote_tp_size=2)], [])
    pusher.begin_step([], [SendTask("req-1", "tx-1", aborted=ended == "aborted")])
    if ended == "deadline":
        pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    assert ctx.reports.done_sending == {"req-1"} and not pusher.job_states()
    assert not final_messages(sender)  # nobody had announced: nobody to tell yet
    return ctx, sender, directory, engine, pusher


@pytest.mark.parametrize("ended", ["aborted", "deadline"])
def test_an_announcement_after_the_job_ended_is_told_write_failed_at_once(ended: str) -> None:
    """Before: a job that ended FAILED before its decode rank's remote_blocks came (the request
    aborted at the prefill, its abort_timeout) dropped the late announcement without an answer
    (the job was no longer PENDING, or no longer known), and the decode rank held its blocks
    for its abort_timeout (120 s). Now each announcing rank gets one write_failed at once, at
    its notify port at the request's decode address, naming why the job ended; nothing is
    handshaken or written, and a copy of the announcement gets no second answer."""
    _, sender, directory, engine, pusher = end_request_before_announcement(ended)
    for rank in (1, 0, 1):  # rank 1's announcement twice (a copy past the listener's memory)
        pusher.on_remote_blocks(
            RemoteBlocks("tx-1", ((20, 21),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    assert final_messages(sender) == [
        (8101, "write_failed", "tx-1", 0),
        (8100, "write_failed", "tx-1", 0),
    ]
    why = "the request was aborted" if ended == "aborted" else "within abort_timeout"
    assert all(why in m.reason for m in sender.sent if isinstance(m, WriteFailed)), sender.sent
    assert not directory.pending and not engine.calls and not pusher.job_states()


def test_a_late_announcement_reaches_the_prefill_and_its_write_failed_the_decode() -> None:
    """Over the real notify channel with a shared secret: the prefill's request was aborted
    before the decode rank announced, so the transfer is terminal at the prefill's listener.
    Before: the listener dropped the late remote_blocks as a message of a terminal transfer,
    and the decode rank waited its abort_timeout. Now it reaches the pusher, and the decode
    rank's listener gets the write_failed, authenticated."""
    secure = ControlSecurity(MessageAuth("a shared secret of 32 bytes!!!!!"), PeerAllowlist())
    secure.allowlist.learn("127.0.0.1")
    with (
        NotifyListener(0, secure, bind_host="127.0.0.1") as prefill,
        NotifyListener(0, secure, bind_host="127.0.0.1") as decode,
        NotifySender(secure) as notify,
    ):
        address = ZmqAddress("127.0.0.1", 8000, decode.port)
        ctx, _, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
        ctx.sender, ctx.mark_terminal = notify, prefill.mark_terminal
        pusher = Pusher(ctx)
        pusher.begin_step([SaveTask("req-2", "tx-2", (1, 2), 2, address, remote_tp_size=1)], [])
        pusher.begin_step([], [SendTask("req-2", "tx-2", aborted=True)])
        assert ctx.reports.done_sending == {"req-2"}
        notify.send("127.0.0.1", prefill.port, RemoteBlocks("tx-2", ((20, 21),), "d:8000/dp0/tp0"))
        announced = prefill.get(5.0)
        assert isinstance(announced, RemoteBlocks), prefill.stats()
        pusher.on_remote_blocks(announced)
        received = decode.get(5.0)
        assert decode.stats()["dropped_auth"] == 0
    assert isinstance(received, WriteFailed), received
    assert (received.transfer_id, received.writer_rank) == ("tx-2", 0)
    assert "the request was aborted" in received.reason and not engine.calls


def test_a_request_that_ended_before_its_prompt_was_computed_tells_every_announced_rank() -> None:
    """The request ended at the prefill before its last prompt chunk (no save task: its blocks
    were freed at once), after decode rank 1 announced and before rank 0 did. Before: nothing
    told the workers, rank 1's announcement waited out abort_timeout as an orphan, and both
    decode ranks held their blocks for their abort_timeout. Now the scheduler's notice ends
    the request's jobs: rank 1 is told write_failed at once, rank 0 when it announces, each
    once; nothing is handshaken or written, and nothing is reported freed (vLLM holds no
    blocks of it)."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx-6", ((20, 21),), "d:8000/dp0/tp1", decode_tp_rank=1))
    ended = SendTask("req-6", "tx-6", aborted=True, unsaved=True, peer=DECODE, remote_tp_size=2)
    pusher.begin_step([], [ended])
    assert final_messages(sender) == [(8101, "write_failed", "tx-6", 0)]
    (failed,) = [m for m in sender.sent if isinstance(m, WriteFailed)]
    assert "before its prompt was computed" in failed.reason
    assert not pusher.job_states() and not ctx.reports.done_sending
    for rank in (0, 1):
        pusher.on_remote_blocks(
            RemoteBlocks("tx-6", ((20, 21),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    assert final_messages(sender) == [
        (8101, "write_failed", "tx-6", 0),
        (8100, "write_failed", "tx-6", 0),
    ]
    assert not directory.pending and not engine.calls and not ctx.reports.done_sending


def test_the_records_of_ended_jobs_are_bounded_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """What answers late announcements is bounded (the newest ended jobs) and kept for
    abort_timeout; past either, a late announcement is kept like one for a request never seen
    (an orphan, forgotten after abort_timeout), never answered from a guess."""
    monkeypatch.setattr(pusher_module, "MAX_EARLY_MESSAGES", 4)
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    for i in range(10):
        pusher.begin_step([SaveTask(f"req-{i}", f"tx-{i}", (1, 2), 2, DECODE, 1)], [])
        pusher.begin_step([], [SendTask(f"req-{i}", f"tx-{i}", aborted=True)])
    for i in (0, 9):
        pusher.on_remote_blocks(RemoteBlocks(f"tx-{i}", ((20, 21),), "d:8000/dp0/tp0"))
    assert final_messages(sender) == [(8100, "write_failed", "tx-9", 0)]
    assert pusher.job_states() == {"tx-0": JobState.PENDING}  # an orphan now
    pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    pusher.on_remote_blocks(RemoteBlocks("tx-8", ((20, 21),), "d:8000/dp0/tp0"))
    assert final_messages(sender) == [(8100, "write_failed", "tx-9", 0)]
    assert pusher.job_states() == {"tx-8": JobState.PENDING}


def test_announcements_of_unknown_requests_are_bounded_in_block_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any sender may announce blocks for a request the prefill has not seen (an orphan job,
    kept for its save task), with up to about 1.6 million ids a message: past
    MAX_ORPHAN_BLOCK_IDS in all the oldest orphans are dropped, however few they are; an
    orphan its save task claims no longer counts."""
    monkeypatch.setattr(pusher_module, "MAX_ORPHAN_BLOCK_IDS", 10)
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    for i in range(3):
        pusher.on_remote_blocks(RemoteBlocks(f"tx-{i}", ((20, 21, 22, 23),), "d:8000/dp0/tp0"))
    assert set(pusher.job_states()) == {"tx-1", "tx-2"}  # 12 ids: tx-0 dropped
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3, 4), 4, DECODE, 1)], [])
    pusher.on_remote_blocks(RemoteBlocks("tx-3", ((20, 21, 22, 23),), "d:8000/dp0/tp0"))
    assert set(pusher.job_states()) == {"tx-1", "tx-2", "tx-3"}  # tx-1 is no orphan now
    pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    for i in range(2):
        pusher.on_remote_blocks(
            RemoteBlocks(f"tx-{4 + i}", ((20, 21, 22, 23, 24),), "d:8000/dp0/tp0")
        )
    assert {"tx-4", "tx-5"} <= set(pusher.job_states())  # the expired orphans freed their ids


def abort_write(tid: str, rank: int, engine_rank: int | None = None) -> AbortWrite:
    """Decode rank ``rank``'s abort_write (its engine id: that of ``engine_rank``, default
    its own), naming the decode's base address."""
    named = rank if engine_rank is None else engine_rank
    return AbortWrite(
        tid,
        f"d:8000/dp0/tp{named}",
        DECODE.host,
        DECODE.handshake_port,
        DECODE.notify_port,
        decode_tp_rank=rank,
        decode_tp_size=2,
    )


@pytest.mark.parametrize("when", ["handshake pending", "request ended"])
def test_an_abort_of_an_unhandshaken_job_is_acknowledged_at_once(when: str) -> None:
    """Decode rank 1 announced, the prefill's handshake of it never answers, and the decode
    rank gives up (abort_write) -- with the job still connecting, or after the request ended
    (its write_failed lost). Nothing of the job was posted, so nothing can land. Before: the
    write_aborted waited for a handshake of the decode rank (the one that never answers),
    and the decode rank kept its blocks quarantined for quarantine_timeout (300 s). Now it goes
    at once to that rank's notify port at the request's decode address, once; the late
    handshake then writes nothing and sends nothing more."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-3", "tx-3", (1, 2, 3), 3, DECODE, remote_tp_size=2)], [])
    for rank in (0, 1):
        pusher.on_remote_blocks(
            RemoteBlocks("tx-3", ((20, 21),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    [(_, stuck)] = [p for p in directory.pending if p[0].handshake_port == 8001]
    directory.pending = [p for p in directory.pending if p[0].handshake_port != 8001]
    assert answer_handshakes(directory, DECODE, 2, "WRITE") == [0]
    pusher.forward_done([*DENSE, *WHOLE], None)
    run_writer(ctx, pusher)
    pusher.on_event(event("tx-3"), drained=True)  # rank 0's job is done
    expected = [(8100, "write_done", "tx-3", 0)]
    if when == "request ended":
        stuck.set_exception(TransportError("handshake with 127.0.0.1:8001 timed out after 30s"))
        pusher.begin_step([], [SendTask("req-3", "tx-3")])
        assert ctx.reports.done_sending == {"req-3"} and not pusher.job_states()
        expected.append((8101, "write_failed", "tx-3", 0))
    assert final_messages(sender) == expected
    pusher.on_abort_write(abort_write("tx-3", 1))
    pusher.on_abort_write(abort_write("tx-3", 1))  # a copy past the listener's memory
    assert final_messages(sender) == [*expected, (8101, "write_aborted", "tx-3", 0)]
    assert not directory.pending  # no handshake for the acknowledgement
    if when == "handshake pending":
        assert pusher.job_states()["tx-3#d1"] is JobState.FAILED
        stuck.set_result(peer_at(PeerKey("127.0.0.1", 8001), DECODE, 1, 2, "WRITE"))
    assert {c[1] for c in engine.calls if c[0] in ("write_layer", "seal")} == {"tx-3"}
    assert final_messages(sender) == [*expected, (8101, "write_aborted", "tx-3", 0)]


class CachedDirectory(Directory):
    """Decode rank 0 of TP 2 is handshaken (the cache's only peer); handshakes stay pending."""

    def find_engine(self, engine_id: str) -> Peer | None:
        key = PeerKey("127.0.0.1", DECODE.handshake_port)
        peer = peer_at(key, DECODE, 0, 2, "WRITE")
        return peer if peer.response.engine_id == engine_id else None


def test_an_abort_for_a_transfer_never_known_is_acknowledged_only_by_the_rank_it_names() -> None:
    """An abort_write for a transfer this prefill rank never knew (nothing of it was or is
    written here) names decode rank 1 but the engine id of rank 0, which the prefill has
    handshaken. Before: the write_aborted went to rank 0 (the cached peer of that engine id),
    which would free blocks this rank may still write for that transfer. Now only the rank the
    abort names is answered, after a handshake at the abort's address confirms it; the
    transfer's job stays failed, and a save task for it later writes nothing into rank 1."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.directory = directory = CachedDirectory()  # type: ignore[assignment]
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_abort_write(abort_write("tx-4", 1, engine_rank=0))
    assert not final_messages(sender)
    [(key, future)] = directory.pending
    assert key == PeerKey("127.0.0.1", 8001)
    future.set_result(peer_at(key, DECODE, 1, 2, "WRITE"))  # its engine id is not the abort's
    assert not final_messages(sender)
    pusher.on_abort_write(abort_write("tx-5", 1))
    [(key, future)] = directory.pending[1:]
    future.set_result(peer_at(key, DECODE, 1, 2, "WRITE"))
    assert final_messages(sender) == [(8101, "write_aborted", "tx-5", 0)]
    assert pusher.job_states() == {"tx-4#d1": JobState.FAILED, "tx-5#d1": JobState.FAILED}
    assert not engine.calls


def test_an_abort_whose_handshake_failed_is_acknowledged_when_it_answers_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An abort_write for a transfer this prefill rank never had (its prefill leg lost), from
    decode rank 1, whose handshake fails once (a busy or restarting decode). Before: the
    acknowledgement was given up at once, so the decode held its quarantined blocks, and the
    request with them, for quarantine_timeout (300 s). Now it is tried again every
    ACK_RETRY_EVERY_S, still only through a handshake that proves the rank, and goes out once
    that answers; one whose handshakes keep failing is given up after abort_timeout; one whose
    address answers as another engine is not tried again."""
    # Its three handshakes at once (the bound is tested on its own).
    monkeypatch.setattr(pusher_module, "MAX_ACK_HANDSHAKES", 3)
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    retry, late = pusher_module.ACK_RETRY_EVERY_S, ctx.cfg.abort_timeout
    start = time.monotonic()
    for tid in ("tx-1", "tx-2"):
        pusher.on_abort_write(abort_write(tid, 1))
    pusher.on_abort_write(abort_write("tx-3", 1, engine_rank=0))
    for key, future in directory.pending:
        future.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
    directory.pending = []
    pusher.check_timeouts(start + retry / 2)  # not due yet
    assert not directory.pending and not final_messages(sender)
    pusher.check_timeouts(time.monotonic() + retry + 1)
    assert [key.handshake_port for key, _ in directory.pending] == [8001] * 3
    (key, answers), (_, fails), (_, other) = directory.pending
    answers.set_result(peer_at(key, DECODE, 1, 2, "WRITE"))
    fails.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
    other.set_result(peer_at(key, DECODE, 1, 2, "WRITE"))  # not the engine tx-3's abort named
    assert final_messages(sender) == [(8101, "write_aborted", "tx-1", 0)]
    directory.pending = []
    pusher.check_timeouts(time.monotonic() + 2 * retry + 1)  # tx-2 again, nothing else
    [(_, fails)] = directory.pending
    fails.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
    directory.pending = []
    pusher.check_timeouts(start + late + 2 * retry)  # past abort_timeout: given up
    assert not directory.pending
    assert final_messages(sender) == [(8101, "write_aborted", "tx-1", 0)]


def test_aborts_naming_addresses_that_never_answer_hold_few_handshake_threads() -> None:
    """A flood of abort_write for transfers this prefill rank never knew, each naming another
    decode address where nothing answers (any sender may send them). Before: each one queued a
    handshake for the peer directory's few threads, which time out one by one (transfer_timeout
    each), so thousands of them queued and a genuine transfer's handshake waited behind all of
    them. Now at most MAX_ACK_HANDSHAKES are in flight; the rest wait for their next try, in
    the bounded map of acknowledgements tried again, and one starts when one ends."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    for n in range(200):
        port = 20000 + n
        pusher.on_abort_write(AbortWrite(f"flood-{n}", "flood:1/dp0/tp0", "127.0.0.1", port, port))
    # Fewer than the directory's threads: one stays free for genuine handshakes.
    assert len(directory.pending) < HANDSHAKE_THREADS
    assert len(directory.pending) == pusher_module.MAX_ACK_HANDSHAKES
    assert len(pusher._ack_retries) == 200 - pusher_module.MAX_ACK_HANDSHAKES
    key, future = directory.pending.pop(0)
    future.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
    pusher.check_timeouts(time.monotonic() + pusher_module.ACK_RETRY_EVERY_S + 1)
    assert len(directory.pending) == pusher_module.MAX_ACK_HANDSHAKES


def test_acknowledgements_waiting_for_a_handshake_are_not_retried_while_none_may_start() -> None:
    """The same flood: 198 acknowledgements wait while the 2 handshakes the acknowledgements may
    have are in flight. Before: each pass over those due (check_timeouts, under the context
    lock) tried every one again, each failing at once for want of a handshake and queued again:
    23 ms of the lock per 1,024 of them, every 5 s, that genuine transfers wait for. Now a pass
    tries only as many as handshakes may start; the rest stay due, tried once one ends."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    for n in range(200):
        port = 20000 + n
        pusher.on_abort_write(AbortWrite(f"flood-{n}", "flood:1/dp0/tp0", "127.0.0.1", port, port))
    tried: list[str] = []
    ack_by_handshake = pusher._ack_by_handshake

    def counted(request: AbortWrite, ack: WriteAborted, since: float | None = None) -> None:
        tried.append(request.transfer_id)
        ack_by_handshake(request, ack, since)

    pusher._ack_by_handshake = counted  # type: ignore[method-assign]
    later = time.monotonic() + pusher_module.ACK_RETRY_EVERY_S + 1
    pusher.check_timeouts(later)
    assert tried == []
    key, future = directory.pending.pop(0)
    future.set_exception(TransportError(f"handshake with {key} timed out after 30s"))
    pusher.check_timeouts(later)
    assert tried == ["flood-2"]  # the first waiting, in a handshake that may start now
    assert len(directory.pending) == pusher_module.MAX_ACK_HANDSHAKES


def test_acknowledgements_start_at_most_their_handshakes_a_second() -> None:
    """A flood of abort_write each naming another address that answers at once (a stranger's
    handshake server: each costs a handshake, a connection and an eviction). Before: in flight
    at most 2 at a time, but no bound on the rate, so all 200 handshakes ran back to back. Now
    at most ACK_HANDSHAKES_PER_S start a second; the rest wait for their next try, and a second
    later the due ones start handshakes again (2 a pass: the in-flight bound)."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    pusher = Pusher(ctx)
    clock = [0.0]
    pusher._ack_budget = pusher_module._HandshakeBudget(
        pusher_module.ACK_HANDSHAKES_PER_S, clock=lambda: clock[0]
    )
    started = 0

    def answer_all() -> None:
        nonlocal started
        while directory.pending:
            key, future = directory.pending.pop(0)
            started += 1
            future.set_exception(TransportError(f"handshake with {key} answered too late"))

    for n in range(200):
        port = 20000 + n
        pusher.on_abort_write(AbortWrite(f"flood-{n}", "flood:1/dp0/tp0", "127.0.0.1", port, port))
        answer_all()
    assert started == pusher_module.ACK_HANDSHAKES_PER_S
    clock[0] += 1.0
    pusher.check_timeouts(time.monotonic() + pusher_module.ACK_RETRY_EVERY_S + 1)
    answer_all()
    assert started <= pusher_module.ACK_HANDSHAKES_PER_S + pusher_module.MAX_ACK_HANDSHAKES
    assert started > pusher_module.ACK_HANDSHAKES_PER_S  # tried again once the second passed


def write_one_request(ctx: Context, directory: Directory, pusher: Pusher, tid: str) -> None:
    """A WRITE of request ``tid`` into decode rank 0 of TP 1, handshaken, written and done."""
    decode = ZmqAddress(DECODE.host, DECODE.handshake_port, DECODE.notify_port)
    pusher.begin_step([SaveTask(f"req-{tid}", tid, (1, 2), 2, decode, remote_tp_size=1)], [])
    pusher.on_remote_blocks(RemoteBlocks(tid, ((20, 21),), "d:8000/dp0/tp0", decode_tp_rank=0))
    assert answer_handshakes(directory, DECODE, 1, "WRITE") == [0]
    pusher.forward_done([*DENSE, *WHOLE], None)
    run_writer(ctx, pusher)
    ctx.stop.clear()
    pusher.on_event(event(tid), drained=True)


def pusher_without_refill(ctx: Context) -> tuple[PortSender, Pusher]:
    """A pusher whose acknowledgement handshake budget never refills (its clock stands), and
    the sender that records what it sends."""
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher._ack_budget = pusher_module._HandshakeBudget(
        pusher_module.ACK_HANDSHAKES_PER_S, clock=lambda: 0.0
    )
    return sender, pusher


def flood_of_failing_strangers(directory: Directory, pusher: Pusher) -> None:
    """200 aborts of transfers never known, each naming a stranger whose handshake fails: they
    take the acknowledgement handshakes' budget and wait for their next try."""
    for n in range(200):
        port = 20000 + n
        pusher.on_abort_write(AbortWrite(f"flood-{n}", f"s{n}:1/dp0/tp0", "127.0.0.1", port, port))
        for _, future in directory.pending:
            future.set_exception(TransportError("the stranger's handshake failed"))
        directory.pending = []


def test_an_abort_from_a_decode_written_to_before_needs_no_handshake_under_a_flood() -> None:
    """Decode rank 0 was written to, then its cached handshake went (the scripted directory
    caches nothing, as after an eviction at max_peers by a flood of aborts naming strangers'
    answering addresses), and such aborts took this second's acknowledgement handshakes. It
    then announces a request this prefill rank has not
    scheduled yet and aborts it (a client gave up while the prompt queued). Before: the
    acknowledgement needed a handshake, which waited behind the flood's for the budget, was
    given up among the flood's, and the decode kept the request's blocks quarantined for
    quarantine_timeout (300 s). Now it goes at once to the notify port that decode rank's
    handshake proved when this rank wrote to it; no handshake starts for it."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    sender, pusher = pusher_without_refill(ctx)
    write_one_request(ctx, directory, pusher, "tx-1")
    assert final_messages(sender) == [(8100, "write_done", "tx-1", 0)]
    flood_of_failing_strangers(directory, pusher)
    assert pusher._ack_budget.available() == 0
    pusher.on_remote_blocks(RemoteBlocks("tx-2", ((30, 31),), "d:8000/dp0/tp0", decode_tp_rank=0))
    pusher.on_abort_write(
        AbortWrite("tx-2", "d:8000/dp0/tp0", DECODE.host, DECODE.handshake_port, 8100)
    )
    assert final_messages(sender)[1:] == [(8100, "write_aborted", "tx-2", 0)]
    assert not directory.pending
    # The same engine id naming another rank still needs a handshake proving that rank.
    pusher.on_abort_write(
        AbortWrite(
            "tx-3", "d:8000/dp0/tp0", DECODE.host, 8000, 8100, decode_tp_rank=1, decode_tp_size=2
        )
    )
    assert len(final_messages(sender)) == 2


def test_an_acknowledgement_waiting_for_a_handshake_goes_once_its_rank_is_proven() -> None:
    """A flood of aborts naming strangers took this second's acknowledgement handshakes; then
    decode rank 0, never written to, aborts a request this prefill rank does not have yet, so
    its acknowledgement waits for a handshake among the flood's. The prefill then writes
    another request into that rank: its handshake proves the rank. Before: the waiting
    acknowledgement still waited for the budget (a pass tries only as many as handshakes may
    start), behind the flood's, and the decode kept the blocks quarantined. Now proving a rank
    sends the acknowledgements waiting for it, at once, without a handshake."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    sender, pusher = pusher_without_refill(ctx)
    flood_of_failing_strangers(directory, pusher)
    pusher.on_abort_write(
        AbortWrite("tx-0", "d:8000/dp0/tp0", DECODE.host, DECODE.handshake_port, 8100)
    )
    assert not directory.pending and not final_messages(sender)
    assert len(pusher._ack_retries) == 201
    write_one_request(ctx, directory, pusher, "tx-1")
    assert final_messages(sender) == [
        (8100, "write_aborted", "tx-0", 0),
        (8100, "write_done", "tx-1", 0),
    ]
    assert len(pusher._ack_retries) == 200  # the flood's, still waiting for handshakes
    assert pusher._ack_retries.take_naming(("d:8000/dp0/tp0", 0, 0, 1, 8100)) == []  # sent once


def test_an_acknowledgements_handshake_sends_the_others_waiting_for_that_rank() -> None:
    """Two aborts of decode rank 0 (never written to) for requests this prefill rank does not
    have: the first one's handshake starts; a stranger's takes the last acknowledgement
    handshake slot, so the second waits. When the first handshake proves the rank, both are
    acknowledged there, once each, and nothing waits for that rank any more; the stranger's
    handshake is still its own."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)

    def abort(tid: str) -> None:
        pusher.on_abort_write(
            AbortWrite(tid, "d:8000/dp0/tp0", DECODE.host, DECODE.handshake_port, 8100)
        )

    abort("tx-a")
    pusher.on_abort_write(AbortWrite("flood-0", "s0:1/dp0/tp0", "127.0.0.1", 20000, 20000))
    abort("tx-b")
    assert [key.handshake_port for key, _ in directory.pending] == [8000, 20000]
    assert len(pusher._ack_retries) == 1  # tx-b: no slot
    key, future = directory.pending.pop(0)
    future.set_result(peer_at(key, DECODE, 0, 1, "WRITE"))
    assert sorted(final_messages(sender)) == [
        (8100, "write_aborted", "tx-a", 0),
        (8100, "write_aborted", "tx-b", 0),
    ]
    assert len(pusher._ack_retries) == 0
    assert [key.handshake_port for key, _ in directory.pending] == [20000]


def test_a_remembered_decode_rank_is_not_acknowledged_at_a_port_it_no_longer_has() -> None:
    """Decode rank dp1/tp0 of TP 1 was written to (its notify port 8101); then the decode
    restarted under the same address as TP 2: the same engine ids (vLLM's name the address and
    the ranks), but dp1/tp0 now listens on 8102, and 8101 is dp0/tp1's. Its abort of a request
    this rank never had names TP 2. Before: the write_aborted went to the remembered 8101, to
    another rank that may wait for this rank's writes of that transfer, and the aborting rank's
    blocks stayed quarantined. Now a remembered rank counts only where the abort's own fields
    put it (its TP size and notify port); here a handshake proves the rank first."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    engine_id = "d:8000/dp1/tp0"
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2), 2, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(
        RemoteBlocks("tx-1", ((20, 21),), engine_id, decode_dp_rank=1, decode_tp_rank=0)
    )

    def answer(tp_size: int) -> None:
        key, future = directory.pending.pop(0)
        assert key.handshake_port == rank_port(DECODE.handshake_port, 1, 0, tp_size)
        response = HandshakeResponse(
            engine_id,
            b"meta",
            1,
            0,
            2,
            tp_size,
            "WRITE",
            total_kv_heads=8,
            incarnation=incarnation(tp_size),
        )
        notify = rank_port(DECODE.notify_port, 1, 0, tp_size)
        future.set_result(Peer(Handshake(key, engine_id, response, asked_at=0.0), notify))

    answer(1)
    assert pusher._written_ranks[engine_id].notify_port == 8101
    pusher.on_abort_write(
        AbortWrite(
            "tx-9", engine_id, DECODE.host, 8000, 8100, 1, decode_tp_rank=0, decode_tp_size=2
        )
    )
    assert final_messages(sender) == []
    answer(2)
    assert final_messages(sender) == [(8102, "write_aborted", "tx-9", 0)]


def test_a_prefill_rank_no_decode_rank_needs_frees_when_the_request_ends() -> None:
    ctx, _, _, _ = context("write", producer=True, tp_rank=1, tp_size=4, heads=2)
    pusher = Pusher(ctx)
    save = SaveTask("req-1", "tx-8", (1, 2), 2, DECODE, remote_tp_size=2)
    pusher.begin_step([save], [])
    assert not pusher.job_states()
    pusher.begin_step([], [SendTask("req-1", "tx-8")])
    assert ctx.reports.done_sending == {"req-1"}


def run_writer(ctx: Context, pusher: Pusher) -> None:
    """Let the writer thread post everything queued, then stop it."""
    thread = threading.Thread(target=pusher.writer_loop)
    thread.start()
    deadline = time.monotonic() + 10
    while not pusher._writer_q.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the last op taken is posted under the lock
    ctx.stop.set()
    thread.join(5)


GROUPS = (
    KvGroup(kind="full", block_size=16, layers=("attn.0",), element_types=("bfloat16",)),
    KvGroup(
        kind="sliding",
        block_size=16,
        layers=("attn.1",),
        element_types=("bfloat16",),
        sliding_window=32,
    ),
)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_different_tp_sizes_with_several_groups_are_refused_before_any_network(
    mode: str,
) -> None:
    """A decode rank of TP 1 with two KV-cache groups and a prefill of TP 2: the load fails at
    once naming both TP sizes and the groups; no handshake starts, the request is recomputed."""
    ctx, directory, _, engine = context(mode, producer=False, tp_rank=0, tp_size=1)
    ctx.cfg = dataclasses.replace(ctx.cfg, groups=GROUPS)
    remote = ((3, 4), (0, 5)) if mode == "read" else ()  # WRITE: the prefill's ids come later
    grouped = GroupedBlocks(((10, 11), (0, 12)), remote, 0, 20)
    task = RecvTask(
        "req-1", "tx-1", PREFILL, "p:7000", 0, 2, (10, 11, 12), grouped=grouped, report_done=True
    )
    Puller(ctx).start(task)
    assert "req-1" in ctx.reports.failed_recving
    why = ctx.reports.failures["req-1"]
    assert "prefill TP 2 and decode TP 1 differ" in why
    assert "2 KV-cache groups (group 0 (full, block size 16" in why
    assert "group 1 (sliding, block size 16, window 32" in why
    assert not directory.pending and not engine.calls
    # Equal TP sizes plan as before.
    assert ctx.tp_plan("127.0.0.1", 1, prefill=False).identity


class HandshakenDirectory(Directory):
    """Every decode rank handshaken already: connect returns a completed future, as the real
    directory does for a cached peer."""

    def answer(self, key: PeerKey) -> Future[Peer]:
        rank = key.handshake_port - DECODE.handshake_port
        future: Future[Peer] = Future()
        future.set_result(peer_at(key, DECODE, rank, 2, "WRITE"))
        return future


class ContendedLock:
    """A lock that says when a thread other than its holder starts waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited_for = threading.Event()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited_for.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_remote_blocks_of_a_handshaken_decode_never_feed_the_writer_under_the_lock() -> None:
    """Before: with the decode rank handshaken already, the connect continued inline, under the
    context lock the notify thread held for remote_blocks, and fed the writer there (the feed
    lock after the context lock), while the forward thread's step feeds it the other way round
    (the feed lock, then the context lock): the prefill deadlocked in vllm serve (WRITE 1->2)."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.directory = HandshakenDirectory()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher._feed = feed = ContendedLock()  # type: ignore[assignment]
    pusher.begin_step([SaveTask("req-1", "tx-9", (1, 2, 3), 3, DECODE, remote_tp_size=2)], [])
    got_context_lock: list[bool] = []

    def forward_thread_feeding() -> None:
        with feed:  # a step's feed_writer: it holds the feed lock and wants the context lock
            feed.waited_for.wait(10)  # the announcement now waits for the feed lock
            got = ctx.lock.acquire(timeout=5)
            got_context_lock.append(got)
            if got:
                ctx.lock.release()

    forward = threading.Thread(target=forward_thread_feeding)
    forward.start()
    announce = threading.Thread(
        target=pusher.on_remote_blocks,
        args=(RemoteBlocks("tx-9", ((20, 21, 22),), "d:8000/dp0/tp0", decode_tp_rank=0),),
    )
    announce.start()
    forward.join(20)
    announce.join(20)
    assert got_context_lock == [True], "the announcement fed the writer holding the context lock"
    assert pusher.job_states()["tx-9"] is JobState.WRITING
    # Nothing is written yet (the forward runs), but the job holds its decode peer.
    assert len(pusher.peers_in_use()) == 1


def test_an_announcement_for_a_request_that_cannot_be_written_is_told_write_failed() -> None:
    """The request still runs at the prefill, but its job failed when its save task came (a
    decode of another TP size, with two KV-cache groups: no plan). Before: the decode rank's
    later announcement found the job no longer PENDING and got no answer. Now it is told
    write_failed at once, with the reason, at its notify port; nothing is handshaken."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.cfg = dataclasses.replace(ctx.cfg, groups=GROUPS)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-7", "tx-7", (1, 2), 2, DECODE, remote_tp_size=2)], [])
    assert pusher.job_states() == {"tx-7": JobState.FAILED} and not final_messages(sender)
    pusher.on_remote_blocks(RemoteBlocks("tx-7", ((20, 21),), "d:8000/dp0/tp0"))
    assert final_messages(sender) == [(8100, "write_failed", "tx-7", 0)]
    (failed,) = [m for m in sender.sent if isinstance(m, WriteFailed)]
    assert "prefill TP 1 and decode TP 2 differ" in failed.reason
    assert not directory.pending and not engine.calls


def test_a_request_naming_a_huge_decode_tp_makes_few_jobs_and_ends_at_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a request whose kv_transfer_params named decode TP 65,536 (the largest they
    accept) made this TP 1 prefill rank a job per decode rank it names, at once, and their
    expiry re-checked the request's jobs at each one's end, under the context lock, in vLLM's
    engine step (34 s for 16,384 ranks). Now the client's number makes at most
    MAX_UNCONFIRMED_JOBS jobs until a handshake confirms it; the request ends at its
    abort_timeout with its blocks freed, and the log names remote_tp_size and the transfer."""
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    save = SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, remote_tp_size=65536)
    with caplog.at_level(logging.WARNING, logger="moriio_native.pd.pusher"):
        pusher.begin_step([save], [])
        assert len(pusher.job_states()) == pusher_module.MAX_UNCONFIRMED_JOBS
        pusher.forward_done([*DENSE, *WHOLE], None)
        pusher.begin_step([], [SendTask("req-1", "tx-1")])
        assert not ctx.reports.done_sending  # held for the decode ranks that may announce
        pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    assert ctx.reports.done_sending == {"req-1"} and not pusher.job_states()
    assert not directory.pending and not engine.calls and not final_messages(sender)
    named = [r.getMessage() for r in caplog.records if "remote_tp_size" in r.getMessage()]
    assert named and all("tx-1" in m and "65536" in m for m in named), caplog.text


class CountedStates(frozenset[JobState]):
    """JOB_TERMINAL that counts the membership checks made of it."""

    def __init__(self, states: frozenset[JobState]) -> None:
        self.checks = 0

    def __contains__(self, state: object) -> bool:
        self.checks += 1
        return super().__contains__(state)


def test_a_confirmed_large_fanout_writes_every_rank_and_each_job_end_costs_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill TP 1 -> decode TP 128 (each decode rank holds a replica of its heads): the first
    MAX_UNCONFIRMED_JOBS jobs wait for their ranks, the other ranks' announcements wait as
    orphans, and the first handshake (of the TP size the request named) makes their jobs, with
    the layers computed so far; every rank is written and sealed. Before: each job's end
    re-checked every job of the request (O(ranks^2) checks of terminal states for the request:
    8,256 here); now a count of the request's live jobs makes it a few checks per job."""
    decode_tp = 128
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, decode_tp)], [])
    for rank in range(decode_tp):
        pusher.on_remote_blocks(
            RemoteBlocks("tx-1", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    pusher.layer_saved("attn.0", None)  # before the handshake confirmed the decode's TP size
    assert answer_handshakes(directory, DECODE, decode_tp, "WRITE") == list(range(decode_tp))
    pusher.forward_done([*DENSE, *WHOLE], None)  # after it
    run_writer(ctx, pusher)
    jobs = ["tx-1", *(f"tx-1#d{rank}" for rank in range(1, decode_tp))]
    seals = sorted((c[1], c[3]) for c in engine.calls if c[0] == "seal")
    assert seals == sorted((job, 3) for job in jobs)
    written = {(c[1], c[2]) for c in engine.calls if c[0] == "write_layer"}
    assert written == {(job, layer) for job in jobs for layer in (*DENSE, *WHOLE)}

    terminal = CountedStates(pusher_module.JOB_TERMINAL)
    monkeypatch.setattr(pusher_module, "JOB_TERMINAL", terminal)
    pusher.begin_step([], [SendTask("req-1", "tx-1")])
    for job in jobs:
        pusher.on_event(event(job), drained=True)
    assert ctx.reports.done_sending == {"req-1"} and not pusher.job_states()
    assert terminal.checks <= 4 * decode_tp, f"{terminal.checks} checks for {decode_tp} jobs"
    done = [port - DECODE.notify_port for port, m in sender.ports if isinstance(m, WriteDone)]
    assert sorted(done) == list(range(decode_tp))


def test_the_plan_for_a_huge_tp_size_is_logged_in_one_short_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the first plan for a peer's TP size logged what this rank moves rank by rank:
    for the decode TP 65,536 a request may name, a 2.3 MB line that took 1.4 s to make, in
    vLLM's engine step. Now a plan past MAX_DESCRIBED_TP ranks is logged by its sizes alone;
    smaller ones are listed as before."""
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    with caplog.at_level(logging.INFO, logger="moriio_native.pd.context"):
        ctx.tp_plan(DECODE.host, 65536, prefill=True)
        ctx.tp_plan(DECODE.host, 2, prefill=True)
    huge, small = (r.getMessage() for r in caplog.records)
    assert "prefill TP 1 -> decode TP 65536, 8 KV heads" in huge and len(huge) < 200, huge[:300]
    assert "[4, 8) to decode rank 1" in small


def test_releases_from_ranks_whose_jobs_wait_for_the_tp_confirmation_end_those_jobs() -> None:
    """Prefill TP 1 -> decode TP 32: the jobs of decode ranks 16-31 wait for a handshake to
    confirm the size. Decode rank 30 released before the request reached the prefill and rank
    20 after its save task, both before the confirmation (each gave up): their jobs, made when
    it comes, end at once, released (no write_failed owed), instead of waiting for the
    abort_timeout; the others go on."""
    decode_tp = 32
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_release(Release("tx-1", consumer_tp_size=decode_tp, consumer_tp_rank=30))
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, decode_tp)], [])
    pusher.on_release(Release("tx-1", consumer_tp_size=decode_tp, consumer_tp_rank=20))
    pusher.begin_step([], [SendTask("req-1", "tx-1")])
    pusher.on_remote_blocks(RemoteBlocks("tx-1", ((20, 21, 22),), "d:8000/dp0/tp0"))
    assert answer_handshakes(directory, DECODE, decode_tp, "WRITE") == [0]
    states = pusher.job_states()
    assert len(states) == decode_tp
    assert states["tx-1#d20"] is states["tx-1#d30"] is JobState.FAILED
    assert states["tx-1"] is JobState.WRITING
    assert all(states[f"tx-1#d{rank}"] is JobState.PENDING for rank in (1, 19, 21, 31))
    assert not final_messages(sender)


@pytest.mark.parametrize("ending", ["aborted", "unconfirmed"])
def test_ranks_held_back_for_the_tp_confirmation_are_told_write_failed_when_the_request_ends(
    ending: str,
) -> None:
    """Prefill TP 1 -> decode TP 32: the jobs of decode ranks 16-31 wait for a handshake to
    confirm the size, and the request ends before one does -- aborted, or every made job's
    handshake failing (nothing answers at the decode's ports). Before: a held-back rank that
    had announced its blocks (kept as an orphan) and one announcing after the end got no answer
    at all, so each held those blocks until its own timeout (and the orphan stayed). Now each
    is told write_failed, once, with the reason, at its notify port, and an abort_write from
    one is acknowledged at once; ranks that never announce are owed nothing."""
    decode_tp = 32
    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    announce = [
        RemoteBlocks("tx-1", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        for rank in range(decode_tp)
    ]
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, decode_tp)], [])
    for rank in (0, 3, 20):  # a made job's rank and a held-back one's announce before the end
        pusher.on_remote_blocks(announce[rank])
    if ending == "aborted":
        pusher.begin_step([], [SendTask("req-1", "tx-1", aborted=True)])
    else:
        while directory.pending:
            _, future = directory.pending.pop(0)
            future.set_exception(TransportError("no reply"))
        pusher.forward_done([*DENSE, *WHOLE], None)
        pusher.begin_step([], [SendTask("req-1", "tx-1")])
        pusher.check_timeouts(time.monotonic() + ctx.cfg.abort_timeout + 1)
    assert ctx.reports.done_sending == {"req-1"} and not pusher.job_states()
    for rank in (3, 20, 25, 31):  # (and again: each rank is answered once)
        pusher.on_remote_blocks(announce[rank])
        pusher.on_remote_blocks(announce[rank])
    abort = AbortWrite("tx-1", "d:8000/dp0/tp28", "d", 9000, 9100, 0, 28, decode_tp)
    pusher.on_abort_write(abort)
    pusher.on_abort_write(abort)
    acked = [port - DECODE.notify_port for port, m in sender.ports if isinstance(m, WriteAborted)]
    assert acked == [28]
    failed = sorted(
        (port - DECODE.notify_port, m.reason)
        for port, m in sender.ports
        if isinstance(m, WriteFailed)
    )
    assert [rank for rank, _ in failed] == [0, 3, 20, 25, 31]
    assert all(reason for _, reason in failed), failed
    held_back = [reason for rank, reason in failed if rank >= pusher_module.MAX_UNCONFIRMED_JOBS]
    assert all("decode TP size 32" in reason for reason in held_back), held_back
    assert not [c for c in engine.calls if c[0] == "write_layer"]


def test_a_held_back_rank_that_announced_and_aborted_gets_one_answer() -> None:
    """A made job's rank that announced and then aborted is answered write_aborted alone (its
    abort settles it). Before: a held-back rank in the same place (its orphan had both) was
    also told write_failed when the request ended, two answers for one transfer (found by a
    review). Now it gets the write_aborted only, as a made job's rank does."""
    decode_tp = 32
    ctx, _, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, decode_tp)], [])
    for rank in (3, 20):  # 3: a made job's rank; 20: one held back for the TP confirmation
        pusher.on_remote_blocks(
            RemoteBlocks("tx-1", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
        pusher.on_abort_write(
            AbortWrite("tx-1", f"d:8000/dp0/tp{rank}", "d", 9000, 9100, 0, rank, decode_tp)
        )
    pusher.begin_step([], [SendTask("req-1", "tx-1", aborted=True)])
    assert not [m for _, m in sender.ports if isinstance(m, WriteFailed)]


def test_a_write_whose_drain_notice_came_first_still_ends_after_an_event_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review of the fix for WRITE event errors: the error path told the pusher the
    event's own ``drained`` (False) although the drain notice had come first and been taken
    already, so the job waited in DRAINING, which has no deadline, for a notice that would
    never come again: the blocks were held for good, the decode never told. Now the error path
    is told what the event's handling was."""
    ctx, directory, _, _ = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    core = SimpleNamespace(ctx=ctx, puller=Puller(ctx), pusher=pusher, _drained_jobs=set())
    for name in ("_handle_event", "_on_event_error", "_on_drained"):
        setattr(core, name, getattr(PdCore, name).__get__(core))
    pusher.begin_step([SaveTask("req-1", "tx-9", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(RemoteBlocks("tx-9", ((20, 21, 22),), "d:8000/dp0/tp0"))
    answer_handshakes(directory, DECODE, 1, "WRITE")
    for layer in (*DENSE, *WHOLE):
        pusher.layer_saved(layer, None)
    pusher.forward_done([*DENSE, *WHOLE], None)
    run_writer(ctx, pusher)
    pusher.begin_step([], [SendTask("req-1", "tx-9")])  # the request finished
    assert pusher._jobs["tx-9"].state is JobState.SEALED
    # The drain notice overtakes the undrained timed_out event.
    core._on_drained(SimpleNamespace(transfer_id="tx-9", seconds=0.1))
    assert core._drained_jobs == {"tx-9"}
    calls = break_first_call(monkeypatch, pusher, "on_event")
    core._handle_event(event("tx-9", "timed_out", drained=False))
    assert calls and calls[0][1] is True  # the pusher was told: drained
    assert "tx-9" not in pusher._jobs or pusher._jobs["tx-9"].state is JobState.FAILED
    assert [m for _, m in sender.ports if isinstance(m, WriteFailed)]
    assert ctx.reports.done_sending == {"req-1"}


def test_writes_staged_when_a_handshake_ends_on_the_thread_that_asked_for_it_are_fed() -> None:
    """Prefill TP 1 -> decode TP 32 (MAX_UNCONFIRMED_JOBS = 16): decode ranks 0 and 16 both
    announced, the forward ended. A handshake pool thread completes rank 0's handshake: its
    callback (_connected -> _confirm_decode_tp) makes rank 16's job, which asks for rank 16's
    handshake FROM THAT POOL THREAD (Pusher._connect records it as ``caller``). The same pool
    thread then runs rank 16's handshake (the next task it takes): _connected gets
    ``feed = get_ident() != caller`` == False, so rank 16's writes and seal stay in
    ``_staged`` -- nobody feeds them to the writer (the prefill may have no more steps or
    messages). The job then sat in WRITING until abort_timeout failed it (found by a review,
    2026-12-07; seen failing)."""
    decode_tp = 32
    ctx, directory, _, _engine = context("write", producer=True, tp_rank=0, tp_size=1)
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, decode_tp)], [])
    for rank in (0, 16):
        pusher.on_remote_blocks(
            RemoteBlocks("tx-1", ((20, 21, 22),), f"d:8000/dp0/tp{rank}", decode_tp_rank=rank)
        )
    pusher.forward_done([*DENSE, *WHOLE], None)  # the step is over: no hook feeds any more

    # One handshake pool thread completes the pending handshakes in turn (rank 0's, whose
    # callback asks for rank 16's from this thread, then rank 16's).
    ranks: list[int] = []
    pool_thread = threading.Thread(
        target=lambda: ranks.extend(answer_handshakes(directory, DECODE, decode_tp, "WRITE"))
    )
    pool_thread.start()
    pool_thread.join(5)
    assert not pool_thread.is_alive()
    assert ranks == [0, 16], ranks
    states = pusher.job_states()
    assert states["tx-1"] is JobState.SEALED and states["tx-1#d16"] is JobState.SEALED

    # What the writer thread can see: the queue. Nothing else calls feed_writer now.
    queued = []
    while not pusher._writer_q.empty():
        queued.append(pusher._writer_q.get_nowait())
    queued_jobs = sorted({job.transfer_id for _, job, _, _ in queued})
    stranded = [(op, job.transfer_id) for op, job, _, _ in pusher._staged]
    assert queued_jobs == ["tx-1", "tx-1#d16"] and not stranded, (
        f"writer queue holds ops of {queued_jobs}; staged but never fed: {stranded}"
    )


def test_a_write_check_queued_at_verifier_shutdown_still_gets_its_verdict() -> None:
    """Verifier.check_write / for_write_done queue their work on a DaemonPool of CHECK_THREADS
    threads. Verifier.shutdown (PdCore.shutdown) cancels the queued tasks: the task that would
    call ``verdict`` / ``done`` never runs, and nothing else calls it (no _when_dropped as
    PeerDirectory uses, no done-callback as check_read uses: "one cancelled at shutdown still
    gets its verdict"). The decode's WRITE part stays VERIFYING and the prefill's job stays
    CHECKSUMMING for good: neither reached a terminal state (found by a review, 2026-12-07;
    seen failing)."""
    from moriio_native.control.security import ControlSecurity
    from moriio_native.pd import verify as verify_module

    busy = threading.Event()
    release = threading.Event()
    started = []

    class SlowSums:
        layers = ("attn.0",)

        def compute(self, block_ids: Any, window: Any = None) -> dict[str, bytes]:
            started.append(block_ids)
            busy.set()
            release.wait(10)
            return {"attn.0": b"x" * 8}

    security = ControlSecurity.from_config({"allowed_peers": ["127.0.0.1/32"]})
    verifier = verify_module.Verifier(lambda: SlowSums(), security, "d:1/dp0/tp0", timeout=5.0)
    verdicts: dict[str, object] = {}
    sums_done: dict[str, object] = {}
    try:
        # Occupy every check thread, then queue one more of each kind behind them.
        for i in range(verify_module.CHECK_THREADS):
            verifier.check_write(f"busy-{i}", {"attn.0": b"x" * 8}, [i], lambda why: None)
        verifier.check_write(
            "queued-check", {"attn.0": b"x" * 8}, [99], lambda why: verdicts.update(q=why)
        )
        verifier.for_write_done(
            "queued-sums", [98], lambda sums, why: sums_done.update(q=(sums, why))
        )
        deadline = time.monotonic() + 5
        while len(started) < verify_module.CHECK_THREADS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == verify_module.CHECK_THREADS
        verifier.shutdown()
    finally:
        release.set()
    deadline = time.monotonic() + 3
    while (not verdicts or not sums_done) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "q" in verdicts, "check_write queued at shutdown: its verdict never came"
    assert "q" in sums_done, "for_write_done queued at shutdown: its done never came"


def test_a_part_posted_while_its_sibling_failed_is_aborted() -> None:
    """Decode TP 1 reading from prefill TP 2: two parts. Part 1's handshake is done and its
    pool thread is inside the engine's post (Puller._post_read -> _post_part: it passed the
    ``read.failing`` check, its state is still CONNECTING). Meanwhile part 0's handshake fails:
    _stop_other_parts marks the load failing and aborts the parts it finds READING -- not
    part 1 (still CONNECTING). Part 1's post then returns and advances it to READING; nothing
    looks at ``read.failing`` again, so part 1's READ is never aborted: the failed load's report
    (and the prefill's release) waits for part 1's READ to end on its own -- a stalled prefill
    holds it up to the engine's transfer_timeout. Docstring of _stop_other_parts: "the other
    parts posted are aborted ... and those not posted yet will not be" (found by a review,
    2026-12-07; seen failing)."""
    in_post = threading.Event()
    go_on = threading.Event()

    class SlowPartOne(Engine):
        def _maybe_wait(self, tid: str) -> None:
            if tid.endswith("p1"):
                in_post.set()
                go_on.wait(5)

        def read(self, tid: str, peer: str, local: Any, remote: Any) -> None:
            self._maybe_wait(tid)
            super().read(tid, peer, local, remote)

        def read_segments(self, tid: str, peer: str, segments: Any) -> None:
            self._maybe_wait(tid)
            super().read_segments(tid, peer, segments)

    ctx, directory, _, _ = context("read", producer=False, tp_rank=0, tp_size=1)
    engine = SlowPartOne()
    ctx.engine = lambda: engine  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task("tx-2", 2))
    pending = {k.handshake_port - PREFILL.handshake_port: f for k, f in directory.pending}
    keys = {k.handshake_port - PREFILL.handshake_port: k for k, _ in directory.pending}
    assert sorted(pending) == [0, 1]

    # Part 1's handshake completes on a pool thread, which then posts its READ (held there).
    pool_thread = threading.Thread(
        target=lambda: pending[1].set_result(peer_at(keys[1], PREFILL, 1, 2, "READ"))
    )
    pool_thread.start()
    try:
        assert in_post.wait(5)
        pending[0].set_exception(TransportError("prefill rank 0 unreachable"))  # part 0 fails
    finally:
        go_on.set()
    pool_thread.join(5)
    assert not pool_thread.is_alive()
    posted = [c for c in engine.calls if c[0] in ("read", "read_segments")]
    assert [c[1] for c in posted] == ["tx-2#p1"], engine.calls
    aborted = [c[1] for c in engine.calls if c[0] == "abort"]
    assert aborted == ["tx-2#p1"], (
        f"part 1's READ was posted after its sibling failed and never aborted: {engine.calls}"
    )
