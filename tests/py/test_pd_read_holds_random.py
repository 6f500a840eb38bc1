"""Random interleavings of a READ prefill rank's hold (pd/pusher.py): releases of every decode
rank (before and after the send task, repeated), the deadline, hold checks. Written by a review
of the prefill side (2026-12-07). Invariants: done_sending exactly once per request; never
before every decode rank that reads this rank released, unless abort_timeout passed; a hold
check passes only while held."""

from __future__ import annotations

import random
import time

from moriio_native.control.messages import Release
from moriio_native.pd.pusher import Pusher
from moriio_native.pd.tasks import SendTask
from test_pd_tp_fanout import context


def trial(seed: int, prefill_tp: int, rank: int, decode_tp: int) -> list[str]:
    rng = random.Random(seed)
    ctx, _, _, _ = context("read", producer=True, tp_rank=rank, tp_size=prefill_tp)
    pusher = Pusher(ctx)
    plan = ctx.tp_plan("d", decode_tp, prefill=True)
    readers = set(plan.consumers(rank)) or {d for d in range(decode_tp) if plan.releases(d, rank)}
    errors: list[str] = []
    released: set[int] = set()
    st = {"sent": False, "done": 0, "expired": False}
    t0 = time.monotonic()
    now = [t0]
    ids = (5, 6, 7)
    for _ in range(30):
        a = rng.choice(["send", "release", "release", "check", "timeout", "dup"])
        if a == "send" and not st["sent"]:
            st["sent"] = True
            pusher.begin_step([], [SendTask("req", "tx", block_ids=ids, hold_until_ms=99)])
        elif a == "release":
            d = rng.randrange(decode_tp)
            released.add(d)
            pusher.on_release(Release("tx", consumer_tp_size=decode_tp, consumer_tp_rank=d))
        elif a == "dup" and released:
            d = rng.choice(sorted(released))
            pusher.on_release(Release("tx", consumer_tp_size=decode_tp, consumer_tp_rank=d))
        elif a == "timeout":
            now[0] += rng.choice([1.0, ctx.cfg.abort_timeout / 2])
            pusher.check_timeouts(now[0])
        elif a == "check":
            why = pusher.held_for_checksums("tx", ids[:1], 99, ids)
            held = st["sent"] and not st["done"]
            if (why is None) != held:
                errors.append(f"hold check {why!r} while held={held}")
        if "req" in ctx.reports.take().done_sending:
            st["done"] += 1
            expired = now[0] - t0 > ctx.cfg.abort_timeout
            if not readers <= released and not expired:
                errors.append(f"freed with readers {readers} but releases {released}")
    if st["sent"]:
        pusher.check_timeouts(now[0] + 10 * ctx.cfg.abort_timeout)
        if "req" in ctx.reports.take().done_sending:
            st["done"] += 1
        if st["done"] != 1:
            errors.append(f"done_sending {st['done']} times")
    return errors


def test_random_read_holds() -> None:
    failures = [
        (seed, ptp, r, dtp, e)
        for seed in range(60)
        for ptp, dtp in ((1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 2), (2, 8))
        for r in range(ptp)
        if (e := trial(seed, ptp, r, dtp))
    ]
    assert not failures, failures[:3]
