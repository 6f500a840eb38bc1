"""Independent tests of the layout engine through the Python facade.

Every expected offset is derived by hand from the tensor's shape and strides (derivations in the
comments); nothing asks the code under test for an expectation. Strides are in elements (as
torch reports them), offsets in bytes. Caches are bf16 (2 bytes) unless stated otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

import moriio_native as mn
from moriio_native import (
    CacheSpec,
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    OutOfRangeError,
    TensorGeometry,
)

BF16 = 2


def contiguous(shape: list[int]) -> list[int]:
    strides = [0] * len(shape)
    s = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = s
        s *= shape[i]
    return strides


def geo(shape: list[int], strides: list[int] | None = None, es: int = BF16) -> TensorGeometry:
    return TensorGeometry(shape, strides if strides is not None else contiguous(shape), es, 0)


def small(**kw: object) -> CacheSpec:
    """block_size 4, 2 KV heads, head size 3, bf16."""
    args: dict = {
        "kind": "kv",
        "block_size": 4,
        "num_kv_heads": 2,
        "head_size": 3,
        "dtype_bytes": BF16,
    }
    args.update(kw)
    return CacheSpec(**args)


def latent(block_size: int = 4, head_size: int = 3) -> CacheSpec:
    return CacheSpec(kind="mla", block_size=block_size, head_size=head_size, dtype_bytes=BF16)


def runs(local: mn.LayerLayout, remote: mn.LayerLayout, lids: list[int], rids: list[int]):
    plan = mn.plan_block_copies(local, remote, lids, rids)
    triples = list(
        zip(
            plan.local_offsets.tolist(),
            plan.remote_offsets.tolist(),
            plan.sizes.tolist(),
            strict=True,
        )
    )
    # The tuple view and the array view of the plan agree.
    assert [tuple(r) for r in plan.runs()] == triples
    assert plan.total_bytes == sum(s for _, _, s in triples)
    assert len(plan) == len(triples)
    return triples


# Worked example: [2,N,B,H,D] = [2,8,4,2,3], strides [192,24,6,3,1] -> plane 384 B, block 48 B,
# token 12 B, head 6 B. A plane of a block is [0,48) in (t,h) order on both sides, so one run per
# plane per block. Remote [2,16,4,2,3]: plane 768 B. 1->4, 3->5:
#   K (48,192) (144,240); V (384+48, 768+192) = (432,960), (384+144, 768+240) = (528,1008).
WORKED = [(48, 192, 48), (144, 240, 48), (432, 960, 48), (528, 1008, 48)]


def test_worked_example_separated_block_head() -> None:
    local = mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small())
    remote = mn.describe_layer("r0", geo([2, 16, 4, 2, 3]), small())
    assert local.num_blocks == 8 and remote.num_blocks == 16
    assert local.block_stride == 48
    assert local.block_bytes == 96  # 2 planes * 2 heads * 4 tokens * 6 B
    assert local.span_bytes == 768  # the whole tensor: 2*8*4*2*3*2
    assert local.params["plane_offset"] == (0, 384)
    assert runs(local, remote, [1, 3], [4, 5]) == WORKED


@pytest.mark.parametrize(
    ("local_shape", "remote_shape", "expected", "order"),
    [
        # [2,N,H,B,D]: strides [192,24,12,3,1] -> plane 384, block 48, head 24, token 6. A plane
        # of a block is still [0,48) contiguous: same runs as the worked example.
        ([2, 8, 2, 4, 3], [2, 16, 2, 4, 3], WORKED, "auto"),
        # [N,2,B,H,D]: strides [48,24,6,3,1] -> block 96, plane 48. K [0,48) and V [48,96)
        # touch on both sides: one 96 B run per block. 1->4: (96,384); 3->5: (288,480).
        ([8, 2, 4, 2, 3], [16, 2, 4, 2, 3], [(96, 384, 96), (288, 480, 96)], "auto"),
        # [N,2,H,B,D]: strides [48,24,12,3,1] -> same bytes per block as above.
        ([8, 2, 2, 4, 3], [16, 2, 2, 4, 3], [(96, 384, 96), (288, 480, 96)], "auto"),
        # Kernel block [2,16,2,2,3] (block_size 4 = 2 kernel blocks of 2): strides
        # [192,12,6,3,1] -> plane 384, kernel block 24, token 12, head 6. Cell of block b:
        # p*384 + b*48 + (t//2)*24 + (t%2)*12 + h*6 = p*384 + b*48 + t*12 + h*6: the worked
        # example's bytes. Remote a plain [2,16,4,2,3]. 2 heads = 2-token kernel blocks: the
        # shape cannot say which axis is which, the spec says tokens first.
        ([2, 16, 2, 2, 3], [2, 16, 4, 2, 3], WORKED, "nhd"),
        # Kernel block [16,2,2,2,3]: strides [24,12,6,3,1] -> kernel block 48, plane 24, token
        # 12, head 6; manager block 96. Same layout on the remote ([32,2,2,2,3]): one run/block.
        ([16, 2, 2, 2, 3], [32, 2, 2, 2, 3], [(96, 384, 96), (288, 480, 96)], "nhd"),
    ],
)
def test_contiguous_kv_families(local_shape, remote_shape, expected, order) -> None:
    local = mn.describe_layer("l0", geo(local_shape), small(axis_order=order))
    remote = mn.describe_layer("r0", geo(remote_shape), small(axis_order=order))
    assert local.num_blocks == 8
    assert remote.num_blocks == 16
    assert runs(local, remote, [1, 3], [4, 5]) == expected


def test_kernel_block_heads_first_block16_heads8() -> None:
    # [2,32,8,2,3], block_size 16, 8 heads: axis 2 = 8 heads, axis 3 = 2-token kernel block.
    # 32 kernel blocks / (16/2) = 4 blocks. Strides [1536,48,6,3,1] -> plane 3072, kernel block
    # 96, head 12, token 6; block stride 8*96 = 768; each plane of a block is one 768 B run.
    # Self-pairing 1->2, 3->0 sorted by local:
    #   K (768,1536) (2304,0); V (3072+768, 3072+1536) = (3840,4608), (5376,3072).
    spec = CacheSpec(kind="kv", block_size=16, num_kv_heads=8, head_size=3, dtype_bytes=BF16)
    layer = mn.describe_layer("l0", geo([2, 32, 8, 2, 3]), spec)
    assert (layer.num_blocks, layer.num_heads, layer.block_stride) == (4, 8, 768)
    assert layer.params["kernel_block_size"] == 2
    assert runs(layer, layer, [3, 1], [0, 2]) == [
        (768, 1536, 768),
        (2304, 0, 768),
        (3840, 4608, 768),
        (5376, 3072, 768),
    ]


def test_ambiguous_kernel_block_shape() -> None:
    # Without the head count both 8 and 2 divide block_size 16.
    spec = CacheSpec(kind="kv", block_size=16, head_size=3, dtype_bytes=BF16)
    with pytest.raises(InvalidArgumentError, match="Ambiguous") as err:
        mn.describe_layer("layers.3.attn", geo([2, 32, 8, 2, 3]), spec)
    assert "layers.3.attn" in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "shape",
    [
        [2, 8, 4, 4, 3],  # [2,N,B,H,D] or [2,N,H,B,D]
        [8, 2, 4, 4, 3],  # [N,2,B,H,D] or [N,2,H,B,D]
    ],
)
def test_heads_equal_to_block_size_are_ambiguous_without_axis_order(shape) -> None:
    spec = small(num_kv_heads=4)
    with pytest.raises(InvalidArgumentError, match="Ambiguous") as err:
        mn.describe_layer("layers.9.attn", geo(shape), spec)
    assert "layers.9.attn" in str(err.value)
    assert str(shape) in str(err.value)
    assert "axis_order" in str(err.value)
    # The same with heads equal to the kernel block size: [2,16,2,2,3] = 2-token kernel blocks
    # of block_size 4 with 2 heads, either way round.
    with pytest.raises(InvalidArgumentError, match="Ambiguous"):
        mn.describe_layer("layers.9.attn", geo([2, 16, 2, 2, 3]), small())


def test_axis_order_reads_equal_heads_and_tokens() -> None:
    # [2,8,4,4,3] contiguous: strides [384,48,12,3,1] -> axis 2 steps 24 B, axis 3 steps 6 B.
    nhd = mn.describe_layer("l", geo([2, 8, 4, 4, 3]), small(num_kv_heads=4, axis_order="nhd"))
    assert (nhd.params["token_stride"], nhd.params["head_stride"]) == (24, 6)
    hnd = mn.describe_layer("l", geo([2, 8, 4, 4, 3]), small(num_kv_heads=4, axis_order="hnd"))
    assert (hnd.params["token_stride"], hnd.params["head_stride"]) == (6, 24)
    # Kernel blocks [2,16,2,2,3] strides [192,12,6,3,1]: hnd -> head 12 B, token 6 B.
    kernel = mn.describe_layer("l", geo([2, 16, 2, 2, 3]), small(axis_order="hnd"))
    assert kernel.params["kernel_block_size"] == 2
    assert (kernel.params["token_stride"], kernel.params["head_stride"]) == (6, 12)
    assert small(axis_order="hnd").axis_order == "hnd"
    assert small().axis_order == "auto"
    assert "axis_order='nhd'" in repr(small(axis_order="nhd"))
    with pytest.raises(InvalidArgumentError, match="axis_order"):
        small(axis_order="bhnd")


def test_axis_order_contradicting_the_shape_names_layer_and_shape() -> None:
    # [2,8,4,2,3]: 4 tokens x 2 heads; heads first cannot hold block_size 4 with 2 heads.
    with pytest.raises(InvalidArgumentError, match="'hnd' contradicts") as err:
        mn.describe_layer("layers.1.attn", geo([2, 8, 4, 2, 3]), small(axis_order="hnd"))
    assert "layers.1.attn" in str(err.value) and "[2, 8, 4, 2, 3]" in str(err.value)
    # 4-D caches are [N,H,B,C]: heads first, whatever the strides.
    with pytest.raises(InvalidArgumentError, match="'nhd' contradicts") as err:
        mn.describe_layer("layers.2.attn", geo([8, 2, 4, 6]), small(axis_order="nhd"))
    assert "layers.2.attn" in str(err.value) and "[8, 2, 4, 6]" in str(err.value)
    assert mn.describe_layer("l", geo([8, 2, 4, 6]), small(axis_order="hnd")).num_heads == 2


def test_equal_heads_and_block_nhd_to_hnd_read_moves_exact_bytes() -> None:
    # The loopback reproduction: 4 heads, block_size 4, prefill [2,N,B,H,D] and decode
    # [2,N,H,B,D]. Tokens-first was assumed for both, so the decode was read transposed and the
    # READ ended done with wrong bytes. kvcache states each layer's axis order in its spec.
    from moriio_native import kvcache as kc

    prefill = kc.build_caches(
        [kc.LayerShape("l", "separated_nhd", block_size=4, head_size=8, num_heads=4)], 8
    )
    decode = kc.build_caches(
        [kc.LayerShape("l", "separated_hnd", block_size=4, head_size=8, num_heads=4)], 8
    )
    kc.fill_random(prefill, seed=1)
    kc.fill_random(decode, seed=2)
    p, d = mn.Engine("p"), mn.Engine("d")
    meta_p = p.register_kv_caches(prefill.registrations())
    meta_d = d.register_kv_caches(decode.registrations())
    d.add_peer(meta_p)
    p.add_peer(meta_d)
    expected = kc.expected_after_copy(decode, prefill, [1], [3])
    d.read("r", "p", [1], [3])
    assert d.wait(["r"], timeout=10)["r"].state == "done"
    assert int((decode.backing != expected).sum()) == 0


def test_ambiguous_plane_axis_and_override() -> None:
    with pytest.raises(InvalidArgumentError, match="Ambiguous"):
        mn.describe_layer("l0", geo([2, 2, 4, 2, 3]), small())
    # Separated: strides [48,24,6,3,1] -> plane 96 B, block 48 B.
    sep = mn.describe_layer("l0", geo([2, 2, 4, 2, 3]), small(), kv_plane_axis="separated")
    assert sep.params["plane_offset"] == (0, 96) and sep.block_stride == 48
    inter = mn.describe_layer("l0", geo([2, 2, 4, 2, 3]), small(), kv_plane_axis="interleaved")
    assert inter.params["plane_offset"] == (0, 48) and inter.block_stride == 96
    with pytest.raises(InvalidArgumentError, match="kv_plane_axis"):
        mn.describe_layer("l0", geo([2, 2, 4, 2, 3]), small(), kv_plane_axis="sideways")


def test_key_only_latent() -> None:
    # [N,B,D] = [8,4,3]: strides [12,3,1] -> block 24 B, token 6 B. Remote [16,4,3].
    # 1->4: (24,96,24); 3->5: (72,120,24). 1,2 -> 4,5 touch on both sides: (24,96,48).
    local = mn.describe_layer("idx", geo([8, 4, 3]), latent())
    remote = mn.describe_layer("idx", geo([16, 4, 3]), latent())
    assert local.kind == "mla" and local.num_heads == 1 and local.block_bytes == 24
    assert runs(local, remote, [1, 3], [4, 5]) == [(24, 96, 24), (72, 120, 24)]
    assert runs(local, remote, [1, 2], [4, 5]) == [(24, 96, 48)]


def test_standardized_contiguous_and_permuted() -> None:
    torch = pytest.importorskip("torch")
    # LBHNC-like [N,H,B,C] = [8,2,4,6], C = K 3 | V 3, contiguous strides [48,24,6,1]
    # -> block 96, head 48, token 12, K at +0, V at +6.
    local_t = torch.zeros((8, 2, 4, 6), dtype=torch.bfloat16)
    # LBNHC-like: memory [N,B,H,C] contiguous, viewed as [N,H,B,C] by permute: strides
    # [48,6,12,1] -> block 96, head 12, token 24.
    remote_t = torch.zeros((16, 4, 2, 6), dtype=torch.bfloat16).permute(0, 2, 1, 3)
    assert tuple(remote_t.stride()) == (48, 6, 12, 1)
    local = mn.describe_layer("l0", local_t, small())
    remote = mn.describe_layer("r0", remote_t, small())
    assert local.params["plane_offset"] == (0, 6) and local.params["plane_bytes"] == (6, 6)
    assert (remote.params["head_stride"], remote.params["token_stride"]) == (12, 24)
    # K and V of one (h,t) are adjacent on both sides (12 B); neighbouring cells are not:
    # runs (h*48 + t*12, t*24 + h*12, 12) per block, at local b*96, remote rb*96.
    expected = []
    for lb, rb in ((1, 4), (3, 5)):
        for h in range(2):
            for t in range(4):
                expected.append((lb * 96 + h * 48 + t * 12, rb * 96 + t * 24 + h * 12, 12))
    # Spelled out for block 1 -> 4 so the formula above is checked against hand numbers too.
    assert expected[:8] == [
        (96, 384, 12),
        (108, 408, 12),
        (120, 432, 12),
        (132, 456, 12),
        (144, 396, 12),
        (156, 420, 12),
        (168, 444, 12),
        (180, 468, 12),
    ]
    assert runs(local, remote, [1, 3], [4, 5]) == expected
    # Same layout on both sides: a block is one 96 B run. 1->4 (96,384), 3->5 (288,480).
    remote_same = mn.describe_layer("r1", torch.zeros((16, 2, 4, 6), dtype=torch.bfloat16), small())
    assert runs(local, remote_same, [1, 3], [4, 5]) == [(96, 384, 96), (288, 480, 96)]


def test_block_interleaved_padded_page() -> None:
    torch = pytest.importorskip("torch")
    # Two layers share each page of 112 bf16 (224 B): layer 0 at +0, layer 1 at +48 elements
    # (+96 B), 16 elements (32 B) of padding. Layer 1 = as_strided [8,2,4,6], strides
    # [112,24,6,1], storage offset 48 -> block stride 224 B > 96 B of content.
    backing = torch.zeros(8 * 112, dtype=torch.bfloat16)
    view = backing.as_strided((8, 2, 4, 6), (112, 24, 6, 1), 48)
    layer = mn.describe_layer("layers.1", view, small())
    assert layer.block_stride == 224
    assert layer.block_bytes == 96
    assert layer.span_bytes == 7 * 224 + 96
    remote = mn.describe_layer("r", geo([16, 2, 4, 6]), small())
    # 1->4: (224,384,96); 3->5: (672,480,96); 1,2 -> 4,5 do not touch locally (224+96 != 448).
    assert runs(layer, remote, [1, 3], [4, 5]) == [(224, 384, 96), (672, 480, 96)]
    assert runs(layer, remote, [1, 2], [4, 5]) == [(224, 384, 96), (448, 480, 96)]


@pytest.mark.parametrize(("dk", "dv"), [(3, 2), (2, 3)])
def test_packed_unequal_key_and_value_widths(dk: int, dv: int) -> None:
    # [8,2,4,5] with C = dk + dv = 5: strides [40,20,5,1] -> block 80, head 40, token 10; K at
    # +0 (dk*2 B), V at +dk*2 (dv*2 B). A (h,t) cell is 10 B and cells tile the block, so a block
    # is one 80 B run: 1->4 (80,320,80); 3->5 (240,400,80). block_bytes 80, extent 640.
    spec = small(head_size=dk, head_size_v=dv)
    local = mn.describe_layer("l0", geo([8, 2, 4, 5]), spec)
    remote = mn.describe_layer("r0", geo([16, 2, 4, 5]), spec)
    assert local.params["plane_offset"] == (0, 2 * dk)
    assert local.params["plane_bytes"] == (2 * dk, 2 * dv)
    assert (local.block_stride, local.block_bytes, local.span_bytes) == (80, 80, 640)
    assert runs(local, remote, [1, 3], [4, 5]) == [(80, 320, 80), (240, 400, 80)]


def test_separated_vs_interleaved_vs_packed_pair_the_same_content() -> None:
    # Separated S = [2,8,4,2,3] (cell p*384 + b*48 + t*12 + h*6), interleaved I = [8,2,4,2,3]
    # (b*96 + p*48 + t*12 + h*6), packed P = [8,2,4,6] (b*96 + h*48 + t*12 + p*6).
    s = mn.describe_layer("s", geo([2, 8, 4, 2, 3]), small())
    i = mn.describe_layer("i", geo([8, 2, 4, 2, 3]), small())
    p = mn.describe_layer("p", geo([8, 2, 4, 6]), small())
    # S -> I, block 2 -> 1: S's K plane (local 96, 48 B) lands at I's block 1 K (96);
    # S's V plane (384+96 = 480) at I's V (96+48 = 144).
    assert runs(s, i, [2], [1]) == [(96, 96, 48), (480, 144, 48)]
    # I -> S, block 1 -> 2: the mirror image, sorted by I's offsets.
    assert runs(i, s, [1], [2]) == [(96, 96, 48), (144, 480, 48)]
    # I -> P, block 0 -> 0: I's cell (p,t,h) at p*48 + t*12 + h*6, P's at h*48 + t*12 + p*6:
    # every 6 B cell stands alone. In I's byte order (p, t, h):
    expected = []
    for plane in range(2):
        for t in range(4):
            for h in range(2):
                expected.append((plane * 48 + t * 12 + h * 6, h * 48 + t * 12 + plane * 6, 6))
    assert expected[:4] == [(0, 0, 6), (6, 48, 6), (12, 12, 6), (18, 60, 6)]
    assert runs(i, p, [0], [0]) == expected


def test_unsorted_ids_and_merging() -> None:
    local = mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small())
    remote = mn.describe_layer("r0", geo([2, 16, 4, 2, 3]), small())
    assert runs(local, remote, [3, 1], [5, 4]) == WORKED
    # 3->4, 1->5: block 1 (48) pairs with remote 5 (240), block 3 (144) with 4 (192).
    assert runs(local, remote, [3, 1], [4, 5]) == [
        (48, 240, 48),
        (144, 192, 48),
        (432, 1008, 48),
        (528, 960, 48),
    ]
    # 1,2,3 -> 4,5,6: one run per plane. K (48,192,144); V (432,960,144).
    assert runs(local, remote, [2, 3, 1], [5, 6, 4]) == [(48, 192, 144), (432, 960, 144)]
    # 1,2 -> 4,6: remote does not touch (192+48 != 288): four runs.
    assert runs(local, remote, [1, 2], [4, 6]) == [
        (48, 192, 48),
        (96, 288, 48),
        (432, 960, 48),
        (480, 1056, 48),
    ]
    # numpy id arrays work like lists.
    assert runs(local, remote, np.array([1, 3]), np.array([4, 5])) == WORKED


def test_plan_block_copies_takes_a_request_s_block_pairs() -> None:
    # The worked example again, through one BlockPairs for the request: the same runs, and the
    # layer pair's template is built once and then served from the cache.
    local = mn.describe_layer("pairs.l", geo([2, 8, 4, 2, 3]), small())
    remote = mn.describe_layer("pairs.r", geo([2, 16, 4, 2, 3]), small())
    pairs = mn.BlockPairs([3, 1], [5, 4])
    before = mn.block_template.cache_info()
    for _ in range(3):
        plan = mn.plan_block_copies(local, remote, pairs)
        assert [tuple(r) for r in plan.runs()] == WORKED
    after = mn.block_template.cache_info()
    assert after.misses == before.misses + 1 and after.hits == before.hits + 2
    assert runs(local, remote, [3, 1], [5, 4]) == WORKED
    with pytest.raises(InvalidArgumentError, match="not both"):
        mn.plan_block_copies(local, remote, pairs, [4, 5])
    with pytest.raises(InvalidArgumentError, match="remote_block_ids is required"):
        mn.plan_block_copies(local, remote, [1, 3])


def test_block_id_errors() -> None:
    local = mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small())
    remote = mn.describe_layer("r0", geo([2, 16, 4, 2, 3]), small())
    # Highest valid on each side: 7 -> 15: K (336,720); V (384+336, 768+720) = (720,1488).
    assert runs(local, remote, [7], [15]) == [(336, 720, 48), (720, 1488, 48)]
    with pytest.raises(OutOfRangeError, match="local block id 8"):
        mn.plan_block_copies(local, remote, [0, 8], [1, 2])
    # Remote 8..15 is valid although the local side has 8 blocks; 16 is not.
    assert runs(local, remote, [0], [8]) == [(0, 384, 48), (384, 768 + 384, 48)]
    with pytest.raises(OutOfRangeError, match="remote block id 16") as err:
        mn.plan_block_copies(local, remote, [0, 1], [3, 16])
    assert isinstance(err.value, IndexError)
    with pytest.raises(MoriioError):
        mn.plan_block_copies(local, remote, [-1], [0])
    with pytest.raises(InvalidArgumentError, match="longer than remote"):
        mn.plan_block_copies(local, remote, [1, 2, 3], [4, 5])
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        mn.plan_block_copies(local, remote, [1, 3, 1], [4, 5, 6])
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        mn.plan_block_copies(local, remote, [1, 3], [5, 5])
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        mn.plan_block_copies(local, remote, [1, 2, 3], [5, 4, 5])
    with pytest.raises(InvalidArgumentError):
        mn.plan_block_copies(local, remote, np.array([[1, 2]]), np.array([[3, 4]]))


def test_empty_local_gives_empty_plan() -> None:
    local = mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small())
    remote = mn.describe_layer("r0", geo([2, 16, 4, 2, 3]), small())
    for rids in ([4, 5], []):
        plan = mn.plan_block_copies(local, remote, [], rids)
        assert len(plan) == 0 and plan.total_bytes == 0
        assert plan.local_offsets.shape == (0,)
    # Local shorter than remote pairs with the first remote ids: only 1 -> 4.
    assert runs(local, remote, [1], [4, 5]) == [(48, 192, 48), (432, 960, 48)]


@pytest.mark.parametrize(
    ("shape", "spec", "token"),
    [
        ([2, 8, 8, 2, 3], {"block_size": 8}, "block_size=8"),
        ([2, 8, 4, 4, 3], {"num_kv_heads": 4, "axis_order": "nhd"}, "heads=4"),
        ([2, 8, 4, 2, 5], {"head_size": 5}, "K=10B"),
    ],
)
def test_logical_mismatch_names_both(shape, spec, token) -> None:
    local = mn.describe_layer("model.layers.0", geo([2, 8, 4, 2, 3]), small())
    remote = mn.describe_layer("peer.layers.0", geo(shape), small(**spec))
    with pytest.raises(IncompatiblePeerError) as err:
        mn.plan_block_copies(local, remote, [1], [1])
    msg = str(err.value)
    assert "model.layers.0" in msg and "peer.layers.0" in msg
    assert "block_size=4" in msg and "heads=2" in msg and token in msg


def test_dtype_and_kind_mismatch() -> None:
    local = mn.describe_layer("a", geo([2, 8, 4, 2, 3]), small())
    fp32 = mn.describe_layer("b", geo([2, 8, 4, 2, 3], es=4), small(dtype_bytes=4))
    with pytest.raises(IncompatiblePeerError, match="dtype_bytes=4") as err:
        mn.plan_block_copies(local, fp32, [1], [1])
    assert "dtype_bytes=2" in str(err.value)
    # Same bytes per block (96), different kind.
    mla = mn.describe_layer("c", geo([8, 4, 12]), latent(head_size=12))
    with pytest.raises(IncompatiblePeerError):
        mn.plan_block_copies(local, mla, [1], [1])
    assert local.fingerprint != mla.fingerprint
    # Physical layout does not change the logical fingerprint.
    assert local.fingerprint == mn.describe_layer("d", geo([8, 2, 4, 6]), small()).fingerprint


def test_spec_tensor_mismatch_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="l0"):
        mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small(head_size=4))
    with pytest.raises(InvalidArgumentError, match="element size"):
        mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small(dtype_bytes=1))
    with pytest.raises(InvalidArgumentError, match=r"\[2, 8, 4, 2, 3\]"):
        mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small(block_size=5))
    with pytest.raises(InvalidArgumentError):
        mn.describe_layer("l0", geo([2, 15, 2, 2, 3]), small())
    with pytest.raises(InvalidArgumentError, match="block_size"):
        CacheSpec(kind="kv", block_size=0, dtype_bytes=2)
    with pytest.raises(InvalidArgumentError, match="kind"):
        CacheSpec(kind="kvv", block_size=4, dtype_bytes=2)
    with pytest.raises(TypeError):
        mn.describe_layer("l0", object(), small())


def test_overlapping_views_rejected() -> None:
    torch = pytest.importorskip("torch")
    one_plane = torch.zeros((1, 8, 4, 2, 3), dtype=torch.bfloat16)
    expanded = one_plane.expand(2, 8, 4, 2, 3)  # K and V alias: plane stride 0
    assert expanded.stride()[0] == 0
    with pytest.raises(InvalidArgumentError, match="overlap"):
        mn.describe_layer("l0", expanded, small())
    one_block = torch.zeros((2, 1, 4, 2, 3), dtype=torch.bfloat16).expand(2, 8, 4, 2, 3)
    with pytest.raises(InvalidArgumentError, match="overlap"):
        mn.describe_layer("l0", one_block, small())
    # Blocks 24 B apart while each spans 48 B.
    with pytest.raises(InvalidArgumentError, match="overlap"):
        mn.describe_layer("l0", geo([2, 8, 4, 2, 3], [192, 12, 6, 3, 1]), small())


def test_non_contiguous_last_dim_rejected() -> None:
    torch = pytest.importorskip("torch")
    wide = torch.zeros((2, 8, 4, 2, 6), dtype=torch.bfloat16)
    strided = wide[..., ::2]  # head content with stride 2
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        mn.describe_layer("l0", strided, small())
    # A head-content axis moved off the innermost position by a permute.
    moved = torch.zeros((2, 8, 4, 3, 2), dtype=torch.bfloat16).permute(0, 1, 2, 4, 3)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        mn.describe_layer("l0", moved, small())


def test_torch_tensor_and_geometry_agree() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros((2, 8, 4, 2, 3), dtype=torch.bfloat16)
    from_tensor = mn.describe_layer("l0", t, small())
    from_geo = mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small())
    assert from_tensor.params == from_geo.params
    assert from_tensor == from_geo
    # The HND layout vLLM builds by permuting: memory [2,N,H,B,D], logical [2,N,B,H,D].
    hnd = torch.zeros((2, 8, 2, 4, 3), dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    layer = mn.describe_layer("hnd", hnd, small())
    # strides [192,24,3,12,1] (B axis 3 el = 6 B, H axis 12 el = 24 B).
    assert (layer.params["token_stride"], layer.params["head_stride"]) == (6, 24)
    # Per plane a block is still [0,48): the worked-example runs against a contiguous remote
    # in the same HND order.
    remote = mn.describe_layer(
        "hnd_r", torch.zeros((2, 16, 2, 4, 3), dtype=torch.bfloat16).permute(0, 1, 3, 2, 4), small()
    )
    assert runs(layer, remote, [1, 3], [4, 5]) == WORKED


def _valid_params() -> dict:
    """The [2,8,4,2,3] bf16 layout's numbers, written by hand."""
    return {
        "kind": "kv",
        "num_blocks": 8,
        "block_size": 4,
        "kernel_block_size": 4,
        "num_heads": 2,
        "dtype_bytes": 2,
        "block_stride": 48,
        "kernel_block_stride": 48,
        "head_stride": 6,
        "token_stride": 12,
        "plane_offset": (0, 384),
        "plane_bytes": (6, 6),
    }


def test_described_params_match_hand_numbers() -> None:
    layer = mn.describe_layer("l0", geo([2, 8, 4, 2, 3]), small())
    assert layer.params == _valid_params()
