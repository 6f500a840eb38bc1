"""Benchmarks that print ratios against a baseline measured in the same process.

``moriio_native.bench.planning``: per-layer copy-plan computation (the native template stamping
against a pure-Python planner and, when installed, vLLM's MoRIIO offset code).
"""

from __future__ import annotations

__all__: list[str] = []
