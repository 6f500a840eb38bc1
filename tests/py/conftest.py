"""Shared pytest configuration: markers derived from what this machine can run."""

from __future__ import annotations

import importlib.util

import pytest

import moriio_native


def _backend_available(name: str) -> tuple[bool, str]:
    for info in moriio_native.available_backends():
        if info.name == name:
            return info.available, info.reason
    return False, f"unknown backend {name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ucx_ok, ucx_why = _backend_available("ucx")
    vllm_ok = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "ucx" in item.keywords and not ucx_ok:
            item.add_marker(pytest.mark.skip(reason=f"UCX backend unavailable: {ucx_why}"))
        if "vllm" in item.keywords and not vllm_ok:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed"))
