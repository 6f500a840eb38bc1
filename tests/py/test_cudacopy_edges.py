"""The CUDA copy plugin at its edges: its checksum kernel against the definition
(include/moriio_native/checksum.hpp) over random geometries, error reporting across calls, the
caller's CUDA context kept, and the Python binding's handling of a library that is not the
plugin. Written by a review of the plugin (2026-12-07).

GPU tests run only where torch sees a CUDA GPU and the plugin is there (beside
libmoriio_native.so); the host-only tests run anywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import numpy as np
import pytest

from moriio_native import cudacopy as cc
from test_cudacopy import _SKIP

_STEP = 0x9E3779B97F4A7C15
_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53


def _plugin() -> cc.Plugin:
    if _SKIP:
        pytest.skip(_SKIP)
    return cc.Plugin(cc.default_plugin_path())


# ---- host-only: the binding -------------------------------------------------------------------


def test_shared_plugin_is_none_for_a_library_without_the_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """shared_plugin() promises None (reason logged) when the file is not a usable plugin. A
    library that loads but lacks moriio_native_cudacopy_api (a stale or foreign file at that
    path) makes ctypes raise AttributeError, which shared_plugin does not catch: the caller
    (verify's plugin lookup) gets an exception instead of the torch fallback, on every call."""
    libm = ctypes.util.find_library("m")
    assert libm is not None
    monkeypatch.setattr(cc, "default_plugin_path", lambda: libm)
    monkeypatch.setattr(cc, "_shared", [])
    assert cc.shared_plugin() is None


def test_default_plugin_path_of_a_library_path_with_a_space(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/proc/self/maps names the file after five fields; default_plugin_path takes the last
    whitespace-separated token, so an install under a directory with a space (a venv in
    "/home/u/My Models/venv") yields a relative directory, and shared_plugin() then reports the
    plugin missing (verify silently falls back to torch)."""
    import io

    root = "/opt/my models/venv/lib/python3.11/site-packages/moriio_native/lib"
    maps = (
        "7f0000000000-7f0000100000 r-xp 00000000 08:01 1234                       "
        f"{root}/libmoriio_native.so\n"
    )
    monkeypatch.setattr(cc, "open", lambda *a, **k: io.StringIO(maps), raising=False)
    assert cc.default_plugin_path() == f"{root}/libmoriio_native_cudacopy.so"


# ---- GPU: the checksum kernel against the definition ------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(33))
        x = x * np.uint64(_M1)
        x = x ^ (x >> np.uint64(33))
        x = x * np.uint64(_M2)
        return x ^ (x >> np.uint64(33))


def _reference(buf: np.ndarray, g: dict[str, Any], ids: list[int]) -> list[int]:
    """checksum.hpp's value, straight from its definition (numpy, host)."""
    out = []
    for b in ids:
        words = []
        for p in range(g["planes"]):
            n = g["plane_bytes"][p]
            padded = -(-n // 8) * 8
            for h in range(g["head_begin"], g["head_begin"] + g["heads"]):
                for t in range(g["token_begin"], g["token_begin"] + g["tokens"]):
                    at = (
                        g["offset"]
                        + b * g["block_stride"]
                        + g["plane_offset"][p]
                        + h * g["head_stride"]
                        + (t // g["kbs"]) * g["kernel_block_stride"]
                        + (t % g["kbs"]) * g["token_stride"]
                    )
                    cell = np.zeros(padded, dtype=np.uint8)
                    cell[:n] = buf[at : at + n]
                    words.append(cell.view("<u8"))
        w = np.concatenate(words).astype(np.uint64)
        with np.errstate(over="ignore"):
            pos = (np.arange(1, len(w) + 1, dtype=np.uint64) * np.uint64(_STEP)).astype(np.uint64)
        out.append(int(_mix(w ^ pos).sum(dtype=np.uint64)))
    return out


def _random_geometry(rng: np.random.Generator) -> dict[str, Any]:
    planes = int(rng.integers(1, 3))
    sizes = [1, 3, 7, 8, 12, 16, 24, 32, 48, 100, 256, 264, 272, 512, 520, 1000, 4096, 4104]
    plane_bytes = [int(rng.choice(sizes)) for _ in range(planes)] + [0] * (2 - planes)
    align = int(rng.choice([1, 4, 8, 16]))
    total_heads = int(rng.integers(1, 9))
    block = int(rng.integers(1, 40))
    if rng.random() < 0.2:  # many cells: past the kernel's shared-memory table
        total_heads, block = int(rng.integers(16, 33)), int(rng.integers(64, 129))
        plane_bytes = [int(rng.choice([1, 8, 16, 24])) for _ in range(planes)] + [0] * (2 - planes)
    kbs = int(rng.choice([1, 2, 3, 5, 8, 16, 64, block]))
    head_begin = int(rng.integers(0, total_heads))
    heads = int(rng.integers(1, total_heads - head_begin + 1))
    token_begin = int(rng.integers(0, block))
    tokens = int(rng.integers(1, block - token_begin + 1))
    cell = max(plane_bytes)

    def stride(lo: int) -> int:
        return (lo + int(rng.integers(0, 3)) * align + align - 1) // align * align

    token_stride = stride(cell)
    kernel_block_stride = stride(token_stride * kbs)
    head_stride = stride(kernel_block_stride * (-(-block // kbs)))
    plane_offset = [0, stride(head_stride * total_heads)] if planes == 2 else [0, 0]
    block_stride = stride(plane_offset[1] + head_stride * total_heads)
    return dict(
        planes=planes,
        plane_bytes=plane_bytes,
        offset=int(rng.integers(0, 16)) // align * align,
        block_stride=block_stride,
        head_stride=head_stride,
        token_stride=token_stride,
        kernel_block_stride=kernel_block_stride,
        plane_offset=plane_offset,
        kbs=kbs,
        head_begin=head_begin,
        heads=heads,
        token_begin=token_begin,
        tokens=tokens,
        num_blocks=int(rng.integers(1, 6)),
    )


def test_checksum_kernel_matches_the_definition_over_random_geometries() -> None:
    import torch

    plugin = _plugin()
    rng = np.random.default_rng(7)
    failures = []
    for case in range(300):
        g = _random_geometry(rng)
        span = g["offset"] + g["block_stride"] * g["num_blocks"] + 16
        host = rng.integers(0, 256, span, dtype=np.uint8)
        dev = torch.from_numpy(host).cuda()
        layer = cc.ChecksumLayer(
            base=int(dev.data_ptr()) + g["offset"],
            block_stride=g["block_stride"],
            head_stride=g["head_stride"],
            token_stride=g["token_stride"],
            kernel_block_stride=g["kernel_block_stride"],
            plane_offset=tuple(g["plane_offset"]),
            plane_bytes=tuple(g["plane_bytes"]),
            planes=g["planes"],
            kernel_block_size=g["kbs"],
            head_begin=g["head_begin"],
            heads=g["heads"],
            token_begin=g["token_begin"],
            tokens=g["tokens"],
        )
        ids = [int(i) for i in rng.integers(0, g["num_blocks"], int(rng.integers(1, 7)))]
        torch.cuda.synchronize()
        got = plugin.checksum_blocks(0, 0, cc.layer_array([layer]), np.asarray(ids))
        want = _reference(host, g, ids)
        if [int(v) for v in got[0]] != want:
            failures.append((case, g, ids))
    assert not failures, f"{len(failures)} of 300 geometries disagree; first: {failures[0]}"


# ---- GPU: errors reported by the call that made them ------------------------------------------


def _submit_one(plugin: cc.Plugin, queue: ctypes.c_void_p, dst: Any, src: Any) -> tuple[int, str]:
    offsets = np.zeros(1, dtype=np.int64)
    sizes = np.full(1, 4096, dtype=np.int64)
    op = ctypes.c_void_p()
    err = ctypes.create_string_buffer(cc.ERR_LEN)
    rc = plugin.api.submit(
        queue,
        int(dst.data_ptr()),
        int(src.data_ptr()),
        offsets.ctypes.data_as(cc.INT64_P),
        offsets.ctypes.data_as(cc.INT64_P),
        sizes.ctypes.data_as(cc.INT64_P),
        1,
        0,
        ctypes.byref(op),
        err,
        cc.ERR_LEN,
    )
    if rc == 0:
        plugin.api.release_op(op)
    return rc, err.value.decode()


def test_a_failed_call_does_not_fail_the_next_launch() -> None:
    """A call that failed earlier in this thread (here create_queue on a device that does not
    exist) leaves its error as the runtime's last error; the next submit's launch check,
    cudaGetLastError() after the launch (cudacopy.cu Submit/Enqueue), takes that stale error
    for its own: the kernel was launched (and will write) but the submit says it failed."""
    import torch

    plugin = _plugin()
    queue = ctypes.c_void_p()
    err = ctypes.create_string_buffer(cc.ERR_LEN)
    assert plugin.api.create_queue(0, ctypes.byref(queue), err, cc.ERR_LEN) == 0, err.value
    try:
        src = torch.arange(4096, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        assert _submit_one(plugin, queue, dst, src) == (0, "")
        bad = ctypes.c_void_p()
        assert plugin.api.create_queue(10_000, ctypes.byref(bad), err, cc.ERR_LEN) != 0
        rc, why = _submit_one(plugin, queue, dst, src)
        torch.cuda.synchronize()
        assert rc == 0, f"submit failed with an earlier call's error: {why}"
        assert torch.equal(dst, src)
    finally:
        plugin.api.destroy_queue(queue)


def test_a_failed_call_does_not_fail_the_next_checksum() -> None:
    """The same for checksum_blocks: its launch check is cudaGetLastError() after the launch."""
    import torch

    plugin = _plugin()
    data = torch.arange(256, dtype=torch.uint8, device="cuda")
    layer = cc.ChecksumLayer(
        base=int(data.data_ptr()),
        block_stride=256,
        head_stride=16,
        token_stride=16,
        kernel_block_stride=16,
        plane_offset=(0, 0),
        plane_bytes=(16, 0),
        planes=1,
        kernel_block_size=1,
        head_begin=0,
        heads=16,
        token_begin=0,
        tokens=1,
    )
    layers = cc.layer_array([layer])
    first = plugin.checksum_blocks(0, 0, layers, np.zeros(1, dtype=np.int64))
    queue = ctypes.c_void_p()
    err = ctypes.create_string_buffer(cc.ERR_LEN)
    assert plugin.api.create_queue(10_000, ctypes.byref(queue), err, cc.ERR_LEN) != 0
    again = plugin.checksum_blocks(0, 0, layers, np.zeros(1, dtype=np.int64))
    assert list(again[0]) == list(first[0])


def test_polling_an_unfinished_op_does_not_fail_the_next_submit() -> None:
    """poll_op / query_event answer 'not yet' (cudaErrorNotReady) while work runs; the UCX
    progress thread polls so between every two submits. The next submit must not take that
    answer for a launch failure."""
    import torch

    plugin = _plugin()
    queue = ctypes.c_void_p()
    err = ctypes.create_string_buffer(cc.ERR_LEN)
    assert plugin.api.create_queue(0, ctypes.byref(queue), err, cc.ERR_LEN) == 0, err.value
    try:
        src = torch.arange(4096, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
        event = torch.cuda.Event()
        event.record()
        assert plugin.api.query_event(int(event.cuda_event), err, cc.ERR_LEN) == 0
        rc, why = _submit_one(plugin, queue, dst, src)
        assert rc == 0, f"submit failed after a 'not ready' query: {why}"
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
    finally:
        plugin.api.destroy_queue(queue)


_STRAY_CONTEXT_CHILD = r"""
import ctypes, os, sys, threading
import numpy as np
import torch
sys.path.insert(0, os.environ["STUB_PATH"]) if os.environ.get("STUB_PATH") else None
from moriio_native import cudacopy as cc
from test_cudacopy import _SKIP

cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0

def primary_active(device):
    flags, active = ctypes.c_uint(), ctypes.c_int()
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), device) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)

data = torch.arange(256, dtype=torch.uint8, device="cuda:1")
torch.cuda.synchronize(1)
if primary_active(0):
    print("SKIP: torch itself made device 0's context")
    sys.exit(0)
plugin = cc.Plugin(sys.argv[1])
layer = cc.ChecksumLayer(base=int(data.data_ptr()), block_stride=256, head_stride=16,
    token_stride=16, kernel_block_stride=16, plane_offset=(0, 0), plane_bytes=(16, 0), planes=1,
    kernel_block_size=1, head_begin=0, heads=16, token_begin=0, tokens=1)
def work():  # a pool thread, as pd/verify.py's: no CUDA context current on it
    plugin.checksum_blocks(1, 0, cc.layer_array([layer]), np.zeros(1, dtype=np.int64))
t = threading.Thread(target=work); t.start(); t.join()
print("STRAY" if primary_active(0) else "CLEAN")
"""


def test_checksum_on_device_1_from_a_fresh_thread_makes_no_context_on_device_0() -> None:
    """ChecksumBlocks' DeviceScope (checksum.cu) 'restores' the calling thread's device: on a
    thread with no CUDA context (pd/verify.py's pool threads) cudaGetDevice says 0, and the
    restoring cudaSetDevice(0) creates device 0's primary context (CUDA >= 12 initialises it
    in cudaSetDevice): every worker of a GPU other than 0 that verifies gets a stray context
    (hundreds of MiB) on GPU 0, after vLLM sized its KV cache there. Needs two GPUs."""
    import subprocess
    import sys

    import torch

    if _SKIP:
        pytest.skip(_SKIP)
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    out = subprocess.run(
        [sys.executable, "-c", _STRAY_CONTEXT_CHILD, cc.default_plugin_path()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.strip() == "CLEAN", "a stray primary context was created on device 0"
