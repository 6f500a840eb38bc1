"""The CUDA gather/scatter kernel, byte for byte, through the plugin's C ABI (no UCX, no engine).

Runs only where torch sees a CUDA GPU and the plugin was built; elsewhere every test skips and
says which of the two is missing.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import pytest

from moriio_native.bench.cudacopy import Queue
from moriio_native.cudacopy import CudaCopyError, Plugin, default_plugin_path

pytestmark = pytest.mark.gpu


def _why_not() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    try:
        path = default_plugin_path()
    except FileNotFoundError as e:
        return str(e)
    if not os.path.exists(path):
        return f"the CUDA copy plugin was not built ({path} is missing)"
    return ""


_SKIP = _why_not()


@pytest.fixture(scope="module")
def queue() -> Any:
    if _SKIP:
        pytest.skip(_SKIP)
    q = Queue(Plugin(default_plugin_path()), 0)
    yield q
    q.close()


def _runs(
    rng: np.random.Generator, sizes: list[int], dst_len: int, src_len: int, align: int
) -> Any:
    """Destinations laid out one after another with random gaps (so runs never overlap and the
    bytes between them must stay untouched), sources anywhere; offsets multiples of ``align``
    (1: the low bits random, so the two ends share 16-byte, 4-byte or no alignment in turn)."""
    dst, src = [], []
    pos = 0
    for size in sizes:
        pos += int(rng.integers(0, 64)) * align
        dst.append(pos)
        src.append(int(rng.integers(0, (src_len - size) // align)) * align)
        pos += size
    assert pos <= dst_len
    order = rng.permutation(len(sizes))  # not sorted: the kernel must not rely on an order
    as_array = np.asarray
    return (
        as_array(dst, dtype=np.int64)[order],
        as_array(src, dtype=np.int64)[order],
        as_array(sizes, dtype=np.int64)[order],
    )


def _check(
    queue: Queue, rng: np.random.Generator, batches: list[list[int]], align: int = 1
) -> None:
    import torch

    total = sum(sum(b) for b in batches)
    dst_len = total + 64 * align * (sum(len(b) for b in batches) + 1)
    src_len = max(max(max(b) for b in batches) * 2, 1 << 20)
    src_host = rng.integers(0, 256, src_len, dtype=np.uint8)
    dst_host = rng.integers(0, 256, dst_len, dtype=np.uint8)  # poison: every byte random
    src = torch.from_numpy(src_host).cuda()
    dst = torch.from_numpy(dst_host).cuda()
    want = dst_host.copy()
    plans = []
    base = 0
    for sizes in batches:
        d, s, n = _runs(rng, sizes, dst_len - base, src_len, align)
        d += base
        base = int((d + n).max()) + align
        for do, so, sz in zip(d, s, n, strict=True):
            want[do : do + sz] = src_host[so : so + sz]
        plans.append((d, s, n))
    torch.cuda.synchronize()
    queue.gather(dst.data_ptr(), src.data_ptr(), plans)
    got = dst.cpu().numpy()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} wrong bytes, first at {bad[0]}"


def test_odd_sizes_and_every_alignment(queue: Queue) -> None:
    rng = np.random.default_rng(1)
    sizes = [1, 3, 15, 16, 17, 31, 255, 256, 511, 4095, 4096, 4100, 65536 + 7, 73728]
    _check(queue, rng, [list(rng.permutation(sizes * 20))])


def test_runs_of_many_chunks_beside_small_ones(queue: Queue) -> None:
    # 128 KiB chunks: these runs span 2 to 40 chunks, mixed with one-chunk runs in one batch.
    rng = np.random.default_rng(2)
    _check(queue, rng, [[300000, 4096, (2 << 20) + 5, 128 * 1024, 1, 65537, 5 << 20] * 3])
    # All runs of one size (the table then has no size or chunk column: chunks by arithmetic)
    # spanning several chunks, on the aligned kernel's 32 KiB chunks and the warp kernel's.
    _check(queue, rng, [[300000] * 40, [65536 + 16] * 100], align=16)
    _check(queue, rng, [[300001] * 30, [(1 << 20) + 3] * 5])


def test_many_small_runs_in_batches_back_to_back(queue: Queue) -> None:
    # More runs than the grid has warps, so warps take groups of several runs each; batches on
    # the queue's two streams at once.
    rng = np.random.default_rng(3)
    _check(queue, rng, [[4096] * 20000, [256] * 30000, [32768] * 3000, [1000] * 5000])


def test_aligned_runs_take_the_vector_path_to_the_last_byte(queue: Queue) -> None:
    # 16-byte aligned at both ends: full 4 KiB steps, a predicated partial step (sizes that end
    # mid-step), runs of several 128 KiB chunks.
    rng = np.random.default_rng(4)
    sizes = [16, 2048, 16384, 16400, 65536, 73728, 300000, (2 << 20) + 16, 5 << 20, 24592]
    _check(queue, rng, [sizes * 8, [65536] * 3000, [73728] * 2000], align=16)
    # One chunk per run and 16-byte offsets, sizes mixed: the table written in the validating
    # pass, its size column begun at the first size that differs.
    _check(queue, rng, [[16, 2048, 16384, 16400, 65536, 73728, 24592] * 300], align=16)


def test_aligned_small_runs_in_many_groups_per_cta(queue: Queue) -> None:
    # The CTA kernel takes groups of consecutive chunks (up to 32, about 64 KiB), several per
    # CTA with the next group's table entries loaded during the copy: 70,000 runs of 4 KiB are
    # about eight groups per CTA; 16-byte runs fill groups of many chunks; mixed sizes put a
    # run's 128 KiB chunks and one-vector runs in one group.
    rng = np.random.default_rng(5)
    _check(queue, rng, [[4096] * 70000, [16] * 5000], align=16)
    _check(queue, rng, [list(rng.permutation([16, 4096, 4112, 131072 + 16, 48] * 2000))], align=16)


def test_copy_waits_on_the_device_for_the_event(queue: Queue) -> None:
    # The producer stream sleeps, then writes the source; the copy is submitted at once behind
    # the event recorded after that write. Without the device-side wait it would copy the old
    # bytes (the sleep is ~50 ms; submitting takes microseconds).
    import torch

    n = 1 << 20
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    producer = torch.cuda.Stream()
    ready = torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)
        src.fill_(7)
        ready.record(producer)
    offsets = np.arange(0, n, 4096, dtype=np.int64)
    sizes = np.full(offsets.size, 4096, dtype=np.int64)
    queue.gather(dst.data_ptr(), src.data_ptr(), [(offsets, offsets, sizes)], ready.cuda_event)
    assert bool((dst == 7).all()), "the copy ran before the event's work finished"


def test_an_event_reads_completed_only_once_its_work_finished() -> None:
    # The UCX backend's query before it posts a batch that waits for an event as UCX operations
    # (a peer on another node): "not yet" while the producer still sleeps, then completed.
    if _SKIP:
        pytest.skip(_SKIP)
    import torch

    plugin = Plugin(default_plugin_path())
    producer = torch.cuda.Stream()
    done, ready = torch.cuda.Event(), torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()
    assert plugin.event_completed(done.cuda_event)  # the plugin's runtime set up before the sleep
    with torch.cuda.stream(producer):
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s
        ready.record(producer)
    assert not plugin.event_completed(ready.cuda_event)
    ready.synchronize()
    assert plugin.event_completed(ready.cuda_event)


def test_empty_batch_completes(queue: Queue) -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert queue.gather(0, 0, [(empty, empty, empty)]) >= 0.0


def test_a_batch_of_2_to_the_32_pieces_is_refused(queue: Queue) -> None:
    # 2^20 runs of 128 MiB are 2^32 pieces of 32 KiB: refused before anything is read or copied.
    import torch

    buf = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    offsets = np.zeros(1 << 20, dtype=np.int64)
    sizes = np.full(1 << 20, 128 << 20, dtype=np.int64)
    with pytest.raises(CudaCopyError, match="more than one kernel takes"):
        queue.gather(buf.data_ptr(), buf.data_ptr(), [(offsets, offsets, sizes)])


def test_non_positive_size_is_refused_with_the_run_named(queue: Queue) -> None:
    import torch

    buf = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    offsets = np.zeros(3, dtype=np.int64)
    sizes = np.asarray([16, 0, 16], dtype=np.int64)
    with pytest.raises(CudaCopyError, match="run 1 has size 0"):
        queue.gather(buf.data_ptr(), buf.data_ptr(), [(offsets, offsets + 1024, sizes)])


# ---- The transposing cell copy (submit_cells) ------------------------------------------------


def _kv_layer(name: str, shape: tuple[int, ...], order: str, heads: int, block: int) -> Any:
    """A bf16 K/V layer of ``shape`` (a CPU tensor: only its geometry is read)."""
    import torch

    import moriio_native as mn

    spec = mn.CacheSpec(
        block_size=block, num_kv_heads=heads, head_size=shape[-1], dtype_bytes=2, axis_order=order
    )
    return mn.describe_layer(name, torch.empty(shape, dtype=torch.bfloat16), spec)


def _check_cells(
    queue: Queue,
    local: Any,
    remote: Any,
    local_ids: list[int],
    remote_ids: list[int],
    into_local: bool,
    batch_blocks: int = 1 << 30,
    windows: tuple[Any, Any] | None = None,
) -> None:
    """The cell copy of the pairs must leave both buffers byte-identical to applying the pair's
    run plan on the host (an independent path: numpy slices, the planner's runs). ``windows``:
    (local, remote) CellWindows of a windowed template (its origin is in the block offsets)."""
    import torch

    import moriio_native as mn
    from moriio_native.bench.cudacopy import cells_of

    tmpl = mn.block_template(local, remote, *(windows or ()))
    geometry = tmpl.cell_geometry
    assert geometry is not None
    pairs = mn.BlockPairs(local_ids, remote_ids)
    plan = tmpl.plan(pairs)
    lo, ro = tmpl.block_offsets(pairs)
    rng = np.random.default_rng(len(local_ids))
    local_host = rng.integers(0, 256, local.span_bytes, dtype=np.uint8)
    remote_host = rng.integers(0, 256, remote.span_bytes, dtype=np.uint8)
    dst_host, src_host = (local_host, remote_host) if into_local else (remote_host, local_host)
    want = dst_host.copy()
    for lo_run, ro_run, n in plan.runs():
        d, s = (lo_run, ro_run) if into_local else (ro_run, lo_run)
        want[d : d + n] = src_host[s : s + n]
    dst = torch.from_numpy(dst_host).cuda()
    src = torch.from_numpy(src_host).cuda()
    d_blocks, s_blocks = (lo, ro) if into_local else (ro, lo)
    batches = [
        (d_blocks[i : i + batch_blocks].copy(), s_blocks[i : i + batch_blocks].copy())
        for i in range(0, len(d_blocks), batch_blocks)
    ]
    torch.cuda.synchronize()
    queue.copy_cells(dst.data_ptr(), src.data_ptr(), cells_of(geometry, into_local), batches)
    got = dst.cpu().numpy()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} wrong bytes, first at {bad[0]}"


@pytest.mark.parametrize("into_local", [True, False], ids=["read", "write"])
def test_cells_nhd_separated_to_hnd_interleaved(queue: Queue, into_local: bool) -> None:
    # The case at llama3-8b's geometry: prefill [2,N,B,H,D] against decode [N,2,H,B,D],
    # 8 heads x 16 tokens x 256-byte cells: one 32 KiB tile per block and plane.
    local = _kv_layer("prefill", (2, 96, 16, 8, 128), "nhd", 8, 16)
    remote = _kv_layer("decode", (128, 2, 8, 16, 128), "hnd", 8, 16)
    rng = np.random.default_rng(5)
    ids = rng.permutation(96)[:60].tolist()
    _check_cells(queue, local, remote, ids, rng.permutation(128)[:60].tolist(), into_local)


def test_cells_tiles_split_heads_and_tokens(queue: Queue) -> None:
    rng = np.random.default_rng(6)
    # 32 heads x 16 tokens x 256 B = 128 KiB per plane: four head tiles per plane.
    local = _kv_layer("l.wide", (2, 40, 16, 32, 128), "nhd", 32, 16)
    remote = _kv_layer("r.wide", (40, 2, 32, 16, 128), "hnd", 32, 16)
    _check_cells(queue, local, remote, rng.permutation(40)[:17].tolist(), list(range(17)), True)
    # 12 KiB cells (head size 6144): two tokens per tile, three token tiles (one partial) per
    # head; 3 heads.
    local = _kv_layer("l.long", (2, 6, 5, 3, 6144), "nhd", 3, 5)
    remote = _kv_layer("r.long", (6, 2, 3, 5, 6144), "hnd", 3, 5)
    _check_cells(queue, local, remote, [5, 0, 2], [1, 4, 3], False)


def test_cells_of_every_alignment_and_many_batches(queue: Queue) -> None:
    rng = np.random.default_rng(7)
    # Head sizes of 3, 4, 6 and 12 bf16 elements: 6-, 8-, 12- and 24-byte cells take the byte,
    # 8-, 4- and 8-byte vector paths; 16 heads x 16 tokens. Batches of 7 blocks, back to back.
    for d in (3, 4, 6, 12):
        local = _kv_layer(f"l.{d}", (2, 64, 16, 16, d), "nhd", 16, 16)
        remote = _kv_layer(f"r.{d}", (64, 2, 16, 16, d), "hnd", 16, 16)
        ids = rng.permutation(64)[:50].tolist()
        _check_cells(queue, local, remote, ids, rng.permutation(64)[:50].tolist(), True, 7)


@pytest.mark.parametrize("into_local", [True, False], ids=["read", "write"])
def test_cells_of_windows(queue: Queue, into_local: bool) -> None:
    import moriio_native as mn

    rng = np.random.default_rng(8)
    # Decode TP 2 against prefill TP 1: heads [4,8) of an 8-head NHD prefill block into a 4-head
    # HND decode block (a sub-grid of the prefill's cells, starting 4 heads in).
    local = _kv_layer("decode", (64, 2, 4, 16, 128), "hnd", 4, 16)
    remote = _kv_layer("prefill", (2, 48, 16, 8, 128), "nhd", 8, 16)
    windows = (mn.CellWindow(), mn.CellWindow(head_begin=4))
    ids = rng.permutation(64)[:30].tolist()
    _check_cells(
        queue, local, remote, ids, rng.permutation(48)[:30].tolist(), into_local, 8, windows
    )
    # Prefill 16-token blocks into tokens [32,48) of decode 64-token blocks.
    local = _kv_layer("decode.64", (20, 2, 2, 64, 128), "hnd", 2, 64)
    remote = _kv_layer("prefill.16", (2, 80, 16, 2, 128), "nhd", 2, 16)
    windows = (mn.CellWindow(token_begin=32, tokens=16), mn.CellWindow())
    _check_cells(queue, local, remote, [3, 19, 0], [79, 1, 40], into_local, windows=windows)


def test_cells_refuse_a_geometry_out_of_range(queue: Queue) -> None:
    import torch

    from moriio_native.cudacopy import Cells

    buf = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    blocks = np.zeros(1, dtype=np.int64)
    for cells in (Cells(2, 8, 16, 0, 0, 0, 0, 0, 0, 0), Cells(3, 8, 16, 256, 0, 0, 0, 0, 0, 0)):
        with pytest.raises(CudaCopyError, match="cell geometry out of range"):
            queue.copy_cells(buf.data_ptr(), buf.data_ptr(), cells, [(blocks, blocks)])


# ---- stamped copies (submit_stamps): layers x blocks x template runs, offsets on the GPU ----


def _stamp_reference(
    dst: np.ndarray,
    src: np.ndarray,
    layers: list[Any],
    runs: list[Any],
    dst_ids: np.ndarray,
    src_ids: np.ndarray,
) -> None:
    """Applies a stamped copy on the host: what the kernel must produce, byte for byte."""
    for layer in layers:
        for i in range(layer.first_block, layer.first_block + layer.num_blocks):
            d0 = layer.dst_layer + int(dst_ids[i]) * layer.dst_stride
            s0 = layer.src_layer + int(src_ids[i]) * layer.src_stride
            for run in runs[layer.first_run : layer.first_run + layer.num_runs]:
                dst[d0 + run.dst : d0 + run.dst + run.size] = src[
                    s0 + run.src : s0 + run.src + run.size
                ]


def _check_stamps(
    queue: Queue,
    layers: list[Any],
    runs: list[Any],
    dst_ids: np.ndarray,
    src_ids: np.ndarray,
    dst_len: int,
    src_len: int,
    seed: int,
) -> None:
    import torch

    rng = np.random.default_rng(seed)
    src_host = rng.integers(0, 256, src_len, dtype=np.uint8)
    dst_host = rng.integers(0, 256, dst_len, dtype=np.uint8)  # poison: every byte random
    src = torch.from_numpy(src_host).cuda()
    dst = torch.from_numpy(dst_host.copy()).cuda()
    queue.copy_stamps(dst.data_ptr(), src.data_ptr(), layers, runs, dst_ids, src_ids)
    torch.cuda.synchronize()
    want = dst_host.copy()
    _stamp_reference(want, src_host, layers, runs, dst_ids, src_ids)
    got = dst.cpu().numpy()
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, f"{wrong.size} bytes differ, first at {wrong[:8]}"


def test_stamps_of_kv_layers_with_split_planes(queue: Queue) -> None:
    from moriio_native.cudacopy import StampLayer, StampRun

    # 8 layers of 2 planes of 4 KiB per block (separated K and V: the plane stride is the
    # cache's half), blocks gathered at random from 64 into 64 others, then a 1-run layer of
    # 64 KiB blocks (chunked into 16 KiB pieces) and a 3-run layer of odd sizes and offsets.
    blocks, plane, n = 64, 4096, 48
    rng = np.random.default_rng(5)
    dst_ids = rng.permutation(blocks)[:n].astype(np.int64)
    src_ids = rng.permutation(blocks)[:n].astype(np.int64)
    layer_bytes = 2 * plane * blocks
    layers = [
        StampLayer(i * layer_bytes, i * layer_bytes, plane, plane, 0, n, 0, 2) for i in range(8)
    ]
    runs = [StampRun(0, 0, plane), StampRun(plane * blocks, plane * blocks, plane)]
    big = 8 * layer_bytes
    layers.append(StampLayer(big, big, 65536, 65536, 0, n, 2, 1))
    runs.append(StampRun(0, 0, 65536))
    odd = big + 65536 * blocks
    layers.append(StampLayer(odd, odd + 3, 1000, 1003, 16, 20, 3, 3))
    runs += [StampRun(0, 5, 17), StampRun(100, 40, 333), StampRun(500, 700, 300)]
    size = odd + 1003 * blocks + 4096
    _check_stamps(queue, layers, runs, dst_ids, src_ids, size, size, seed=6)


def test_stamps_with_many_blocks_and_many_runs_per_layer(queue: Queue) -> None:
    from moriio_native.cudacopy import StampLayer, StampRun

    # 256 runs per layer (the most a layer may have: every cell of a head window) over 3 layers
    # sharing 1,000 block pairs, so every CTA binary-searches a long run table.
    blocks, n, cell = 2048, 1000, 64
    rng = np.random.default_rng(7)
    dst_ids = rng.permutation(blocks)[:n].astype(np.int64)
    src_ids = rng.permutation(blocks)[:n].astype(np.int64)
    block = 256 * cell * 2
    runs = [StampRun(k * cell, k * 2 * cell + cell, cell) for k in range(256)]
    layers = [
        StampLayer(i * block * blocks, i * block * blocks, block, block, 0, n, 0, 256)
        for i in range(3)
    ]
    size = 3 * block * blocks
    _check_stamps(queue, layers, runs, dst_ids, src_ids, size, size, seed=8)


def test_stamps_of_runs_over_16_kib_beside_small_ones_in_one_layer(queue: Queue) -> None:
    from moriio_native.cudacopy import StampLayer, StampRun

    # One layer's template mixes runs of several 16 KiB pieces (the last one short, or exactly
    # full) with runs of one piece and of a few bytes, packed in another order on each side, so
    # a warp's pieces cross runs of every kind; a second layer takes a middle slice of the same
    # template (its first piece is not the template's first).
    sizes = [40000, 16, 16384, 16385, 100000, 7, 32768, 4096]
    src_offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    dst_offsets, at = [0] * len(sizes), 3
    for r in reversed(range(len(sizes))):
        dst_offsets[r], at = at, at + sizes[r] + 5
    src_block, dst_block = sum(sizes) + 1, at
    runs = [StampRun(d, s, n) for d, s, n in zip(dst_offsets, src_offsets, sizes, strict=True)]
    blocks, n = 40, 25
    rng = np.random.default_rng(11)
    dst_ids = rng.permutation(blocks)[:n].astype(np.int64)
    src_ids = rng.permutation(blocks)[:n].astype(np.int64)
    second_dst, second_src = dst_block * blocks, src_block * blocks
    layers = [
        StampLayer(0, 0, dst_block, src_block, 0, n, 0, len(sizes)),
        StampLayer(second_dst, second_src, dst_block, src_block, 5, 17, 2, 4),
    ]
    _check_stamps(queue, layers, runs, dst_ids, src_ids, 2 * second_dst, 2 * second_src, seed=12)


def test_stamps_refuse_a_layer_outside_the_arrays(queue: Queue) -> None:
    import torch

    from moriio_native.cudacopy import StampLayer, StampRun

    buf = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    ids = np.zeros(4, dtype=np.int64)
    runs = [StampRun(0, 0, 64)]
    for layer, words in [
        (StampLayer(0, 0, 64, 64, 0, 4, 0, 2), "stamp layer 0 names runs [0, +2) of 1"),
        (StampLayer(0, 0, 64, 64, 2, 3, 0, 1), "block ids [2, +3) of 4"),
        (StampLayer(0, 0, 64, 64, 0, 4, 0, 257), "1..256 per layer"),
    ]:
        with pytest.raises(CudaCopyError, match=re.escape(words)):
            queue.copy_stamps(buf.data_ptr(), buf.data_ptr(), [layer], runs, ids, ids)
    with pytest.raises(CudaCopyError, match="stamp run 0 has size 0"):
        queue.copy_stamps(
            buf.data_ptr(),
            buf.data_ptr(),
            [StampLayer(0, 0, 64, 64, 0, 4, 0, 1)],
            [StampRun(0, 0, 0)],
            ids,
            ids,
        )
