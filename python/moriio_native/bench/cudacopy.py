"""ctypes binding of the CUDA gather/scatter plugin (``libmoriio_native_cudacopy.so``).

The plugin's C ABI is ``cpp/cudacopy/cudacopy_abi.h``; the UCX backend is its real user.
This binding exists so that the kernel alone can be benchmarked (``bench/cudacopy_bench.py``)
and checked byte for byte on a GPU (``tests/py/test_cudacopy.py``) without UCX or the engine.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

ABI_VERSION = 6

_ERR = ctypes.c_char_p
_I64P = ctypes.POINTER(ctypes.c_int64)
_ERR_LEN = 256


class Cells(ctypes.Structure):
    """``moriio_cudacopy_cells`` of cudacopy_abi.h: a block pair's cell grid, strides in bytes."""

    _fields_ = [
        ("planes", ctypes.c_uint32),
        ("heads", ctypes.c_uint32),
        ("tokens", ctypes.c_uint32),
        ("cell_bytes", ctypes.c_uint32),
        ("dst_plane_stride", ctypes.c_int64),
        ("dst_head_stride", ctypes.c_int64),
        ("dst_token_stride", ctypes.c_int64),
        ("src_plane_stride", ctypes.c_int64),
        ("src_head_stride", ctypes.c_int64),
        ("src_token_stride", ctypes.c_int64),
    ]


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


class StampLayer(ctypes.Structure):
    """``moriio_cudacopy_stamp_layer`` of cudacopy_abi.h: one layer of a stamped copy."""

    _fields_ = [
        ("dst_layer", ctypes.c_int64),
        ("src_layer", ctypes.c_int64),
        ("dst_stride", ctypes.c_int64),
        ("src_stride", ctypes.c_int64),
        ("first_block", ctypes.c_uint64),
        ("num_blocks", ctypes.c_uint64),
        ("first_run", ctypes.c_uint32),
        ("num_runs", ctypes.c_uint32),
    ]


class StampRun(ctypes.Structure):
    """``moriio_cudacopy_stamp_run`` of cudacopy_abi.h: a template run within a block."""

    _fields_ = [("dst", ctypes.c_int64), ("src", ctypes.c_int64), ("size", ctypes.c_int64)]


class _Api(ctypes.Structure):
    """``moriio_cudacopy_api`` of cudacopy_abi.h (ABI version 6)."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("probe", ctypes.CFUNCTYPE(ctypes.c_int, _ERR, ctypes.c_size_t)),
        (
            "create_queue",
            ctypes.CFUNCTYPE(
                ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), _ERR, ctypes.c_size_t
            ),
        ),
        ("destroy_queue", ctypes.CFUNCTYPE(None, ctypes.c_void_p)),
        (
            "submit",
            ctypes.CFUNCTYPE(
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_uint64,
                ctypes.c_uint64,
                _I64P,
                _I64P,
                _I64P,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_void_p),
                _ERR,
                ctypes.c_size_t,
            ),
        ),
        ("poll_op", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _ERR, ctypes.c_size_t)),
        ("release_op", ctypes.CFUNCTYPE(None, ctypes.c_void_p)),
        (
            "submit_cells",
            ctypes.CFUNCTYPE(
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(Cells),
                _I64P,
                _I64P,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_void_p),
                _ERR,
                ctypes.c_size_t,
            ),
        ),
        (
            "submit_stamps",
            ctypes.CFUNCTYPE(
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(StampLayer),
                ctypes.c_uint32,
                ctypes.POINTER(StampRun),
                ctypes.c_uint32,
                _I64P,
                _I64P,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_void_p),
                _ERR,
                ctypes.c_size_t,
            ),
        ),
        ("query_event", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, _ERR, ctypes.c_size_t)),
    ]


class CudaCopyError(RuntimeError):
    """The plugin refused or failed a call; the message is the plugin's."""


def default_plugin_path() -> str:
    """The plugin beside the ``libmoriio_native.so`` that this process loaded with the package."""
    import moriio_native._native  # noqa: F401  (loads libmoriio_native.so)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.endswith("/libmoriio_native.so"):
                return os.path.join(os.path.dirname(path), "libmoriio_native_cudacopy.so")
    raise FileNotFoundError("libmoriio_native.so is not loaded; pass the plugin's path")


class Plugin:
    """The loaded plugin; ``probe`` already passed. Not thread-safe (as the ABI's queues)."""

    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)
        entry = self._lib.moriio_native_cudacopy_api
        entry.restype = ctypes.POINTER(_Api)
        self.api: Any = entry().contents
        if self.api.abi_version != ABI_VERSION:
            raise CudaCopyError(
                f"{path}: ABI version {self.api.abi_version}, this binding speaks {ABI_VERSION}"
            )
        err = ctypes.create_string_buffer(_ERR_LEN)
        if self.api.probe(err, _ERR_LEN) != 0:
            raise CudaCopyError(f"{path}: {err.value.decode()}")

    def event_completed(self, event: int) -> bool:
        """Whether the work the cudaEvent_t handle ``event`` recorded has finished (the query
        the UCX backend makes before posting a batch that waits for it as UCX operations)."""
        err = ctypes.create_string_buffer(_ERR_LEN)
        done = self.api.query_event(event, err, _ERR_LEN)
        if done < 0:
            raise CudaCopyError(err.value.decode())
        return done == 1


class Queue:
    """One plugin queue on ``device``; ``close`` frees it (every op is released before)."""

    def __init__(self, plugin: Plugin, device: int) -> None:
        self.api = plugin.api
        self.handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(_ERR_LEN)
        if self.api.create_queue(device, ctypes.byref(self.handle), err, _ERR_LEN) != 0:
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
                d.ctypes.data_as(_I64P),
                s.ctypes.data_as(_I64P),
                n.ctypes.data_as(_I64P),
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
                d.ctypes.data_as(_I64P),
                s.ctypes.data_as(_I64P),
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
                dst_ids.ctypes.data_as(_I64P),
                src_ids.ctypes.data_as(_I64P),
                len(dst_ids),
                wait_event,
            )
        ]
        return lambda: self._run(args, self.api.submit_stamps)

    def _run(self, batches: list[tuple[Any, ...]], submit: Any) -> float:
        """Calls ``submit(*args, op, err, err_len)`` for every argument tuple, then waits for
        every op and releases it (also on failure); returns the seconds spent in ``submit``."""
        err = ctypes.create_string_buffer(_ERR_LEN)
        ops: list[ctypes.c_void_p] = []
        in_submit = 0.0
        failure = ""
        try:
            for args in batches:
                op = ctypes.c_void_p()
                t = time.perf_counter()
                rc = submit(*args, ctypes.byref(op), err, _ERR_LEN)
                in_submit += time.perf_counter() - t
                if rc != 0:
                    raise CudaCopyError(err.value.decode())
                ops.append(op)
            for op in ops:
                while (r := self.api.poll_op(op, err, _ERR_LEN)) == 0:
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
