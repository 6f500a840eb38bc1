"""What the scheduler-side connector hands the workers each step (plain immutable records).

vLLM ships :class:`MoRIIONativeMetadata` from the scheduler process to every worker. It only
carries validated values: block ids the scheduler itself allocated, block ids the peer
advertised (already mapped by position), and the peer's address parsed and checked by
:mod:`moriio_native.control.addressing` (whether it may be dialled is the worker's allowlist
decision).

Records:

* :class:`RecvTask` (decode side): load ``transfer_id`` into ``local_block_ids`` -- READ pulls
  ``remote_block_ids[i] -> local_block_ids[i]``; WRITE announces ``local_block_ids`` (the tail
  of the prompt's blocks, see :class:`SaveTask`) and waits for the prefill's writes. No blocks
  means notify-only: tell the prefill to release its blocks (full prefix hit, or the request
  ended before it was scheduled).
* :class:`SaveTask` (prefill side, WRITE): the request's prompt blocks, handed over in the step
  that computes its last prompt chunk.
* :class:`SendTask` (prefill side, both modes): the request finished and the scheduler keeps
  its blocks until the worker reports the transfer ended (or ``abort_timeout`` passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from moriio_native.control.addressing import ZmqAddress


@dataclass(frozen=True)
class RecvTask:
    """Decode side: one request's load (or release-only notification)."""

    req_id: str
    transfer_id: str
    peer: ZmqAddress  # the prefill instance (base ports)
    remote_engine_id: str | None
    remote_dp_rank: int
    remote_tp_size: int  # 0 = unknown (same as ours)
    local_block_ids: tuple[int, ...] = ()
    remote_block_ids: tuple[int, ...] = ()  # READ only, paired with local_block_ids by index
    report_done: bool = False  # async (WRITE) load: report finished_recving to vLLM
    error: str = ""  # set: the load cannot be planned -- report it failed, release the prefill
    # The request was aborted while its WRITE load may run: give up on it now (the blocks stay
    # quarantined until the prefill confirms its writes stopped).
    aborted: bool = False

    @property
    def notify_only(self) -> bool:
        return not self.local_block_ids


@dataclass(frozen=True)
class SaveTask:
    """Prefill side (WRITE): the request computes its last prompt chunk in this step."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]  # the request's blocks covering the prompt, in order
    num_prompt_blocks: int
    peer: ZmqAddress | None  # the decode instance (base ports), when the request names it
    remote_tp_size: int


@dataclass(frozen=True)
class SendTask:
    """Prefill side: the scheduler holds the request's blocks until the worker reports it."""

    req_id: str
    transfer_id: str
    aborted: bool = False  # the request was aborted: stop its transfer, then report it


@dataclass
class MoRIIONativeMetadata(KVConnectorMetadata):
    """One step's work for the workers. Built by the scheduler side, read-only afterwards."""

    recv: list[RecvTask] = field(default_factory=list)
    save: list[SaveTask] = field(default_factory=list)
    send: list[SendTask] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.recv or self.save or self.send)


__all__ = ["MoRIIONativeMetadata", "RecvTask", "SaveTask", "SendTask"]
