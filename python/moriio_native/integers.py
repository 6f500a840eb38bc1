"""The one test of "an integer" the Python API applies to counts, ids, windows and handles."""

from __future__ import annotations

from typing import TypeGuard

import numpy as np


def is_integer(value: object) -> TypeGuard[int | np.integer]:
    """Whether ``value`` is a Python or numpy integer and not a bool. A bool is an int to Python
    (``True`` would pass as 1) and a float would be truncated by ``int()``, so both are refused
    where a count, an id or a window field is expected; numpy's ``bool_`` is no ``np.integer``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
