"""
moriio_native native core (private; use the moriio_native package)
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['BlockPairs', 'BlockTemplate', 'CacheSpec', 'CopyPlan', 'DrainedTransfer', 'LayerLayout', 'RegistrationPlan', 'TensorGeometry', 'TransferEvent', 'available_backends', 'checksum_blocks', 'plan_registration', 'trace_marks_compiled_in', 'trace_marks_disable', 'trace_marks_enable', 'trace_marks_take']
class CacheSpec:
    """
    Logical description of one layer's KV cache.
    """
    def __init__(self, *, kind: str = 'kv', block_size: typing.SupportsInt | typing.SupportsIndex, num_kv_heads: typing.SupportsInt | typing.SupportsIndex | None = None, head_size: typing.SupportsInt | typing.SupportsIndex | None = None, dtype_bytes: typing.SupportsInt | typing.SupportsIndex, head_size_v: typing.SupportsInt | typing.SupportsIndex | None = None, axis_order: str = 'auto') -> None:
        ...
    def __repr__(self) -> str:
        ...
    @property
    def axis_order(self) -> str:
        ...
    @property
    def block_size(self) -> int:
        ...
    @property
    def dtype_bytes(self) -> int:
        ...
    @property
    def head_size(self) -> int | None:
        ...
    @property
    def head_size_v(self) -> int | None:
        ...
    @property
    def kind(self) -> str:
        ...
    @property
    def num_kv_heads(self) -> int | None:
        ...
class TensorGeometry:
    """
    Shape and strides (in elements) of a tensor.
    """
    def __init__(self, shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], strides: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], element_size: typing.SupportsInt | typing.SupportsIndex, data_ptr: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def __repr__(self) -> str:
        ...
    @property
    def data_ptr(self) -> int:
        ...
    @property
    def element_size(self) -> int:
        ...
    @property
    def shape(self) -> list[int]:
        ...
    @property
    def strides(self) -> list[int]:
        ...
class LayerLayout:
    """
    A validated layer layout (immutable).
    """
    def __eq__(self, arg0: LayerLayout) -> bool:
        ...
    def __hash__(self) -> int:
        ...
    def __repr__(self) -> str:
        ...
    def describe(self) -> str:
        ...
    @property
    def block_bytes(self) -> int:
        ...
    @property
    def block_size(self) -> int:
        ...
    @property
    def block_stride(self) -> int:
        ...
    @property
    def fingerprint(self) -> int:
        ...
    @property
    def kind(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def num_blocks(self) -> int:
        ...
    @property
    def num_heads(self) -> int:
        ...
    @property
    def params(self) -> dict:
        ...
    @property
    def span_bytes(self) -> int:
        ...
class CopyPlan:
    """
    Runs sorted by local offset (bytes from each layer base).
    """
    def __len__(self) -> int:
        ...
    def __repr__(self) -> str:
        ...
    def runs(self) -> list:
        """
        The runs as a list of (local_offset, remote_offset, size) tuples.
        """
    @property
    def local_offsets(self) -> numpy.typing.NDArray[numpy.int64]:
        ...
    @property
    def remote_offsets(self) -> numpy.typing.NDArray[numpy.int64]:
        ...
    @property
    def sizes(self) -> numpy.typing.NDArray[numpy.int64]:
        ...
    @property
    def total_bytes(self) -> int:
        ...
class BlockPairs:
    """
    A request's (local, remote) block pairs, validated and sorted once.
    """
    def __init__(self, local_block_ids: typing.Any, remote_block_ids: typing.Any) -> None:
        ...
    def __len__(self) -> int:
        ...
class BlockTemplate:
    """
    The runs that copy one block of a layer pair.
    """
    @typing.overload
    def __init__(self, local: LayerLayout, remote: LayerLayout) -> None:
        ...
    @typing.overload
    def __init__(self, local: LayerLayout, remote: LayerLayout, local_window: tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex | None, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex | None], remote_window: tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex | None, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex | None]) -> None:
        """
        The runs that copy the cells of local_window of a local block to those of remote_window of a remote block; each window is (head_begin, heads or None, token_begin, tokens or None).
        """
    def block_offsets(self, pairs: BlockPairs, local_shift: typing.SupportsInt | typing.SupportsIndex = 0, remote_shift: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple:
        """
        (local, remote) int64 arrays: each pair's block byte offsets, in local id order, for a cell copy.
        """
    @typing.overload
    def plan(self, local_block_ids: typing.Any, remote_block_ids: typing.Any) -> CopyPlan:
        ...
    @typing.overload
    def plan(self, pairs: BlockPairs) -> CopyPlan:
        """
        Plan a request whose pairs were prepared once for all layers.
        """
    @property
    def cell_geometry(self) -> typing.Any:
        """
        The pair's blocks as one grid of equal cells: {planes, heads, tokens, cell_bytes, local, remote} (each side {block_stride, plane_stride, head_stride, token_stride}, bytes), or None when the layouts admit none.
        """
    @property
    def cell_origins(self) -> tuple:
        """
        (local, remote): bytes from a block's base to its window's first cell, the shift block_offsets adds (0 for whole windows).
        """
    @property
    def prefers_cell_copy(self) -> bool:
        """
        True when the run plan cuts blocks into short runs that a cell copy moves whole.
        """
    @property
    def runs(self) -> list:
        ...
class RegistrationPlan:
    """
    Regions to register and where each view lands.
    """
    def __repr__(self) -> str:
        ...
    @property
    def placements(self) -> list:
        """
        For each input view, in order: (region_index, offset_in_region).
        """
    @property
    def regions(self) -> list:
        """
        List of (start, size, aligned).
        """
class DrainedTransfer:
    """
    A quarantined transfer whose last operation completed.
    """
    def __repr__(self) -> str:
        ...
    @property
    def kind(self) -> str:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def seconds(self) -> float:
        ...
    @property
    def transfer_id(self) -> str:
        ...
class _LayerRegistration:
    def __init__(self, name: str, geometry: TensorGeometry, spec: CacheSpec, kv_plane_axis: str, allocation_base: typing.SupportsInt | typing.SupportsIndex, allocation_size: typing.SupportsInt | typing.SupportsIndex, memory: str, device: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class TransferEvent:
    """
    A transfer reached its terminal state.
    """
    def __repr__(self) -> str:
        ...
    @property
    def batches(self) -> int:
        ...
    @property
    def bytes(self) -> int:
        ...
    @property
    def cell_batches(self) -> int:
        """
        Of batches, those that moved whole blocks as cells (a transposing copy).
        """
    @property
    def drained(self) -> bool:
        """
        False: the transfer ended with batches in flight; its destination is quarantined until Engine.poll_drained reports it (never, for writes the transport could not confirm before their connection closed).
        """
    @property
    def kind(self) -> str:
        ...
    @property
    def message(self) -> str:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def runs(self) -> int:
        ...
    @property
    def seconds(self) -> float:
        ...
    @property
    def stamped_batches(self) -> int:
        """
        Of batches, those that went as stamped batches (template and block ids).
        """
    @property
    def state(self) -> str:
        ...
    @property
    def transfer_id(self) -> str:
        ...
class _Engine:
    def __init__(self, engine_id: str, backend: str, options: collections.abc.Mapping[str, str], transfer_timeout: typing.SupportsFloat | typing.SupportsIndex, terminal_history: typing.SupportsInt | typing.SupportsIndex, page_size: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def abort(self, arg0: str) -> None:
        ...
    def add_peer(self, metadata: bytes, replace: bool = False, expected_engine_id: str = '') -> str:
        ...
    def allocate_backing(self, size: typing.SupportsInt | typing.SupportsIndex, memory: str, device: typing.SupportsInt | typing.SupportsIndex) -> tuple[int, int]:
        ...
    def free_backing(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def local_metadata(self) -> bytes:
        ...
    def peers(self) -> list[str]:
        ...
    def waits_for_device_events(self, peer: str) -> bool:
        ...
    def poll_drained(self, max_transfers: typing.SupportsInt | typing.SupportsIndex) -> list[DrainedTransfer]:
        ...
    def poll_events(self, max_events: typing.SupportsInt | typing.SupportsIndex, timeout: typing.SupportsFloat | typing.SupportsIndex) -> list[TransferEvent]:
        ...
    def poll_events_into(self, out: list, max_events: typing.SupportsInt | typing.SupportsIndex, timeout: typing.SupportsFloat | typing.SupportsIndex) -> int:
        ...
    def read(self, arg0: str, arg1: str, arg2: typing.Any, arg3: typing.Any, arg4: collections.abc.Sequence[str]) -> None:
        ...
    def read_segments(self, transfer_id: str, peer: str, segments: list) -> None:
        ...
    def register_kv_caches(self, arg0: collections.abc.Sequence[_LayerRegistration]) -> bytes:
        ...
    def remove_idle_peer(self, arg0: str) -> bool:
        ...
    def remove_peer(self, arg0: str) -> None:
        ...
    def seal(self, transfer_id: str, peer: str, expected_writes: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def write_layer(self, transfer_id: str, layer: str, peer: str, local_blocks: typing.Any, remote_blocks: typing.Any, cuda_event: int = 0) -> bool:
        ...
    def write_layer_segments(self, transfer_id: str, layer: str, peer: str, segments: list, cuda_event: int = 0) -> bool:
        ...
    def write_layers(self, transfer_id: str, layers: collections.abc.Sequence[str], peer: str, local_blocks: typing.Any, remote_blocks: typing.Any, cuda_event: int = 0) -> bool:
        ...
    @property
    def backend(self) -> str:
        ...
    @property
    def engine_id(self) -> str:
        ...
    @property
    def pending_transfers(self) -> int:
        ...
    @property
    def quarantined_transfers(self) -> int:
        ...
def _describe_layer(name: str, geometry: TensorGeometry, spec: CacheSpec, kv_plane_axis: str = 'auto') -> LayerLayout:
    ...
def _raise_status(arg0: str, arg1: str) -> None:
    """
    Raise the exception of a status code (for testing the error mapping).
    """
def available_backends(options: collections.abc.Mapping[str, str] = {}) -> list:
    """
    List of (name, available, reason) for every known backend.
    """
def checksum_blocks(layout: LayerLayout, buffer: typing.Any, block_ids: typing.Any, *, head_begin: typing.SupportsInt | typing.SupportsIndex = 0, heads: typing.SupportsInt | typing.SupportsIndex | None = None, token_begin: typing.SupportsInt | typing.SupportsIndex = 0, tokens: typing.SupportsInt | typing.SupportsIndex | None = None) -> numpy.typing.NDArray[numpy.uint64]:
    """
    One uint64 checksum per block id over the logical cells of the window (heads [head_begin, head_begin + heads), tokens [token_begin, token_begin + tokens); None: to the end) of the layer whose bytes start at the buffer's first byte (at least layout.span_bytes long). See include/moriio_native/checksum.hpp for the definition.
    """
def plan_registration(allocation_base: typing.SupportsInt | typing.SupportsIndex, allocation_size: typing.SupportsInt | typing.SupportsIndex, regions: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]], page_size: typing.SupportsInt | typing.SupportsIndex = 4096, allow_unaligned: bool = True) -> RegistrationPlan:
    """
    Plan one memory region for views (ptr, nbytes) that share one allocation.
    """
def trace_marks_compiled_in() -> bool:
    """
    True when this build records timing marks (-DMORIIO_NATIVE_TRACE_MARKS=ON).
    """
def trace_marks_enable(capacity: typing.SupportsInt | typing.SupportsIndex = 65536) -> None:
    """
    Clear the process's marks and record up to `capacity` of them until trace_marks_disable.
    """
def trace_marks_disable() -> None:
    """
    Stop recording marks (the recorded ones stay).
    """
def trace_marks_take() -> tuple[list[tuple[str, int, int, int]], int]:
    """
    The marks since enable or the last take as (name, monotonic ns, batch token, thread) in recording order, and how many were dropped for lack of capacity.
    """
