"""The baseline every GPU benchmark here prints beside its own rate: one large device copy."""

from __future__ import annotations

import time


def device_copy_gbps(
    nbytes: int, src_device: int | None = None, dst_device: int | None = None
) -> float:
    """GB/s of one ``torch`` ``copy_`` of ``nbytes`` (best of 5) from ``src_device`` to
    ``dst_device`` (default: the current device for both): the HBM ceiling for moving that many
    bytes on one GPU, the peer-to-peer copy rate between two."""
    import torch

    src = torch.cuda.current_device() if src_device is None else src_device
    dst = src if dst_device is None else dst_device
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    best = 0.0
    for _ in range(5):
        # Host timing around both devices' synchronisation: an event pair would see only one
        # device's stream of a peer copy; a few GB make the host's microseconds negligible.
        for device in {src, dst}:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        b.copy_(a)
        for device in {src, dst}:
            torch.cuda.synchronize(device)
        best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best
