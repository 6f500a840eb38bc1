"""The hold check and the integrity check against answers and writes at their edges: an answer
whose ids moved between KV-cache groups, a sliding-window WRITE that writes less than it was
announced, and a WRITE mismatch's message. Found by a review of the integrity check
(2026-12-07); each test failed before its fix."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.messages import KvGroup
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.pd.groups import GroupedBlocks, plan_segments
from moriio_native.pd.puller import _announced_ids, _answer_ids, _answer_sizes, _read_remote_ids
from moriio_native.pd.pusher import Pusher
from moriio_native.pd.tasks import RecvTask, SendTask
from moriio_native.pd.verify import Verifier
from moriio_native.verify import WHOLE_BLOCK, CellWindow, compare, pack
from test_pd_protocol import context as protocol_context

BS = 16
FULL = KvGroup(kind="full", block_size=BS, layers=("full.0",), element_types=("bfloat16",))
SWA = KvGroup(
    kind="sliding", block_size=BS, layers=("swa.0",), element_types=("bfloat16",), sliding_window=17
)
PREFILL_AT = ZmqAddress("127.0.0.1", 9000, 9100)


def _task(local: tuple[tuple[int, ...], ...], remote: tuple[tuple[int, ...], ...], end: int):  # type: ignore[no-untyped-def]
    flat = tuple(b for ids in local for b in ids if b)
    return RecvTask(
        "req-1",
        "tx-1",
        PREFILL_AT,
        "p",
        0,
        1,
        local_block_ids=flat,
        grouped=GroupedBlocks(local, remote, 0, end),
    )


def test_an_answer_regrouped_on_its_way_is_not_confirmed() -> None:
    """The prefill computed 33 tokens; its sliding group freed block index 0. Its answer names
    ((1, 2, 3), (0, 4, 5)); the same ids in the same flat order split ((1, 2, 3, 0), (4, 5))
    make the READ fill the decode's sliding slot for tokens 16..31 from the prefill's block 5
    (tokens 32..47). Before, the hold check compared the flat ids only and confirmed it."""
    groups = (FULL, SWA)
    local = ((21, 22, 23), (0, 24, 25))
    answer, regrouped = ((1, 2, 3), (0, 4, 5)), ((1, 2, 3, 0), (4, 5))

    def moved(remote: tuple[tuple[int, ...], ...]) -> dict[int, int]:
        blocks = GroupedBlocks(local, remote, 0, 32)
        out: dict[int, int] = {}
        for seg in plan_segments(groups, groups, blocks, dest="local"):
            out.update(zip(seg.local_blocks, seg.remote_blocks, strict=True))
        return out

    assert (moved(answer)[24], moved(regrouped)[24]) == (4, 5)  # the harm
    ctx, _, _ = protocol_context("read", producer=True)
    pusher = Pusher(ctx)
    sent = SendTask("req-1", "tx-1", block_ids=(1, 2, 3, 0, 4, 5), group_sizes=(3, 3))
    pusher.begin_step([], [sent])

    def check(remote: tuple[tuple[int, ...], ...]) -> str | None:
        task = _task(local, remote, 32)
        return pusher.held_for_checksums(
            "tx-1", _read_remote_ids(task), 0, _answer_ids(task), _answer_sizes(task)
        )

    assert check(answer) is None
    why = check(regrouped)
    assert why is not None and "groups hold [4, 2]" in why, why


def test_a_sliding_window_write_moving_every_needed_byte_passes_verify() -> None:
    """The decode announced 4 blocks for 64 tokens; the prefill writes (and checksums) only
    the last 2, those the window needs. Before, the decode compared all 4 and failed the good
    WRITE (1 peer checksum for 4 blocks... here 2 for 4)."""
    decode, prefill, end = ((31, 32, 33, 34),), ((0, 0, 13, 14),), 64
    task = _task(decode, (), end)
    decode_ids = _announced_ids(SimpleNamespace(task=task, parts={0: object()}), (SWA,))
    assert decode_ids is not None
    segments = plan_segments((SWA,), (SWA,), GroupedBlocks(prefill, decode, 0, end), dest="remote")
    prefill_ids = Pusher._verified_ids(SimpleNamespace(plan=None, segments={"swa.0": segments}))
    assert prefill_ids is not None
    moved = {d: p for s in segments for p, d in zip(s.local_blocks, s.remote_blocks, strict=True)}
    theirs = {"swa.0": pack(np.array([1000 + p for p in prefill_ids], dtype=np.uint64))}
    ours = {"swa.0": pack(np.array([1000 + moved.get(d, -999) for d in decode_ids]))}
    mismatches = compare(ours, theirs, decode_ids, None)
    assert mismatches == [], [str(m) for m in mismatches]


class _Summer:
    layers = ("L",)

    def compute(self, block_ids: Sequence[int], window: CellWindow = WHOLE_BLOCK) -> dict:
        return {"L": pack(np.array([1, 3], dtype=np.uint64))}


def test_a_write_mismatch_does_not_name_the_decode_block_as_the_prefills() -> None:
    """A write_done names no prefill block ids: the message said "block 32 (remote block 32)"
    for a block the prefill knows as another."""
    verifier = Verifier(
        lambda: _Summer(),
        ControlSecurity(MessageAuth(None), PeerAllowlist(["127.0.0.0/8"])),
        "d:1/dp0/tp0",
        timeout=5.0,
    )
    got: list[str | None] = []
    done = threading.Event()

    def verdict(why: str | None) -> None:
        got.append(why)
        done.set()

    try:
        theirs = {"L": pack(np.array([1, 2], dtype=np.uint64))}
        verifier.check_write("tx-1", theirs, [31, 32], verdict)
        assert done.wait(10)
    finally:
        verifier.shutdown()
    (why,) = got
    assert why is not None and "block 32" in why and "remote block" not in why, why
