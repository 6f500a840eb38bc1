"""What the core is asked to do, in plain immutable records (no framework types).

* :class:`RecvTask` (decode side): load ``transfer_id`` into ``local_block_ids`` -- READ pulls
  ``remote_block_ids[i] -> local_block_ids[i]``; WRITE announces ``local_block_ids`` (the tail
  of the prompt's blocks, see :class:`SaveTask`) and waits for the prefill's writes. No blocks
  means notify-only: tell the prefill to release its blocks (full prefix hit, or the request
  ended before it was scheduled).
* :class:`SaveTask` (prefill side, WRITE): the request's prompt blocks, handed over when its
  last prompt chunk is computed.
* :class:`SendTask` (prefill side, both modes): the request finished and its blocks are held
  until the core reports the transfer ended (or ``abort_timeout`` passes). WRITE, ``unsaved``:
  it ended before its last prompt chunk, holds nothing, and is never reported; the decode
  ranks that announce its blocks are told ``write_failed``.

Block ids come from the caller's allocator (local) or from the peer's advertisement (remote);
addresses are parsed and checked by :mod:`moriio_native.control.addressing` (whether they may
be dialled is the allowlist's decision, at connect time).
"""

from __future__ import annotations

from dataclasses import dataclass

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.schema import PART_SEPARATOR
from moriio_native.errors import InvalidArgumentError
from moriio_native.pd.groups import GroupedBlocks


def _check_transfer_id(task: RecvTask | SaveTask | SendTask) -> None:
    """Refuses a transfer id holding the separator the engine names a transfer's parts with:
    such an id could name another request's part (kv_transfer_params refuse it already)."""
    if PART_SEPARATOR in task.transfer_id:
        raise InvalidArgumentError(
            f"{type(task).__name__} of request {task.req_id}: transfer id "
            f"{task.transfer_id!r} holds {PART_SEPARATOR!r}, which is reserved (the engine "
            f"names a transfer's parts <id>{PART_SEPARATOR}p<rank> and "
            f"<id>{PART_SEPARATOR}d<rank>)"
        )


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
    # Asynchronous load (WRITE, and READ unless loaded synchronously): the request's end is
    # reported as finished receiving (and failed receiving on failure).
    report_done: bool = False
    error: str = ""  # set: the load cannot be planned -- report it failed, release the prefill
    # The request was aborted while its load may run: give up on it now (blocks the prefill
    # may be writing stay quarantined until it confirms its writes stopped).
    aborted: bool = False
    # KV-cache groups (hybrid models): each group's ids positionally and the tokens to load
    # (READ: both sides' ids; WRITE: ours, announced as they are). ``local_block_ids`` then
    # lists every local non-null id (what a failure reports for recomputation).
    grouped: GroupedBlocks | None = None
    # READ: the incarnation of each prefill TP rank that computed the request, by TP rank (the
    # prefill's answer); None: not stated, and then nothing is read (docs/protocol.md §5).
    remote_incarnations: tuple[str, ...] | None = None
    # READ: until when the prefill holds the blocks, by its clock (ms since the Unix epoch; the
    # prefill's answer); None: not stated, and then nothing checks it.
    remote_hold_until_ms: int | None = None

    def __post_init__(self) -> None:
        _check_transfer_id(self)

    @property
    def notify_only(self) -> bool:
        return not self.local_block_ids


@dataclass(frozen=True)
class SaveTask:
    """Prefill side (WRITE): the request computes its last prompt chunk now."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]  # the request's blocks covering the prompt, in order
    num_prompt_blocks: int
    peer: ZmqAddress | None  # the decode instance (base ports), when the request names it
    remote_tp_size: int
    # KV-cache groups (hybrid models): each group's ids positionally from the first token
    # (mamba: the state block), and the number of prompt tokens computed into them.
    groups: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0

    def __post_init__(self) -> None:
        _check_transfer_id(self)


@dataclass(frozen=True)
class SendTask:
    """Prefill side: the request's blocks are held until the core reports it."""

    req_id: str
    transfer_id: str
    aborted: bool = False  # the request was aborted: stop its transfer, then report it
    # WRITE: it ended before its last prompt chunk (no SaveTask came): nothing of it is written
    # and vLLM freed its blocks (the core reports nothing). ``peer`` and ``remote_tp_size``: its
    # decode (as in SaveTask), whose ranks that announced blocks are told write_failed.
    unsaved: bool = False
    # WRITE: vLLM preempted it after its SaveTask and freed the blocks that task named (it will
    # recompute it): its writes stop, its decode is told write_failed, and the core reports
    # nothing (vLLM holds no blocks of it). No other send task of it follows.
    preempted: bool = False
    peer: ZmqAddress | None = None
    remote_tp_size: int = 0
    # READ: the blocks the prefill's answer names (of every group it moves): a decode's
    # checksum request (verify) or hold check (confirm_reads) may name only these ...
    block_ids: tuple[int, ...] = ()
    # ... and the hold the answer stated (remote_hold_until_ms; 0: none), which such a request
    # names too: a later request reusing the transfer id is another answer.
    hold_until_ms: int = 0
    # ... and how many of ``block_ids`` each KV-cache group's list holds (empty: not stated).
    group_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_transfer_id(self)


__all__ = ["RecvTask", "SaveTask", "SendTask"]
