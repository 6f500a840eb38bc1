"""Metadata that names one engine and carries another engine's address reaches nothing of that
other engine over UCX: a range moves only once the process behind the address vouched for it as
the named engine's registration (the table of registered regions a process publishes, read
through batched cma on one host; a region check over UCX on the operation path). Before, a party
that could answer a handshake could have this engine read or write another engine's memory.

Both engines live in this process: the one table they share still tells them apart."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc

pytestmark = pytest.mark.ucx

TIMEOUT = 30.0  # hang guard, not a performance bound
SHAPES = [kc.LayerShape("dense.0", "separated_nhd", block_size=4, head_size=8, num_heads=2)]

# Batched cma (the default on one host), and UCX operations (whose ranges a region check vouches
# for): the refusal each gives.
PATHS = {
    "batched_cma": ({}, "registered no region that holds it for engine 'prefill-9'"),
    "ucx_operations": (
        {"ucx_direct_copy": "off"},
        "asks about engine 'prefill-9', but this target serves engine 'prefill-0'",
    ),
}


def _renamed(metadata: bytes, engine_id: str) -> bytes:
    root = msgpack.unpackb(metadata, raw=False)
    root["engine_id"] = engine_id
    return msgpack.packb(root, use_bin_type=True)


@pytest.mark.parametrize("path", list(PATHS))
def test_metadata_naming_another_engine_moves_no_byte_of_the_engine_behind_the_address(
    path: str,
) -> None:
    options, reason = PATHS[path]
    decode = mn.Engine("decode-0", "ucx", options=options, transfer_timeout=TIMEOUT)
    prefill = mn.Engine("prefill-0", "ucx", options=options, transfer_timeout=TIMEOUT)
    decode_caches = kc.build_caches(SHAPES, 8)
    prefill_caches = kc.build_caches(SHAPES, 8)
    kc.fill_random(decode_caches, seed=1)
    kc.fill_random(prefill_caches, seed=2)
    decode.register_kv_caches(decode_caches.registrations())
    genuine = prefill.register_kv_caches(prefill_caches.registrations())
    decode_before = decode_caches.backing.copy()
    prefill_before = prefill_caches.backing.copy()

    # Well formed, so it is accepted; every transfer through it fails, naming why.
    assert decode.add_peer(_renamed(genuine, "prefill-9")) == "prefill-9"
    decode.read("r", "prefill-9", [0, 1], [2, 3])
    read = decode.wait(["r"], timeout=TIMEOUT)["r"]
    assert read.state == "failed"
    assert reason in read.message
    decode.write_layer("w", "dense.0", "prefill-9", [0, 1], [2, 3])
    decode.seal("w", "prefill-9", expected_writes=1)
    write = decode.wait(["w"], timeout=TIMEOUT)["w"]
    assert write.state == "failed"
    assert reason in write.message
    assert np.array_equal(decode_caches.backing, decode_before), "the READ landed bytes"
    assert np.array_equal(prefill_caches.backing, prefill_before), "the WRITE landed bytes"

    # The same address under its own engine id moves the bytes.
    assert decode.add_peer(genuine) == "prefill-0"
    expected = kc.expected_after_copy(decode_caches, prefill_caches, [0, 1], [2, 3])
    decode.read("r2", "prefill-0", [0, 1], [2, 3])
    assert decode.wait(["r2"], timeout=TIMEOUT)["r2"].state == "done"
    assert np.array_equal(decode_caches.backing, expected)
