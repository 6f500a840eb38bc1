"""The MoRI-IO backend from Python.

Everywhere: ``available_backends()`` lists mori with the precise reason it cannot run, and an
Engine on it raises BackendUnavailableError carrying that reason. On a ROCm machine with MoRI-IO
(marker ``rocm``): two engines register KV caches, handshake, and move blocks with READ and WRITE
over MoRI, verified byte for byte -- in host memory and in GPU memory.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc

# Loopback control plane: both engines live in this process; data still crosses the NIC.
MORI_OPTIONS = {"mori_backend": "rdma", "mori_host": "127.0.0.1", "qp_per_transfer": "2"}


def _mori_info() -> mn.BackendInfo:
    infos = {info.name: info for info in mn.available_backends(MORI_OPTIONS)}
    assert "mori" in infos, f"available_backends() does not list mori: {sorted(infos)}"
    return infos["mori"]


def _rocm7_loadable() -> bool:
    try:
        ctypes.CDLL("libamdhip64.so.7")
    except OSError:
        return False
    return True


_INFO = _mori_info()
requires_mori = pytest.mark.skipif(
    not _INFO.available, reason=f"MoRI-IO cannot run here: {_INFO.reason}"
)


def test_available_backends_says_why_mori_cannot_run() -> None:
    info = _mori_info()
    if info.available:
        assert info.reason == ""
        return
    assert info.reason, "an unavailable backend must say why"
    if not _rocm7_loadable():
        # Either the plugin was built and its MoRI libraries need ROCm 7's HIP runtime, or the
        # plugin was not built at all; both are named precisely.
        assert (
            "libamdhip64.so.7" in info.reason
            or "built without the mori backend plugin" in info.reason
        ), info.reason


def test_engine_on_mori_raises_backend_unavailable_with_the_reason() -> None:
    info = _mori_info()
    if info.available:
        engine = mn.Engine(engine_id="x", backend="mori", options=MORI_OPTIONS)
        assert engine.backend == "mori"
        return
    with pytest.raises(mn.BackendUnavailableError) as excinfo:
        mn.Engine(engine_id="x", backend="mori", options=MORI_OPTIONS)
    assert info.reason in str(excinfo.value)
    assert isinstance(excinfo.value, RuntimeError)  # catchable without knowing this package


# ---- on ROCm ------------------------------------------------------------------------------------


@pytest.mark.rocm
@requires_mori
def test_bad_mori_option_is_refused_with_its_name() -> None:
    with pytest.raises(mn.InvalidArgumentError, match="qp_per_transfer"):
        mn.Engine(engine_id="x", backend="mori", options={**MORI_OPTIONS, "qp_per_transfer": "0"})
    with pytest.raises(mn.InvalidArgumentError, match="mori_bakend"):
        mn.Engine(engine_id="x", backend="mori", options={**MORI_OPTIONS, "mori_bakend": "rdma"})


def _engines(
    prefill_regs: list[mn.LayerRegistration], decode_regs: list[mn.LayerRegistration]
) -> tuple[mn.Engine, mn.Engine]:
    ep = mn.Engine("prefill-0", "mori", options=MORI_OPTIONS)
    ed = mn.Engine("decode-0", "mori", options=MORI_OPTIONS)
    meta_p = ep.register_kv_caches(prefill_regs)
    meta_d = ed.register_kv_caches(decode_regs)
    assert ed.add_peer(meta_p) == "prefill-0"
    assert ep.add_peer(meta_d) == "decode-0"
    return ep, ed


def _caches() -> tuple[kc.KvCacheSet, kc.KvCacheSet]:
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=12)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=20)
    kc.fill_random(prefill, seed=1)
    kc.fill_random(decode, seed=2)
    return prefill, decode


@pytest.mark.rocm
@requires_mori
def test_read_and_write_in_host_memory_over_mori() -> None:
    prefill, decode = _caches()
    ep, ed = _engines(prefill.registrations(), decode.registrations())

    local, remote = [19, 0, 5, 6], [3, 7, 1, 11]
    expected = kc.expected_after_copy(decode, prefill, local, remote)
    ed.read("req-read", "prefill-0", local, remote)
    event = ed.wait(["req-read"], timeout=60)["req-read"]
    assert (event.kind, event.state) == ("read", "done"), event.message
    assert np.array_equal(decode.backing, expected)

    src, dst = [0, 1, 2, 11], [2, 4, 8, 19]
    expected = kc.expected_after_copy(decode, prefill, dst, src)
    for shape in prefill.shapes:
        assert ep.write_layer("req-write", shape.name, "decode-0", src, dst) is True
    ep.seal("req-write", "decode-0", expected_writes=len(prefill.shapes))
    event = ep.wait(["req-write"], timeout=60)["req-write"]
    assert (event.kind, event.state) == ("write", "done"), event.message
    assert np.array_equal(decode.backing, expected)


def _gpu_copy(cache: kc.KvCacheSet, device: int) -> tuple[object, int, list[mn.LayerRegistration]]:
    """Put ``cache``'s backing on a ROCm GPU (page aligned inside one allocation) and return the
    allocation tensor, the backing's offset in it and registrations of the layers there."""
    import torch

    n = cache.backing.nbytes
    alloc = torch.empty(n + 4096, dtype=torch.uint8, device=f"cuda:{device}")
    base = alloc.data_ptr()
    offset = (-base) % 4096
    alloc[offset : offset + n].copy_(torch.from_numpy(cache.backing))
    host_base = cache.backing.ctypes.data
    regs = []
    for reg in cache.registrations():
        geo = mn.layout.geometry_of(reg.tensor)
        moved = mn.TensorGeometry(
            shape=list(geo.shape),
            strides=list(geo.strides),
            element_size=geo.element_size,
            data_ptr=base + offset + (geo.data_ptr - host_base),
        )
        regs.append(
            mn.LayerRegistration(
                name=reg.name,
                tensor=moved,
                spec=reg.spec,
                allocation=(base, n + 4096),
                memory="rocm",
                device=device,
            )
        )
    return alloc, offset, regs


@pytest.mark.rocm
@requires_mori
def test_read_and_write_in_gpu_memory_over_mori() -> None:
    torch = pytest.importorskip("torch")
    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        pytest.skip("needs a ROCm build of torch that sees an AMD GPU")
    devices = torch.cuda.device_count()
    prefill, decode = _caches()
    p_alloc, p_off, p_regs = _gpu_copy(prefill, 0)
    d_alloc, d_off, d_regs = _gpu_copy(decode, 1 if devices > 1 else 0)
    ep, ed = _engines(p_regs, d_regs)
    n = decode.backing.nbytes

    def decode_bytes() -> np.ndarray:
        torch.cuda.synchronize()
        return d_alloc[d_off : d_off + n].cpu().numpy()  # type: ignore[index]

    local, remote = [19, 0, 5, 6], [3, 7, 1, 11]
    expected = kc.expected_after_copy(decode, prefill, local, remote)
    ed.read("gpu-read", "prefill-0", local, remote)
    event = ed.wait(["gpu-read"], timeout=60)["gpu-read"]
    assert event.state == "done", event.message
    assert np.array_equal(decode_bytes(), expected)

    decode.backing[:] = expected  # the host mirror follows the GPU copy
    src, dst = [0, 1, 2, 11], [2, 4, 8, 19]
    expected = kc.expected_after_copy(decode, prefill, dst, src)
    for shape in prefill.shapes:
        assert ep.write_layer("gpu-write", shape.name, "decode-0", src, dst) is True
    ep.seal("gpu-write", "decode-0", expected_writes=len(prefill.shapes))
    event = ep.wait(["gpu-write"], timeout=60)["gpu-write"]
    assert event.state == "done", event.message
    assert np.array_equal(decode_bytes(), expected)
    del p_alloc, p_off
