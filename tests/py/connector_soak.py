"""A soak through the connector: many READ requests of mixed lengths, many in flight, between a
prefill and a decode process, each vLLM's real Scheduler plus the connector's worker half over
UCX (TCP), driven through the connector's vLLM hooks as tests/py/faults_support.py drives them.

The model is faults_support's mixed one (dense, MLA and indexer layers in one backing, another
physical layout on each side); each request is 1 to 8 blocks long. The prefill computes every
request first and hands each one's ``kv_transfer_params`` to the decode over a ZMQ pipe (the
proxy's part), holding its blocks for the decode as vLLM does (computing is the slow part of
this harness: the decode could otherwise never keep its window full). Then the decode keeps
``in_flight`` requests outstanding at all times until the last ones drain: it READs their KV
asynchronously, computes the last prompt token and one more, and one request in
``verify_every`` is byte-verified (every loaded slot of every layer holds exactly the
prefill's pattern); meanwhile the prefill steps on, frees each request's blocks when the
decode's release arrives. Transfers/s and the latencies (request handed to the decode's
scheduler to finished) are the decode phase's. Checked by code at the end: every
request finished on both sides; the prefill reported each request finished-sending exactly once
(its blocks handed back to vLLM once) and the decode no request twice; no load failed; vLLM's
block pool holds every block again on both sides with every reference count 0 (a double release
would drive one negative); neither engine holds a pending or quarantined transfer.

Run as a command for the full soak (docs/reliability.md)::

    PYTHONPATH=build/dev/python python3 tests/py/connector_soak.py --transfers 10000 \\
        --in-flight 64 --json soak-connector.json

``--check confirm_reads`` (or ``verify``) turns that check on on both sides: every READ is then
confirmed with the prefill before its load counts, and the soak also requires that every one
was, none failing.

tests/py/test_connector_soak.py runs a short one in the default pytest.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults_support import LEGS, UCX_ENV
from moriio_native.control.addressing import ZmqAddress, format_request_id
from net_support import free_port
from test_vllm_support import (
    BLOCK_SIZE,
    ChildContext,
    RemoteSides,
    decode_params,
    prefill_params,
    transfer_id,
    write_model_dir,
)

logger = logging.getLogger("moriio_native.tests.connector_soak")

SOAK = "connector_soak"
MAX_BLOCKS = 8  # blocks per request, at most
# Deadlines far above a transfer's time here: the soak measures, the fault tests time out.
# abort_timeout: the prefill holds every request from its computation to the decode's release.
DEADLINES = {"transfer_timeout": 60.0, "abort_timeout": 7200.0, "quarantine_timeout": 120.0}
#: Per ``--check``: the connector's counts of READs its check passed and failed.
CHECKS = {
    "confirm_reads": ("confirmed_reads", "confirm_failures"),
    "verify": ("verified", "verify_failures"),
}
CHECK_COUNTS = tuple(key for keys in CHECKS.values() for key in keys)


@dataclass(frozen=True)
class Planned:
    rid: str
    tid: str
    length: int  # prompt tokens
    seed: int
    verify: bool


def soak_prompt(length: int, seed: int) -> list[int]:
    """Request ``seed``'s prompt: random tokens, so no two requests share a prefix block. A
    decode's own prefix-cache hit on an earlier request's block would hold the decode's bytes
    in a slot the check expects the prefill's in (the harness's two sides write different
    patterns, to tell loaded from recomputed)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def plan(n: int, prefill: ZmqAddress, decode: ZmqAddress, verify_every: int) -> list[Planned]:
    rng = random.Random(20261201)
    out = []
    for i in range(n):
        blocks = rng.randint(1, MAX_BLOCKS)
        # A last block partly filled or full: the loaded range ends anywhere in it.
        length = (blocks - 1) * BLOCK_SIZE + rng.randint(1, BLOCK_SIZE)
        out.append(
            Planned(
                format_request_id(prefill, decode),
                transfer_id(),
                max(length, 2),
                i + 1,
                i % verify_every == 0,
            )
        )
    return out


def _pool_audit(side: Any) -> dict[str, Any]:
    pool = side.scheduler.kv_cache_manager.block_pool
    bad_refs = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt != 0 and b.block_id != 0}
    engine = side.worker.worker.engine
    return {
        "unfinished": side.scheduler.get_num_unfinished_requests(),
        "free": side.free_blocks(),
        "initial_free": side.initial_free,
        "nonzero_ref_counts": bad_refs,
        "pending_transfers": engine.pending_transfers,
        "quarantined_transfers": engine.quarantined_transfers,
    }


# ---- in the child processes --------------------------------------------------------------------


def leg_prefill(
    ctx: ChildContext, name: str, port: int, planned: list[Planned], ahead: int, max_s: float
) -> dict[str, Any]:
    """Compute every planned request and hand its kv_transfer_params to the decode; step on
    until every one was reported finished-sending (released by the decode)."""
    import zmq

    side = ctx.sides[name]
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"tcp://127.0.0.1:{port}")
    todo = deque(planned)
    held: set[str] = set()  # added and not yet reported finished-sending
    deadline = time.monotonic() + max_s
    ctx.progress("running")
    try:
        while todo or held:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {len(todo)} to prefill, {len(held)} unreleased")
            while todo and len(held) < ahead:
                need = -(-todo[0].length // BLOCK_SIZE)
                if side.free_blocks() < need + MAX_BLOCKS:
                    break
                p = todo.popleft()
                params = prefill_params(p.tid)
                side.add_request(p.rid, soak_prompt(p.length, p.seed), params=params, max_tokens=1)
                held.add(p.rid)
            result = side.step()
            for rid, out in result.finished().items():
                push.send_pyobj((rid, out.kv_transfer_params))
            held -= result.transfer.finished_sending
            if not result.scheduled:
                time.sleep(0.001)
        # Quiet: vLLM frees a request's blocks in the step that reports it finished-sending.
        side.step()
        return {"reports": {k: dict(v) for k, v in side.reports.items()}, **_pool_audit(side)}
    finally:
        push.close(linger=1000)


@dataclass
class _Decoding:
    planned: Planned
    prompt: list[int]
    added_at: float
    checked: bool = False


@dataclass
class DecodeResult:
    done: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    verified: int = 0
    verify_failures: list[str] = field(default_factory=list)
    load_failures: list[str] = field(default_factory=list)
    max_in_flight: int = 0
    min_full_window: int = 1 << 30  # the fewest outstanding while requests waited to start
    mean_in_flight: float = 0.0
    # The connector's counts of the READs' checks with the prefill (CHECK_COUNTS), summed.
    prefill_checks: dict[str, int] = field(default_factory=dict)


def leg_decode(
    ctx: ChildContext,
    name: str,
    port: int,
    planned: list[Planned],
    in_flight: int,
    prefill_salt: int,
    max_s: float,
) -> dict[str, Any]:
    """Once every planned request was handed over, decode them ``in_flight`` at a time (a new
    one as soon as one finished) until all are done."""
    import zmq

    side = ctx.sides[name]
    by_rid = {p.rid: p for p in planned}
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(f"tcp://127.0.0.1:{port}")
    ctx.progress("bound")
    inbox: deque[tuple[str, dict[str, Any]]] = deque()
    active: dict[str, _Decoding] = {}
    out = DecodeResult()
    window_sum = window_steps = 0
    deadline = time.monotonic() + max_s
    try:
        while len(inbox) < len(planned):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {len(inbox)} of {len(planned)} handed over")
            if pull.poll(1000):
                inbox.append(pull.recv_pyobj())
        start = time.monotonic()
        while out.done < len(planned):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {out.done} of {len(planned)} done in {max_s} s")
            while inbox and len(active) < in_flight:
                rid, returned = inbox.popleft()
                p = by_rid[rid]
                prompt = soak_prompt(p.length, p.seed)
                side.add_request(rid, prompt, params=decode_params(p.tid, returned), max_tokens=2)
                active[rid] = _Decoding(p, prompt, time.monotonic())
            # In flight: the requests the decode's scheduler holds (loading or computing).
            held = len(side.scheduler.requests)
            out.max_in_flight = max(out.max_in_flight, held)
            if inbox:  # requests are left to start: the window must be full
                out.min_full_window = min(out.min_full_window, held)
            window_sum += held
            window_steps += 1
            result = side.step()
            if result.stats is not None:
                for key in CHECK_COUNTS:
                    count = result.stats.data.get(key, 0)
                    out.prefill_checks[key] = out.prefill_checks.get(key, 0) + count
            if result.invalid_blocks or result.transfer.failed_recving:
                out.load_failures.append(
                    f"failed {sorted(result.transfer.failed_recving)}, "
                    f"invalid blocks {sorted(result.invalid_blocks)}"
                )
            for rid in result.scheduled:
                d = active.get(rid)
                request = side.scheduler.requests.get(rid)
                if d is None or d.checked or not d.planned.verify or request is None:
                    continue
                if request.num_computed_tokens >= len(d.prompt):
                    d.checked = True
                    loaded = range(len(d.prompt) - 1)
                    if all(side.slot_matches(rid, loaded, prefill_salt, d.prompt)):
                        out.verified += 1
                    else:
                        out.verify_failures.append(rid)
            now = time.monotonic()
            for rid in result.finished():
                d = active.pop(rid, None)
                if d is not None:
                    out.latencies_s.append(now - d.added_at)
                    out.done += 1
            if not result.scheduled:
                time.sleep(0.001)
        out.seconds = time.monotonic() - start
        out.mean_in_flight = window_sum / max(window_steps, 1)
        side.step()
        audit = _pool_audit(side)
        return {
            "result": asdict(out),
            "reports": {k: dict(v) for k, v in side.reports.items()},
            **audit,
        }
    finally:
        pull.close(linger=0)


# ---- in the driving process --------------------------------------------------------------------


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def violations(
    n: int, prefill: dict[str, Any], decode: dict[str, Any], check: str = "none"
) -> list[str]:
    """Every invariant of the module docstring that failed, as a sentence."""
    bad = []
    res = decode["result"]
    if res["done"] != n:
        bad.append(f"decode: {res['done']} of {n} requests done")
    if check != "none":
        passed, failed = (res["prefill_checks"].get(k, 0) for k in CHECKS[check])
        if passed != n or failed:
            bad.append(f"decode: {check}: {passed} of {n} READs checked, {failed} failed")
    if res["verify_failures"]:
        bad.append(f"decode: bytes differ in {res['verify_failures']}")
    if res["load_failures"]:
        bad.append(f"decode: loads failed: {res['load_failures'][:5]}")
    sent = Counter(prefill["reports"]["finished_sending"])
    if len(sent) != n or any(c != 1 for c in sent.values()):
        twice = {r: c for r, c in sent.items() if c != 1}
        bad.append(f"prefill: {len(sent)} of {n} reported finished-sending; not once: {twice}")
    for who, got in (("prefill", prefill), ("decode", decode)):
        for kind, counts in got["reports"].items():
            twice = {r: c for r, c in counts.items() if c > 1}
            if twice:
                bad.append(f"{who}: {kind} reported more than once: {twice}")
        if got["unfinished"]:
            bad.append(f"{who}: {got['unfinished']} requests unfinished")
        if got["free"] != got["initial_free"]:
            bad.append(f"{who}: {got['initial_free'] - got['free']} blocks not back in the pool")
        if got["nonzero_ref_counts"]:
            bad.append(f"{who}: blocks with reference counts != 0: {got['nonzero_ref_counts']}")
        if got["pending_transfers"] or got["quarantined_transfers"]:
            bad.append(
                f"{who}: engine holds {got['pending_transfers']} pending, "
                f"{got['quarantined_transfers']} quarantined transfers"
            )
    return bad


def run(
    model_dir: str,
    transfers: int,
    in_flight: int,
    verify_every: int,
    max_s: float,
    check: str = "none",
) -> dict[str, Any]:
    """One soak; the figures and the violations (empty when every invariant held). ``check``:
    "confirm_reads" or "verify" on both sides (every READ checked with the prefill), or
    "none"."""
    num_blocks = 2 * in_flight * MAX_BLOCKS + 4 * MAX_BLOCKS
    sizes = {
        # The prefill holds every request's blocks until the decode released them.
        "kv_producer": {"num_blocks": transfers * MAX_BLOCKS + 4 * MAX_BLOCKS},
        "kv_consumer": {"num_blocks": num_blocks, "max_num_seqs": 2 * in_flight},
    }
    for role in sizes:
        sizes[role]["max_num_batched_tokens"] = 4096
    procs = {
        role: RemoteSides(model_dir, timeout=120.0, env=UCX_ENV)
        for role in ("kv_producer", "kv_consumer")
    }
    try:
        ports = {}
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            checked = {check: True} if check != "none" else {}
            args = (name, role, "read", {**DEADLINES, **checked}, sizes[role])
            procs[role].submit("run", f"{LEGS}:leg_make", args)
        for role in procs:
            ports[role] = procs[role].result("run", "make", timeout=300.0)
        p_addr = ZmqAddress("127.0.0.1", *ports["kv_producer"])
        d_addr = ZmqAddress("127.0.0.1", *ports["kv_consumer"])
        planned = plan(transfers, p_addr, d_addr, verify_every)
        pipe = free_port()
        decode, prefill = procs["kv_consumer"], procs["kv_producer"]
        decode.submit("run", f"{SOAK}:leg_decode", ("decode", pipe, planned, in_flight, 1, max_s))
        decode.progress("bound")
        # Every request computed before the decode starts (see the module docstring).
        prefill.submit("run", f"{SOAK}:leg_prefill", ("prefill", pipe, planned, transfers, max_s))
        prefill.progress("running")
        d = decode.result("run", "decode", timeout=max_s + 60)
        p = prefill.result("run", "prefill", timeout=120)
    finally:
        for proc in procs.values():
            proc.close()
    res = d["result"]
    lat = res.pop("latencies_s")
    return {
        "transfers": transfers,
        "in_flight": in_flight,
        "max_in_flight": res["max_in_flight"],
        "min_full_window": res["min_full_window"],
        "mean_in_flight": round(res["mean_in_flight"], 1),
        "seconds": round(res["seconds"], 2),
        "transfers_per_s": round(res["done"] / res["seconds"], 1) if res["seconds"] else 0.0,
        "p50_ms": round(1000 * _percentile(lat, 0.50), 1),
        "p99_ms": round(1000 * _percentile(lat, 0.99), 1),
        "max_ms": round(1000 * max(lat, default=0.0), 1),
        "verified": res["verified"],
        "num_blocks": num_blocks,
        "check": check,
        "checked": res["prefill_checks"].get(CHECKS[check][0], 0) if check != "none" else 0,
        "violations": violations(transfers, p, d, check),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transfers", type=int, default=10000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--verify-every", type=int, default=50)
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument(
        "--check",
        choices=["none", *CHECKS],
        default="none",
        help="every READ checked with the prefill (set on both sides)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="connector-soak-") as tmp:
        model = write_model_dir(Path(tmp) / "model")
        figures = run(
            model, args.transfers, args.in_flight, args.verify_every, args.max_seconds, args.check
        )
    line = json.dumps(figures)
    if args.json is not None:
        args.json.write_text(line + "\n")
    sys.stdout.write(line + "\n")
    return 1 if figures["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
