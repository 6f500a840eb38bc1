"""Faults against the connector in WRITE mode: prefill and decode in two processes over UCX
(TCP only, on loopback), vLLM's real Scheduler on both sides; the invariants of
:mod:`faults_support` after every round. ``MORIIO_FAULT_ROUNDS`` sets the rounds."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import faults_support as fs
from fault_proxy import Fault, FaultProxy, Rule
from moriio_native.control.addressing import ZmqAddress
from test_vllm_support import write_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]

LEGS = fs.LEGS
# A WRITE the decode gave up on is freed at the latest after abort_timeout, one writer probe
# (every 5 s) and its handshake timeout.
GIVE_UP_S = fs.ABORT_TIMEOUT + 5 + fs.TRANSFER_TIMEOUT + 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[fs.Pair]:
    made = fs.Pair(write_model_dir(Path(tmp_path_factory.mktemp("model"))), "write")
    try:
        yield made
    finally:
        made.close()


def test_healthy_rounds_are_written_byte_exact(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, no fault (baseline)") as row:
        for i in range(fs.rounds(2)):
            out = fs.write_transfer(pair, row, prefill_first=bool(i % 2))
            fs.audit(pair, row, [out["rid"]])
            row.rounds += 1
        fs.finish(pair, row)


def test_prefill_sigstop_shorter_than_the_deadline_is_survived(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, prefill SIGSTOP 0.5 s before the announcement, then SIGCONT") as row:
        for _ in range(fs.rounds(1)):
            out = fs.write_transfer(
                pair,
                row,
                prefill_first=True,
                between=fs.signal_prefill(pair, row, signal.SIGSTOP),
                after=fs.resume_prefill_after(pair, 0.5),
            )
            fs.audit(pair, row, [out["rid"]])
            row.rounds += 1
        fs.finish(pair, row)


def test_prefill_sigstop_past_the_deadline_quarantines_then_recomputes(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, prefill SIGSTOP past abort_timeout, then SIGCONT") as row:
        for _ in range(fs.rounds(1)):
            # The decode gives up after abort_timeout and quarantines its blocks; the resumed
            # prefill stops its job and acknowledges the abort (recomputed), or its writes land
            # first and its write_done ends the quarantine (loaded): no byte lands once freed.
            out = fs.write_transfer(
                pair,
                row,
                expect=("loaded", "recomputed"),
                prefill_first=True,
                between=fs.signal_prefill(pair, row, signal.SIGSTOP),
                after=fs.resume_prefill_after(pair, fs.ABORT_TIMEOUT + 2),
            )
            fs.audit(pair, row, [out["rid"]], wait=GIVE_UP_S)
            row.rounds += 1
        fs.finish(pair, row)


def test_first_write_after_an_unnoticed_prefill_restart_is_loaded(pair: fs.Pair) -> None:
    """Before: the decode's cached handshake outlived the prefill it named, so its announcement
    of the first request after a restart under the same address named the dead process; the
    new one refused it and the request was recomputed. Now the new process answers
    misaddressed and the decode announces the same blocks to it, which writes them."""
    with fs.recorded("WRITE, first request after an unnoticed prefill restart") as row:
        fs.write_transfer(pair, row)
        pair.restart("prefill")
        row.faults += 1
        out = fs.write_transfer(pair, row)
        fs.audit(pair, row, [out["rid"]])
        row.rounds += 1
        fs.finish(pair, row)


@fs.full_tier
def test_prefill_killed_before_its_writes_is_recomputed_then_restarted(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, kill -9 prefill before its writes; restart, same address") as row:
        for _ in range(fs.rounds(1)):
            fs.write_transfer(pair, row)  # cached handshakes with the process about to die

            def kill() -> None:
                pair.p.proc.kill()
                row.faults += 1

            out = fs.write_transfer(
                pair, row, expect=("recomputed",), between=kill, run_prefill=False
            )
            pair.restart("prefill")
            after = fs.write_transfer(pair, row)
            fs.audit(pair, row, [after["rid"]], recv=[out["rid"], after["rid"]], wait=GIVE_UP_S)
            row.rounds += 1
        fs.finish(pair, row)


@fs.full_tier
def test_prefill_killed_right_after_its_forward(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, kill -9 prefill right after its forward (writes in flight)") as row:
        for _ in range(fs.rounds(1)):

            def kill() -> None:
                pair.p.proc.kill()
                row.faults += 1

            out = fs.write_transfer(pair, row, expect=("loaded", "recomputed"), after=kill)
            pair.restart("prefill")
            after = fs.write_transfer(pair, row)
            fs.audit(pair, row, [after["rid"]], recv=[out["rid"], after["rid"]], wait=GIVE_UP_S)
            row.rounds += 1
        fs.finish(pair, row)


def test_decode_killed_during_the_writes_frees_the_prefill(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, kill -9 decode during the prefill's writes") as row:
        for _ in range(fs.rounds(1)):
            rid, tid = fs.request_ids(pair.p.address(), pair.d.address())
            prompt = pair.prompt()
            args = ("decode", rid, prompt, fs.consume_params(tid), 1)
            pair.d.proc.submit("run", f"{LEGS}:leg_consume", args)
            pair.d.proc.progress("posted")
            time.sleep(0.3)  # the announcement reaches the prefill
            pair.d.proc.signal(signal.SIGSTOP)  # its transport no longer answers the writes
            pair.p.proc.run(f"{LEGS}:leg_prefill", "prefill", rid, prompt, fs.read_params(tid))
            killed_at = time.monotonic()
            pair.d.proc.kill()
            row.faults += 1
            fs.after_decode_death(pair, row, rid, killed_at)
            row.rounds += 1
        fs.finish(pair, row)


def test_decode_aborts_while_the_prefill_is_stopped(pair: fs.Pair) -> None:
    with fs.recorded("WRITE, decode aborts during the transfer (prefill stopped)") as row:
        for _ in range(fs.rounds(1)):
            out = fs.write_transfer(
                pair,
                row,
                expect=("aborted",),
                prefill_first=True,
                between=fs.signal_prefill(pair, row, signal.SIGSTOP),
                abort_after_steps=2,
            )
            pair.p.proc.signal(signal.SIGCONT)  # it acknowledges the abort_write
            # The decode reports nothing for an aborted request; its blocks come back once.
            fs.audit(pair, row, [out["rid"]], recv=[], wait=GIVE_UP_S)
            row.rounds += 1
        fs.finish(pair, row)


# ---- faults on the control plane --------------------------------------------------------------


@dataclass
class Proxies:
    """Proxies in front of both instances' listeners; the request ids name these addresses
    (new handshake ports, so both sides handshake anew and learn the proxied notify ports)."""

    to_prefill: FaultProxy  # the prefill's notify listener: remote_blocks, abort_write
    to_decode: FaultProxy  # the decode's: write_done, write_failed, write_aborted
    prefill_at: ZmqAddress
    decode_at: ZmqAddress


@pytest.fixture
def proxies(pair: fs.Pair) -> Iterator[Proxies]:
    made = [
        FaultProxy("127.0.0.1", port)
        for port in (pair.p.hs, pair.p.notify, pair.d.hs, pair.d.notify)
    ]
    try:
        p_hs, p_notify, d_hs, d_notify = made
        yield Proxies(
            p_notify,
            d_notify,
            ZmqAddress("127.0.0.1", p_hs.port, p_notify.port),
            ZmqAddress("127.0.0.1", d_hs.port, d_notify.port),
        )
    finally:
        for proxy in made:
            proxy.close()


CONTROL_FAULTS = {
    "drop write_done": ("decode", {"write_done": Rule(Fault.DROP)}, ("recomputed",)),
    "duplicate write_done": ("decode", {"write_done": Rule(Fault.DUPLICATE)}, ("loaded",)),
    "delay write_done 1 s": ("decode", {"write_done": Rule(Fault.DELAY, delay_s=1.0)}, ("loaded",)),
    "duplicate remote_blocks": (
        "prefill",
        {"remote_blocks": Rule(Fault.DUPLICATE)},
        ("loaded",),
    ),
    "reorder remote_blocks": (
        "prefill",
        {"remote_blocks": Rule(Fault.REORDER, delay_s=1.0)},
        ("loaded",),
    ),
}
# Each waits out abort_timeout and a writer probe: the full tier only.
SLOW_CONTROL_FAULTS = {
    "drop remote_blocks": ("prefill", {"remote_blocks": Rule(Fault.DROP)}, ("recomputed",)),
}
if fs.FULL_TIER:
    CONTROL_FAULTS.update(SLOW_CONTROL_FAULTS)


@pytest.mark.parametrize("fault", list(CONTROL_FAULTS))
def test_control_message_faults(pair: fs.Pair, proxies: Proxies, fault: str) -> None:
    target, rules, expect = CONTROL_FAULTS[fault]
    proxy = proxies.to_prefill if target == "prefill" else proxies.to_decode
    with fs.recorded(f"WRITE, control plane: {fault}") as row:
        for _ in range(fs.rounds(1)):
            proxy.set_rules(rules)
            before = proxy.injected()
            outs = [
                fs.write_transfer(
                    pair,
                    row,
                    expect=expect,
                    prefill_at=proxies.prefill_at,
                    decode_at=proxies.decode_at,
                )
                for _ in range(2)
            ]
            fs.audit(pair, row, [o["rid"] for o in outs], wait=GIVE_UP_S)
            injected = proxy.injected() - before
            row.check(injected > 0, f"{fault}: the proxy injected nothing")
            row.faults += injected
            row.rounds += 1
        fs.finish(pair, row)
