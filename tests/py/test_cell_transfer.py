"""Layer pairs of different axis orders (prefill NHD, decode HND) through the Engine, byte for
byte: READ and WRITE between two engines of this process, on the loopback backend taking cells
(the CPU reference of the transposing copy), on loopback with cells off and on UCX host memory
(both the engine's run fallback), and on loopback taking stamped batches instead (templates and
block ids, the CPU reference of the stamping kernel). Every byte of the destination backing is
compared with what plain numpy indexing says (kvcache.expected_after_copy), and each transfer's
event says which path moved it (``cell_batches``). The GPU path (UCX CUDA IPC with the cell
kernel) is checked in test_ucx_two_process.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc

TIMEOUT = 60.0  # hang guard, not a performance bound


def _model(side: str) -> list[kc.LayerShape]:
    """Two K/V layers whose runs are single 32-byte cells between the sides (NHD against HND,
    separated against interleaved), and a latent layer that moves as whole-block runs."""
    if side == "prefill":
        return [
            kc.LayerShape("kv.0", "separated_nhd", block_size=8, head_size=16, num_heads=4),
            kc.LayerShape("kv.1", "interleaved_nhd", block_size=8, head_size=16, num_heads=4),
            kc.LayerShape("lat", "latent", block_size=8, head_size=24),
        ]
    return [
        kc.LayerShape("kv.0", "interleaved_hnd", block_size=8, head_size=16, num_heads=4),
        kc.LayerShape("kv.1", "separated_hnd", block_size=8, head_size=16, num_heads=4),
        kc.LayerShape("lat", "latent", block_size=8, head_size=24, pad_bytes=16),
    ]


def _ucx_available() -> bool:
    return {b.name: b for b in mn.available_backends()}["ucx"].available


CASES = [
    pytest.param("loopback", {}, "cells", id="loopback-cells"),
    pytest.param("loopback", {"loopback_cells": "0"}, "runs", id="loopback-runs"),
    pytest.param(
        "loopback",
        {"loopback_cells": "0", "loopback_stamps": "1"},
        "stamps",
        id="loopback-stamps",
    ),
    pytest.param(
        "ucx",
        {},
        "runs",
        id="ucx-host-runs",
        marks=[
            pytest.mark.ucx,
            pytest.mark.skipif(not _ucx_available(), reason="the ucx backend is unavailable"),
        ],
    ),
]


@pytest.mark.parametrize(("backend", "options", "path"), CASES)
def test_nhd_hnd_read_and_write_are_byte_exact(
    backend: str, options: dict[str, str], path: str
) -> None:
    caches = {}
    engines = {}
    for role, blocks, seed in (("prefill", 10, 5), ("decode", 14, 6)):
        caches[role] = kc.build_caches(_model(role), num_blocks=blocks)
        kc.fill_random(caches[role], seed)
        engines[role] = mn.Engine(role, backend, options=options)
    meta = {r: e.register_kv_caches(caches[r].registrations()) for r, e in engines.items()}
    assert engines["decode"].add_peer(meta["prefill"]) == "prefill"
    assert engines["prefill"].add_peer(meta["decode"]) == "decode"
    decode, prefill = caches["decode"], caches["prefill"]
    prefill_before = prefill.backing.copy()
    # The two K/V layers move as cells where the backend takes them, one batch each (their
    # strides differ: two geometries), and the latent layer as runs; with stamps every batch
    # is a stamped one.
    want_cells = 2 if path == "cells" else 0

    local, remote = [13, 0, 7, 2], [4, 9, 0, 5]
    expected = kc.expected_after_copy(decode, prefill, local, remote)
    engines["decode"].read("r", "prefill", local, remote)
    event = engines["decode"].wait(["r"], timeout=TIMEOUT)["r"]
    assert event.state == "done", event.message
    assert event.cell_batches == want_cells
    assert event.stamped_batches == (event.batches if path == "stamps" else 0)
    assert event.bytes == len(local) * decode.total_block_bytes()
    np.testing.assert_array_equal(decode.backing, expected)
    np.testing.assert_array_equal(prefill.backing, prefill_before)

    # WRITE: the prefill pushes other blocks, layer by layer.
    expected = kc.expected_after_copy(decode, prefill, [1, 11], [8, 3])
    for shape in prefill.shapes:
        assert engines["prefill"].write_layer("w", shape.name, "decode", [8, 3], [1, 11])
    engines["prefill"].seal("w", "decode", expected_writes=len(prefill.shapes))
    event = engines["prefill"].wait(["w"], timeout=TIMEOUT)["w"]
    assert event.state == "done", event.message
    assert event.cell_batches == want_cells  # a WRITE's batch is one layer
    assert event.stamped_batches == (event.batches if path == "stamps" else 0)
    np.testing.assert_array_equal(decode.backing, expected)


@pytest.mark.parametrize("key", ["loopback_cells", "loopback_stamps"])
def test_loopback_path_options_are_checked(key: str) -> None:
    with pytest.raises(mn.InvalidArgumentError, match=f"{key} must be '0' or '1'"):
        mn.Engine("x", "loopback", options={key: "yes"})
