"""The CUDA gather/scatter plugin's copy queues driven directly, without UCX or the engine:
the kernel alone benchmarked (``bench/cudacopy_bench.py``, ``bench/cellcopy_bench.py``) and
checked byte for byte on a GPU (``tests/py/test_cudacopy.py``). The ABI's binding itself is
:mod:`moriio_native.cudacopy`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

from moriio_native.cudacopy import (
    ERR_LEN,
    INT64_P,
    Cells,
    CudaCopyError,
    Plugin,
    StampLayer,
    StampRun,
)


def cells_of(geometry: dict[str, Any], into_local: bool) -> Cells:
    """The plugin's form of ``BlockTemplate.cell_geometry`` for a copy into the local side
    (a READ) or into the remote side (a WRITE)."""
    dst, src = ("local", "remote") if into_local else ("remote", "local")
    return Cells(
        geometry["planes"],
        geometry["heads"],
        geometry["tokens"],
        geometry["cell_bytes"],
        *(geometry[dst][k] for k in ("plane_stride", "head_stride", "token_stride")),
        *(geometry[src][k] for k in ("plane_stride", "head_stride", "token_stride")),
    )


class Queue:
    """One plugin queue on ``device``; ``close`` frees it (every op is released before)."""

    def __init__(self, plugin: Plugin, device: int) -> None:
        self.api = plugin.api
        self.handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(ERR_LEN)
        if self.api.create_queue(device, ctypes.byref(self.handle), err, ERR_LEN) != 0:
            raise CudaCopyError(err.value.decode())

    def gather(
        self, dst: int, src: int, plans: list[tuple[Any, Any, Any]], wait_event: int = 0
    ) -> float:
        """Submits every (dst offsets, src offsets, sizes) batch of int64 numpy arrays back to
        back, each behind ``wait_event`` (a cudaEvent_t handle, 0: none), waits for all; returns
        the seconds spent inside submit. Every submitted op is released, also on failure."""
        return self.prepare_gather(dst, src, plans, wait_event)()

    def prepare_gather(
        self, dst: int, src: int, plans: list[tuple[Any, Any, Any]], wait_event: int = 0
    ) -> Callable[[], float]:
        """``gather`` with the ctypes arguments built now: the returned call only submits and
        waits, so a benchmark times the plugin, not the conversion of numpy arrays (the engine
        passes its arrays from C++). The arrays must stay unchanged until then."""
        args = [
            (
                self.handle,
                dst,
                src,
                d.ctypes.data_as(INT64_P),
                s.ctypes.data_as(INT64_P),
                n.ctypes.data_as(INT64_P),
                len(n),
                wait_event,
            )
            for d, s, n in plans
        ]
        return lambda: self._run(args, self.api.submit)

    def copy_cells(
        self, dst: int, src: int, cells: Cells, batches: list[tuple[Any, Any]], wait_event: int = 0
    ) -> float:
        """Submits every (dst block offsets, src block offsets) batch of int64 numpy arrays as
        one cell copy of ``cells`` each, back to back, and waits for all (as ``gather``)."""
        return self.prepare_cells(dst, src, cells, batches, wait_event)()

    def prepare_cells(
        self, dst: int, src: int, cells: Cells, batches: list[tuple[Any, Any]], wait_event: int = 0
    ) -> Callable[[], float]:
        """``copy_cells`` with the ctypes arguments built now (as ``prepare_gather``)."""
        args = [
            (
                self.handle,
                dst,
                src,
                ctypes.byref(cells),
                d.ctypes.data_as(INT64_P),
                s.ctypes.data_as(INT64_P),
                len(d),
                wait_event,
            )
            for d, s in batches
        ]
        return lambda: self._run(args, self.api.submit_cells)

    def copy_stamps(
        self,
        dst: int,
        src: int,
        layers: list[StampLayer],
        runs: list[StampRun],
        dst_ids: Any,
        src_ids: Any,
        wait_event: int = 0,
    ) -> float:
        """Submits one stamped copy (every run of every layer, block ids as int64 numpy arrays)
        and waits for it (as ``gather``)."""
        return self.prepare_stamps(dst, src, layers, runs, dst_ids, src_ids, wait_event)()

    def prepare_stamps(
        self,
        dst: int,
        src: int,
        layers: list[StampLayer],
        runs: list[StampRun],
        dst_ids: Any,
        src_ids: Any,
        wait_event: int = 0,
    ) -> Callable[[], float]:
        """``copy_stamps`` with the ctypes arguments built now (as ``prepare_gather``)."""
        layer_array = (StampLayer * len(layers))(*layers)
        run_array = (StampRun * len(runs))(*runs)
        args = [
            (
                self.handle,
                dst,
                src,
                layer_array,
                len(layers),
                run_array,
                len(runs),
                dst_ids.ctypes.data_as(INT64_P),
                src_ids.ctypes.data_as(INT64_P),
                len(dst_ids),
                wait_event,
            )
        ]
        return lambda: self._run(args, self.api.submit_stamps)

    def _run(self, batches: list[tuple[Any, ...]], submit: Any) -> float:
        """Calls ``submit(*args, op, err, err_len)`` for every argument tuple, then waits for
        every op and releases it (also on failure); returns the seconds spent in ``submit``."""
        err = ctypes.create_string_buffer(ERR_LEN)
        ops: list[ctypes.c_void_p] = []
        in_submit = 0.0
        failure = ""
        try:
            for args in batches:
                op = ctypes.c_void_p()
                t = time.perf_counter()
                rc = submit(*args, ctypes.byref(op), err, ERR_LEN)
                in_submit += time.perf_counter() - t
                if rc != 0:
                    raise CudaCopyError(err.value.decode())
                ops.append(op)
            for op in ops:
                while (r := self.api.poll_op(op, err, ERR_LEN)) == 0:
                    pass
                if r < 0 and not failure:
                    failure = err.value.decode()
        finally:
            for op in ops:
                self.api.release_op(op)  # waits for a kernel still running
        if failure:
            raise CudaCopyError(failure)
        return in_submit

    def close(self) -> None:
        self.api.destroy_queue(self.handle)
