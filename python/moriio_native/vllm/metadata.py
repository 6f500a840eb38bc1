"""What the scheduler-side connector hands the workers each step (plain immutable records).

vLLM ships :class:`MoRIIONativeMetadata` from the scheduler process to every worker. It only
carries validated values: block ids the scheduler itself allocated, block ids the peer
advertised (already mapped by position), and the peer's address parsed and checked by
:mod:`moriio_native.control.addressing` (whether it may be dialled is the worker's allowlist
decision).

Records (defined by the protocol core, :mod:`moriio_native.pd.tasks`):

* :class:`RecvTask` (decode side): load ``transfer_id`` into ``local_block_ids`` -- READ pulls
  ``remote_block_ids[i] -> local_block_ids[i]``; WRITE announces ``local_block_ids`` (the tail
  of the prompt's blocks, see :class:`SaveTask`) and waits for the prefill's writes. No blocks
  means notify-only: tell the prefill to release its blocks (full prefix hit, or the request
  ended before it was scheduled).
* :class:`SaveTask` (prefill side, WRITE): the request's prompt blocks, handed over in the step
  that computes its last prompt chunk.
* :class:`SendTask` (prefill side, both modes): the request finished and the scheduler keeps
  its blocks until the worker reports the transfer ended (or ``abort_timeout`` passes); in
  WRITE mode, ``unsaved``: it ended before its last prompt chunk, its blocks are free already,
  and the workers only tell the decode ranks that announce blocks for it ``write_failed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from moriio_native.pd.tasks import RecvTask, SaveTask, SendTask


@dataclass
class MoRIIONativeMetadata(KVConnectorMetadata):
    """One step's work for the workers. Built by the scheduler side, read-only afterwards."""

    recv: list[RecvTask] = field(default_factory=list)
    save: list[SaveTask] = field(default_factory=list)
    send: list[SendTask] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.recv or self.save or self.send)


@dataclass(frozen=True)
class RankIncarnation(KVConnectorHandshakeMetadata):
    """What one worker tells the scheduler once its caches are registered (vLLM's
    ``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``): its rank's incarnation, which
    the prefill's answer carries to the decode (``remote_incarnations``)."""

    engine_id: str
    tp_rank: int
    incarnation: str


__all__ = ["MoRIIONativeMetadata", "RankIncarnation", "RecvTask", "SaveTask", "SendTask"]
