"""Cell windows given as something other than integers are refused, never truncated: a
CellWindow's fields went through int(), so a head range computed with true division (1.5) moved
another window and the transfer ended done. Found by a review of the layout paths (2026-12-07,
which also ran more than 50,000 randomized transfers of every layout pair against an independent
reference without a wrong byte); each case seen failing. Two loopback engines in one process."""

from __future__ import annotations

import numpy as np
import pytest

import moriio_native as mn

TIMEOUT = 10.0


def _pair():  # type: ignore[no-untyped-def]
    """decode (local, 4 heads, 2 blocks) and prefill (remote, 4 heads, 2 blocks): one separated
    NHD layer [2, N, B, H, D] of uint8, block 4 tokens, head size 2, each on its own page-aligned
    backing filled with distinct bytes."""

    def side(name: str, fill: int):  # type: ignore[no-untyped-def]
        raw = np.zeros(2 * 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        backing = raw[start : start + 4096]
        view = backing[: 2 * 2 * 4 * 4 * 2].reshape(2, 2, 4, 4, 2)  # [2, N, B, H, D]
        view.reshape(-1)[:] = (np.arange(view.size, dtype=np.int64) % 251 + fill).astype(np.uint8)
        spec = mn.CacheSpec(
            kind="kv", block_size=4, num_kv_heads=4, head_size=2, dtype_bytes=1, axis_order="nhd"
        )
        engine = mn.Engine(name, "loopback")
        reg = mn.LayerRegistration(
            name="attn",
            tensor=view,
            spec=spec,
            allocation=(backing.ctypes.data, backing.nbytes),
            kv_plane_axis="separated",
        )
        return engine, view, engine.register_kv_caches([reg])

    ed, vd, md = side("decode", 0)
    ep, vp, mp = side("prefill", 100)
    ed.add_peer(mp)
    ep.add_peer(md)
    return ed, vd, ep, vp


@pytest.mark.parametrize(
    "window",
    [
        mn.CellWindow(head_begin=1.5, heads=2),  # a head range computed with true division
        mn.CellWindow(head_begin=0, heads=2.7),
        mn.CellWindow(token_begin=0.5, tokens=2),
        mn.CellWindow(head_begin=True, heads=2),  # block ids refuse bools (PyBool_Check)
        mn.CellWindow(head_begin=0, heads=2**70),  # was a RuntimeError from the binding
    ],
    ids=["head_begin", "heads", "token_begin", "bool", "huge"],
)
def test_non_integer_window_is_refused_not_truncated(window: mn.CellWindow) -> None:
    """Before: 1.5 became 1 and 2.7 became 2, and the transfer of another window ended done.
    Block ids and seal counts refuse non-integers; a window does too, before any transfer
    exists, with nothing changed."""
    ed, vd, _, _ = _pair()
    before = vd.copy()
    with pytest.raises(mn.InvalidArgumentError):
        ed.read_segments("t", "prefill", [mn.BlockSegment([0], [1], None, window, window)])
    assert ed.pending_transfers == 0
    assert ed.poll_events(timeout=0.05) == []
    assert np.array_equal(vd, before)


def test_non_integer_window_is_refused_by_write_layer_and_block_template() -> None:
    """The same truncation on the WRITE path (write_layer segments) and in
    layout.block_template / plan_block_copies: every entry point goes through
    CellWindow._native()."""
    _, vd, ep, _ = _pair()
    before = vd.copy()
    window = mn.CellWindow(head_begin=1.5, heads=2)
    with pytest.raises(mn.InvalidArgumentError):
        ep.write_layer(
            "w", "attn", "decode", segments=[mn.BlockSegment([1], [0], None, window, window)]
        )
    event = ep.wait(["w"], timeout=TIMEOUT).get("w")
    assert event is None or event.state != "done"
    assert np.array_equal(vd, before)

    from moriio_native.layout import describe_layer, plan_block_copies

    spec = mn.CacheSpec(
        kind="kv", block_size=4, num_kv_heads=4, head_size=2, dtype_bytes=1, axis_order="nhd"
    )
    layout = describe_layer("attn", vd, spec, "separated")
    with pytest.raises(mn.InvalidArgumentError):
        plan_block_copies(layout, layout, [0], [1], local_window=window, remote_window=window)


def _planning_layout() -> mn.LayerLayout:
    spec = mn.CacheSpec(
        kind="kv", block_size=4, num_kv_heads=4, head_size=2, dtype_bytes=1, axis_order="nhd"
    )
    return mn.describe_layer("attn", np.zeros((2, 3, 4, 4, 2), np.uint8), spec, "separated")


@pytest.mark.parametrize(
    "window",
    [
        mn.CellWindow(head_begin=False),
        mn.CellWindow(token_begin=0.0),  # type: ignore[arg-type]
        mn.CellWindow(head_begin=0.0),  # type: ignore[arg-type]
    ],
    ids=["bool-equal-to-whole", "float-equal-to-whole", "float-head-begin"],
)
def test_a_non_integer_window_equal_to_the_whole_block_is_refused(window: mn.CellWindow) -> None:
    """Seen failing (a review of the layout paths, 2026-12-07): a window equal to the whole
    block took its shortcut before its fields were checked."""
    layout = _planning_layout()
    with pytest.raises(mn.InvalidArgumentError, match="must be an integer"):
        mn.plan_block_copies(layout, layout, [0], [1], local_window=window, remote_window=window)


def test_a_non_integer_window_is_refused_after_its_integer_twin_was_planned() -> None:
    """Seen failing: ``CellWindow(head_begin=True, heads=2.0)`` equals (and hashes as) the
    integer window, so once that one was planned the template cache answered for it."""
    layout = _planning_layout()
    good = mn.CellWindow(head_begin=1, heads=2)
    mn.plan_block_copies(layout, layout, [0], [1], local_window=good, remote_window=good)
    bad = mn.CellWindow(head_begin=True, heads=2.0)  # type: ignore[arg-type]
    with pytest.raises(mn.InvalidArgumentError, match="must be an integer"):
        mn.plan_block_copies(layout, layout, [0], [1], local_window=bad, remote_window=bad)
