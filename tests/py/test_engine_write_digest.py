"""A write's block ids are digested in four lanes (cpp/engine.cpp DigestOfIds). Before each lane
was mixed through a finaliser, two different whole-block writes of small block ids shared a
digest, so the second was taken for a repeat of the first (write_layer answered False,
"scheduled before", nothing refused, nothing failed) instead of being refused as "scheduled
before with other blocks". Loopback engines through the bindings."""

from __future__ import annotations

import pytest

import moriio_native as mn
from moriio_native import kvcache as kc

# Found by exhaustive searches against a replica of DigestOfIds: every local[2], remote[2] with
# ids < 64 (16.7 M writes: 4 pairs collide; none with the single chain before a22f6b6), every
# local[3], remote[3] with ids < 16 (16.7 M: 16 pairs).
COLLISIONS = [
    (([46, 48], [60, 63]), ([46, 62], [62, 15])),
    (([3, 0, 5], [11, 14, 2]), ([3, 0, 7], [11, 8, 10])),
]
FIRST = COLLISIONS[0][0]


def _pair() -> tuple[mn.Engine, mn.Engine, kc.KvCacheSet, kc.KvCacheSet]:
    prefill = kc.build_caches(kc.mixed_model("prefill"), num_blocks=64)
    decode = kc.build_caches(kc.mixed_model("decode"), num_blocks=64)
    ep = mn.Engine(
        "p", "loopback", options={"loopback_delay_ms": 300}
    )  # the first write stays in flight
    ed = mn.Engine("d", "loopback")
    ep.register_kv_caches(prefill.registrations())
    ed.register_kv_caches(decode.registrations())
    ep.add_peer(ed.local_metadata())
    ed.add_peer(ep.local_metadata())
    return ep, ed, prefill, decode


def test_a_write_of_other_blocks_is_refused_not_taken_for_a_repeat_control() -> None:
    """Control: another write of the scheduled layer (one id differs) is refused by name."""
    ep, *_ = _pair()
    assert ep.write_layer("w", "dense.0", "d", *FIRST) is True
    with pytest.raises(mn.InvalidArgumentError, match="scheduled before with other blocks"):
        ep.write_layer("w", "dense.0", "d", [46, 62], [62, 14])
    ep.abort("w")


@pytest.mark.parametrize("first,colliding", COLLISIONS, ids=["2x2", "3x3"])
def test_a_write_of_other_blocks_with_a_colliding_digest_is_refused(
    first: tuple[list[int], list[int]], colliding: tuple[list[int], list[int]]
) -> None:
    """[46, 62] -> [62, 15] after [46, 48] -> [60, 63] on the same layer: every id but the
    first differs, yet DigestOfIds gives both 0x2b934e946715cf5e (lane 0 takes 46, 60 / 46, 62,
    lane 1 48, 63 / 62, 15; the final chain over the lanes cancels the two differences).
    write_layer answers False -- "this (transfer, layer) was scheduled before", the answer to
    a repeat -- and the transfer goes on to end done without remote blocks 62 and 15 ever being
    written, which the caller was told nothing about (the digest's refusal exists exactly for
    this, dc0839a)."""
    ep, *_ = _pair()
    assert ep.write_layer("w", "dense.0", "d", *first) is True
    try:
        with pytest.raises(mn.InvalidArgumentError, match="scheduled before with other blocks"):
            answer = ep.write_layer("w", "dense.0", "d", *colliding)
            pytest.fail(f"another write taken for a repeat of the first: answered {answer}")
    finally:
        ep.abort("w")
