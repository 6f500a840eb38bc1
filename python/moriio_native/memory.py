"""Registration planning and the page-aligned KV backing allocator."""

from __future__ import annotations

from typing import Any

import numpy as np

from moriio_native._native import RegistrationPlan, plan_registration
from moriio_native.errors import InvalidArgumentError
from moriio_native.integers import is_integer

DEFAULT_PAGE_SIZE = 4096


def _padded_size(nbytes: int, page_size: int, what: str) -> int:
    """``nbytes`` rounded up to whole pages, after checking both arguments."""
    for name, value in (("nbytes", nbytes), ("page_size", page_size)):
        if not is_integer(value):
            raise InvalidArgumentError(
                f"{what}: {name} must be an integer, got {type(value).__name__} {value!r}"
            )
    if nbytes <= 0:
        raise InvalidArgumentError(f"{what}: nbytes must be positive, got {nbytes}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise InvalidArgumentError(f"{what}: page_size must be a power of two, got {page_size}")
    return -(-nbytes // page_size) * page_size


def _page_aligned_window(raw: Any, address: int, padded: int, page_size: int) -> Any:
    """The ``padded`` bytes of ``raw`` (one page longer) that start at its first page boundary:
    inside the allocation, never before it."""
    shift = (-address) % page_size
    return raw[shift : shift + padded]


def allocate_kv_backing(
    nbytes: int, device: Any = "cpu", page_size: int = DEFAULT_PAGE_SIZE
) -> Any:
    """A zeroed ``torch.uint8`` tensor of ``nbytes`` whose data pointer is page aligned.

    It over-allocates by up to one page and returns a view that starts at the first page boundary
    inside the allocation (never before it); its size is rounded up to whole pages so one
    page-aligned memory region covers it exactly. The view keeps the allocation alive.
    """
    import torch  # torch is optional for the core package; only this helper needs it

    padded = _padded_size(nbytes, page_size, "allocate_kv_backing")
    raw = torch.zeros(padded + page_size, dtype=torch.uint8, device=device)
    return _page_aligned_window(raw, raw.data_ptr(), padded, page_size)


def allocate_host_backing(nbytes: int, page_size: int = DEFAULT_PAGE_SIZE) -> np.ndarray:
    """A zeroed host ``numpy.uint8`` array like :func:`allocate_kv_backing`, without torch."""
    padded = _padded_size(nbytes, page_size, "allocate_host_backing")
    raw = np.zeros(padded + page_size, dtype=np.uint8)
    return _page_aligned_window(raw, raw.ctypes.data, padded, page_size)


__all__ = [
    "DEFAULT_PAGE_SIZE",
    "RegistrationPlan",
    "allocate_host_backing",
    "allocate_kv_backing",
    "plan_registration",
]
