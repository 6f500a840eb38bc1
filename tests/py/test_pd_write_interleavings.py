"""A deterministic random-interleaving check of the WRITE prefill (pd/pusher.py) against a
simulated engine (no network, no vLLM, no threads: the writer runs one op per step). Written by
a review of the prefill side (2026-12-07); it failed before the fix of decode ranks confirmed
during the save step. Invariants: each request reported done_sending at most once (exactly once
once everything ended), never while an engine transfer of it may still write, nothing posted
after that; at most one write_done/write_failed per job; write_done only after the engine said
done; an undisturbed request ends in write_done on every rank."""

from __future__ import annotations

import dataclasses
import queue
import random
from collections import deque
from types import SimpleNamespace
from typing import Any

from moriio_native.control.messages import (
    AbortWrite,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
)
from moriio_native.errors import NotFoundError, TransportError
from moriio_native.pd.pusher import Pusher, job_transfer_id
from moriio_native.pd.tasks import SaveTask, SendTask
from test_pd_tp_fanout import DECODE, DENSE, WHOLE, PortSender, context, peer_at

LAYERS = DENSE + WHOLE


class SimEngine:
    def __init__(self) -> None:
        self.t: dict[str, dict[str, Any]] = {}
        self.ended: dict[str, str] = {}
        self.events: list[Any] = []
        self.log: list[tuple[Any, ...]] = []
        self.inflight: set[str] = set()  # ended undrained: writes may still land
        self.rng = random.Random(0)

    def _open(self, tid: str) -> dict[str, Any]:
        return self.t.setdefault(tid, {"layers": set(), "expected": None})

    def write_layer(self, tid: str, layer: str, peer: str, *a: Any, **k: Any) -> bool:
        return self.write_layers(tid, [layer], peer)

    def write_layers(self, tid: str, layers: list[str], peer: str, *a: Any, **k: Any) -> bool:
        if tid in self.ended:
            return False
        t = self._open(tid)
        new = [x for x in layers if x not in t["layers"]]
        if not new:
            return False
        t["layers"].update(new)
        self.log.append(("write", tid, tuple(new)))
        return True

    def seal(self, tid: str, peer: str, *, expected_writes: int) -> bool:
        if tid in self.ended:
            return False
        self._open(tid)["expected"] = expected_writes
        self.log.append(("seal", tid, expected_writes))
        return True

    def abort(self, tid: str) -> None:
        if tid in self.ended:
            return
        if tid not in self.t:
            raise NotFoundError(f"no transfer {tid!r}")
        self._end(tid, "aborted")

    def _end(self, tid: str, state: str) -> None:
        self.ended[tid] = state
        wrote = bool(self.t.pop(tid, {"layers": ()})["layers"])
        drained = not (state != "done" and wrote and self.rng.random() < 0.4)
        if not drained:
            self.inflight.add(tid)
        self.events.append(
            SimpleNamespace(transfer_id=tid, state=state, message="", drained=drained)
        )

    def completable(self) -> list[str]:
        return [
            tid
            for tid, t in self.t.items()
            if t["expected"] is not None and len(t["layers"]) == t["expected"]
        ]

    def active(self) -> list[str]:
        return list(self.t)

    def waits_for_device_events(self, peer: str) -> bool:
        return False


class OneOp:
    """The writer queue, giving the writer loop one op per run."""

    def __init__(self, ctx: Any) -> None:
        self.q: deque[Any] = deque()
        self.ctx = ctx
        self.given = False

    def put(self, op: Any, timeout: float | None = None) -> None:
        self.q.append(op)

    def get(self, timeout: float | None = None) -> Any:
        if self.given or not self.q:
            self.ctx.stop.set()
            raise queue.Empty
        self.given = True
        return self.q.popleft()

    def empty(self) -> bool:
        return not self.q


def trial(
    seed: int, decode_tp: int, steps: int = 60, prefill: tuple[int, int] = (0, 1)
) -> list[str]:
    rng = random.Random(seed)
    my_rank, my_tp = prefill
    clean = seed % 2 == 1
    ctx, directory, _, _ = context(
        "write", producer=True, tp_rank=my_rank, tp_size=my_tp, heads=max(8, decode_tp)
    )
    consumers = list(ctx.tp_plan("d", decode_tp, prefill=True).consumers(my_rank))
    ctx.cfg = dataclasses.replace(ctx.cfg, quarantine_timeout=1e9)
    from concurrent.futures import Future

    cached: set[Any] = set()
    if rng.random() < 0.5:
        cached.add("all")
    plain_connect = directory.connect

    def connect(key: Any, notify_port: int, validate: Any, **kw: Any) -> Any:
        if "all" in cached or key in cached:
            future: Future[Any] = Future()
            rank = key.handshake_port - DECODE.handshake_port
            future.set_result(peer_at(key, DECODE, rank, decode_tp, "WRITE"))
            return future
        return plain_connect(key, notify_port, validate, **kw)

    directory.connect = connect  # type: ignore[method-assign]
    engine = SimEngine()
    engine.rng = random.Random(seed + 7)
    drained_early: set[str] = set()
    pending_sums: list[Any] = []

    class Verifier:
        def for_write_done(self, tid_: str, local: Any, done: Any) -> None:
            pending_sums.append(done)

    use_verify = seed % 3 == 0
    if use_verify:
        ctx.verifier = Verifier()  # type: ignore[assignment]
    reannounced: set[int] = set()
    ctx.engine = lambda: engine  # type: ignore[assignment]
    ctx.sender = sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    q = OneOp(ctx)
    pusher._writer_q = q  # type: ignore[assignment]
    tid, rid = "tx", "req-1"
    jids = [job_transfer_id(tid, r, my_rank) for r in range(decode_tp)]
    errors: list[str] = []
    trace: list[str] = []
    st = {"saved": False, "fwd": False, "sent": None, "layers": set(), "done": 0, "done_at": None}
    announced: set[int] = set()
    released: set[int] = set()
    aborted: set[int] = set()
    now = [__import__("time").monotonic()]
    disturbed: list[str] = []
    if use_verify and decode_tp != my_tp:
        disturbed.append("verify across TP sizes is refused")

    def writer_step() -> None:
        q.given = False
        pusher.writer_loop()
        ctx.stop.clear()

    def collect() -> None:
        done = ctx.reports.take().done_sending
        if rid in done:
            st["done"] += 1
            if st["done_at"] is None:
                st["done_at"] = len(engine.log)
            live = [j for j in engine.active() + list(engine.inflight) if j in jids]
            if live:
                errors.append(f"done_sending while engine transfers {live} may still write")
        if st["done"] > 1:
            errors.append("done_sending twice")
        if st["done_at"] is not None and len(engine.log) > st["done_at"]:
            late = engine.log[st["done_at"] :]
            if any(e[1] in jids for e in late if e[0] == "write"):
                errors.append(f"posted after done_sending: {late}")
                st["done_at"] = len(engine.log)

    settling = False

    def act(name: str) -> bool:
        nonlocal settling
        if name == "save" and not st["saved"] and st["sent"] is None:
            st["saved"] = True
            save = SaveTask(rid, tid, (1, 2, 3), 3, DECODE, remote_tp_size=decode_tp)
            pusher.begin_step([save], [])
        elif name == "layer" and st["saved"] and not st["fwd"]:
            layer = rng.choice(LAYERS)
            st["layers"].add(layer)
            pusher.layer_saved(layer, None)
        elif name == "fwd" and st["saved"] and not st["fwd"]:
            st["fwd"] = True
            pusher.forward_done(list(LAYERS), None)
        elif name == "announce":
            r = rng.choice(consumers)
            if r in announced or r in released:
                return False
            announced.add(r)
            old = "ab" * 16 if not clean and rng.random() < 0.2 else ""
            if old:
                disturbed.append("misaddressed")
            pusher.on_remote_blocks(
                RemoteBlocks(
                    tid,
                    ((20, 21, 22),),
                    f"d:8000/dp0/tp{r}",
                    decode_tp_rank=r,
                    prefill_incarnation=old,
                )
            )
        elif name == "reannounce":
            from moriio_native.control.messages import Misaddressed
            from moriio_native.control.ports import rank_port as _rp

            got = {p for p, m in sender.ports if isinstance(m, Misaddressed)}
            cands = [
                r
                for r in sorted(announced)
                if r not in reannounced and _rp(DECODE.notify_port, 0, r, decode_tp) in got
            ]
            if not cands:
                return False
            r = cands[0]
            reannounced.add(r)
            pusher.on_remote_blocks(
                RemoteBlocks(
                    tid,
                    ((20, 21, 22),),
                    f"d:8000/dp0/tp{r}",
                    decode_tp_rank=r,
                    prefill_incarnation=ctx.incarnation,
                )
            )
        elif name == "checksum" and pending_sums:
            cb = pending_sums.pop(rng.randrange(len(pending_sums)))
            ok_sums = clean or rng.random() < 0.8
            if not ok_sums:
                disturbed.append("no checksums")
            cb({"attn.0": b"x"} if ok_sums else None, "no sums")
        elif name == "handshake" and directory.pending:
            key, future = directory.pending.pop(rng.randrange(len(directory.pending)))
            if not clean and rng.random() < 0.15:
                disturbed.append("handshake failed")
                future.set_exception(TransportError("refused"))
            else:
                rank = key.handshake_port - DECODE.handshake_port
                cached.add(key)
                future.set_result(peer_at(key, DECODE, rank, decode_tp, "WRITE"))
            pusher.feed_writer()
        elif name == "writer" and q.q:
            writer_step()
        elif name == "complete" and engine.completable():
            engine._end(rng.choice(engine.completable()), "done")
        elif name == "efail" and engine.active():
            disturbed.append("engine failure")
            engine._end(rng.choice(engine.active()), "failed")
        elif name == "event" and engine.events:
            ev = engine.events.pop(0)
            drained = ev.drained or ev.transfer_id in drained_early
            drained_early.discard(ev.transfer_id)
            pusher.on_event(ev, drained)
        elif name == "drain" and engine.inflight:
            tid_ = rng.choice(sorted(engine.inflight))
            engine.inflight.discard(tid_)
            if pusher.on_drained(tid_) == "early":
                drained_early.add(tid_)
        elif name == "release":
            r = rng.choice(consumers)
            if r in released or r in announced:
                return False
            released.add(r)
            disturbed.append("release")
            pusher.on_release(Release(tid, consumer_tp_size=decode_tp, consumer_tp_rank=r))
        elif name == "abort":
            r = rng.choice(consumers)
            if r in aborted or r not in announced:
                return False
            aborted.add(r)
            disturbed.append("abort")
            pusher.on_abort_write(
                AbortWrite(
                    tid,
                    f"d:8000/dp0/tp{r}",
                    DECODE.host,
                    DECODE.handshake_port,
                    DECODE.notify_port,
                    decode_tp_rank=r,
                    decode_tp_size=decode_tp,
                )
            )
        elif name == "send" and st["sent"] is None and (st["fwd"] or not st["saved"]):
            if not st["saved"]:
                st["sent"] = "unsaved"
                send = SendTask(
                    rid, tid, aborted=True, unsaved=True, peer=DECODE, remote_tp_size=decode_tp
                )
            elif not clean and rng.random() < 0.2:
                st["sent"] = "preempted"
                send = SendTask(rid, tid, aborted=True, preempted=True)
                pusher.drop_preempted([send])
            else:
                ab = not clean and rng.random() < 0.3
                st["sent"] = "aborted" if ab else "finished"
                send = SendTask(rid, tid, aborted=ab)
            pusher.begin_step([], [send])
        elif name == "timeout" and st["sent"] is not None:
            if not settling:
                disturbed.append("deadline")
            now[0] += 6
            pusher.check_timeouts(now[0])
        else:
            return False
        return True

    names = [
        "save",
        "layer",
        "fwd",
        "announce",
        "handshake",
        "writer",
        "complete",
        "efail",
        "event",
        "release",
        "abort",
        "send",
        "timeout",
        "drain",
        "reannounce",
        "checksum",
    ]
    weights = [3, 3, 2, 2, 3, 4, 2, 0.3, 3, 0.3, 0.3, 1, 0.3, 1, 1, 1]
    if clean:  # nothing goes wrong: every job must end in write_done
        weights = [3, 3, 2, 2, 3, 4, 2, 0, 3, 0, 0, 0, 0, 1, 0, 1]
    for _ in range(steps):
        name = rng.choices(names, weights)[0]
        if act(name):
            trace.append(name)
            collect()
    # Settle: every pending thing happens, then the deadlines pass.
    settling = False
    for r in consumers:
        if r not in announced and r not in released:
            announced.add(r)
            pusher.on_remote_blocks(
                RemoteBlocks(tid, ((20, 21, 22),), f"d:8000/dp0/tp{r}", decode_tp_rank=r)
            )
    for _ in range(50):
        for name in [
            "handshake",
            "writer",
            "complete",
            "event",
            "drain",
            "checksum",
            "reannounce",
            "fwd",
            "save",
        ]:
            while act(name):
                collect()
    act("send")
    collect()
    for _ in range(50):
        for name in ["handshake", "writer", "complete", "event", "drain", "checksum", "reannounce"]:
            while act(name):
                collect()
    if (
        not disturbed
        and st["sent"] == "finished"
        and st["saved"]
        and (
            st["done"] != 1
            or any(
                not isinstance(m, WriteDone)
                for _, m in sender.ports
                if isinstance(m, (WriteDone, WriteFailed, WriteAborted))
            )
        )
    ):
        errors.append(
            f"undisturbed request did not end in write_done: done={st['done']} states="
            f"{ {k: v.name for k, v in pusher.job_states().items() if v.name != 'DONE'} }"
        )
    settling = True
    for name in ["save", "fwd"]:
        act(name)
        collect()
    for _ in range(2000):
        progressed = False
        for name in ["handshake", "writer", "complete", "event", "drain", "checksum", "reannounce"]:
            while act(name):
                trace.append(name)
                collect()
                progressed = True
        if not progressed:
            if act("send"):
                trace.append("send")
            elif st["done"] or st["sent"] in ("unsaved", "preempted"):
                if not pusher._requests and not len(pusher._ack_retries) and not directory.pending:
                    break
                act("timeout")
                trace.append("timeout")
            else:
                act("timeout")
                trace.append("timeout")
            collect()
    if st["sent"] in ("finished", "aborted") and st["done"] != 1:
        errors.append(f"done_sending {st['done']} times at the end; states {pusher.job_states()}")
    if st["sent"] in ("unsaved", "preempted") and st["done"]:
        errors.append("done_sending for a request vLLM freed")
    finals: dict[tuple[int, str], list[str]] = {}
    for port, m in sender.ports:
        if isinstance(m, (WriteDone, WriteFailed)):
            finals.setdefault((port, m.transfer_id), []).append(m.TYPE)
    for key, types in finals.items():
        if len(types) > 1:
            errors.append(f"several final messages to {key}: {types}")
    from moriio_native.control.ports import rank_port

    for r in sorted(announced - released):
        port = rank_port(DECODE.notify_port, 0, r, decode_tp)
        told = [
            m.TYPE
            for p, m in sender.ports
            if p == port and isinstance(m, (WriteDone, WriteFailed, WriteAborted))
        ]
        if not told:
            errors.append(f"decode rank {r} announced and was never told anything")
    acks = [(p, m.transfer_id) for p, m in sender.ports if isinstance(m, WriteAborted)]
    if len(acks) != len(set(acks)):
        errors.append(f"write_aborted twice: {acks}")
    if errors:
        errors.append(f"trace: {trace}")
    return errors


def test_random_interleavings() -> None:
    failures = []
    for seed in range(120):
        for tp, prefill in ((1, (0, 1)), (2, (0, 1)), (2, (1, 2)), (4, (1, 2)), (32, (0, 1))):
            errs = trial(seed, tp, steps=80, prefill=prefill)
            if errs:
                failures.append((seed, tp, prefill, errs))
    assert not failures, failures[:2]
