"""The puller and the pusher against a scripted peer directory and sender (no network, no
vLLM): the review findings on the old worker, each pinned down."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.channel import RateLimitedWarnings
from moriio_native.control.messages import (
    AbortWrite,
    HandshakeResponse,
    Release,
    RemoteBlocks,
    WriteAborted,
)
from moriio_native.errors import IncompatiblePeerError, TransportError
from moriio_native.pd import pusher as pusher_module
from moriio_native.pd.config import PdConfig
from moriio_native.pd.context import Context
from moriio_native.pd.core import PdCore
from moriio_native.pd.peers import Handshake, Peer, PeerKey
from moriio_native.pd.puller import PROBE_FAILURES_FOR_DEATH, AwaitState, Puller
from moriio_native.pd.pusher import Pusher
from moriio_native.pd.tasks import RecvTask, SaveTask, SendTask

PREFILL = ZmqAddress("127.0.0.1", 7000, 7100)


class Directory:
    """Hands out futures the test completes; probes answer from a script."""

    def __init__(self) -> None:
        self.pending: list[tuple[PeerKey, Future[Peer]]] = []
        self.probe_answers: list[str] = []
        self.probes = 0

    def connect(
        self,
        key: PeerKey,
        notify_port: int,
        validate: Any,
        *,
        expect: Any = None,
        incarnation: str = "",
        recover: bool = False,
    ) -> Future[Peer]:
        return self.answer(key)

    def check_current(self, peer: Peer) -> None:
        """No connection is ever replaced here: every post goes ahead."""

    @contextlib.contextmanager
    def posting(self, peer: Peer) -> Iterator[None]:
        yield

    def answer(self, key: PeerKey) -> Future[Peer]:
        """The handshake of ``key``: pending until the test completes it."""
        future: Future[Peer] = Future()
        self.pending.append((key, future))
        return future

    def probe(self, peer: Peer) -> Future[str]:
        self.probes += 1
        future: Future[str] = Future()
        future.set_result(self.probe_answers.pop(0))
        return future

    def forget(self, peer: Peer | None) -> None:
        pass

    def find_engine(self, engine_id: str) -> Peer | None:
        return None


class Sender:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, host: str, port: int, message: Any) -> None:
        self.sent.append(message)


class Stats:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def context(
    mode: str, *, producer: bool, engine: Any = None, **settings: Any
) -> tuple[Context, Directory, Sender]:
    """A rank's context over a scripted directory and sender; ``settings`` override the
    PdConfig's."""
    directory, sender = Directory(), Sender()
    fields: dict[str, Any] = {
        "engine_id": "d:1/dp0/tp0",
        "mode": mode,
        "producer": producer,
        "consumer": not producer,
        "host_ip": "127.0.0.1",
        "handshake_port": 8000,
        "notify_port": 8100,
        "quarantine_timeout": 3600,
    }
    cfg = PdConfig(**{**fields, **settings})
    ctx = Context(
        cfg=cfg,
        engine=lambda: engine,
        sender=sender,  # type: ignore[arg-type]
        directory=directory,  # type: ignore[arg-type]
        stats=Stats(),
        mark_terminal=lambda tid: None,
    )
    return ctx, directory, sender


def break_first_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """``owner.name`` raises on its first call (a defect of ours, injected) and works after;
    the calls' arguments are recorded in the list returned."""
    method = getattr(owner, name)
    calls: list[Any] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError(f"{name} broke")
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, broken)
    return calls


def peer(key: PeerKey) -> Peer:
    response = HandshakeResponse("p:7000/dp0/tp0", b"meta", 0, 0, 1, 1, "WRITE")
    return Peer(Handshake(key, "p:7000/dp0/tp0", response, asked_at=0.0), 7100)


def quarantined_await() -> tuple[Puller, Context, Directory]:
    ctx, directory, sender = context("write", producer=False)
    puller = Puller(ctx)
    task = RecvTask("req-1", "tx-1", PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5))
    puller.start(task)
    key, future = directory.pending.pop()
    future.set_result(peer(key))  # handshake done: remote_blocks goes out
    assert isinstance(sender.sent[-1], RemoteBlocks)
    puller.give_up("tx-1", "test gave up")
    assert isinstance(sender.sent[-1], AbortWrite)
    assert puller.await_states() == {"tx-1": AwaitState.QUARANTINED}
    return puller, ctx, directory


def notify_core(ctx: Context, puller: Puller) -> Any:
    """What PdCore._on_message needs of a core: a decode rank's, over ``puller``."""
    warnings = RateLimitedWarnings(logging.getLogger("moriio_native.pd.core"), "notify")
    return SimpleNamespace(cfg=ctx.cfg, puller=puller, _stray=warnings)


def test_a_write_aborted_naming_another_decode_rank_does_not_end_the_wait() -> None:
    """Found by a review: a prefill acknowledges an abort_write of a transfer it has no job of
    for the rank it names at the notify port the message names, which can be another rank's:
    one that aborted the same transfer and waits while the prefill's writes into it drain.
    write_aborted named no decode rank, so that rank freed its blocks at once (the writes could
    still land in them, now another request's). Now it names the rank it acknowledges, and any
    other rank ignores it."""
    puller, ctx, _ = quarantined_await()
    core = notify_core(ctx, puller)
    PdCore._on_message(core, WriteAborted("tx-1", "d:9/dp0/tp1"))
    assert puller.await_states() == {"tx-1": AwaitState.QUARANTINED}
    assert not ctx.reports.failed_recving and not ctx.reports.invalid_blocks
    PdCore._on_message(core, WriteAborted("tx-1", ctx.cfg.engine_id))
    assert puller.await_states() == {}
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}


def test_one_failed_probe_does_not_free_a_quarantined_write() -> None:
    """Before: one failed re-handshake of the prefill was taken as its death, and blocks it
    may still write were handed back to vLLM."""
    puller, ctx, directory = quarantined_await()
    directory.probe_answers = ["it is unreachable (timeout)"] * PROBE_FAILURES_FOR_DEATH
    now = time.monotonic()
    for probe in range(1, PROBE_FAILURES_FOR_DEATH):
        now += 10
        puller.check_timeouts(now)
        assert directory.probes == probe
        assert puller.await_states() == {"tx-1": AwaitState.QUARANTINED}, probe
        assert not ctx.reports.done_recving
    now += 10
    puller.check_timeouts(now)  # the last failure in a row: the prefill is dead
    assert puller.await_states() == {}
    assert ctx.reports.failed_recving == {"req-1"} and ctx.reports.invalid_blocks == {4, 5}


def test_an_answering_probe_resets_the_count_and_a_restart_frees_at_once() -> None:
    puller, ctx, directory = quarantined_await()
    directory.probe_answers = ["it is unreachable (timeout)", "", "it is unreachable (timeout)"]
    now = time.monotonic()
    for _ in range(3):
        now += 10
        puller.check_timeouts(now)
    assert puller.await_states() == {"tx-1": AwaitState.QUARANTINED}  # 1, then 0, then 1
    directory.probe_answers = ["it restarted as another engine (p:7000/dp0/tp0)"]
    puller.check_timeouts(now + 10)
    assert puller.await_states() == {}
    assert ctx.reports.failed_recving == {"req-1"}


def test_abort_write_for_unknown_transfers_holds_bounded_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: every abort_write (unauthenticated without a shared secret) created a job that
    lived until abort_timeout, however many arrived."""
    monkeypatch.setattr(pusher_module, "MAX_EARLY_MESSAGES", 8)
    ctx, _, _ = context("write", producer=True)
    pusher = Pusher(ctx)
    for i in range(50):
        pusher.on_abort_write(AbortWrite(f"tx-{i}", "d:9000/dp0/tp0", "127.0.0.1", 9000, 9100))
    assert len(pusher.job_states()) <= 8
    # The newest ones are kept (a real abort that overtook its request still gets its answer).
    assert "tx-49" in pusher.job_states()


def test_early_releases_at_their_bound_add_no_objects_to_the_garbage_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: each release of a transfer the prefill does not know yet (one that overtook its
    request, or a flood's) was kept as a tuple, a dataclass and a set, all tracked by the cyclic
    garbage collector, so a flood that filled the memory to its bound lengthened every full
    collection of the process (3 objects per record; with vLLM loaded a full collection already
    takes tens of ms). Now the records add a constant number of tracked objects however many
    there are, and still do their work: the newest are kept, the send task of a released
    transfer frees at once, that of a forgotten one waits for its release."""
    bound = 4096
    monkeypatch.setattr(pusher_module, "MAX_EARLY_MESSAGES", bound)
    ctx, _, _ = context("read", producer=True, tp_size=1)
    pusher = Pusher(ctx)
    pusher.on_release(Release("tx-warm-up"))  # the first record's one-off allocations
    gc.collect()
    before = len(gc.get_objects())
    for i in range(2 * bound):
        pusher.on_release(Release(f"tx-{i}"))
    gc.collect()
    added = len(gc.get_objects()) - before
    assert len(pusher._early_releases) == bound
    assert added < 64, f"{added} more tracked objects for {bound} early releases"
    pusher.begin_step([], [SendTask("req-new", f"tx-{2 * bound - 1}"), SendTask("req-old", "tx-0")])
    assert ctx.reports.done_sending == {"req-new"}


def test_orphan_jobs_at_their_bound_add_no_objects_to_the_garbage_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: each remote_blocks of a request a WRITE-mode prefill has not seen yet (one that
    overtook its request, or a flood's) was kept as a whole job -- a dataclass, its state
    machine, lists, a set, a dict and the message -- all tracked by the cyclic garbage
    collector, so a flood that filled the orphans to their bound lengthened every full
    collection of the process, as the early releases did. Now the orphans, also those a
    release or an abort_write then ended, add a constant number of tracked objects however
    many there are, and still do their work: the newest are kept, a save task continues an
    announced one (its handshake starts), one the decode released or aborted stays failed,
    and an abort_write is acknowledged as before."""
    bound = 4096
    monkeypatch.setattr(pusher_module, "MAX_EARLY_MESSAGES", bound)
    # Each failed orphan logs a warning, and pytest's log capture keeps every record.
    monkeypatch.setattr(pusher_module.logger, "disabled", True)
    ctx, directory, _ = context("write", producer=True, tp_size=1)
    pusher = Pusher(ctx)

    def announce(tid: str) -> None:
        pusher.on_remote_blocks(RemoteBlocks(tid, ((20, 21, 22),), "d:9000/dp0/tp0"))

    def abort(tid: str) -> None:
        pusher.on_abort_write(AbortWrite(tid, "d:9000/dp0/tp0", "127.0.0.1", 9000, 9100))

    announce("tx-warm-up")  # the first orphan's one-off allocations
    pusher.on_release(Release("tx-warm-up"))
    abort("tx-warm-up")
    directory.pending.clear()
    gc.collect()
    before = len(gc.get_objects())
    for i in range(2 * bound):
        announce(f"tx-{i}")
        if i % 4 == 1:
            pusher.on_release(Release(f"tx-{i}"))
        elif i % 4 == 2:
            abort(f"tx-{i}")
    # An abort of a transfer never known: a handshake proves its rank, at most
    # MAX_ACK_HANDSHAKES at once (the warm-up's holds one: none of these futures completes), the
    # others wait to be tried again (1,024 at most, as wire bytes and times).
    acks = len(directory.pending)
    directory.pending.clear()
    gc.collect()
    added = len(gc.get_objects()) - before
    states = pusher.job_states()
    assert len(states) == bound and "tx-0" not in states and f"tx-{2 * bound - 1}" in states
    assert acks == pusher_module.MAX_ACK_HANDSHAKES - 1
    assert len(pusher._ack_retries) == pusher_module.MAX_ACK_RETRIES
    assert added < 64, f"{added} more tracked objects for {bound} orphan jobs"
    last = 2 * bound - 4
    assert [states[f"tx-{last + k}"] for k in range(3)] == [
        pusher_module.JobState.PENDING,
        pusher_module.JobState.FAILED,
        pusher_module.JobState.FAILED,
    ]
    decode = ZmqAddress("127.0.0.1", 9000, 9100)
    saves = [SaveTask(f"req-{k}", f"tx-{last + k}", (1, 2, 3), 3, decode, 1) for k in range(3)]
    pusher.begin_step(saves, [])
    assert [key.handshake_port for key, _ in directory.pending] == [9000]  # tx-{last} goes on
    assert pusher.job_states()[f"tx-{last}"] is pusher_module.JobState.CONNECTING
    pusher.begin_step([], [SendTask(f"req-{k}", f"tx-{last + k}") for k in (1, 2)])
    assert ctx.reports.done_sending == {"req-1", "req-2"}


def test_messages_of_requests_not_seen_log_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: each abort_write, release or empty announcement that ended an orphan job (any
    sender may send them, naming any transfer) logged a warning, and each abort the prefill could
    not acknowledge a second one, so a flood of them flooded the log: 800 lines for 200 of
    each. Now both are rate limited like the listeners' drops (at most 20 lines per 10 s each,
    then a line with the count); every abort is still answered or tried (a handshake, at most
    MAX_ACK_HANDSHAKES at once, or a place among those tried again)."""
    ctx, directory, _ = context("write", producer=True, tp_size=1)
    pusher = Pusher(ctx)
    with caplog.at_level(logging.WARNING, logger="moriio_native.pd.pusher"):
        for i in range(200):
            pusher.on_abort_write(AbortWrite(f"tx-{i}", "d:9000/dp0/tp0", "127.0.0.1", 9000, 9100))
            pusher.on_remote_blocks(RemoteBlocks(f"tx-e{i}", ((),), "d:9000/dp0/tp0"))
            pusher.on_remote_blocks(RemoteBlocks(f"tx-r{i}", ((7,),), "d:9000/dp0/tp0"))
            pusher.on_release(Release(f"tx-r{i}"))
        assert len(directory.pending) == pusher_module.MAX_ACK_HANDSHAKES
        assert len(pusher._ack_retries) == 200 - pusher_module.MAX_ACK_HANDSHAKES
        for _, future in directory.pending:
            future.set_exception(TransportError("127.0.0.1:9000 does not answer"))
    lines = [r for r in caplog.records if r.name == "moriio_native.pd.pusher"]
    assert len(lines) <= 2 * 20, f"{len(lines)} lines logged"
    states = pusher.job_states()
    assert len(states) == 600 and set(states.values()) == {pusher_module.JobState.FAILED}


def test_verify_refuses_a_peer_of_another_tp_size_at_handshake() -> None:
    """verify compares whole blocks, so a pair of different TP sizes is refused when the
    handshake answers, naming both sizes; with equal sizes the same answer is accepted."""
    ctx, _, _ = context("read", producer=False, verify=True, tp_size=1)
    key = PeerKey("127.0.0.1", 7000)
    other_tp = HandshakeResponse("p:7000/dp0/tp0", b"meta", 0, 0, 1, 2, "READ", verify=True)
    with pytest.raises(IncompatiblePeerError, match=r"TP 2, we run TP 1: 'verify'"):
        ctx.peer_check(key)(other_tp)
    same_tp = HandshakeResponse("p:7000/dp0/tp0", b"meta", 0, 0, 1, 1, "READ", verify=True)
    ctx.peer_check(key)(same_tp)


def test_heads_that_cannot_pair_are_refused_at_handshake() -> None:
    """Before: a peer of another TP size with the same KV heads passed the handshake although
    its heads cannot pair with ours (4 heads over TP 3); every transfer then failed when its
    plan was made. Now the handshake answer is refused, naming a split layer, the heads per
    rank and both TP sizes; a pair that can pair (TP 4 and 2) passes, from either side."""
    key = PeerKey("127.0.0.1", 7000)
    layers = {"split_layers": ("layers.0.attn", "layers.1.attn"), "total_kv_heads": 4}
    decode, _, _ = context("read", producer=False, tp_size=2, **layers)
    tp3 = HandshakeResponse("p:7000/dp0/tp0", b"meta", 0, 0, 1, 3, "READ", total_kv_heads=4)
    with pytest.raises(
        IncompatiblePeerError,
        match=r"layer layers\.0\.attn .* 1 of 4 KV heads per rank at prefill TP 3 and 2 per "
        r"rank at decode TP 2; the two cannot pair: .*neither divides",
    ):
        decode.peer_check(key)(tp3)
    prefill, _, _ = context("write", producer=True, tp_size=2, **layers)
    tp3_decode = HandshakeResponse("d:7000/dp0/tp0", b"meta", 0, 0, 1, 3, "WRITE", total_kv_heads=4)
    with pytest.raises(IncompatiblePeerError, match=r"at prefill TP 2 .* at decode TP 3"):
        prefill.peer_check(key)(tp3_decode)
    tp4 = HandshakeResponse("p:7000/dp0/tp0", b"meta", 0, 0, 1, 4, "READ", total_kv_heads=4)
    decode.peer_check(key)(tp4)
    tp1_decode = HandshakeResponse("d:7000/dp0/tp0", b"meta", 0, 0, 1, 1, "WRITE", total_kv_heads=4)
    prefill.peer_check(key)(tp1_decode)
    # Split layers whose heads neither side knows, or context parallelism here: refused too.
    unknown, _, _ = context("read", producer=False, tp_size=2, split_layers=("layers.0.attn",))
    tp1 = HandshakeResponse("p:7000/dp0/tp0", b"meta", 0, 0, 1, 1, "READ")
    with pytest.raises(IncompatiblePeerError, match=r"an unknown share .* not known"):
        unknown.peer_check(key)(tp1)
    cp, _, _ = context("read", producer=False, tp_size=2, context_parallel=True, **layers)
    with pytest.raises(IncompatiblePeerError, match="context parallelism"):
        cp.peer_check(key)(tp4)
