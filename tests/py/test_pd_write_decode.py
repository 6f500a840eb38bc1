"""The decode side of WRITE mode: a load reusing an ended transfer id, and a write result
that answers no announcement. Found by a review of the WRITE decode side (2026-12-07); each
test failed before its fix.

Each test drives a decode rank's protocol core (pd/core.py, pd/puller.py) with its REAL notify
listener on 127.0.0.1 (the prefill's messages are sent over ZMQ by a NotifySender), and a
scripted peer directory and sender (no engine, no vLLM). Bounded waits, no timings asserted."""

from __future__ import annotations

import time
from typing import Any

import pytest

from moriio_native.control.channel import NotifySender
from moriio_native.control.messages import (
    AbortWrite,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
)
from moriio_native.control.security import ControlSecurity
from moriio_native.pd.config import PdConfig
from moriio_native.pd.core import PdCore
from moriio_native.pd.puller import AwaitState
from moriio_native.pd.tasks import RecvTask
from test_pd_protocol import PREFILL, Directory, Sender, Stats, peer

LOCAL = "127.0.0.1"


class IdleEngine:
    """An engine with no transfers (a WRITE decode posts none): the events thread polls it."""

    def poll_events(self, timeout: float = 0.0) -> list[Any]:
        time.sleep(timeout)
        return []

    def poll_drained(self) -> list[Any]:
        return []


class ScriptedDirectory(Directory):
    """test_pd_protocol's scripted directory, with what the core's threads call too."""

    def expire(self) -> None:
        pass

    def close(self) -> None:
        pass


class ScriptedSender(Sender):
    def close(self) -> None:
        pass


def wait_for(predicate: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def decode() -> Any:
    """A WRITE-mode decode rank's core, started on 127.0.0.1 (real listener), over a scripted
    directory and sender; yields (core, directory, sender, prefill's NotifySender)."""
    security = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})
    cfg = PdConfig(
        engine_id="d:1/dp0/tp0",
        mode="write",
        producer=False,
        consumer=True,
        host_ip=LOCAL,
        handshake_port=0,
        notify_port=0,
        abort_timeout=3600,
        quarantine_timeout=3600,
    )
    engine = IdleEngine()
    core = PdCore(cfg, security, Stats(), engine=lambda: engine, bind_host=LOCAL)  # type: ignore[arg-type,return-value]
    directory, sender = ScriptedDirectory(), ScriptedSender()
    core.ctx.directory = directory  # type: ignore[assignment]
    core.ctx.sender = sender  # type: ignore[assignment]
    core.start(0, 0)
    prefill = NotifySender(security)
    try:
        yield core, directory, sender, prefill
    finally:
        prefill.close()
        core.shutdown()


def start_load(core: PdCore, directory: Directory, sender: Sender, req: str, tid: str) -> bool:
    """Start request ``req``'s WRITE load of ``tid`` and let the handshake answer: True when
    the announcement (remote_blocks) went out, False when the load was refused at once."""
    task = RecvTask(req, tid, PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5), report_done=True)
    core.start_loads([task])
    if not directory.pending:
        return False
    key, future = directory.pending.pop()
    future.set_result(peer(key))
    assert isinstance(sender.sent[-1], RemoteBlocks)
    assert core.puller.await_states() == {tid: AwaitState.ANNOUNCED}
    return True


def announce(core: PdCore, directory: Directory, sender: Sender, req: str, tid: str) -> None:
    assert start_load(core, directory, sender, req, tid)


def test_a_write_load_reusing_an_ended_transfer_id_is_told_its_prefills_answer(
    decode: Any,
) -> None:
    """R1 (transfer T) is written and loaded; R2 reuses T (a router's retry, a client's own
    params) on the same decode rank. The prefill refuses R2 at once (pd/pusher.py: "transfer
    ids must be fresh per request") and tells this rank write_failed. The decode must end R2's
    load on that answer (or refuse the reused id itself at once). Found: the listener marked T
    terminal when R1 ended and drops every later write_failed / write_done / write_aborted of
    T as late, so R2 waits abort_timeout, is quarantined, its abort_write's answer is dropped
    too, and its blocks stay held until quarantine_timeout (120 s + 300 s by default)."""
    core, directory, sender, prefill = decode
    port = core.listener.port
    announce(core, directory, sender, "req-1", "tx-T")
    prefill.send(LOCAL, port, WriteDone("tx-T", writer_rank=0))
    assert wait_for(lambda: "req-1" in core.ctx.reports.done_recving, 5.0), "R1 never loaded"
    assert not core.ctx.reports.failed_recving

    if start_load(core, directory, sender, "req-2", "tx-T"):
        prefill.send(LOCAL, port, WriteFailed("tx-T", writer_rank=0, reason="transfer id reused"))
    told = wait_for(lambda: "req-2" in core.ctx.reports.done_recving, 3.0)
    assert told, (
        f"R2's load of reused transfer tx-T ignored its prefill's write_failed: await states "
        f"{core.puller.await_states()}, listener {core.listener.stats()}"
    )
    assert "req-2" in core.ctx.reports.failed_recving


def test_a_reused_transfer_ids_quarantine_ends_on_the_prefills_write_aborted(
    decode: Any,
) -> None:
    """The same reuse, given up (abort): the decode quarantines R2's blocks and sends
    abort_write; the prefill's write_aborted (the only proof its writes stopped) is dropped as
    late by the listener, so the blocks stay quarantined until quarantine_timeout."""
    core, directory, sender, prefill = decode
    port = core.listener.port
    announce(core, directory, sender, "req-1", "tx-T")
    prefill.send(LOCAL, port, WriteDone("tx-T", writer_rank=0))
    assert wait_for(lambda: "req-1" in core.ctx.reports.done_recving, 5.0), "R1 never loaded"

    if start_load(core, directory, sender, "req-2", "tx-T"):
        core.puller.give_up("tx-T", "the request was aborted")
        assert isinstance(sender.sent[-1], AbortWrite)
        assert core.puller.await_states() == {"tx-T": AwaitState.QUARANTINED}
        prefill.send(LOCAL, port, WriteAborted("tx-T", core.cfg.engine_id, writer_rank=0))
    freed = wait_for(lambda: "req-2" in core.ctx.reports.done_recving, 3.0)
    assert freed, (
        f"R2's quarantine ignored the prefill's write_aborted: await states "
        f"{core.puller.await_states()}, listener {core.listener.stats()}"
    )


def test_a_write_done_before_the_announcement_does_not_load_the_request() -> None:
    """The await table lets write_done end a part still CONNECTING (its comment: "a final
    message may overtake our announcement's own bookkeeping"). But _announce moves the part to
    ANNOUNCED before remote_blocks leaves, so no write_done caused by our announcement can come
    while it is CONNECTING (initially, or again after a misaddressed answer, when the new process
    wrote nothing and waits for the blocks). One that does (forged by any sender that reaches
    the notify port, steered from another rank, or a stale copy) made the load DONE: vLLM is
    told the request's blocks hold the prompt's KV although no prefill was ever told where to
    write them. Now it is ignored like any other write result that answers nothing of ours."""
    from moriio_native.pd.puller import Puller
    from test_pd_protocol import context as protocol_context

    ctx, _directory, sender = protocol_context("write", producer=False)
    puller = Puller(ctx)
    task = RecvTask(
        "req-1", "tx-1", PREFILL, "p:7000", 0, 1, local_block_ids=(4, 5), report_done=True
    )
    puller.start(task)
    assert puller.await_states() == {"tx-1": AwaitState.CONNECTING}
    puller.on_write_result("tx-1", ok=True, writer_rank=0)
    announced = [m for m in sender.sent if isinstance(m, RemoteBlocks)]
    loaded = "req-1" in ctx.reports.done_recving and "req-1" not in ctx.reports.failed_recving
    assert not loaded, (
        f"load reported done with nothing announced ({len(announced)} remote_blocks sent): "
        f"await states {puller.await_states()}"
    )
