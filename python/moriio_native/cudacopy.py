"""ctypes binding of the CUDA gather/scatter plugin (``libmoriio_native_cudacopy.so``).

The plugin's C ABI is ``cpp/cudacopy/cudacopy_abi.h``. The UCX backend loads it from C++ for
its copies; Python loads it for the integrity check's block checksums of CUDA layers
(:meth:`Plugin.checksum_blocks`, through :func:`shared_plugin`), and the benchmarks and GPU tests
drive its copy queues directly (``moriio_native.bench.cudacopy``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ABI_VERSION = 7

_ERR = ctypes.c_char_p
INT64_P = ctypes.POINTER(ctypes.c_int64)
ERR_LEN = 256


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


class ChecksumLayer(ctypes.Structure):
    """``moriio_cudacopy_checksum_layer`` of cudacopy_abi.h: one layer's cells (a layout's
    parameters with the window resolved) for :meth:`Plugin.checksum_blocks`."""

    _fields_ = [
        ("base", ctypes.c_uint64),
        ("block_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("kernel_block_stride", ctypes.c_int64),
        ("plane_offset", ctypes.c_int64 * 2),
        ("plane_bytes", ctypes.c_uint32 * 2),
        ("planes", ctypes.c_uint32),
        ("kernel_block_size", ctypes.c_uint32),
        ("head_begin", ctypes.c_uint32),
        ("heads", ctypes.c_uint32),
        ("token_begin", ctypes.c_uint32),
        ("tokens", ctypes.c_uint32),
    ]


def layer_array(layers: list[ChecksumLayer]) -> ctypes.Array[ChecksumLayer]:
    """``layers`` as the C array :meth:`Plugin.checksum_blocks` takes (built once, reusable)."""
    return (ChecksumLayer * len(layers))(*layers)


class _Api(ctypes.Structure):
    """``moriio_cudacopy_api`` of cudacopy_abi.h (ABI version 7)."""

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
                INT64_P,
                INT64_P,
                INT64_P,
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
                INT64_P,
                INT64_P,
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
                INT64_P,
                INT64_P,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_void_p),
                _ERR,
                ctypes.c_size_t,
            ),
        ),
        ("query_event", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, _ERR, ctypes.c_size_t)),
        (
            "checksum_blocks",
            ctypes.CFUNCTYPE(
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_uint64,
                ctypes.POINTER(ChecksumLayer),
                ctypes.c_uint32,
                INT64_P,
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_uint64),
                _ERR,
                ctypes.c_size_t,
            ),
        ),
    ]


class CudaCopyError(RuntimeError):
    """The plugin refused or failed a call; the message is the plugin's."""


def default_plugin_path() -> str:
    """The plugin beside the ``libmoriio_native.so`` that this process loaded with the package."""
    import moriio_native._native  # noqa: F401  (loads libmoriio_native.so)

    with open("/proc/self/maps") as maps:
        for line in maps:
            # The path is everything after the first five fields (it may hold spaces).
            fields = line.rstrip("\n").split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.endswith("/libmoriio_native.so"):
                return os.path.join(os.path.dirname(path), "libmoriio_native_cudacopy.so")
    raise FileNotFoundError("libmoriio_native.so is not loaded; pass the plugin's path")


class Plugin:
    """The loaded plugin; ``probe`` already passed. Its queues are not thread-safe (as the
    ABI's); :meth:`event_completed` and :meth:`checksum_blocks` are."""

    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)
        try:
            entry = self._lib.moriio_native_cudacopy_api
        except AttributeError:
            raise CudaCopyError(f"{path}: no moriio_native_cudacopy_api (not the plugin)") from None
        entry.restype = ctypes.POINTER(_Api)
        api = entry()
        if not api:
            raise CudaCopyError(f"{path}: moriio_native_cudacopy_api returned no table")
        self.api: Any = api.contents
        if self.api.abi_version != ABI_VERSION:
            raise CudaCopyError(
                f"{path}: ABI version {self.api.abi_version}, this binding speaks {ABI_VERSION}"
            )
        err = ctypes.create_string_buffer(ERR_LEN)
        if self.api.probe(err, ERR_LEN) != 0:
            raise CudaCopyError(f"{path}: {err.value.decode()}")

    def event_completed(self, event: int) -> bool:
        """Whether the work the cudaEvent_t handle ``event`` recorded has finished (the query
        the UCX backend makes before posting a batch that waits for it as UCX operations)."""
        err = ctypes.create_string_buffer(ERR_LEN)
        done = self.api.query_event(event, err, ERR_LEN)
        if done < 0:
            raise CudaCopyError(err.value.decode())
        return done == 1

    def checksum_blocks(
        self, device: int, stream: int, layers: ctypes.Array[ChecksumLayer], block_ids: np.ndarray
    ) -> np.ndarray:
        """The block checksums of ``block_ids`` (int64) in every layer (:func:`layer_array`),
        one kernel on ``stream`` (a cudaStream_t handle on ``device``, 0: the legacy default
        stream) after the work queued there: a ``(len(layers), len(block_ids))`` uint64 array.
        Blocks until the values are here. The caller has checked the ids and windows against
        the layers; CudaCopyError with the plugin's reason (``checksum layer <i>`` for a bad
        layer)."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        out = np.zeros((len(layers), len(ids)), dtype=np.uint64)
        err = ctypes.create_string_buffer(ERR_LEN)
        rc = self.api.checksum_blocks(
            device,
            stream,
            layers,
            len(layers),
            ids.ctypes.data_as(INT64_P),
            len(ids),
            out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
            err,
            ERR_LEN,
        )
        if rc != 0:
            raise CudaCopyError(err.value.decode())
        return out


_shared_lock = threading.Lock()
_shared: list[Plugin | None] = []  # empty until the first shared_plugin call


def shared_plugin() -> Plugin | None:
    """The plugin beside this package's native library, loaded once per process; None (the
    reason logged once) when it is not there, speaks another ABI or finds no CUDA device --
    on a CPU-only or ROCm machine, or a build without nvcc."""
    with _shared_lock:
        if not _shared:
            try:
                _shared.append(Plugin(default_plugin_path()))
            except (OSError, CudaCopyError) as exc:
                logger.info("CUDA copy plugin not used: %s", exc)
                _shared.append(None)
        return _shared[0]
