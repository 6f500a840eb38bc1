"""Block checksums for the end-to-end integrity check of transfers (``"verify": true``).

A block's checksum covers its LOGICAL cells -- (plane, head, token) in that order, inside an
optional :class:`CellWindow` -- never padding, so the two sides of a transfer agree whatever
their physical layouts. The definition is in ``include/moriio_native/checksum.hpp``: each cell
zero-padded to whole 64-bit little-endian words ``w_i``, the value is
``sum_i fmix64(w_i ^ (i + 1) * 0x9E3779B97F4A7C15) mod 2**64``. Two implementations compute it:

* :func:`checksum_host` -- the native core over host memory (releases the GIL);
* :func:`checksum_torch` -- torch on the tensor's own device (CUDA / ROCm, or CPU), through a
  logical view of the layer's bytes: the same value for the same logical bytes
  (tests/py/test_verify.py checks both against each other on every layout family);
* :func:`checksum_cuda` -- the CUDA copy plugin's one kernel for every CUDA layer at once,
  which :class:`LayerChecksums` takes whenever the plugin loads (torch otherwise: ROCm, or a
  build without nvcc).

:class:`LayerChecksums` holds one rank's registered layers and computes every layer's values
for a list of blocks; :func:`compare` pairs two sides' values. The wire form of one layer's
values is little-endian uint64 bytes, one value per block (:func:`pack` / :func:`unpack`).
Pure functions and immutable holders: thread-safe; torch is imported only for device layers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moriio_native import _native
from moriio_native.errors import FailedPreconditionError, InvalidArgumentError
from moriio_native.integers import is_integer
from moriio_native.layout import LayerLayout, describe_layer, geometry_of

_MASK64 = (1 << 64) - 1
_POSITION_STEP = 0x9E3779B97F4A7C15
_MIX1 = 0xFF51AFD7ED558CCD
_MIX2 = 0xC4CEB9FE1A85EC53
# The torch path works on at most this many bytes of int64 words at once (it needs a few
# temporaries of that size on the device).
_TORCH_CHUNK_BYTES = 64 << 20
# Windows whose description of a device's CUDA layers LayerChecksums keeps: a rank sees the
# whole block and one head window per peer TP layout, so a few; past it the least recently
# used is described again when next asked.
DESCRIBED_WINDOWS = 16


@dataclasses.dataclass(frozen=True)
class CellWindow:
    """The heads ``[head_begin, head_begin + heads)`` and tokens ``[token_begin, token_begin +
    tokens)`` of each block a transfer moves (None: to the end of the block)."""

    head_begin: int = 0
    heads: int | None = None
    token_begin: int = 0
    tokens: int | None = None

    def resolve(self, layout: LayerLayout) -> tuple[int, int, int, int]:
        """``(head_begin, heads, token_begin, tokens)`` for ``layout``; InvalidArgumentError
        naming the layer when the window is empty or reaches past the block."""
        for name in ("head_begin", "heads", "token_begin", "tokens"):
            value = getattr(self, name)
            if value is None and name in ("heads", "tokens"):
                continue
            if not is_integer(value):
                raise InvalidArgumentError(
                    f"layer '{layout.name}': checksum window {name} must be an integer, got "
                    f"{type(value).__name__} {value!r}"
                )
        heads = layout.num_heads - self.head_begin if self.heads is None else self.heads
        tokens = layout.block_size - self.token_begin if self.tokens is None else self.tokens
        for axis, begin, count, size in (
            ("heads", self.head_begin, heads, layout.num_heads),
            ("tokens", self.token_begin, tokens, layout.block_size),
        ):
            if not (begin >= 0 and count > 0 and begin + count <= size):
                raise InvalidArgumentError(
                    f"layer '{layout.name}': checksum window {axis} [{begin}, {begin} + {count}) "
                    f"is empty or outside the block's {size} {axis}"
                )
        return self.head_begin, heads, self.token_begin, tokens


WHOLE_BLOCK = CellWindow()


def checksum_host(
    layout: LayerLayout, buffer: Any, block_ids: Sequence[int], window: CellWindow = WHOLE_BLOCK
) -> np.ndarray:
    """One uint64 per block id: the native core over ``buffer`` (C-contiguous, the layer's bytes
    from its base, at least ``layout.span_bytes`` long). OutOfRangeError naming the layer and
    the id for a bad block id."""
    window.resolve(layout)  # its fields checked by name (pybind11 takes True as 1)
    return _native.checksum_blocks(
        layout,
        buffer,
        block_ids,
        head_begin=window.head_begin,
        heads=window.heads,
        token_begin=window.token_begin,
        tokens=window.tokens,
    )


def _signed(value: int) -> int:
    """``value`` (mod 2**64) as the int64 torch multiplies with (it wraps like uint64)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _torch_mix(x: Any) -> Any:
    """fmix64 on an int64 tensor (``>>`` is arithmetic there: the mask makes it logical)."""
    low31 = (1 << 31) - 1
    x = x ^ ((x >> 33) & low31)
    x = x * _signed(_MIX1)
    x = x ^ ((x >> 33) & low31)
    x = x * _signed(_MIX2)
    return x ^ ((x >> 33) & low31)


def _byte_view(tensor: Any) -> tuple[Any, int]:
    """The uint8 tensor over ``tensor``'s whole storage and the layer base's offset in it."""
    import torch

    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    return raw, int(tensor.data_ptr()) - int(storage.data_ptr())


def _check_held(layout: LayerLayout, tensor: Any) -> None:
    """InvalidArgumentError naming the layer when ``tensor``'s storage does not hold the
    layout's bytes from its base (a device path would read past it). From the storage's
    addresses alone: no view is built (the plugin path runs this per layer and call)."""
    storage = tensor.untyped_storage()
    base = int(tensor.data_ptr()) - int(storage.data_ptr())
    if base < 0 or base + layout.span_bytes > storage.nbytes():
        raise InvalidArgumentError(
            f"layer '{layout.name}': the tensor's storage does not hold the layout's "
            f"{layout.span_bytes} bytes"
        )


def _integer_ids(block_ids: Sequence[int]) -> list[int]:
    """The ids as ints; InvalidArgumentError for a bool or a non-integer (never truncated, as
    checksum_host refuses them)."""
    ids = []
    for position, block in enumerate(block_ids):
        if not is_integer(block):
            raise InvalidArgumentError(
                f"block_ids must be integers, got {type(block).__name__} {block!r} at position "
                f"{position}"
            )
        ids.append(int(block))
    return ids


def _check_ids(layout: LayerLayout, block_ids: Sequence[int]) -> list[int]:
    ids = _integer_ids(block_ids)
    for position, block in enumerate(ids):
        if not 0 <= block < layout.num_blocks:
            from moriio_native.errors import OutOfRangeError

            raise OutOfRangeError(
                f"layer '{layout.name}': block id {block} at position {position} out of range "
                f"(the layer has {layout.num_blocks} blocks)"
            )
    return ids


def checksum_torch(
    layout: LayerLayout, tensor: Any, block_ids: Sequence[int], window: CellWindow = WHOLE_BLOCK
) -> np.ndarray:
    """The values :func:`checksum_host` gives, computed by torch on ``tensor``'s device:
    ``tensor`` is the layer's cache (any dtype and view; its ``data_ptr`` is the layer base and
    its storage holds the layer). Blocks until the device finished."""
    import torch

    ids = _check_ids(layout, block_ids)
    head_begin, heads, token_begin, tokens = window.resolve(layout)
    p = layout.params
    _check_held(layout, tensor)
    raw, base = _byte_view(tensor)
    kernel = p["kernel_block_size"]
    planes = 2 if p["kind"] == "kv" else 1
    words_per_block = sum(heads * tokens * -(-p["plane_bytes"][i] // 8) for i in range(planes))
    out = np.zeros(len(ids), dtype=np.uint64)
    if not ids:
        return out
    chunk = max(1, _TORCH_CHUNK_BYTES // (8 * words_per_block))
    positions = torch.arange(1, words_per_block + 1, dtype=torch.int64, device=tensor.device)
    positions = positions * _signed(_POSITION_STEP)
    for start in range(0, len(ids), chunk):
        index = torch.tensor(ids[start : start + chunk], dtype=torch.int64, device=tensor.device)
        words = []
        for plane in range(planes):
            nbytes = int(p["plane_bytes"][plane])
            cells = raw.as_strided(
                (layout.num_blocks, layout.num_heads, layout.block_size // kernel, kernel, nbytes),
                (
                    p["block_stride"],
                    p["head_stride"],
                    p["kernel_block_stride"],
                    p["token_stride"],
                    1,
                ),
                base + p["plane_offset"][plane],
            )
            picked = cells.index_select(0, index).reshape(
                len(index), layout.num_heads, layout.block_size, nbytes
            )[:, head_begin : head_begin + heads, token_begin : token_begin + tokens]
            padded = torch.zeros(
                (len(index), heads, tokens, -(-nbytes // 8) * 8),
                dtype=torch.uint8,
                device=tensor.device,
            )
            padded[..., :nbytes] = picked
            words.append(padded.view(torch.int64).reshape(len(index), -1))
        mixed = _torch_mix(torch.cat(words, dim=1) ^ positions)
        low = (mixed & 0xFFFFFFFF).sum(dim=1)
        high = ((mixed >> 32) & 0xFFFFFFFF).sum(dim=1)
        for i, (lo, hi) in enumerate(zip(low.tolist(), high.tolist(), strict=True)):
            out[start + i] = (lo + (hi << 32)) & _MASK64
    return out


def _checksum_layer(layout: LayerLayout, tensor: Any, window: CellWindow) -> Any:
    """The plugin's form of ``layout`` over ``tensor`` (its ``data_ptr`` the layer base) with
    ``window`` resolved; InvalidArgumentError naming the layer for a bad window, or a storage
    that does not hold the layout's bytes."""
    from moriio_native.cudacopy import ChecksumLayer

    head_begin, heads, token_begin, tokens = window.resolve(layout)
    _check_held(layout, tensor)
    p = layout.params
    planes = 2 if p["kind"] == "kv" else 1
    return ChecksumLayer(
        base=int(tensor.data_ptr()),
        block_stride=p["block_stride"],
        head_stride=p["head_stride"],
        token_stride=p["token_stride"],
        kernel_block_stride=p["kernel_block_stride"],
        plane_offset=(p["plane_offset"][0], p["plane_offset"][1] if planes == 2 else 0),
        plane_bytes=(p["plane_bytes"][0], p["plane_bytes"][1] if planes == 2 else 0),
        planes=planes,
        kernel_block_size=p["kernel_block_size"],
        head_begin=head_begin,
        heads=heads,
        token_begin=token_begin,
        tokens=tokens,
    )


@dataclasses.dataclass(frozen=True)
class CudaLayers:
    """CUDA layers of one device described for the plugin's kernel with one window
    (:func:`describe_cuda`): built once and passed to every :func:`checksum_described` call, so
    a call costs no Python per layer (describing one costs ~7 us). The description holds the
    tensors' addresses: valid while the tensors live and do not move (registered caches)."""

    layouts: tuple[LayerLayout, ...]
    tensors: tuple[Any, ...]  # kept alive with their addresses
    device: Any
    described: Any  # a ctypes array of moriio_native.cudacopy.ChecksumLayer
    fewest_blocks: int  # the smallest layer's num_blocks: ids below it need no check per layer


def describe_cuda(layers: Sequence[tuple[LayerLayout, Any]], window: CellWindow) -> CudaLayers:
    """Each ``(layout, tensor)`` of CUDA tensors on one device in the plugin's form, ``window``
    resolved; InvalidArgumentError naming the layer for a bad window, or a storage that does not
    hold the layout's bytes."""
    from moriio_native.cudacopy import layer_array

    layouts = tuple(layout for layout, _ in layers)
    tensors = tuple(tensor for _, tensor in layers)
    described = layer_array([_checksum_layer(layout, t, window) for layout, t in layers])
    return CudaLayers(
        layouts,
        tensors,
        tensors[0].device if tensors else None,
        described,
        min((layout.num_blocks for layout in layouts), default=0),
    )


def checksum_described(
    plugin: Any, layers: CudaLayers, block_ids: Sequence[int]
) -> list[np.ndarray]:
    """The values :func:`checksum_host` gives for each of ``layers`` (:func:`describe_cuda`),
    by one kernel of the CUDA copy plugin (``plugin``: a :class:`moriio_native.cudacopy.Plugin`)
    on the current torch stream of their device. Blocks until the values are here.
    OutOfRangeError naming the layer for a bad id (nothing computed); FailedPreconditionError
    naming the layer when the plugin fails."""
    import torch

    from moriio_native.cudacopy import CudaCopyError

    if not layers.layouts:
        return []
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= layers.fewest_blocks):
        for layout in layers.layouts:
            _check_ids(layout, ids.tolist())  # raises, naming the layer, the id and its position
    device = layers.device
    try:
        values = plugin.checksum_blocks(
            device.index,
            torch.cuda.current_stream(device).cuda_stream,
            layers.described,
            ids,
        )
    except CudaCopyError as exc:
        message = str(exc)
        if message.startswith("checksum layer "):
            index = int(message.split()[2].rstrip(":"))
            message = f"layer '{layers.layouts[index].name}': {message}"
        raise FailedPreconditionError(f"verify on {device}: {message}") from None
    return list(values)


def checksum_cuda(
    plugin: Any,
    layers: Sequence[tuple[LayerLayout, Any]],
    block_ids: Sequence[int],
    window: CellWindow = WHOLE_BLOCK,
) -> list[np.ndarray]:
    """:func:`checksum_described` of ``layers`` described for this one call. OutOfRangeError /
    InvalidArgumentError naming the layer for bad ids or windows (nothing computed)."""
    if not layers:
        return []
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    described = describe_cuda(layers, window)
    return checksum_described(plugin, described, ids)


def pack(values: np.ndarray) -> bytes:
    """The wire form of one layer's values: little-endian uint64, one per block."""
    return np.asarray(values, dtype="<u8").tobytes()


def unpack(data: bytes) -> np.ndarray:
    """The values of :func:`pack`'s bytes; InvalidArgumentError when not whole uint64s."""
    if len(data) % 8:
        raise InvalidArgumentError(f"checksums of {len(data)} bytes are not whole uint64 values")
    return np.frombuffer(data, dtype="<u8")


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One block whose two sides differ (or a layer one side did not report)."""

    layer: str
    local_block: int | None
    remote_block: int | None
    why: str

    def __str__(self) -> str:
        if self.local_block is None:
            return f"layer '{self.layer}': {self.why}"
        if self.remote_block is None:  # a WRITE: write_done names no prefill block ids
            return f"layer '{self.layer}' block {self.local_block}: {self.why}"
        return (
            f"layer '{self.layer}' block {self.local_block} (remote block {self.remote_block}): "
            f"{self.why}"
        )


def compare(
    local: Mapping[str, bytes],
    remote: Mapping[str, bytes],
    local_ids: Sequence[int],
    remote_ids: Sequence[int] | None,
) -> list[Mismatch]:
    """Every difference between our values (``local``, over ``local_ids``) and the peer's
    (``remote``, over ``remote_ids``, paired by position; None: the peer's ids are not known,
    one value per block of ours); empty when the transfer is intact. Every layer of ``local``
    must be in ``remote`` with one value per block."""
    known = remote_ids is not None
    remote_ids = remote_ids if remote_ids is not None else local_ids
    out: list[Mismatch] = []
    for layer, ours in local.items():
        theirs = remote.get(layer)
        if theirs is None:
            out.append(Mismatch(layer, None, None, "the peer sent no checksums for it"))
            continue
        a, b = unpack(ours), unpack(theirs)
        if len(a) != len(local_ids) or len(b) != len(remote_ids) or len(a) != len(b):
            out.append(
                Mismatch(
                    layer,
                    None,
                    None,
                    f"{len(b)} peer checksums for {len(remote_ids)} blocks, {len(a)} of ours for "
                    f"{len(local_ids)}",
                )
            )
            continue
        for i in np.flatnonzero(a != b).tolist():
            out.append(
                Mismatch(
                    layer,
                    int(local_ids[i]),
                    int(remote_ids[i]) if known else None,
                    f"checksum {int(a[i]):#018x} here, {int(b[i]):#018x} at the peer",
                )
            )
    return out


@dataclasses.dataclass(frozen=True)
class _Layer:
    name: str
    layout: LayerLayout
    tensor: Any  # a torch tensor (device path) or None
    host: np.ndarray | None  # the layer's bytes from its base (host path) or None


class LayerChecksums:
    """The checksums of one rank's registered layers. Host layers go through the native core;
    CUDA layers through the CUDA copy plugin's kernel, all of a device's in one call, when the
    plugin loads (each device's layers described once per window, :data:`DESCRIBED_WINDOWS`
    windows kept); other device layers (ROCm), or CUDA ones without the plugin, through torch on
    their device. The layers are fixed; thread-safe."""

    def __init__(self, layers: Sequence[_Layer], cuda_plugin: Any = None) -> None:
        self._layers = tuple(layers)
        self._cuda_plugin = cuda_plugin  # a moriio_native.cudacopy.Plugin, or None: torch
        on_cuda: dict[Any, list[_Layer]] = {}
        if cuda_plugin is not None:
            for layer in self._layers:
                if layer.host is None and _is_cuda(layer.tensor):
                    on_cuda.setdefault(layer.tensor.device, []).append(layer)
        self._on_cuda = tuple(tuple(group) for group in on_cuda.values())
        self._lock = threading.Lock()
        # (index in _on_cuda, window) -> its description, least recently used first
        self._described: OrderedDict[tuple[int, CellWindow], CudaLayers] = OrderedDict()

    @classmethod
    def for_registrations(cls, registrations: Sequence[Any]) -> LayerChecksums:
        """From the engine's :class:`~moriio_native.LayerRegistration` s. Raises
        FailedPreconditionError, naming the layer, when a layer lives in device memory but is
        not a torch tensor (neither implementation can read it): ``verify`` is refused at
        start-up, never silently skipped."""
        layers = []
        for reg in registrations:
            layout = describe_layer(reg.name, reg.tensor, reg.spec, reg.kv_plane_axis)
            if reg.memory == "host":
                layers.append(_Layer(reg.name, layout, None, _host_bytes(reg, layout)))
            elif callable(getattr(reg.tensor, "untyped_storage", None)):
                layers.append(_Layer(reg.name, layout, reg.tensor, None))
            else:
                raise FailedPreconditionError(
                    f"verify: layer '{reg.name}' is in {reg.memory} memory as a "
                    f"{type(reg.tensor).__name__}; block checksums on a device need a torch "
                    "tensor (turn verify off, or register the layer as a torch tensor)"
                )
        return cls(layers, _plugin_for(layers))

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self._layers)

    def compute(
        self, block_ids: Sequence[int], window: CellWindow = WHOLE_BLOCK
    ) -> dict[str, bytes]:
        """Every layer's values for ``block_ids`` (wire form, :func:`pack`). Blocking; raises
        OutOfRangeError / InvalidArgumentError naming the layer for bad ids or windows."""
        ids = np.asarray(_integer_ids(list(block_ids)), dtype=np.int64)
        values: dict[str, np.ndarray] = {}
        for group, layers in enumerate(self._on_cuda):
            described = self._cuda_layers(group, window)
            for layer, layer_values in zip(
                layers, checksum_described(self._cuda_plugin, described, ids), strict=True
            ):
                values[layer.name] = layer_values
        for layer in self._layers:
            if layer.name in values:
                continue
            if layer.host is not None:
                values[layer.name] = checksum_host(layer.layout, layer.host, ids, window)
            else:
                values[layer.name] = checksum_torch(
                    layer.layout, layer.tensor, ids.tolist(), window
                )
        return {layer.name: pack(values[layer.name]) for layer in self._layers}

    def _cuda_layers(self, group: int, window: CellWindow) -> CudaLayers:
        """Device group ``group``'s layers described for ``window``: kept from an earlier call,
        or described now (InvalidArgumentError naming the layer for a bad window)."""
        key = (group, window)
        with self._lock:
            described = self._described.get(key)
            if described is not None:
                self._described.move_to_end(key)
                return described
        layers = self._on_cuda[group]
        described = describe_cuda([(layer.layout, layer.tensor) for layer in layers], window)
        with self._lock:
            self._described[key] = described
            while len(self._described) > DESCRIBED_WINDOWS:
                self._described.popitem(last=False)
        return described

    def poison_first_word(self, block_id: int) -> str:
        """TEST HOOK (pd/verify.py's ``MORIIO_NATIVE_TEST_ONLY_CORRUPT_RECEIVED_KV``): set the
        first 8 bytes of block ``block_id`` of the first layer to 0xFF in place (the start of
        its first cell: NaNs in every float format, so a model reading that KV computes NaNs
        from it) and say where. Raises FailedPreconditionError when the checksum does not
        change, OutOfRangeError for a bad id. Not synchronized with the engine: only for a
        block no transfer writes any more."""
        layer = self._layers[0]
        block = _check_ids(layer.layout, [block_id])[0]
        at = block * layer.layout.block_stride
        before = self.compute([block])[layer.name]
        if layer.host is not None:
            layer.host[at : at + 8] = 0xFF
        else:
            raw, base = _byte_view(layer.tensor)
            raw[base + at : base + at + 8] = 0xFF
        if self.compute([block])[layer.name] == before:
            raise FailedPreconditionError(
                f"layer '{layer.name}': bytes {at}..{at + 7} (block {block}) are outside the "
                "block's cells"
            )
        return f"layer '{layer.name}' block {block} bytes {at}..{at + 7}"


def _is_cuda(tensor: Any) -> bool:
    """Whether ``tensor`` lives on a CUDA device (ROCm's torch calls its devices ``cuda`` too,
    and the plugin is CUDA only)."""
    import torch

    return bool(tensor.is_cuda) and torch.version.hip is None


def _plugin_for(layers: Sequence[_Layer]) -> Any:
    """The CUDA copy plugin when a layer lives on a CUDA device and it loads; else None."""
    if not any(layer.tensor is not None and _is_cuda(layer.tensor) for layer in layers):
        return None
    from moriio_native.cudacopy import shared_plugin

    return shared_plugin()


def _host_bytes(reg: Any, layout: LayerLayout) -> np.ndarray:
    """The layer's bytes from its base to the end of its allocation, as a uint8 array that
    keeps the registered tensor alive."""
    base, size = reg._allocation()
    start = geometry_of(reg.tensor).data_ptr
    if not base <= start or start + layout.span_bytes > base + size:
        raise InvalidArgumentError(
            f"layer '{reg.name}': the layout's {layout.span_bytes} bytes from {start:#x} are not "
            f"inside its allocation ({base:#x}, {size} bytes)"
        )
    buffer = (ctypes.c_uint8 * (base + size - start)).from_address(start)
    buffer._owner = reg.tensor  # type: ignore[attr-defined]  # the memory lives as long as it
    return np.frombuffer(buffer, dtype=np.uint8)


__all__ = [
    "WHOLE_BLOCK",
    "CellWindow",
    "CudaLayers",
    "LayerChecksums",
    "Mismatch",
    "checksum_cuda",
    "checksum_described",
    "checksum_host",
    "checksum_torch",
    "compare",
    "describe_cuda",
    "pack",
    "unpack",
]
