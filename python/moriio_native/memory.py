"""Registration planning and the page-aligned KV backing allocator."""

from __future__ import annotations

from typing import Any

import numpy as np

from moriio_native._native import RegistrationPlan, plan_registration
from moriio_native.errors import InvalidArgumentError

DEFAULT_PAGE_SIZE = 4096


def allocate_kv_backing(
    nbytes: int, device: Any = "cpu", page_size: int = DEFAULT_PAGE_SIZE
) -> Any:
    """A zeroed ``torch.uint8`` tensor of ``nbytes`` whose data pointer is page aligned.

    It over-allocates by up to one page and returns a view that starts at the first page boundary
    inside the allocation (never before it); its size is rounded up to whole pages so one
    page-aligned memory region covers it exactly. The view keeps the allocation alive.
    """
    import torch  # torch is optional for the core package; only this helper needs it

    if nbytes <= 0:
        raise InvalidArgumentError(f"allocate_kv_backing: nbytes must be positive, got {nbytes}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise InvalidArgumentError(
            f"allocate_kv_backing: page_size must be a power of two, got {page_size}"
        )
    padded = -(-nbytes // page_size) * page_size
    raw = torch.zeros(padded + page_size, dtype=torch.uint8, device=device)
    shift = (-raw.data_ptr()) % page_size
    return raw[shift : shift + padded]


def allocate_host_backing(nbytes: int, page_size: int = DEFAULT_PAGE_SIZE) -> np.ndarray:
    """A zeroed host ``numpy.uint8`` array like :func:`allocate_kv_backing`, without torch."""
    if nbytes <= 0:
        raise InvalidArgumentError(f"allocate_host_backing: nbytes must be positive, got {nbytes}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise InvalidArgumentError(
            f"allocate_host_backing: page_size must be a power of two, got {page_size}"
        )
    padded = -(-nbytes // page_size) * page_size
    raw = np.zeros(padded + page_size, dtype=np.uint8)
    shift = (-raw.ctypes.data) % page_size
    return raw[shift : shift + padded]


__all__ = [
    "DEFAULT_PAGE_SIZE",
    "RegistrationPlan",
    "allocate_host_backing",
    "allocate_kv_backing",
    "plan_registration",
]
