"""Input the engine must not trust: a peer's strings, a caller's allocation claim, block ids past
int64 and engine settings. Each is refused with an error naming what was wrong, and nothing
changes: no peer is added, nothing is registered, no transfer exists."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import moriio_native as mn
from moriio_native import kvcache as kc


def _engines() -> tuple[mn.Engine, mn.Engine, bytes]:
    """A registered decode ``d`` and the metadata of a registered prefill ``p``."""
    shapes = [kc.LayerShape("dense.0", "separated_nhd", block_size=4, head_size=8, num_heads=2)]
    d, p = mn.Engine("decode-0"), mn.Engine("prefill-0")
    d.register_kv_caches(kc.build_caches(shapes, 8).registrations())
    meta = p.register_kv_caches(kc.build_caches(shapes, 8).registrations())
    d._keep = p  # type: ignore[attr-defined]  # the prefill's memory outlives the test
    return d, p, meta


# ---- a peer's strings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "valid", "broken"),
    [
        ("engine_id", b"\xa9prefill-0", b"\xa9prefill-\xff"),  # never valid
        ("backend", b"\xa8loopback", b"\xa8loopb\xed\xa0\x80"),  # a surrogate
        ("name", b"\xa7dense.0", b"\xa7dense\xc0\xae"),  # overlong "."
        ("engine_id", b"\xa9prefill-0", b"\xa9prefill\xe2\x82"),  # truncated sequence
    ],
)
def test_non_utf8_peer_strings_are_refused_and_change_nothing(field, valid, broken) -> None:
    d, _, meta = _engines()
    assert meta.count(valid) == 1
    bad = meta.replace(valid, broken)
    with pytest.raises(mn.InvalidArgumentError, match=f"{field} is not valid UTF-8"):
        d.add_peer(bad)
    # No peer was connected, and the API keeps working.
    assert d.peers() == []
    assert d.add_peer(meta) == "prefill-0"
    assert d.peers() == ["prefill-0"]


def test_well_formed_non_ascii_peer_names_are_accepted() -> None:
    shapes = [kc.LayerShape("dense.0", "separated_nhd", block_size=4, head_size=8, num_heads=2)]
    d, p = mn.Engine("décode-0"), mn.Engine("预填充-😀")
    d.register_kv_caches(kc.build_caches(shapes, 8).registrations())
    meta = p.register_kv_caches(kc.build_caches(shapes, 8).registrations())
    assert d.add_peer(meta) == "预填充-😀"
    assert d.peers() == ["预填充-😀"]


# ---- the allocation claim -------------------------------------------------------------------

PAGE = 4096


def _torch_layer(offset: int = 256) -> tuple[object, object, mn.CacheSpec]:
    """A [2, N=8, B=4, H=2, D=8] bf16-sized cache viewed ``offset`` bytes into a torch backing."""
    torch = pytest.importorskip("torch")
    backing = torch.zeros(16 * PAGE, dtype=torch.uint8)
    nbytes = 2 * 8 * 4 * 2 * 8 * 2
    view = backing[offset : offset + nbytes].view(torch.int16).view(2, 8, 4, 2, 8)
    spec = mn.CacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=2, axis_order="nhd")
    return backing, view, spec


def _regions(metadata: bytes) -> list[tuple[int, int]]:
    root = msgpack.unpackb(metadata, raw=False)
    return [(r["address"], r["size"]) for r in root["regions"]]


def test_torch_allocation_defaults_to_the_tensor_storage() -> None:
    backing, view, spec = _torch_layer()
    storage = view.untyped_storage()
    engine = mn.Engine("p")
    meta = engine.register_kv_caches([mn.LayerRegistration("layers.0", view, spec)])
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    for address, size in _regions(meta):
        assert start <= address and address + size <= end
    assert storage.data_ptr() == backing.data_ptr()


def test_torch_allocation_claim_inside_the_storage_is_accepted() -> None:
    _, view, spec = _torch_layer(offset=PAGE + 256)
    storage = view.untyped_storage()
    claim = (storage.data_ptr() + PAGE, storage.nbytes() - PAGE)
    engine = mn.Engine("p")
    meta = engine.register_kv_caches([mn.LayerRegistration("layers.0", view, spec, claim)])
    for address, size in _regions(meta):
        assert claim[0] <= address and address + size <= claim[0] + claim[1]


@pytest.mark.parametrize(
    "claim",
    [
        lambda base, size: (base - PAGE, size + PAGE),  # one page before the storage
        lambda base, size: (base, size + 1),  # one byte past its end
        lambda base, size: (base - PAGE, PAGE),  # wholly before it
        lambda base, size: (base + size, PAGE),  # wholly after it
    ],
)
def test_torch_allocation_claim_outside_the_storage_is_refused(claim) -> None:
    _, view, spec = _torch_layer()
    storage = view.untyped_storage()
    base, size = claim(storage.data_ptr(), storage.nbytes())
    engine = mn.Engine("p")
    reg = mn.LayerRegistration("layers.0.attn", view, spec, (base, size))
    with pytest.raises(mn.InvalidArgumentError) as err:
        engine.register_kv_caches([reg])
    message = str(err.value)
    assert "layers.0.attn" in message
    assert f"{base:#x}" in message and f"{size}" in message
    assert f"{storage.data_ptr():#x}" in message and f"{storage.nbytes()}" in message
    # Nothing was registered: the engine has no metadata, and a valid registration still works.
    with pytest.raises(mn.FailedPreconditionError):
        engine.local_metadata()
    engine.register_kv_caches([mn.LayerRegistration("layers.0.attn", view, spec)])


def test_allocation_is_required_without_a_torch_storage() -> None:
    cache = kc.build_caches(
        [kc.LayerShape("dense.0", "separated_nhd", block_size=4, head_size=8, num_heads=2)], 8
    )
    view = cache.views["dense.0"]
    spec = cache.shapes[0].spec()
    with pytest.raises(mn.InvalidArgumentError, match=r"dense\.0.*allocation"):
        mn.Engine("p").register_kv_caches([mn.LayerRegistration("dense.0", view, spec)])


# ---- block ids past int64 -------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        lambda: np.array([0, 2**63], dtype=np.uint64),
        lambda: np.array([2**64 - 1], dtype=np.uint64),
        lambda: [0, 2**63],  # Python ints numpy stores as uint64
    ],
)
def test_block_ids_past_int64_are_out_of_range_not_negative(ids) -> None:
    d, _, meta = _engines()
    d.add_peer(meta)
    big = np.asarray(ids(), dtype=np.uint64)
    wrong = int(big[big >= 2**63][0])
    n = len(big)
    for call in (
        lambda: d.read("t", "prefill-0", ids(), list(range(n))),
        lambda: d.read("t", "prefill-0", list(range(n)), ids()),
        lambda: d.write_layer("w", "dense.0", "prefill-0", ids(), list(range(n))),
        lambda: mn.BlockPairs(ids(), list(range(n))),
    ):
        with pytest.raises(mn.OutOfRangeError) as err:
            call()
        assert str(wrong) in str(err.value) and "out of range" in str(err.value)
        assert "negative" not in str(err.value)
    assert d.pending_transfers == 0


@pytest.mark.parametrize(
    ("ids", "what"), [([1, 2.5], "float"), ([True], "bool"), ([1, "2"], "str")]
)
def test_non_integer_ids_in_a_list_are_refused_naming_the_position(ids, what) -> None:
    with pytest.raises(mn.InvalidArgumentError, match=f"must be integers, got {what} at position"):
        mn.BlockPairs(ids, list(range(len(ids))))


# ---- engine settings ------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, 1, 3, 2048, 4097, 3 * 4096])
def test_engine_refuses_page_sizes_that_cannot_align(page_size) -> None:
    with pytest.raises(mn.InvalidArgumentError, match=f"page_size .* got {page_size}$"):
        mn.Engine("p", page_size=page_size)


@pytest.mark.parametrize("page_size", [4096, 65536, 2**21])
def test_engine_accepts_power_of_two_page_sizes_of_an_os_page_or_more(page_size) -> None:
    assert mn.Engine("p", page_size=page_size).engine_id == "p"


def test_block_id_list_changed_by_index_while_read_is_safe() -> None:
    ids: list[object] = []

    class Shrinking:
        """An id whose ``__index__`` empties the list being read."""

        def __index__(self) -> int:
            ids.clear()
            return 1

    ids.extend([0, Shrinking(), 2, 3])
    pairs = mn.BlockPairs(ids, [5, 6, 7, 8])
    assert len(pairs) == 2  # the ids read before the list was emptied
