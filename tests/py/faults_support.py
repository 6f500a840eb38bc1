"""Fault-injection harness for the connector (no tests here).

A prefill and a decode instance run in two processes (:class:`test_vllm_support.RemoteSides`),
each vLLM's real Scheduler plus the worker connector over UCX on loopback, driven only through
the connector's vLLM hooks. The test process plays the proxy, injects the fault (a signal to
a process, a :class:`fault_proxy.FaultProxy` between them on the ZMQ path, an abort, a
deadline) and then checks the invariants below by code, after every scenario:

* bounded: no step of either instance blocked past its documented bound (and every call to a
  child is itself bounded, so a hang fails the test);
* one terminal state: every request was reported finished-sending (prefill) and
  finished-receiving (decode) at most once, and exactly once where the transfer protocol
  started;
* blocks: once quiet, vLLM's block pool holds every block again on both sides;
* no late bytes: every block free on the decode was filled with a canary when its request
  ended; after the fault resolved (the peer resumed, died or timed out) every canary is intact;
* a failed load is reported and recomputed: the decode's blocks hold either exactly the
  prefill's bytes (loaded) or exactly its own (recomputed), never a mix;
* no growth: RSS, file descriptors, threads and engine peers of each surviving process, sampled
  after every round.

The legs below run inside the child processes (``RemoteSides.run("faults_support:<leg>")``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from fault_rows import Row, recorded
from moriio_native.control.addressing import ZmqAddress, format_request_id
from test_vllm_support import (
    BLOCK_SIZE,
    ChildContext,
    RemoteSides,
    Side,
    decode_params,
    mixed_specs,
    prefill_params,
    transfer_id,
)

NUM_BLOCKS = 48
# Short deadlines, so that every fault resolves within seconds.
TRANSFER_TIMEOUT = 2.0
ABORT_TIMEOUT = 4.0
QUARANTINE_TIMEOUT = 8.0
# UCX over TCP only: no shared-memory or CMA shortcut, so a stopped peer really stalls its
# transfers (CMA would read a stopped process's memory without it).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
CANARY = 0x25
LEGS = "faults_support"


FULL_TIER = os.environ.get("MORIIO_FAULT_TIER") == "full"
# Scenarios beyond the short tier that the default pytest runs (its CI budget is minutes).
full_tier = pytest.mark.skipif(
    not FULL_TIER, reason="full fault tier: MORIIO_FAULT_TIER=full (scripts/reliability.sh)"
)


def rounds(default: int) -> int:
    """Rounds per scenario: ``MORIIO_FAULT_ROUNDS`` (the full tier) or the short tier's."""
    return int(os.environ.get("MORIIO_FAULT_ROUNDS") or default)


# ---- in the child processes ---------------------------------------------------------------------


def _ints(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def _canary(dtype: torch.dtype) -> int:
    value = 0
    for _ in range(torch.empty((), dtype=dtype).element_size()):
        value = (value << 8) | CANARY
    return value


def _free_block_ids(side: Side) -> list[int]:
    held = {b for rid in side.scheduler.requests for b in side.block_ids(rid)}
    return [b for b in range(1, side.num_blocks) if b not in held]  # 0: vLLM's null block


def _fill_canaries(side: Side) -> list[int]:
    blocks = _free_block_ids(side)
    track = _TRACKS[side.name]
    track.canaried, track.touched_since = set(blocks), set()
    index = torch.tensor(blocks, dtype=torch.long)
    for cache in side.caches.values():
        ints = _ints(cache)
        ints[index] = torch.tensor(_canary(ints.dtype), dtype=ints.dtype)
    return blocks


def _resources(side: Side) -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    engine = side.worker.worker.engine
    return {
        "rss_kb": rss_kb,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "engine_peers": len(engine.peers()),
        "pending_transfers": engine.pending_transfers,
        "quarantined_transfers": engine.quarantined_transfers,
    }


def leg_make(
    ctx: ChildContext,
    name: str,
    role: str,
    mode: str,
    extra: dict[str, Any],
    sizes: dict[str, int] | None = None,
) -> Any:
    """An instance with the mixed model (dense, MLA, indexer) over UCX, short deadlines;
    ``sizes`` overrides ``num_blocks`` (48), ``max_num_seqs`` and ``max_num_batched_tokens``."""
    options = {
        "backend": "ucx",
        # As between two hosts: one UCX operation per run (the engine's same-host shortcuts,
        # ucp_rkey_ptr memcpy and batched process_vm_readv, read a stopped peer's memory
        # without it), and UCX's peer-failure detection, which "auto" enables for peers on
        # other hosts only (on one host over TCP alone, a killed peer's operations would
        # otherwise never end: see docs/reliability.md).
        "engine_options": {"ucx_direct_copy": "off", "ucx_error_handling": "peer"},
        "transfer_timeout": TRANSFER_TIMEOUT,
        "abort_timeout": ABORT_TIMEOUT,
        "quarantine_timeout": QUARANTINE_TIMEOUT,
        **extra,
    }
    layout, salt = ("LBNHC", 1) if role == "kv_producer" else ("BLNHC", 2)
    side = Side(
        name,
        role,
        mode,
        ctx.model_dir,
        salt=salt,
        specs=mixed_specs(),
        layout=layout,
        extra=options,
        **{"num_blocks": NUM_BLOCKS, **(sizes or {})},
    )
    ctx.sides[name] = side
    _TRACKS[name] = _Track()
    return side.handshake_port, side.notify_port


@dataclass
class _Track:
    """What the child records of one instance between audits."""

    step_times: list[float] = field(default_factory=list)
    canaried: set[int] = field(default_factory=set)  # free blocks given the canary last
    touched_since: set[int] = field(default_factory=set)  # held by a request since then
    failure_at: float | None = None  # CLOCK_MONOTONIC (shared by processes) of a load failure


_TRACKS: dict[str, _Track] = {}


def _step(side: Side, **hooks: Any) -> Any:
    track = _TRACKS[side.name]
    start = time.monotonic()
    result = side.step(**hooks)
    track.step_times.append(time.monotonic() - start)
    for rid in side.scheduler.requests:
        track.touched_since.update(side.block_ids(rid))
    return result


def leg_prefill(
    ctx: ChildContext, name: str, rid: str, prompt: list[int], params: dict[str, Any]
) -> Any:
    """Prefill one request (finishes after its first token); its kv_transfer_params."""
    side = ctx.sides[name]
    side.add_request(rid, prompt, params=params, max_tokens=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished = _step(side).finished()
        if rid in finished:
            return finished[rid].kv_transfer_params
    raise AssertionError(f"{name}: prefill of {rid} did not finish")


def leg_consume(
    ctx: ChildContext,
    name: str,
    rid: str,
    prompt: list[int],
    params: dict[str, Any],
    prefill_salt: int,
    abort_after_steps: int | None = None,
    max_wait: float = 60.0,
) -> dict[str, Any]:
    """Decode one request to its end (2 tokens), or abort it after ``abort_after_steps``
    steps. Reports ``posted`` once the first start_load_kv ran. Returns how its KV arrived:
    ``loaded`` (the prefill's bytes in every loaded slot), ``recomputed`` (the decode's own
    bytes in every slot, after a reported load error or failed receive), ``aborted`` or
    ``mixed`` (a violation)."""
    side = ctx.sides[name]
    track = _TRACKS[name]
    track.failure_at = None
    side.add_request(rid, prompt, params=params, max_tokens=2)
    posted = False

    def report_posted() -> None:
        nonlocal posted
        if not posted:
            posted = True
            ctx.progress("posted")

    out: dict[str, Any] = {"outcome": None, "failure_reported": False, "scheduled": []}
    deadline = time.monotonic() + max_wait
    steps = 0
    while rid in side.scheduler.requests:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: request {rid} did not finish within {max_wait}s")
        if abort_after_steps is not None and steps >= abort_after_steps:
            report_posted()
            side.abort(rid)
            out["outcome"] = "aborted"
            _step(side)
            break
        result = _step(side, after_start_load=report_posted)
        steps += 1
        if result.invalid_blocks or rid in result.transfer.failed_recving:
            out["failure_reported"] = True
            track.failure_at = track.failure_at or time.monotonic()
        n = result.scheduled.get(rid)
        if n is None:
            time.sleep(0.01)
            continue
        out["scheduled"].append(n)
        request = side.scheduler.requests.get(rid)
        if (
            out["outcome"] is None
            and request is not None
            and not result.invalid_blocks
            and request.num_computed_tokens >= len(prompt)
        ):
            last = len(prompt) - 1
            theirs = side.slot_matches(rid, range(last), prefill_salt, prompt)
            ours = side.slot_matches(rid, range(last), side.salt, prompt)
            mine_last = side.slot_matches(rid, range(last, last + 1), side.salt, prompt)
            if all(theirs) and mine_last == [True]:
                out["outcome"] = "loaded"
            elif all(ours) and mine_last == [True] and out["failure_reported"]:
                out["outcome"] = "recomputed"
            else:
                out["outcome"] = "mixed"
                out["slots"] = {"prefill": theirs, "decode": ours}
    report_posted()
    _fill_canaries(side)
    out["failure_at"] = track.failure_at
    out["done_at"] = time.monotonic()
    return out


def leg_settle(ctx: ChildContext, name: str, expect_sent: list[str], max_wait: float) -> Any:
    """Step until no request is left, every id in ``expect_sent`` was reported
    finished-sending and every block is back in the pool (or ``max_wait`` passed); then check
    the canaries and return the audit."""
    side, track = ctx.sides[name], _TRACKS[name]
    deadline = time.monotonic() + max_wait
    sent = side.reports["finished_sending"]
    # Blocks a finished request still holds for the connector (a quarantine waiting for the
    # peer's confirmation) come back later: wait for them too, until the deadline.
    while (
        side.scheduler.get_num_unfinished_requests()
        or any(r not in sent for r in expect_sent)
        or side.free_blocks() != side.initial_free
    ):
        if time.monotonic() > deadline:
            break
        _step(side)
        time.sleep(0.02)
    # The blocks that got the canary when they were last free and are free now, and that no
    # request held in between: nothing may have written them.
    free = set(_free_block_ids(side))
    watched = sorted((track.canaried & free) - track.touched_since)
    index = torch.tensor(watched, dtype=torch.long)
    late = {}
    for layer, cache in side.caches.items():
        ints = _ints(cache)[index]
        bad = (ints != torch.tensor(_canary(ints.dtype), dtype=ints.dtype)).flatten(1).any(1)
        if bad.any():
            late[layer] = [watched[i] for i in torch.nonzero(bad).flatten().tolist()]
    audit = {
        "unfinished": side.scheduler.get_num_unfinished_requests(),
        "free": side.free_blocks(),
        "initial_free": side.initial_free,
        "reports": {k: dict(v) for k, v in side.reports.items()},
        "late_bytes": late,
        "canary_blocks": len(watched),
        "max_step_s": max(track.step_times, default=0.0),
        "resources": _resources(side),
        "sent_at": time.monotonic(),
    }
    track.step_times.clear()
    _fill_canaries(side)  # blocks freed late are watched from now on
    return audit


def leg_canaries(ctx: ChildContext, name: str) -> int:
    """Fill every free block of ``name`` with the canary (before a scenario)."""
    return len(_fill_canaries(ctx.sides[name]))


# ---- in the test process -----------------------------------------------------------------------


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 17 + i * 29) % 241 + 3 for i in range(n)]


# The longest a step may block: a READ is waited for up to 2 x transfer_timeout, a quarantine up
# to quarantine_timeout more (moriio_native.vllm.worker); one second of slack for the step.
STEP_BOUND_S = 2 * TRANSFER_TIMEOUT + QUARANTINE_TIMEOUT + 1.0


@dataclass
class Instance:
    """One instance in its own process."""

    proc: RemoteSides
    name: str
    role: str
    mode: str
    extra: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    netns: str | None = None
    hs: int = 0
    notify: int = 0

    def submit_start(self) -> None:
        self.proc.submit("run", f"{LEGS}:leg_make", (self.name, self.role, self.mode, self.extra))

    def finish_start(self) -> Instance:
        self.hs, self.notify = self.proc.result("run", "make", timeout=START_TIMEOUT_S)
        return self

    def address(self) -> ZmqAddress:
        return ZmqAddress(self.host, self.hs, self.notify)

    @property
    def host(self) -> str:
        return str(self.extra.get("host_ip", "127.0.0.1"))


# Starting an instance imports vLLM and torch in a fresh process: minutes on a loaded machine.
START_TIMEOUT_S = 300.0


def spawn(
    model_dir: str,
    role: str,
    mode: str,
    extra: dict[str, Any] | None = None,
    *,
    env: dict[str, str] | None = None,
    netns: str | None = None,
) -> Instance:
    """An instance in a new process (in network namespace ``netns`` when given), being
    started (``finish_start`` waits for it)."""
    name = "prefill" if role == "kv_producer" else "decode"
    env = UCX_ENV if env is None else env
    proc = RemoteSides(model_dir, timeout=120.0, env=env, netns=netns)
    inst = Instance(proc, name, role, mode, dict(extra or {}), env=env, netns=netns)
    inst.submit_start()
    return inst


def respawn(model_dir: str, old: Instance) -> Instance:
    """The same instance restarted under the same address (the old one is dead)."""
    extra = {**old.extra, "handshake_port": old.hs, "notify_port": old.notify}
    return spawn(model_dir, old.role, old.mode, extra, env=old.env, netns=old.netns).finish_start()


def check_audit(row: Row, who: str, audit: dict[str, Any], expect_once: list[str]) -> None:
    """The invariants every instance must satisfy once quiet."""
    row.check(audit["unfinished"] == 0, f"{who}: {audit['unfinished']} requests never finished")
    row.check(
        audit["free"] == audit["initial_free"],
        f"{who}: {audit['initial_free'] - audit['free']} blocks never returned to the pool",
    )
    for kind, counts in audit["reports"].items():
        twice = {rid: n for rid, n in counts.items() if n > 1}
        row.check(not twice, f"{who}: reported {kind} more than once: {twice}")
    key = "finished_sending" if who == "prefill" else "finished_recving"
    for rid in expect_once:
        n = audit["reports"][key].get(rid, 0)
        row.check(n == 1, f"{who}: {rid} reported {key} {n} times, expected once")
    row.check(not audit["late_bytes"], f"{who}: bytes landed in free blocks: {audit['late_bytes']}")
    row.check(
        audit["max_step_s"] <= STEP_BOUND_S,
        f"{who}: a step blocked {audit['max_step_s']:.2f}s (bound {STEP_BOUND_S}s)",
    )
    res = audit["resources"]
    row.check(res["pending_transfers"] == 0, f"{who}: {res['pending_transfers']} transfers open")
    row.check(res["quarantined_transfers"] == 0, f"{who}: transfers still quarantined")


class Growth:
    """Resource samples of one process over rounds: after the first two rounds (warm-up:
    lazily started threads, allocator pools) nothing may grow beyond a small slack."""

    SLACK: ClassVar[dict[str, int]] = {
        "rss_kb": 32 * 1024,
        "fds": 2,
        "threads": 2,
        "engine_peers": 1,  # 0 while a quarantine dropped the peer, 1 once handshaken again
    }

    def __init__(self, who: str) -> None:
        self.who = who
        self.samples: list[dict[str, int]] = []

    def add(self, resources: dict[str, int]) -> None:
        self.samples.append(resources)

    def check(self, row: Row) -> None:
        if len(self.samples) < 3:
            return
        base = self.samples[1]
        for key, slack in self.SLACK.items():
            top = max(s[key] for s in self.samples[2:])
            row.check(
                top <= base[key] + slack,
                f"{self.who}: {key} grew from {base[key]} to {top} over {len(self.samples)} rounds",
            )


class Pair:
    """The current prefill and decode processes (a killed one is replaced by a restart under
    the same address) and the resource samples of each."""

    def __init__(
        self,
        model_dir: str,
        mode: str,
        sides: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """``sides``: per role, extra :func:`spawn` arguments (``extra``, ``env``, ``netns``)."""
        self.model_dir = model_dir
        self.mode = mode
        sides = sides or {}
        self.p = spawn(model_dir, "kv_producer", mode, **sides.get("kv_producer", {}))
        self.d = spawn(model_dir, "kv_consumer", mode, **sides.get("kv_consumer", {}))
        self.p.finish_start()
        self.d.finish_start()
        self.d.proc.run(f"{LEGS}:leg_canaries", "decode")
        self.seed = 0
        self.growth = {"prefill": Growth("prefill"), "decode": Growth("decode")}

    def restart(self, which: str) -> None:
        old = self.p if which == "prefill" else self.d
        old.proc.kill()
        new = respawn(self.model_dir, old)
        if which == "prefill":
            self.p = new
        else:
            self.d = new
            new.proc.run(f"{LEGS}:leg_canaries", "decode")
        self.growth[which] = Growth(which)  # a new process: a new baseline

    def prompt(self, length: int = 45) -> list[int]:
        self.seed += 1  # unique prompts: no prefix-cache hit on canary-filled free blocks
        return prompt_of(length, self.seed)

    def close(self) -> None:
        self.p.proc.close()
        self.d.proc.close()


def audit(
    pair: Pair,
    row: Row,
    rids: list[str],
    *,
    sent: list[str] | None = None,
    recv: list[str] | None = None,
    wait: float = 30.0,
) -> None:
    """Settle both instances and check every invariant (``sent``: the requests the prefill
    must report finished-sending once, ``recv``: those the decode must report
    finished-receiving once; by default ``rids``, and for a READ decode none: vLLM 0.33 loads
    a READ within the step, and a load's end is reported through its blocks, so it is checked
    to be reported at most once); sample their resources."""
    sent = rids if sent is None else sent
    if recv is None:
        recv = rids if pair.mode == "write" else []
    for inst, expect_sent, expect_once in ((pair.p, sent, sent), (pair.d, [], recv)):
        got = inst.proc.run(f"{LEGS}:leg_settle", inst.name, expect_sent, wait)
        check_audit(row, inst.name, got, expect_once)
        pair.growth[inst.name].add(got["resources"])


def finish(pair: Pair, row: Row) -> None:
    """The growth check over this scenario's rounds; the next scenario samples afresh (a new
    peer address legitimately opens new sockets)."""
    for who, g in pair.growth.items():
        g.check(row)
        pair.growth[who] = Growth(who)


def _consumed(
    pair: Pair, row: Row, rid: str, expect: tuple[str, ...], fault_at: float
) -> dict[str, Any]:
    """The decode's consume leg's result, checked against ``expect``; detection and recovery
    timed from ``fault_at`` (CLOCK_MONOTONIC is the same in every process)."""
    out = pair.d.proc.result("run", "consume")
    row.check(out["outcome"] in expect, f"{rid}: outcome {out['outcome']}, expected {expect}")
    if out["failure_at"] is not None:
        row.detect_s.append(out["failure_at"] - fault_at)
    row.recover_s.append(out["done_at"] - fault_at)
    out["rid"] = rid
    return out


def signal_prefill(pair: Pair, row: Row, signum: int) -> Callable[[], None]:
    """A hook that sends ``signum`` to the current prefill process (a counted fault)."""

    def send() -> None:
        pair.p.proc.signal(signum)
        row.faults += 1

    return send


def resume_prefill_after(pair: Pair, seconds: float) -> Callable[[], None]:
    """A hook that sends the prefill SIGCONT ``seconds`` from now."""

    def resume() -> None:
        time.sleep(seconds)
        pair.p.proc.signal(signal.SIGCONT)

    return resume


def read_transfer(
    pair: Pair,
    row: Row,
    *,
    prefill_at: ZmqAddress | None = None,
    expect: tuple[str, ...] = ("loaded",),
    before: Callable[[], None] | None = None,
    during: Callable[[], None] | None = None,
    abort_after_steps: int | None = None,
) -> dict[str, Any]:
    """One READ request: prefill, ``before()``, then the decode; ``during()`` runs once the
    decode posted its loads. The request names ``prefill_at`` (a proxy) instead of the
    prefill's own address when given. Detection and recovery are timed from ``before()``: the
    moment the decode was handed the request."""
    rid, tid = request_ids(prefill_at or pair.p.address(), pair.d.address())
    prompt = pair.prompt()
    returned = pair.p.proc.run(f"{LEGS}:leg_prefill", "prefill", rid, prompt, read_params(tid))
    fault_at = time.monotonic()
    if before is not None:
        before()
    args = (rid, prompt, consume_params(tid, returned), 1, abort_after_steps)
    pair.d.proc.submit("run", f"{LEGS}:leg_consume", ("decode", *args))
    pair.d.proc.progress("posted")
    if during is not None:
        during()
    return _consumed(pair, row, rid, expect, fault_at)


def write_transfer(
    pair: Pair,
    row: Row,
    *,
    expect: tuple[str, ...] = ("loaded",),
    prefill_first: bool = False,
    between: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
    prefill_at: ZmqAddress | None = None,
    decode_at: ZmqAddress | None = None,
    abort_after_steps: int | None = None,
    run_prefill: bool = True,
) -> dict[str, Any]:
    """One WRITE request. The decode announces its blocks and the prefill computes and writes,
    in either order (``prefill_first``); ``between()`` runs between the two, ``after()`` once
    both started. Detection and recovery are timed from ``between()``."""
    rid, tid = request_ids(prefill_at or pair.p.address(), decode_at or pair.d.address())
    prompt = pair.prompt()
    args = ("decode", rid, prompt, consume_params(tid), 1, abort_after_steps, 90.0)

    def prefill() -> None:
        if run_prefill:
            pair.p.proc.run(f"{LEGS}:leg_prefill", "prefill", rid, prompt, read_params(tid))

    if prefill_first:
        prefill()
    else:
        pair.d.proc.submit("run", f"{LEGS}:leg_consume", args)
        pair.d.proc.progress("posted")
    fault_at = time.monotonic()
    if between is not None:
        between()
    if prefill_first:
        pair.d.proc.submit("run", f"{LEGS}:leg_consume", args)
        pair.d.proc.progress("posted")
    else:
        prefill()
    if after is not None:
        after()
    return _consumed(pair, row, rid, expect, fault_at)


def after_decode_death(pair: Pair, row: Row, rid: str, killed_at: float) -> None:
    """The decode of ``rid`` was killed: no release or announcement will come, so the prefill
    must free the request's blocks (after abort_timeout at the latest), exactly once. The
    decode is restarted under the same address; so is the prefill if it did not survive (a
    violation), so that later scenarios find a working pair."""
    try:
        got = pair.p.proc.run(
            f"{LEGS}:leg_settle", "prefill", [rid], ABORT_TIMEOUT + 10, timeout=60
        )
    except (OSError, EOFError, AssertionError) as exc:
        row.check(False, f"prefill: did not survive its decode's death ({exc!r})")
        pair.restart("prefill")
    else:
        check_audit(row, "prefill", got, [rid])
        row.recover_s.append(got["sent_at"] - killed_at)
        pair.growth["prefill"].add(got["resources"])
    pair.restart("decode")


def request_ids(prefill: ZmqAddress, decode: ZmqAddress) -> tuple[str, str]:
    return format_request_id(prefill, decode), transfer_id()


def read_params(tid: str) -> dict[str, Any]:
    return prefill_params(tid)


def consume_params(tid: str, returned: dict[str, Any] | None = None) -> dict[str, Any]:
    return decode_params(tid, returned)


__all__ = [
    "BLOCK_SIZE",
    "Growth",
    "Instance",
    "Row",
    "check_audit",
    "recorded",
    "respawn",
    "spawn",
]
