"""Shared pytest configuration: markers derived from what this machine can run, and the
loopback engine pair fixture."""

from __future__ import annotations

import importlib.util

import pytest

import moriio_native as mn
from moriio_native import kvcache as kc


def _backend_available(name: str) -> tuple[bool, str]:
    for info in mn.available_backends():
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


@pytest.fixture()
def pair() -> tuple[kc.KvCacheSet, kc.KvCacheSet, mn.Engine, mn.Engine]:
    """Two loopback engines, prefill-0 (12 blocks) and decode-0 (20), with the mixed model's
    caches filled with random bytes, registered and each added as the other's peer:
    (prefill caches, decode caches, prefill engine, decode engine)."""
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=12)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=20)
    kc.fill_random(prefill, seed=1)
    kc.fill_random(decode, seed=2)
    ep = mn.Engine("prefill-0", "loopback")
    ed = mn.Engine("decode-0", "loopback")
    meta_p = ep.register_kv_caches(prefill.registrations())
    meta_d = ed.register_kv_caches(decode.registrations())
    assert ed.add_peer(meta_p) == "prefill-0"
    assert ep.add_peer(meta_d) == "decode-0"
    return prefill, decode, ep, ed
