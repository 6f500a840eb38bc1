"""KV-cache groups (vLLM's hybrid KV-cache manager) and different block sizes: which block
pairs, token windows and layers one transfer moves. Pure functions, no framework.

A worker holds one or more KV-cache groups (:class:`~moriio_native.control.messages.KvGroup`),
each with its own block ids per request: ``full`` attention, ``sliding`` window attention (vLLM
puts its null block, id 0, where the window no longer needs a block) and ``mamba`` state (one
state slot per block, no token axis: the running state of the tokens computed so far). Both
sides describe their groups in the handshake; :func:`check_groups` refuses structures that do
not pair (group count, kinds, layers, windows, block sizes that do not divide one another).

A grouped load (:class:`GroupedBlocks`) names, per group, each side's block ids positionally
from the request's first token, and the token range ``[start, end)`` the destination needs.
:func:`plan_segments` turns it into :class:`Segment` records -- the engine's ``BlockSegment``
without the engine types (:func:`engine_segments` converts) -- so that:

* attention groups move in units of the smaller block size: unit ``u`` covers tokens
  ``[u*m, (u+1)*m)``, i.e. the token window ``u*m % bs`` of block ``u*m // bs`` on each side
  (four 16-token prefill blocks fill windows 0/16/32/48 of one 64-token decode block, and the
  reverse); units with the same pair of window offsets form one segment, whole blocks when the
  sizes are equal. A partial last block moves as a whole unit (the tokens past ``end`` are
  rewritten by the destination's own forward);
* sliding groups move only the units the window still needs for the destination's next
  token (``[end - window + 1, end)``);
* the destination's null block is never written (it needs nothing there) and a unit the
  destination needs whose source block is the null block is an error (the source freed it);
* mamba groups pair the one state block of each side, whole.

Every error is an :class:`~moriio_native.errors.InvalidArgumentError` naming the group, its
kind, the token and the block index involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np

from moriio_native.control.messages import KvGroup
from moriio_native.errors import IncompatiblePeerError, InvalidArgumentError

# vLLM's null block: a placeholder in a block table for a position that holds nothing.
NULL_BLOCK = 0

Side = Literal["local", "remote"]


@dataclass(frozen=True)
class GroupedBlocks:
    """Per-group block ids of both sides for one transfer: ``local[g]`` / ``remote[g]`` are
    group ``g``'s ids positionally from the request's first token (mamba: its state block),
    and the destination needs tokens ``[start, end)``."""

    local: tuple[tuple[int, ...], ...]
    remote: tuple[tuple[int, ...], ...]
    start: int
    end: int

    def local_ids(self) -> tuple[int, ...]:
        """Every local non-null block id (what a failed load reports for recomputation)."""
        return _live_ids(self.local)

    def remote_ids(self) -> tuple[int, ...]:
        """Every remote non-null block id (the prefill blocks a READ of them takes)."""
        return _live_ids(self.remote)


def _live_ids(groups: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Every non-null block id of ``groups``, sorted, once each."""
    return tuple(sorted({b for ids in groups for b in ids if b != NULL_BLOCK}))


@dataclass(frozen=True)
class Segment:
    """Block pairs of one group moved with the same token windows: local block
    ``local_blocks[i]`` (tokens ``[local_token_begin, +tokens)``) with remote block
    ``remote_blocks[i]`` (tokens ``[remote_token_begin, +tokens)``); ``tokens`` None: whole
    blocks on both sides."""

    group: int
    layers: tuple[str, ...]
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    local_token_begin: int = 0
    remote_token_begin: int = 0
    tokens: int | None = None

    @cached_property
    def block_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) block ids as int64 arrays, made once: the connector's one call for
        several layers of the group passes them (and groups those layers by them)."""
        return (
            np.asarray(self.local_blocks, dtype=np.int64),
            np.asarray(self.remote_blocks, dtype=np.int64),
        )


def _tokens_per_state(group: KvGroup) -> str:
    num, den = group.tokens_per_state
    return f"{num}/{den}" if den != 1 else str(num)


def describe_group(index: int, group: KvGroup) -> str:
    window = f", window {group.sliding_window}" if group.kind == "sliding" else ""
    states = f", {_tokens_per_state(group)} tokens per state" if group.compressed else ""
    return (
        f"group {index} ({group.kind}, block size {group.block_size}{window}{states}, "
        f"{len(group.layers)} layers from {group.layers[0]})"
    )


def _element_type_difference(ours: KvGroup, theirs: KvGroup) -> str | None:
    """The first layer (the groups hold the same layers) whose element types differ, told."""
    for i, layer in enumerate(ours.layers):
        mine, its = ours.element_type(i), theirs.element_type(i)
        if mine != its:
            return f"layer {layer} holds {its} elements there, {mine} here"
    return None


def check_groups(local: Sequence[KvGroup], remote: Sequence[KvGroup], peer: str) -> None:
    """Raise IncompatiblePeerError when ``peer``'s groups cannot pair with ours: another
    number of groups, another kind, other layers, element types, window or tokens per stored
    state in a group, attention block sizes that do not divide one another (mamba state has no token
    axis: its slots pair one to one whatever the block size), or different block sizes in a
    group whose stored states cover other than one token each (compressed or expanded states:
    a token window of such a block is no whole range of its states, so only whole blocks of
    equal size move)."""
    if len(local) != len(remote):
        raise IncompatiblePeerError(
            f"peer {peer} has {len(remote)} KV-cache group(s), we have {len(local)}: "
            f"ours {[g.kind for g in local]}, its {[g.kind for g in remote]} (run the same "
            "model and the same hybrid KV-cache manager setting on both instances)"
        )
    for i, (ours, theirs) in enumerate(zip(local, remote, strict=True)):
        what = f"peer {peer}: KV-cache {describe_group(i, theirs)} does not pair with ours"
        if ours.kind != theirs.kind:
            raise IncompatiblePeerError(f"{what}: ours is {ours.kind}")
        if ours.layers != theirs.layers:
            differ = sorted(set(ours.layers) ^ set(theirs.layers))[:4]
            detail = f"layers {differ} are in one side only" if differ else "another order"
            raise IncompatiblePeerError(f"{what}: its layers differ ({detail})")
        differing = _element_type_difference(ours, theirs)
        if differing is not None:
            raise IncompatiblePeerError(
                f"{what}: {differing} (the same element size can be another number format; run "
                "both instances with the same --dtype and --kv-cache-dtype)"
            )
        if ours.sliding_window != theirs.sliding_window:
            raise IncompatiblePeerError(f"{what}: our window is {ours.sliding_window} tokens")
        if ours.tokens_per_state != theirs.tokens_per_state:
            raise IncompatiblePeerError(
                f"{what}: its stored states cover {_tokens_per_state(theirs)} tokens each, "
                f"ours {_tokens_per_state(ours)}"
            )
        if ours.compressed and ours.block_size != theirs.block_size:
            raise IncompatiblePeerError(
                f"{what}: its blocks store one state per {_tokens_per_state(ours)} tokens "
                f"(tokens_per_state {ours.tokens_per_state[0]}/{ours.tokens_per_state[1]}) "
                f"and the block sizes differ ({ours.block_size} ours, {theirs.block_size} its): "
                "token windows of such blocks are not transferred; run both instances with "
                "the same --block-size"
            )
        small, big = sorted((ours.block_size, theirs.block_size))
        if ours.kind != "mamba" and big % small:
            raise IncompatiblePeerError(
                f"{what}: block sizes {ours.block_size} (ours) and {theirs.block_size} do not "
                "divide one another, so a block's tokens cannot map onto whole token windows"
            )


def _state_block(ids: Sequence[int], what: str) -> int:
    live = [b for b in ids if b != NULL_BLOCK]
    if len(live) != 1:
        raise InvalidArgumentError(
            f"{what}: expected exactly one state block, got {list(ids)[:8]} "
            "(mamba state moves as the running state of one slot)"
        )
    return live[0]


def _attention_segments(
    index: int,
    local_group: KvGroup,
    remote_group: KvGroup,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    start: int,
    end: int,
    dest: Side,
) -> list[Segment]:
    lbs, rbs = local_group.block_size, remote_group.block_size
    unit = min(lbs, rbs)
    what = f"KV-cache {describe_group(index, local_group)}"
    if start % unit:
        raise InvalidArgumentError(
            f"{what}: the transfer starts at token {start}, not a multiple of {unit} tokens"
        )
    first = start
    if local_group.kind == "sliding":
        # The destination's next token (at ``end``) attends to the last window - 1 tokens.
        first = max(start, end - local_group.sliding_window + 1) // unit * unit
    pairs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for token in range(first, end, unit):
        li, ri = token // lbs, token // rbs
        if li >= len(local_ids) or ri >= len(remote_ids):
            raise InvalidArgumentError(
                f"{what}: token {token} needs local block index {li} and remote block index "
                f"{ri}, but the request has {len(local_ids)} local and {len(remote_ids)} "
                "remote blocks"
            )
        lb, rb = local_ids[li], remote_ids[ri]
        dest_block, source_block = (lb, rb) if dest == "local" else (rb, lb)
        if dest_block == NULL_BLOCK:
            continue  # the destination keeps nothing there
        if source_block == NULL_BLOCK:
            source = "remote" if dest == "local" else "local"
            raise InvalidArgumentError(
                f"{what}: token {token} is needed but the {source} block at index "
                f"{ri if source == 'remote' else li} is the null block (freed out of the window)"
            )
        local_ids_out, remote_ids_out = pairs.setdefault((token % lbs, token % rbs), ([], []))
        local_ids_out.append(lb)
        remote_ids_out.append(rb)
    whole = lbs == rbs
    return [
        Segment(
            group=index,
            layers=local_group.layers,
            local_blocks=tuple(lo),
            remote_blocks=tuple(ro),
            local_token_begin=loff,
            remote_token_begin=roff,
            tokens=None if whole else unit,
        )
        for (loff, roff), (lo, ro) in sorted(pairs.items())
    ]


def plan_segments(
    local_groups: Sequence[KvGroup],
    remote_groups: Sequence[KvGroup],
    blocks: GroupedBlocks,
    *,
    dest: Side,
) -> list[Segment]:
    """The segments that move ``blocks`` into the ``dest`` side (``"local"``: READ, we pull;
    ``"remote"``: WRITE, we push). The groups must have passed :func:`check_groups`. Raises
    InvalidArgumentError naming the group when a side's ids do not fit its groups."""
    n = len(local_groups)
    if len(blocks.local) != n or len(blocks.remote) != n:
        raise InvalidArgumentError(
            f"block ids for {len(blocks.local)} local / {len(blocks.remote)} remote KV-cache "
            f"group(s), the workers have {n}"
        )
    if not 0 <= blocks.start <= blocks.end:
        raise InvalidArgumentError(f"token range [{blocks.start}, {blocks.end}) is empty or bad")
    out: list[Segment] = []
    for i, (ours, theirs) in enumerate(zip(local_groups, remote_groups, strict=True)):
        local_ids, remote_ids = blocks.local[i], blocks.remote[i]
        if ours.kind == "mamba":
            what = f"KV-cache {describe_group(i, ours)}"
            lb = _state_block(local_ids, f"{what}, local side")
            rb = _state_block(remote_ids, f"{what}, remote side")
            out.append(Segment(i, ours.layers, (lb,), (rb,)))
            continue
        out.extend(
            _attention_segments(
                i, ours, theirs, local_ids, remote_ids, blocks.start, blocks.end, dest
            )
        )
    return out


def engine_segments(segments: Sequence[Segment], *, with_layers: bool = True) -> list[Any]:
    """The engine's ``BlockSegment`` records for ``segments`` (``with_layers=False`` for
    ``write_layer``, whose segments name no layers)."""
    from moriio_native import BlockSegment, CellWindow

    out = []
    for s in segments:
        if s.tokens is None:
            local_window, remote_window = CellWindow(), CellWindow()
        else:
            local_window = CellWindow(token_begin=s.local_token_begin, tokens=s.tokens)
            remote_window = CellWindow(token_begin=s.remote_token_begin, tokens=s.tokens)
        out.append(
            BlockSegment(
                local_blocks=s.local_blocks,
                remote_blocks=s.remote_blocks,
                layers=s.layers if with_layers else None,
                local_window=local_window,
                remote_window=remote_window,
            )
        )
    return out


def post_read(engine: Any, transfer_id: str, peer: str, segments: Sequence[Segment]) -> None:
    """Post one READ moving every segment (one transfer). A single whole-block segment over
    the only group is the engine's plain ``read``."""
    if not segments:
        raise InvalidArgumentError(f"transfer {transfer_id}: no block of any group to read")
    if len(segments) == 1 and segments[0].tokens is None and segments[0].group == 0:
        only = segments[0]
        engine.read(transfer_id, peer, only.local_blocks, only.remote_blocks)
        return
    engine.read_segments(transfer_id, peer, engine_segments(segments))


def post_write_layer(
    engine: Any,
    transfer_id: str,
    layer: str,
    peer: str,
    segments: Sequence[Segment],
    cuda_event: int = 0,
) -> bool:
    """Post one layer's WRITE of ``segments`` (the segments of the layer's group); its copy
    waits for ``cuda_event`` when one is given. Whether the engine took it (see
    ``Engine.write_layer``)."""
    if len(segments) == 1 and segments[0].tokens is None:
        only = segments[0]
        return engine.write_layer(
            transfer_id, layer, peer, only.local_blocks, only.remote_blocks, cuda_event
        )
    return engine.write_layer(
        transfer_id,
        layer,
        peer,
        cuda_event=cuda_event,
        segments=engine_segments(segments, with_layers=False),
    )


def group_of_layer(groups: Sequence[KvGroup]) -> dict[str, int]:
    """Layer name -> the index of its group."""
    return {name: i for i, g in enumerate(groups) for name in g.layers}


def holds_running_state(groups: Sequence[KvGroup]) -> bool:
    """Whether one of ``groups`` is a Mamba state: the running state after every token the
    prefill computed, so a load must take exactly those tokens as computed, never fewer (the
    decode would compute the rest again on top of a state that already holds them)."""
    return any(g.kind == "mamba" for g in groups)


__all__ = [
    "NULL_BLOCK",
    "GroupedBlocks",
    "Segment",
    "check_groups",
    "describe_group",
    "engine_segments",
    "group_of_layer",
    "holds_running_state",
    "plan_segments",
    "post_read",
    "post_write_layer",
]
