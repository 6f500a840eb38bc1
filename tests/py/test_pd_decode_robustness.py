"""The decode side (pd/puller.py, pd/core.py) when its own handlers fail or requests name ever
new peers: every load still ends exactly once, each prefill rank is released once, and no
memory grows without bound. Found by a review of the decode side (2026-12-06), each test seen
failing before its fix. Scripted directory, sender and engine as in test_pd_protocol.py and
test_pd_tp_fanout.py (no network, no vLLM)."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.messages import Release
from moriio_native.errors import TransportError
from moriio_native.pd.context import MAX_LOGGED_PLANS
from moriio_native.pd.core import PdCore
from moriio_native.pd.puller import Puller, ReadState
from moriio_native.pd.pusher import Pusher
from moriio_native.pd.tasks import RecvTask
from moriio_native.pd.verify import _submit_check
from moriio_native.pools import DaemonPool
from test_pd_protocol import PREFILL, break_first_call, peer
from test_pd_protocol import context as protocol_context
from test_pd_tp_fanout import PREFILL as FANOUT_PREFILL
from test_pd_tp_fanout import (
    PREFILL_HOLD_UNTIL_MS,
    Engine,
    answer_handshakes,
    context,
    event,
    incarnation,
    read_task,
)


def wait_for(predicate: Any, seconds: float) -> bool:
    """Whether ``predicate`` came true within ``seconds`` (the assertions then say what the
    state was, which a bare timeout would not)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class PoolChecks:
    """The verifier's / confirmer's real callback path (verify._submit_check on a DaemonPool:
    the verdict runs on a pool thread), with the network answer replaced by "agreed"."""

    def __init__(self) -> None:
        self.pool = DaemonPool(2, "review-checks")

    def confirm(
        self,
        tid: str,
        peer: Any,
        ids: Any,
        hold: int,
        verdict: Any,
        answer_ids: Any,
        answer_sizes: Any,
    ) -> None:
        _submit_check(self.pool, f"confirmation of transfer {tid}", lambda: None, verdict)

    def check_write(self, tid: str, checksums: Any, local: Any, verdict: Any) -> None:
        _submit_check(self.pool, f"integrity check of transfer {tid}", lambda: None, verdict)


# ---- a release sent once ----------------------------------------------------------------


def test_an_await_given_up_while_connecting_releases_the_prefill_once() -> None:
    """WRITE await: the request is aborted while the handshake is in flight (give_up: the part
    CONNECTING -> FAILED, release sent), then the handshake fails: the part is terminal
    already, and no second release goes out (before: _announce_failed sent it again)."""
    ctx, directory, sender = protocol_context("write", producer=False)
    puller = Puller(ctx)
    task = RecvTask(
        "req-1", "tx-1", PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5), report_done=True
    )
    puller.start(task)
    _, future = directory.pending.pop()
    # vLLM aborted the request: the scheduler's aborted task (notify-only, aborted=True).
    puller.start(dataclasses.replace(task, local_block_ids=(), aborted=True))
    assert ctx.reports.failed_recving == {"req-1"}
    assert len([m for m in sender.sent if isinstance(m, Release)]) == 1
    future.set_exception(TransportError("handshake timed out"))  # the handshake ends later
    releases = [m for m in sender.sent if isinstance(m, Release)]
    assert len(releases) == 1, f"{len(releases)} releases of tx-1 sent to prefill rank 0"


# ---- an exception in a check's verdict ---------------------------------------------------


def test_a_read_whose_confirmation_verdict_raises_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """confirm_reads: the READ is done in the engine, the hold check agrees, and its verdict
    (_read_checked, on a pool thread) raises at the stats sink after the part reached DONE --
    the same injected fault as test_write_whose_event_handling_raises_still_ends[ended job].
    The load still ends and is reported (before: its last part stayed DONE, _finish_read never
    ran, no report and no release, for good)."""
    ctx, directory, sender, _ = context("read", producer=False, tp_rank=0, tp_size=1)
    ctx.confirmer = PoolChecks()  # type: ignore[assignment]
    puller = Puller(ctx)
    puller.start(read_task("tx-1", 1))
    answer_handshakes(directory, FANOUT_PREFILL, 1, "READ")
    calls = break_first_call(monkeypatch, ctx.stats, "record_transfer")
    assert puller.on_event(event("tx-1"))
    assert wait_for(lambda: calls, 5.0), "the verdict never ran"
    puller.check_timeouts(time.monotonic() + 100_000)  # no timeout pass ends it either
    ended = wait_for(lambda: "req-1" in ctx.reports.done_recving, 2.0)
    assert ended, (
        f"load never reported; read states {puller.read_states()}, parts "
        f"{[p.machine.state.name for r in puller._reads.values() for p in r.parts]}, "
        f"releases sent {len([m for m in sender.sent if isinstance(m, Release)])}"
    )


def test_a_write_await_whose_verify_verdict_raises_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verify, WRITE: write_done came (VERIFYING) and the verdict (_write_verified, on a pool
    thread) raises at the stats sink. VERIFYING has no deadline (the writes ended; give_up is
    refused there), so the verdict's error must end the part: the load is reported failed
    (before: the request waited for its KV for good)."""
    ctx, directory, _ = protocol_context("write", producer=False)
    ctx.verifier = PoolChecks()  # type: ignore[assignment]
    puller = Puller(ctx)
    task = RecvTask(
        "req-1", "tx-1", PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5), report_done=True
    )
    puller.start(task)
    key, future = directory.pending.pop()
    future.set_result(peer(key))  # remote_blocks goes out
    calls = break_first_call(monkeypatch, ctx.stats, "record_verify")
    puller.on_write_result("tx-1", ok=True, writer_rank=0, checksums={})
    assert wait_for(lambda: calls, 5.0), "the verdict never ran"
    far = time.monotonic() + 10 * (ctx.cfg.abort_timeout + ctx.cfg.quarantine_timeout)
    puller.check_timeouts(far)
    ended = wait_for(lambda: "req-1" in ctx.reports.done_recving, 2.0)
    assert ended, f"load never reported; await states {puller.await_states()}"


# ---- an exception in a timeout pass ----------------------------------------------------------


class PollingEngine(Engine):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[Any] = []
        self.lock = threading.Lock()

    def poll_events(self, timeout: float = 0.0) -> list[Any]:
        with self.lock:
            out, self.events = self.events, []
        if not out:
            time.sleep(timeout)
        return out

    def poll_drained(self) -> list[Any]:
        return []


def test_an_exception_in_a_timeout_pass_does_not_stop_engine_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One exception in a timeout pass (here the directory's expiry) leaves the events thread
    running: a READ whose 'done' event comes after it is handled and its load ends (before:
    the exception ended the thread, and with it every later engine event)."""
    ctx, directory, _, _ = context("read", producer=False, tp_rank=0, tp_size=1)
    engine = PollingEngine()
    ctx.engine = lambda: engine  # type: ignore[assignment]
    directory.expire = lambda: None  # type: ignore[attr-defined]
    puller = Puller(ctx)
    core = SimpleNamespace(
        ctx=ctx, puller=puller, pusher=Pusher(ctx), _drained_jobs=set(), _engine=ctx.engine
    )
    for name in (
        "_events_loop",
        "_handle_event",
        "_on_event_error",
        "_on_drained",
        "check_timeouts",
    ):
        setattr(core, name, getattr(PdCore, name).__get__(core))
    calls = break_first_call(monkeypatch, directory, "expire")  # one fault, once
    thread = threading.Thread(target=core._events_loop, name="moriio-native-events", daemon=True)
    thread.start()
    try:
        puller.start(read_task("tx-1", 1))
        answer_handshakes(directory, FANOUT_PREFILL, 1, "READ")
        assert puller.read_states() == {"tx-1": ReadState.READING}
        assert wait_for(lambda: calls, 3.0), "no timeout pass ran"
        time.sleep(0.3)
        with engine.lock:
            engine.events.append(event("tx-1"))  # the READ is done in the engine
        ended = wait_for(lambda: "req-1" in ctx.reports.done_recving, 3.0)
        assert ended, (
            f"events thread alive: {thread.is_alive()}; read states {puller.read_states()}; "
            f"engine events never taken: {len(engine.events)}"
        )
    finally:
        ctx.stop.set()
        thread.join(2.0)


# ---- a memory keyed by what requests name ---------------------------------------------------


def test_plan_log_memory_is_bounded_over_requests_naming_new_prefill_hosts() -> None:
    """Context.tp_plan remembers the (host, remote TP size, side) whose plan it logged, so
    each is logged once; requests name the hosts, so it keeps at most MAX_LOGGED_PLANS (before:
    every READ naming a new remote_host with another TP size added an entry for good)."""
    ctx, directory, _, _ = context("read", producer=False, tp_rank=0, tp_size=1)
    puller = Puller(ctx)
    n = 3000
    for i in range(n):
        host = f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}"
        task = RecvTask(
            f"req-{i}",
            f"tx-{i}",
            ZmqAddress(host, 7000, 7100),
            None,
            0,
            2,
            (3, 4, 5),
            (10, 11, 12),
            report_done=True,
            remote_incarnations=(incarnation(0), incarnation(1)),
            remote_hold_until_ms=PREFILL_HOLD_UNTIL_MS,
        )
        puller.start(task)
        while directory.pending:  # nobody answers there: the load fails and ends
            directory.pending.pop()[1].set_exception(TransportError("unreachable"))
    assert puller.read_states() == {}  # every load ended
    assert len(ctx.logged_plans) == MAX_LOGGED_PLANS, f"{len(ctx.logged_plans)} kept after {n}"
