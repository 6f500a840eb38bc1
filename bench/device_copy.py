"""The baseline every GPU benchmark here prints beside its own rate: one large device copy."""

from __future__ import annotations


def device_copy_gbps(nbytes: int) -> float:
    """GB/s of one ``torch`` device-to-device ``copy_`` of ``nbytes`` (best of 5): the HBM
    ceiling for moving that many bytes on the current device."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return best
