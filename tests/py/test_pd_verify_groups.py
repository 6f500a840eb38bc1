"""``verify`` with vLLM's hybrid KV-cache manager. The READ check compares whole blocks of one
KV-cache group (pd/puller.py keeps the checked block pairs only for a single whole-block
segment), so with several groups every load failed its check: intact bytes recomputed, each
counted as a verify failure (the operator's corruption alarm) and logged at ERROR, while nothing
refused the setting. It is refused at start-up now, naming the groups."""

from __future__ import annotations

import pytest

from moriio_native.control.messages import KvGroup
from moriio_native.errors import InvalidArgumentError
from moriio_native.pd.config import PdConfig

FULL = KvGroup(kind="full", block_size=16, layers=("full.0",), element_types=("bfloat16",))
SWA = KvGroup(
    kind="sliding", block_size=16, layers=("swa.0",), element_types=("bfloat16",), sliding_window=17
)
FIELDS = {
    "engine_id": "d:1/dp0/tp0",
    "mode": "read",
    "producer": False,
    "consumer": True,
    "host_ip": "127.0.0.1",
    "handshake_port": 0,
    "notify_port": 0,
}


def test_verify_with_two_kv_cache_groups_is_refused_naming_them() -> None:
    with pytest.raises(InvalidArgumentError, match=r"verify.*2 \(full \(block size 16\), sliding"):
        PdConfig(**FIELDS, verify=True, groups=(FULL, SWA))


def test_verify_with_one_group_and_two_groups_without_verify_are_accepted() -> None:
    assert PdConfig(**FIELDS, verify=True, groups=(FULL,)).verify
    assert not PdConfig(**FIELDS, verify=False, groups=(FULL, SWA)).verify
