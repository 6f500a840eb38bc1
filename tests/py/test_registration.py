"""Property tests of registration planning and the page-aligned KV backing allocator.

What a user relies on: a registered region never exposes a byte outside the allocation (the
old connector exposed up to 4095 bytes BEFORE it), every byte of every layer is inside the
region at the offset the plan says, and the region is page aligned whenever that is possible
inside the allocation; otherwise it is flagged unaligned, or refused when unaligned regions are
not allowed.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import moriio_native as mn
from moriio_native import InvalidArgumentError

PAGE_SIZES = [64, 256, 4096, 65536]


def _floor(x: int, page: int) -> int:
    return x - x % page


def _ceil(x: int, page: int) -> int:
    return -(-x // page) * page


@st.composite
def allocations(draw):
    page = draw(st.sampled_from(PAGE_SIZES))
    aligned_base = draw(st.booleans())
    base = draw(st.integers(1, 2**40)) * page
    if not aligned_base:
        base += draw(st.integers(1, page - 1))
    # Whole pages, or pages plus a tail.
    size = draw(st.integers(0, 6)) * page + draw(st.sampled_from([0, 1, page // 2, page - 1]))
    assume(size > 0)
    nviews = draw(st.integers(1, 6))
    views = []
    for _ in range(nviews):
        start = draw(st.integers(0, size - 1))
        nbytes = draw(st.integers(1, size - start))
        views.append((base + start, nbytes))
    return page, base, size, views


def _aligned_region_possible(base: int, size: int, views, page: int) -> bool:
    """A page-aligned region covering every view exists inside [base, base+size)."""
    lo = min(p for p, _ in views)
    hi = max(p + n for p, n in views)
    return _floor(lo, page) >= base and _ceil(hi, page) <= base + size


@settings(max_examples=300, deadline=None)
@given(allocations(), st.booleans())
def test_regions_inside_allocation_and_cover_every_view(alloc, allow_unaligned) -> None:
    page, base, size, views = alloc
    possible = _aligned_region_possible(base, size, views, page)
    if not possible and not allow_unaligned:
        with pytest.raises(InvalidArgumentError, match="allocate_kv_backing"):
            mn.plan_registration(base, size, views, page, False)
        return
    plan = mn.plan_registration(base, size, views, page, allow_unaligned)
    regions = plan.regions
    placements = plan.placements
    assert len(placements) == len(views)
    assert len(regions) >= 1
    for start, rsize, aligned in regions:
        assert rsize > 0
        # Never a byte before or after the allocation.
        assert base <= start and start + rsize <= base + size
        if aligned:
            assert start % page == 0 and (start + rsize) % page == 0
    for (ptr, nbytes), (index, offset) in zip(views, placements, strict=True):
        start, rsize, _ = regions[index]
        # The view's bytes are where the plan says, entirely inside the region.
        assert start + offset == ptr
        assert offset + nbytes <= rsize
    # Views of one allocation share one region.
    assert {index for index, _ in placements} == {0}
    # Aligned exactly when alignment is possible inside the allocation.
    assert regions[0][2] == possible
    if not possible:
        # The documented fallback: the exact span of the views.
        lo = min(p for p, _ in views)
        hi = max(p + n for p, n in views)
        assert regions[0][:2] == (lo, hi - lo)
    else:
        # Same plan whether or not unaligned regions are allowed.
        strict = mn.plan_registration(base, size, views, page, False)
        assert strict.regions == regions and strict.placements == placements


@settings(max_examples=100, deadline=None)
@given(allocations())
def test_view_outside_allocation_is_refused(alloc) -> None:
    page, base, size, views = alloc
    for bad in [(base - 1, 1), (base + size - 1, 2), (base + size, 1), (base - 8, 16)]:
        with pytest.raises(InvalidArgumentError, match="outside"):
            mn.plan_registration(base, size, [*views, bad], page)


def test_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="power of two"):
        mn.plan_registration(4096, 8192, [(4096, 16)], 3000)
    with pytest.raises(InvalidArgumentError, match="power of two"):
        mn.plan_registration(4096, 8192, [(4096, 16)], 0)
    with pytest.raises(InvalidArgumentError):
        mn.plan_registration(4096, 0, [(4096, 16)])
    with pytest.raises(InvalidArgumentError, match="empty"):
        mn.plan_registration(4096, 8192, [(4096, 0)])
    with pytest.raises(InvalidArgumentError):
        mn.plan_registration(4096, 8192, [])
    # Allocation or view wrapping around the address space.
    with pytest.raises(InvalidArgumentError):
        mn.plan_registration(2**64 - 4096, 8192, [(2**64 - 4096, 16)])
    with pytest.raises(InvalidArgumentError):
        mn.plan_registration(4096, 8192, [(2**64 - 8, 16)])


def test_shared_backing_one_aligned_region_hand_numbers() -> None:
    # Allocation [0x10000, 0x10000 + 3*4096 + 100). Layers at +100 (200 B) and +5000 (3000 B):
    # span [0x10064, 0x10000 + 8000); rounded out to pages: [0x10000, 0x12000) = 8192 B, inside
    # the allocation (which ends at 0x10000 + 12388). Offsets inside the region: 100 and 5000.
    base = 0x10000
    plan = mn.plan_registration(base, 3 * 4096 + 100, [(base + 100, 200), (base + 5000, 3000)])
    assert plan.regions == [(base, 8192, True)]
    assert plan.placements == [(0, 100), (0, 5000)]
    # The old connector's failure: an allocation starting 64 B past a page boundary. Rounding
    # down would start the region 64 B BEFORE the allocation; instead the exact span is used.
    base = 0x20040
    plan = mn.plan_registration(base, 8192, [(base, 4096), (base + 4096, 4096)])
    assert plan.regions == [(base, 8192, False)]
    assert plan.placements == [(0, 0), (0, 4096)]
    with pytest.raises(InvalidArgumentError, match="allocate_kv_backing"):
        mn.plan_registration(base, 8192, [(base, 4096)], allow_unaligned=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300_000), st.sampled_from(PAGE_SIZES))
def test_allocate_kv_backing(nbytes: int, page: int) -> None:
    torch = pytest.importorskip("torch")
    t = mn.allocate_kv_backing(nbytes, page_size=page)
    assert t.dtype == torch.uint8 and t.device.type == "cpu"
    assert t.dim() == 1
    ptr = t.data_ptr()
    assert ptr % page == 0
    # Rounded up to whole pages.
    assert t.numel() == _ceil(nbytes, page)
    assert t.numel() % page == 0 and t.numel() >= nbytes
    # The view lies inside its allocation: never starts before it (no negative offset), never
    # ends after it.
    storage = t.untyped_storage()
    assert storage.data_ptr() <= ptr
    assert ptr + t.numel() <= storage.data_ptr() + storage.nbytes()
    assert t.storage_offset() >= 0
    assert int(t.count_nonzero()) == 0
    # Writable over its whole length without touching anything outside.
    t.fill_(7)
    assert int((t == 7).sum()) == t.numel()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 64_000),
    st.sampled_from(PAGE_SIZES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 10_000)), min_size=1, max_size=5),
)
def test_layers_carved_from_backing_register_as_one_aligned_region(nbytes, page, cuts) -> None:
    # Layers at arbitrary (unaligned) offsets inside an aligned backing: the allocation is the
    # backing's storage; one page-aligned region covers them all, also when unaligned regions
    # are not allowed.
    pytest.importorskip("torch")
    t = mn.allocate_kv_backing(nbytes, page_size=page)
    storage = t.untyped_storage()
    views = []
    for off, n in cuts:
        off = off % t.numel()
        n = max(1, min(n, t.numel() - off))
        v = t[off : off + n]
        views.append((v.data_ptr(), v.numel()))
    plan = mn.plan_registration(storage.data_ptr(), storage.nbytes(), views, page, False)
    ((start, size, aligned),) = plan.regions
    assert aligned
    assert storage.data_ptr() <= start and start + size <= storage.data_ptr() + storage.nbytes()
    for (ptr, n), (_, offset) in zip(views, plan.placements, strict=True):
        assert start + offset == ptr and offset + n <= size


def test_allocate_kv_backing_rejects_bad_arguments() -> None:
    pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        mn.allocate_kv_backing(0)
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        mn.allocate_kv_backing(-5)
    with pytest.raises(InvalidArgumentError, match="power of two"):
        mn.allocate_kv_backing(4096, page_size=3000)
