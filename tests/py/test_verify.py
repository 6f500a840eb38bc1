"""Block checksums (moriio_native.verify) and the verify messages.

The native (host) and torch (device) implementations must give the same value for the same
logical bytes in every layout family vLLM ships; any changed byte of a moved cell changes its
block's value; padding and bytes outside the window are never read; bad ids and windows are
refused naming the layer. The messages of the verify step are schema-checked like every other.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from moriio_native import CacheSpec, describe_layer
from moriio_native import verify as verify_module
from moriio_native.control.messages import (
    MAX_CHECKSUM_REQUEST_BYTES,
    MAX_NOTIFY_BYTES,
    ChecksumRequest,
    ChecksumResponse,
    HandshakeRequest,
    HandshakeResponse,
    InvalidMessageError,
    WriteDone,
    decode,
    encode,
)
from moriio_native.cudacopy import ChecksumLayer, CudaCopyError, layer_array
from moriio_native.engine import LayerRegistration
from moriio_native.errors import FailedPreconditionError, InvalidArgumentError, OutOfRangeError
from moriio_native.verify import (
    WHOLE_BLOCK,
    CellWindow,
    LayerChecksums,
    checksum_cuda,
    checksum_host,
    checksum_torch,
    compare,
    pack,
    unpack,
)

torch = pytest.importorskip("torch")

N, B, H, D = 6, 4, 2, 3  # blocks, tokens per block, heads, head size (bf16: 6-byte cells)


def spec(order: str = "auto", heads: int = H, block_size: int = B, head_size: int = D) -> CacheSpec:
    return CacheSpec(
        kind="kv",
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype_bytes=2,
        axis_order=order,
    )


def logical(seed: int = 0) -> Any:
    """K/V content as [2, N, B, H, D] int16 (the bit patterns of bf16)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (2, N, B, H, D), dtype=torch.int16, generator=gen)


def noise_like(shape: tuple[int, ...], seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)


def layouts(content: Any) -> dict[str, tuple[Any, CacheSpec]]:
    """The same logical content in every layout family: (tensor, spec) per name. Padded and
    strided forms are views into larger random buffers, so their gaps hold other bytes."""
    k, v = content[0], content[1]  # [N, B, H, D]
    d = content.shape[-1]
    out: dict[str, tuple[Any, CacheSpec]] = {
        "sep_nhd": (content.clone(), spec()),
        "sep_hnd": (content.permute(0, 1, 3, 2, 4).contiguous(), spec()),
        "int_nhd": (content.permute(1, 0, 2, 3, 4).contiguous(), spec()),
        "int_hnd": (content.permute(1, 0, 3, 2, 4).contiguous(), spec()),
        # Packed K|V per head and token: [N, H, B, 2D], contiguous and in NBHC memory order.
        "packed": (torch.cat([k, v], -1).permute(0, 2, 1, 3).contiguous(), spec()),
        "packed_nbhc": (torch.cat([k, v], -1).contiguous().permute(0, 2, 1, 3), spec()),
    }
    # Kernel blocks of 2 tokens, HND: [N*2, 2, H, 2, D] (tokens split across kernel blocks).
    kb = content.reshape(2, N, 2, 2, H, d).permute(1, 2, 0, 4, 3, 5).reshape(N * 2, 2, H, 2, d)
    out["kernel_int_hnd"] = (kb.contiguous(), spec("hnd"))
    # Padded blocks: each block's slot 1.5x its bytes, the rest random.
    padded = noise_like((2, N, H, B + 2, d), 7)
    padded[:, :, :, :B] = content.permute(0, 1, 3, 2, 4)
    out["padded_hnd"] = (padded[:, :, :, :B], spec())
    return out


def host_bytes(tensor: Any) -> np.ndarray:
    """The layer's bytes from its base to the end of its storage (what the native path reads)."""
    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return raw[tensor.data_ptr() - storage.data_ptr() :]


def both(name: str, tensor: Any, cache_spec: CacheSpec, ids: list[int], **window: Any) -> Any:
    layout = describe_layer(name, tensor, cache_spec)
    w = CellWindow(**window)
    native = checksum_host(layout, host_bytes(tensor), ids, w)
    by_torch = checksum_torch(layout, tensor, ids, w)
    assert native.dtype == np.uint64
    np.testing.assert_array_equal(native, by_torch, err_msg=name)
    return native


def test_every_layout_family_and_both_implementations_agree() -> None:
    content = logical(1)
    ids = [5, 0, 3, 2]
    values = {name: both(name, t, s, ids) for name, (t, s) in layouts(content).items()}
    reference = values["sep_nhd"]
    for name, got in values.items():
        np.testing.assert_array_equal(got, reference, err_msg=name)
    assert len(set(reference.tolist())) == len(ids)  # random blocks, distinct values
    # Another content gives other values.
    other = both("sep_nhd", logical(2), spec(), ids)
    assert not np.any(other == reference)


def test_any_flipped_byte_of_a_moved_cell_changes_only_its_block() -> None:
    content = logical(3)
    tensor, cache_spec = layouts(content)["int_hnd"]
    before = both("int_hnd", tensor, cache_spec, [1, 4])
    raw = host_bytes(tensor)
    block_bytes = 2 * H * B * D * 2
    for offset in (0, 1, block_bytes // 2 + 5, block_bytes - 1):  # block 4 is contiguous here
        raw[4 * block_bytes + offset] ^= 0x80
        after = both("int_hnd", tensor, cache_spec, [1, 4])
        assert after[0] == before[0] and after[1] != before[1], offset
        raw[4 * block_bytes + offset] ^= 0x80
    np.testing.assert_array_equal(both("int_hnd", tensor, cache_spec, [1, 4]), before)


def test_padding_and_cells_outside_the_window_are_ignored() -> None:
    content = logical(4)
    tensor, cache_spec = layouts(content)["padded_hnd"]
    window = {"head_begin": 1, "heads": 1, "token_begin": 2}
    before = both("padded_hnd", tensor, cache_spec, [0, 5], **window)
    whole = both("padded_hnd", tensor, cache_spec, [0, 5])
    base = tensor._base if tensor._base is not None else tensor
    base[:, :, :, B:] = 0  # the padding slots
    tensor[:, :, 0] ^= 0x55  # head 0: outside the window
    tensor[:, :, 1, :2] ^= 0x55  # tokens 0..1 of head 1: outside too
    np.testing.assert_array_equal(both("padded_hnd", tensor, cache_spec, [0, 5], **window), before)
    assert not np.any(both("padded_hnd", tensor, cache_spec, [0, 5]) == whole)
    tensor[1, 5, 1, 3, 0] ^= 1  # V, block 5, head 1, token 3: inside
    after = both("padded_hnd", tensor, cache_spec, [0, 5], **window)
    assert after[0] == before[0] and after[1] != before[1]


def test_a_head_window_equals_the_whole_block_of_the_side_holding_only_those_heads() -> None:
    content = logical(5)
    narrow = content[:, :, :, 1:].contiguous()  # heads 1.. of [2, N, B, H, D]
    wide = both("wide", content, spec(), [3, 1], head_begin=1)
    np.testing.assert_array_equal(both("narrow", narrow, spec(heads=H - 1), [3, 1]), wide)
    tail = content[:, :, 2:].contiguous()  # tokens 2..3 as blocks of 2 tokens
    np.testing.assert_array_equal(
        both("tail", tail, spec("nhd", block_size=2), [3, 1]),
        both("wide", content, spec(), [3, 1], token_begin=2),
    )


def test_bad_ids_and_windows_are_refused_naming_the_layer() -> None:
    tensor, cache_spec = layouts(logical(6))["sep_nhd"]
    layout = describe_layer("L0", tensor, cache_spec)
    for ids in ([N], [-1], [0, N + 3]):
        for fn, data in ((checksum_host, host_bytes(tensor)), (checksum_torch, tensor)):
            with pytest.raises(
                OutOfRangeError, match=rf"layer 'L0': block id {ids[-1]} .*{N} blocks"
            ):
                fn(layout, data, ids)
    for window in (
        CellWindow(heads=H + 1),
        CellWindow(head_begin=H),
        CellWindow(tokens=0),
        CellWindow(token_begin=B - 1, tokens=2),
    ):
        with pytest.raises(InvalidArgumentError, match="layer 'L0': checksum window"):
            checksum_host(layout, host_bytes(tensor), [0], window)
        with pytest.raises(InvalidArgumentError, match="layer 'L0': checksum window"):
            checksum_torch(layout, tensor, [0], window)
    with pytest.raises(InvalidArgumentError, match=r"layer 'L0'.*buffer of 10 bytes"):
        checksum_host(layout, np.zeros(10, dtype=np.uint8), [0])
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        checksum_host(layout, host_bytes(tensor)[::2], [0])


def test_compare_names_the_layer_and_both_blocks() -> None:
    ours = {
        "L0": pack(np.array([1, 2, 3], dtype=np.uint64)),
        "L1": pack(np.array([4], dtype=np.uint64)),
    }
    theirs = {"L0": pack(np.array([1, 9, 3], dtype=np.uint64))}
    got = compare(ours, theirs, [10, 11, 12], [20, 21, 22])
    assert str(got[0]).startswith("layer 'L0' block 11 (remote block 21): checksum")
    assert str(got[1]) == "layer 'L1': the peer sent no checksums for it"
    assert compare(ours, dict(ours), [10, 11, 12], [20, 21, 22])[:1] != []  # L1 has 1 of 3
    assert compare({"L0": ours["L0"]}, {"L0": ours["L0"]}, [1, 2, 3], [4, 5, 6]) == []
    with pytest.raises(InvalidArgumentError, match="whole uint64"):
        unpack(b"123")


def test_device_layers_that_are_not_torch_tensors_are_refused_at_start_up() -> None:
    tensor, cache_spec = layouts(logical(7))["sep_nhd"]
    array = tensor.numpy()
    reg = LayerRegistration(
        "L0",
        array,
        cache_spec,
        allocation=(array.ctypes.data, array.nbytes),
        memory="cuda",
        device=0,
    )
    with pytest.raises(FailedPreconditionError, match="verify: layer 'L0' is in cuda memory"):
        LayerChecksums.for_registrations([reg])
    host = LayerChecksums.for_registrations(
        [LayerRegistration("L0", array, cache_spec, allocation=(array.ctypes.data, array.nbytes))]
    )
    assert host.layers == ("L0",)
    assert host.compute([2, 1])["L0"] == pack(both("L0", tensor, cache_spec, [2, 1]))


# ---- messages ---------------------------------------------------------------------------------


def test_verify_messages_round_trip_and_are_bounded() -> None:
    request = ChecksumRequest(requester_engine_id="d/dp0/tp0", transfer_id="t1", block_ids=(3, 1))
    assert len(request.nonce) == 16
    again = decode(encode(request), (ChecksumRequest,), max_bytes=MAX_CHECKSUM_REQUEST_BYTES)
    assert again == request and (again.heads, again.tokens) == (0, 0)
    response = ChecksumResponse(transfer_id="t1", checksums={"L0": b"\0" * 16})
    assert decode(encode(response), (ChecksumResponse,), max_bytes=1 << 20) == response
    done = WriteDone("t1", checksums={"L0": b"\1" * 8})
    assert decode(encode(done), (WriteDone,), max_bytes=MAX_NOTIFY_BYTES).checksums == {
        "L0": b"\1" * 8
    }
    assert WriteDone("t1").checksums is None
    with pytest.raises(InvalidMessageError, match="block_ids"):
        ChecksumRequest(requester_engine_id="d", transfer_id="t", block_ids=(-1,))
    with pytest.raises(InvalidMessageError, match="checksums"):
        ChecksumResponse(transfer_id="t", checksums={"bad\nlayer": b""})
    raw = msgspec.msgpack.encode({"type": "checksum_response", "transfer_id": "t"})
    with pytest.raises(InvalidMessageError, match="lacks checksums"):
        decode(raw, (ChecksumResponse,), max_bytes=1 << 20)


def test_handshakes_from_peers_that_predate_verify_mean_verify_off() -> None:
    request = HandshakeRequest("d/dp0/tp0", verify=True)
    assert decode(encode(request), (HandshakeRequest,), max_bytes=4096).verify is True
    wire = msgspec.msgpack.decode(encode(request))
    del wire["verify"]
    old = decode(msgspec.msgpack.encode(wire), (HandshakeRequest,), max_bytes=4096)
    assert old.verify is False
    response = HandshakeResponse(engine_id="p/dp0/tp0", engine_metadata=b"m")
    wire = msgspec.msgpack.decode(encode(response))
    del wire["verify"], wire["nonce"]
    with pytest.raises(InvalidMessageError, match="lacks nonce"):  # other keys stay required
        decode(msgspec.msgpack.encode(wire), (HandshakeResponse,), max_bytes=4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_device_checksums_equal_the_native_host_ones() -> None:
    """The torch path on the GPU (what the vLLM adapter runs for device caches) against the
    native core over the same bytes in host memory, for every layout family."""
    content = logical(8)
    ids = [4, 1, 5]
    for name, (tensor, cache_spec) in layouts(content).items():
        host = both(name, tensor, cache_spec, ids)
        storage = tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage).cuda()
        device = raw.view(tensor.dtype).as_strided(
            tensor.shape, tensor.stride(), tensor.storage_offset()
        )
        layout = describe_layer(name, device, cache_spec)
        np.testing.assert_array_equal(checksum_torch(layout, device, ids), host, err_msg=name)
        every = list(range(N))
        before = checksum_torch(layout, device, every)
        device[(1,) * device.dim()] ^= 1  # one moved byte changes exactly one block's value
        changed = checksum_torch(layout, device, every)
        assert int(np.count_nonzero(changed != before)) == 1, name


def _cuda_plugin() -> Any:
    from moriio_native.cudacopy import shared_plugin

    plugin = shared_plugin() if torch.cuda.is_available() and torch.version.hip is None else None
    if plugin is None:
        pytest.skip("needs a CUDA device and the CUDA copy plugin (built where nvcc is)")
    return plugin


def _on_cuda(tensor: Any) -> Any:
    """``tensor``'s storage copied to the GPU, viewed with the same shape and strides."""
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).cuda()
    return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def test_the_cuda_kernel_equals_the_native_host_checksums_in_one_call() -> None:
    """Every layout family at once (one kernel for all layers): 6-byte cells (the byte path),
    whole-word cells of 16 and 256 bytes (a warp per cell), windows of heads and tokens; a
    changed byte changes exactly its block in exactly its layer."""
    plugin = _cuda_plugin()
    families: list[tuple[str, Any, CacheSpec]] = []
    for head_size in (3, 8, 128):
        content = torch.randint(-(2**15), 2**15, (2, N, B, H, head_size), dtype=torch.int16)
        for name, (tensor, cache_spec) in layouts(content).items():
            sized = spec(cache_spec.axis_order, H, cache_spec.block_size, head_size)
            families.append((f"{name}_d{head_size}", tensor, sized))
    ids = [4, 1, 5, 1, 0]
    for window in ({}, {"head_begin": 1}, {"token_begin": 1, "tokens": 2}):
        w = CellWindow(**window)
        pairs = []
        expected = []
        for name, tensor, cache_spec in families:
            layout = describe_layer(name, tensor, cache_spec)
            expected.append(checksum_host(layout, host_bytes(tensor), ids, w))
            pairs.append((layout, _on_cuda(tensor)))
        got = checksum_cuda(plugin, pairs, ids, w)
        for (name, _, _), want, values in zip(families, expected, got, strict=True):
            np.testing.assert_array_equal(values, want, err_msg=f"{name} {window}")
    every = list(range(N))
    before = checksum_cuda(plugin, pairs, every)
    pairs[5][1][(1,) * pairs[5][1].dim()] ^= 1
    after = checksum_cuda(plugin, pairs, every)
    changed = [int(np.count_nonzero(a != b)) for a, b in zip(after, before, strict=True)]
    assert changed == [0] * 5 + [1] + [0] * (len(pairs) - 6)


def test_the_cuda_kernel_refuses_bad_ids_and_windows_naming_the_layer() -> None:
    plugin = _cuda_plugin()
    tensor, cache_spec = layouts(logical(3))["int_hnd"]
    layout = describe_layer("L7", tensor, cache_spec)
    pairs = [(layout, _on_cuda(tensor))]
    with pytest.raises(OutOfRangeError, match="layer 'L7': block id 6 at position 1"):
        checksum_cuda(plugin, pairs, [0, 6])
    with pytest.raises(InvalidArgumentError, match="layer 'L7': checksum window heads"):
        checksum_cuda(plugin, pairs, [0], CellWindow(head_begin=H))
    short = pairs[0][1].reshape(-1)[: pairs[0][1].numel() // 2]
    with pytest.raises(InvalidArgumentError, match="layer 'L7': the tensor's storage does not"):
        checksum_cuda(plugin, [(layout, torch.empty_like(short))], [0])
    assert checksum_cuda(plugin, [], [0]) == []
    assert [len(v) for v in checksum_cuda(plugin, pairs, [])] == [0]

    # The plugin's own bound (its cell indices are 32-bit), named by the layer's index.
    def planes_of(heads: int, tokens: int) -> ChecksumLayer:
        return ChecksumLayer(
            base=int(pairs[0][1].data_ptr()),
            plane_bytes=(8, 8),
            planes=2,
            kernel_block_size=tokens,
            heads=heads,
            tokens=tokens,
        )

    huge = planes_of(1 << 15, 1 << 15)  # 2^31 cells: the first count the plugin refuses
    fine = verify_module.describe_cuda(pairs, WHOLE_BLOCK).described[0]
    # Review: 2 * heads * tokens wrapped 64 bits to 290,948,384 cells and passed the bound.
    wrapping = planes_of(3_037_000_500, 3_037_000_500)
    with pytest.raises(CudaCopyError, match=r"checksum layer 0: 2 \* 3037000500 \* 3037000500"):
        plugin.checksum_blocks(0, 0, layer_array([wrapping]), np.zeros(1, dtype=np.int64))
    with pytest.raises(CudaCopyError, match=r"checksum layer 1: 2 \* 32768 \* 32768 cells per"):
        plugin.checksum_blocks(0, 0, layer_array([fine, huge]), np.zeros(1, dtype=np.int64))


def _plugin_checksums(form: str, seed: int) -> tuple[LayerChecksums, Any, Any]:
    """LayerChecksums of one CUDA layer ``L0`` in layout family ``form`` (checked to go through
    the plugin), its layout and its tensor."""
    plugin = _cuda_plugin()
    tensor, cache_spec = layouts(logical(seed))[form]
    device = _on_cuda(tensor)
    registration = LayerRegistration("L0", device, cache_spec, memory="cuda")
    checksums = LayerChecksums.for_registrations([registration])
    assert checksums._cuda_plugin is plugin
    return checksums, describe_layer("L0", device, cache_spec), device


def test_cuda_layers_go_through_the_plugin_and_agree_with_torch() -> None:
    """LayerChecksums picks the plugin for CUDA layers: its values equal torch's."""
    checksums, layout, device = _plugin_checksums("sep_nhd", 5)
    values = checksums.compute([3, 0])
    assert values == {"L0": pack(checksum_torch(layout, device, [3, 0]))}


def _kv_forms(
    blocks: int, tokens: int, heads: int, kernel: int, head_size: int, *, interleaved: bool
) -> dict[str, tuple[Any, str]]:
    """Random int16 K/V content of ``blocks`` blocks as separated NHD, interleaved HND (with
    ``interleaved``) and interleaved HND with its tokens split into kernel blocks of ``kernel``
    (``[N * tokens/kernel, 2, H, kernel, D]``): each form's tensor and block order."""
    gen = torch.Generator().manual_seed(head_size)
    content = torch.randint(
        -(2**15), 2**15, (2, blocks, tokens, heads, head_size), dtype=torch.int16, generator=gen
    )
    split = content.reshape(2, blocks, tokens // kernel, kernel, heads, head_size)
    forms = {"sep_nhd": (content, "auto")}
    if interleaved:
        forms["int_hnd"] = (content.permute(1, 0, 3, 2, 4).contiguous(), "auto")
    forms["kernel_int_hnd"] = (
        split.permute(1, 2, 0, 4, 3, 5)
        .reshape(blocks * (tokens // kernel), 2, heads, kernel, head_size)
        .contiguous(),
        "hnd",
    )
    return forms


def _assert_kernel_equals_host(
    plugin: Any,
    forms: dict[str, tuple[Any, str]],
    geometry: tuple[int, int, int],
    ids: list[int],
    windows: tuple[dict[str, int], ...],
) -> None:
    """Each form's checksums by the kernel (one layer per call) equal the host's, per window;
    ``geometry``: heads, tokens, head size."""
    heads, tokens, head_size = geometry
    for form, (tensor, order) in forms.items():
        layout = describe_layer(form, tensor, spec(order, heads, tokens, head_size))
        on_gpu = _on_cuda(tensor)
        for window in windows:
            w = CellWindow(**window)
            want = checksum_host(layout, host_bytes(tensor), ids, w)
            got = checksum_cuda(plugin, [(layout, on_gpu)], ids, w)[0]
            np.testing.assert_array_equal(got, want, err_msg=f"{form} d{head_size} {window}")


def test_the_cuda_kernel_steps_through_large_blocks_as_the_host_does() -> None:
    """Blocks of many heads and tokens (512 cells, which the kernel looks up in its cell table;
    a later test takes blocks past it, where a cursor steps), for cells of 4 to 512 bytes (512:
    a whole warp per cell, 16 bytes a lane), with kernel blocks of 4 tokens and windows inside
    the first kernel block, across kernel blocks and over a head range; 40 ids so a block's
    units spread over the grid."""
    plugin = _cuda_plugin()
    blocks, tokens, heads, kernel = 48, 32, 8, 4
    ids = [(7 * i + 3) % blocks for i in range(40)] + [3]
    windows = (
        {},
        {"token_begin": 1, "tokens": 2},  # inside the first kernel block
        {"token_begin": 3, "tokens": 26},  # across kernel blocks
        {"head_begin": 3, "heads": 4, "token_begin": 5},
    )
    for head_size in (2, 8, 64, 128, 256):
        forms = _kv_forms(blocks, tokens, heads, kernel, head_size, interleaved=True)
        _assert_kernel_equals_host(plugin, forms, (heads, tokens, head_size), ids, windows)


def test_layer_checksums_describe_each_window_once_and_see_new_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LayerChecksums keeps each window's description of its CUDA layers (describing costs
    Python per layer and call), not their values: bytes written after a call change the next."""
    checksums, layout, device = _plugin_checksums("int_nhd", 6)
    described: list[CellWindow] = []
    describe = verify_module.describe_cuda

    def counted(layers: Any, window: CellWindow) -> Any:
        described.append(window)
        return describe(layers, window)

    monkeypatch.setattr(verify_module, "describe_cuda", counted)
    head = CellWindow(head_begin=1)
    first = checksums.compute([2, 5])
    assert checksums.compute([5], head) == {"L0": pack(checksum_torch(layout, device, [5], head))}
    device[2] ^= 0x0101  # block 2's cells change
    second = checksums.compute([2, 5])
    assert checksums.compute([5], head) == {"L0": pack(checksum_torch(layout, device, [5], head))}
    assert described == [WHOLE_BLOCK, head]
    assert second == {"L0": pack(checksum_torch(layout, device, [2, 5]))}
    assert unpack(first["L0"])[0] != unpack(second["L0"])[0]
    assert unpack(first["L0"])[1] == unpack(second["L0"])[1]


def test_the_cuda_kernel_walks_many_units_per_cta_as_the_host_does() -> None:
    """More units than the grid has CTAs, so each CTA walks several, a unit count per block (7)
    that does not divide a grid of 396 (132 SMs, 3 CTAs each, two layers): the walk's carries
    from one block's units to the next are taken. Two layers of 1,000 blocks of 7 heads and 32
    tokens of 256-byte cells, every block, against the host checksums."""
    plugin = _cuda_plugin()
    blocks, tokens, heads, head_size = 1000, 32, 7, 128
    pairs = []
    expected = []
    ids = list(range(blocks - 1, -1, -1))
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        content = torch.randint(
            -(2**15), 2**15, (2, blocks, tokens, heads, head_size), dtype=torch.int16, generator=gen
        )
        layout = describe_layer(f"L{seed}", content, spec("auto", heads, tokens, head_size))
        expected.append(checksum_host(layout, host_bytes(content), ids))
        pairs.append((layout, _on_cuda(content)))
    got = checksum_cuda(plugin, pairs, ids)
    for (layout, _), want, values in zip(pairs, expected, got, strict=True):
        np.testing.assert_array_equal(values, want, err_msg=layout.name)


def _aligned_and_odd_cells() -> list[tuple[str, Any, CacheSpec]]:
    """Layers whose cells the kernel reads 16, 8 or 1 bytes at a time: [2, N, B, H, D] placed 0,
    2, 8 and 16 bytes into their storage, and HND with each token's slot 8 bytes longer than
    its cell (a token stride of 8 modulo 16), for cells of 6, 16, 24, 256 and 528 bytes (528:
    33 chunks of 16 bytes, more than a warp has lanes)."""
    families: list[tuple[str, Any, CacheSpec]] = []
    for head_size in (3, 8, 12, 128, 264):
        cache_spec = spec("auto", H, B, head_size)
        numel = 2 * N * B * H * head_size
        for shift in (0, 1, 4, 8):  # int16 elements into the storage: 0, 2, 8, 16 bytes
            storage = noise_like((numel + 8,), 10 * head_size + shift)
            tensor = storage[shift : shift + numel].view(2, N, B, H, head_size)
            families.append((f"d{head_size}_at{2 * shift}", tensor, cache_spec))
        padded = noise_like((2, N, H, B, head_size + 4), head_size)
        families.append((f"d{head_size}_padded", padded[..., :head_size], cache_spec))
    return families


def test_the_cuda_kernel_reads_16_8_and_1_byte_aligned_cells_as_the_host_does() -> None:
    """The kernel loads 16 bytes at a time where every cell of a layer is 16-byte aligned and a
    multiple of 16 bytes long, whole 8-byte words where they are 8-byte aligned whole words, and
    bytes otherwise; layers of each kind in one call, whole blocks and windows, give the host's
    values, and a changed byte changes only its block."""
    plugin = _cuda_plugin()
    families = _aligned_and_odd_cells()
    ids = [3, 0, 5, 3, 1]
    pairs = [(describe_layer(name, t, s), _on_cuda(t)) for name, t, s in families]
    for window in ({}, {"head_begin": 1}, {"token_begin": 1, "tokens": 2}):
        w = CellWindow(**window)
        got = checksum_cuda(plugin, pairs, ids, w)
        for (name, tensor, _), (layout, _), values in zip(families, pairs, got, strict=True):
            want = checksum_host(layout, host_bytes(tensor), ids, w)
            np.testing.assert_array_equal(values, want, err_msg=f"{name} {window}")
    every = list(range(N))
    before = checksum_cuda(plugin, pairs, every)
    for index in range(len(pairs)):
        layer = pairs[index][1]
        layer[(1,) * layer.dim()] ^= 1  # block 1, one byte
    after = checksum_cuda(plugin, pairs, every)
    for (name, _, _), a, b in zip(families, after, before, strict=True):
        assert (a != b).tolist() == [False, True] + [False] * (N - 2), name


def test_the_cuda_kernel_walks_blocks_of_more_cells_than_its_table() -> None:
    """Blocks of more than 2,048 cells (the kernel's table of cell offsets holds that many; past
    it a cursor steps each lane's cell from one pass to the next): 8 heads of 136 tokens, kernel
    blocks of 8 tokens, cells of 4 to 528 bytes, whole blocks and windows, against the host."""
    plugin = _cuda_plugin()
    blocks, tokens, heads, kernel = 6, 136, 8, 8
    ids = [5, 0, 3, 5]
    windows = ({}, {"token_begin": 5, "tokens": 100}, {"head_begin": 3, "heads": 4})
    for head_size in (2, 8, 128, 264):
        forms = _kv_forms(blocks, tokens, heads, kernel, head_size, interleaved=False)
        _assert_kernel_equals_host(plugin, forms, (heads, tokens, head_size), ids, windows)
