"""Which peer ranks hold which KV heads when prefill and decode run different TP sizes.

vLLM splits a dense attention layer's ``T`` KV heads over ``tp`` ranks as its QKV projection
does: with ``tp <= T`` (``T % tp == 0``) rank ``r`` holds heads ``[r*T/tp, (r+1)*T/tp)``; with
``tp > T`` (``tp % T == 0``) the heads are replicated and rank ``r`` holds head
``r // (tp/T)`` alone. Any other pair is refused by vLLM itself, and here.

A :class:`TpPlan` maps one prefill TP size onto one decode TP size for a model with
``total_kv_heads`` heads in its split layers (``0``: the model has none, only caches every rank
holds whole, MLA latent and indexer) and, when ``whole`` is set, whole caches too:

* a decode rank takes each of its heads from one prefill rank that holds it -- a slice of one
  rank (prefill TP < decode TP), a gather from several (prefill TP > decode TP); a head several
  prefill ranks hold (replicated) comes from the replica picked by the decode rank's index, so
  the choice is deterministic and spread;
* whole caches come from the first prefill rank the heads come from (one transfer carries
  both), or from rank ``d mod P`` when the model has no split layer;
* release fan-in: a prefill rank frees a request's blocks once every decode rank that reads
  (or, in WRITE mode, receives) from it released it; a prefill rank no decode rank uses is
  released by decode rank ``p mod D``, so nothing is stranded and nothing is counted twice.

With equal TP sizes the plan is rank ``r`` with rank ``r``, whole blocks, one release each.
:func:`read_segments` and :func:`write_segments` turn a plan into the engine's block segments
(head windows) of one transfer. Pure functions on immutable values; thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from moriio_native.engine import BlockSegment
from moriio_native.errors import FailedPreconditionError, IncompatiblePeerError
from moriio_native.pd.config import PdConfig


@dataclass(frozen=True)
class HeadSlice:
    """``heads`` consecutive KV heads: the peer rank ``rank``'s heads from ``remote_begin``
    pair with ours from ``local_begin`` (indices into each rank's own layer)."""

    rank: int
    remote_begin: int
    local_begin: int
    heads: int


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank of ``tp_size`` holds (vLLM: ``max(1, T // tp)``)."""
    return max(1, total_kv_heads // tp_size)


def check_split(total_kv_heads: int, tp_size: int, what: str) -> None:
    """Raise IncompatiblePeerError unless vLLM can split ``total_kv_heads`` over ``tp_size``
    ranks (one divides the other). ``what`` names the instance in the message."""
    if total_kv_heads < 1 or tp_size < 1:
        raise IncompatiblePeerError(
            f"{what}: {total_kv_heads} KV heads over TP {tp_size} cannot be split"
        )
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise IncompatiblePeerError(
            f"{what}: {total_kv_heads} KV heads over TP {tp_size}: neither divides the other, "
            "so the heads are not split the way vLLM splits them"
        )


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads rank ``rank`` of ``tp_size`` holds (global head indices)."""
    n = heads_per_rank(total_kv_heads, tp_size)
    if tp_size <= total_kv_heads:
        return range(rank * n, rank * n + n)
    head = rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


def holders(total_kv_heads: int, tp_size: int, head: int) -> range:
    """The ranks of ``tp_size`` that hold global head ``head``."""
    if tp_size <= total_kv_heads:
        n = total_kv_heads // tp_size
        return range(head // n, head // n + 1)
    rep = tp_size // total_kv_heads
    return range(head * rep, head * rep + rep)


def consumer_ranks(
    prefill_tp: int, decode_tp: int, total_kv_heads: int, prefill_rank: int
) -> tuple[int, ...]:
    """The decode ranks that take something from prefill rank ``prefill_rank`` under the rules
    of :class:`TpPlan` (its :meth:`TpPlan.sources`, inverted), in order, in time linear in
    their number: no decode rank that takes nothing is looked at."""
    if prefill_tp == decode_tp:
        return (prefill_rank,)
    if not total_kv_heads:  # whole caches only: decode rank d takes them from d mod P
        return tuple(range(prefill_rank, decode_tp, prefill_tp))
    heads = rank_heads(total_kv_heads, prefill_tp, prefill_rank)
    if prefill_tp <= total_kv_heads:
        # This rank is each of its heads' only holder: every decode rank holding one of them
        # takes it from here (the whole caches too, from its first head's source).
        first = holders(total_kv_heads, decode_tp, heads.start).start
        last = holders(total_kv_heads, decode_tp, heads.stop - 1).stop
        return tuple(range(first, last))
    # One head, replicated on ``copies`` prefill ranks: a decode rank holding it takes it from
    # replica ``d mod copies``, so from this rank when d is congruent to its replica index.
    copies = prefill_tp // total_kv_heads
    takers = holders(total_kv_heads, decode_tp, heads.start)
    first = takers.start + (prefill_rank - takers.start) % copies
    return tuple(range(first, takers.stop, copies))


@dataclass(frozen=True)
class TpPlan:
    """Prefill TP ``prefill_tp`` -> decode TP ``decode_tp`` for one model: ``total_kv_heads``
    in its split layers (0: none) and whether it has whole caches. Build with :meth:`make`,
    which refuses what cannot be served."""

    prefill_tp: int
    decode_tp: int
    total_kv_heads: int = 0
    whole: bool = True

    @classmethod
    def make(cls, prefill_tp: int, decode_tp: int, total_kv_heads: int, whole: bool) -> TpPlan:
        """The plan, or IncompatiblePeerError naming both TP sizes and the head count."""
        if prefill_tp < 1 or decode_tp < 1:
            raise IncompatiblePeerError(
                f"TP sizes must be >= 1: prefill {prefill_tp}, decode {decode_tp}"
            )
        if not total_kv_heads and not whole:
            raise IncompatiblePeerError("a TP plan needs split layers or whole caches")
        if total_kv_heads and prefill_tp != decode_tp:  # equal sizes pair rank with rank
            for tp, side in ((prefill_tp, "prefill"), (decode_tp, "decode")):
                check_split(
                    total_kv_heads,
                    tp,
                    f"prefill TP {prefill_tp} -> decode TP {decode_tp} with "
                    f"{total_kv_heads} KV heads, {side} side",
                )
        return cls(prefill_tp, decode_tp, total_kv_heads, whole)

    @property
    def identity(self) -> bool:
        """Equal TP sizes: rank r with rank r, whole blocks."""
        return self.prefill_tp == self.decode_tp

    # ---- decode side --------------------------------------------------------------------------

    def head_sources(self, decode_rank: int) -> tuple[HeadSlice, ...]:
        """Where decode rank ``decode_rank``'s heads of the split layers come from, in order
        of its own heads: one slice per prefill rank (empty when the model has none)."""
        self._check_rank(decode_rank, self.decode_tp, "decode")
        total = self.total_kv_heads
        if not total:
            return ()
        if self.identity:
            return (HeadSlice(decode_rank, 0, 0, heads_per_rank(total, self.decode_tp)),)
        mine = rank_heads(total, self.decode_tp, decode_rank)
        out: list[HeadSlice] = []
        for local, head in enumerate(mine):
            options = holders(total, self.prefill_tp, head)
            rank = options[decode_rank % len(options)]
            remote = head - rank_heads(total, self.prefill_tp, rank).start
            last = out[-1] if out else None
            if (
                last is not None
                and last.rank == rank
                and last.remote_begin + last.heads == remote
                and last.local_begin + last.heads == local
            ):
                out[-1] = HeadSlice(rank, last.remote_begin, last.local_begin, last.heads + 1)
            else:
                out.append(HeadSlice(rank, remote, local, 1))
        return tuple(out)

    def whole_source(self, decode_rank: int) -> int | None:
        """The prefill rank decode rank ``decode_rank`` takes the whole caches from (None when
        the model has none)."""
        if not self.whole:
            return None
        heads = self.head_sources(decode_rank)
        return heads[0].rank if heads else decode_rank % self.prefill_tp

    def sources(self, decode_rank: int) -> tuple[int, ...]:
        """Every prefill rank decode rank ``decode_rank`` transfers with, in order (one
        transfer each): the ranks of its head slices, then the whole caches' if not among
        them."""
        ranks = [s.rank for s in self.head_sources(decode_rank)]
        whole = self.whole_source(decode_rank)
        if whole is not None and whole not in ranks:
            ranks.append(whole)
        return tuple(dict.fromkeys(ranks))

    def release_targets(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks decode rank ``decode_rank`` releases: its sources, then the
        prefill ranks no decode rank uses that are assigned to it (``p mod D``)."""
        unused = [p for p in self._unused_prefill_ranks if p % self.decode_tp == decode_rank]
        return (*self.sources(decode_rank), *unused)

    # ---- prefill side -------------------------------------------------------------------------

    def head_targets(self, prefill_rank: int) -> tuple[HeadSlice, ...]:
        """What prefill rank ``prefill_rank`` writes of the split layers (WRITE): one slice per
        decode rank, ``rank`` the decode rank, ``local_begin`` in the prefill rank's heads and
        ``remote_begin`` in the decode rank's."""
        self._check_rank(prefill_rank, self.prefill_tp, "prefill")
        return tuple(
            HeadSlice(d, s.local_begin, s.remote_begin, s.heads)
            for d in range(self.decode_tp)
            for s in self.head_sources(d)
            if s.rank == prefill_rank
        )

    def consumers(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks that transfer with prefill rank ``prefill_rank`` (read from it, or
        receive its writes), in order. Worked out from the rank's heads, not by asking every
        decode rank for its sources: a request may name a decode TP size of 65,536, and asking
        each took a third of a second."""
        self._check_rank(prefill_rank, self.prefill_tp, "prefill")
        known = self._consumers.get(prefill_rank)
        if known is None:
            known = self._consumers[prefill_rank] = consumer_ranks(
                self.prefill_tp, self.decode_tp, self.total_kv_heads, prefill_rank
            )
        return known

    def releases(self, decode_rank: int, prefill_rank: int) -> bool:
        """Whether decode rank ``decode_rank`` is one that releases ``prefill_rank``."""
        return prefill_rank in self.release_targets(decode_rank)

    def expected_releases(self, prefill_rank: int) -> int:
        """How many decode ranks release prefill rank ``prefill_rank``: its consumers, or the
        one assigned when it has none."""
        return len(self.consumers(prefill_rank)) or 1

    def describe(self, rank: int, *, prefill: bool, whole_layers: bool) -> str:
        """What rank ``rank`` of the ``prefill`` side (else the decode side) moves under this
        plan, in global KV head indices, e.g. ``decode rank 0 takes KV heads [0, 1) from
        prefill rank 0, [1, 2) from prefill rank 1`` (for the logs); the whole caches' source
        or targets too when the model has ``whole_layers``."""
        total = self.total_kv_heads
        if prefill:
            base = rank_heads(total, self.prefill_tp, rank).start if total else 0
            parts = [
                f"[{base + s.local_begin}, {base + s.local_begin + s.heads}) to decode rank "
                f"{s.rank}"
                for s in self.head_targets(rank)
            ]
            whole = [d for d in self.consumers(rank) if self.whole_source(d) == rank]
            whole = whole if whole_layers else []
            what, verb = f"prefill rank {rank}", "gives KV heads"
            whole_text = f"whole caches to decode ranks {whole}"
        else:
            base = rank_heads(total, self.decode_tp, rank).start if total else 0
            parts = [
                f"[{base + s.local_begin}, {base + s.local_begin + s.heads}) from prefill rank "
                f"{s.rank}"
                for s in self.head_sources(rank)
            ]
            source = self.whole_source(rank)
            whole = [] if source is None or not whole_layers else [source]
            what, verb = f"decode rank {rank}", "takes KV heads"
            whole_text = f"whole caches from prefill rank {source}"
        moved = f"{verb} {', '.join(parts)}" if parts else "moves no split heads"
        sizes = f"prefill TP {self.prefill_tp} -> decode TP {self.decode_tp}"
        return f"{sizes}, {total} KV heads: {what} {moved}" + (f"; {whole_text}" if whole else "")

    @cached_property
    def _consumers(self) -> dict[int, tuple[int, ...]]:
        """Each prefill rank's consumers once worked out (the same tuple for the same rank
        whichever thread asks first)."""
        return {}

    @cached_property
    def _unused_prefill_ranks(self) -> tuple[int, ...]:
        if self.decode_tp < self.prefill_tp:  # the few decode ranks' sources are the used ones
            used = {p for d in range(self.decode_tp) for p in self.sources(d)}
            return tuple(p for p in range(self.prefill_tp) if p not in used)
        return tuple(p for p in range(self.prefill_tp) if not self.consumers(p))

    @staticmethod
    def _check_rank(rank: int, size: int, side: str) -> None:
        if not 0 <= rank < size:
            raise IncompatiblePeerError(f"{side} rank {rank} outside TP size {size}")


def _with_heads(base: BlockSegment, layers: Sequence[str] | None, head: HeadSlice) -> BlockSegment:
    """``base`` (its block pairs and any token windows) over ``layers``, restricted to one
    head slice of ``head.heads`` heads from each side's begin."""
    if base.local_window.tokens is not None or base.remote_window.tokens is not None:
        raise FailedPreconditionError(
            "different TP sizes with different block sizes (token windows) are not supported: "
            "use the same block size on both instances"
        )
    return replace(
        base,
        layers=layers,
        local_window=replace(base.local_window, head_begin=head.local_begin, heads=head.heads),
        remote_window=replace(base.remote_window, head_begin=head.remote_begin, heads=head.heads),
    )


def _split(cfg: PdConfig, layers: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(split layers, whole layers) among ``layers`` (None: every layer)."""
    if layers is None:
        return cfg.split_layers, cfg.whole_layers
    names = set(layers)
    return (
        tuple(n for n in cfg.split_layers if n in names),
        tuple(n for n in cfg.whole_layers if n in names),
    )


def read_segments(
    plan: TpPlan, cfg: PdConfig, prefill_rank: int, base: Sequence[BlockSegment]
) -> list[BlockSegment] | None:
    """The block segments decode rank ``cfg.tp_rank`` reads from ``prefill_rank``: the
    request's ``base`` segments (whole heads; local = decode blocks) cut to a head window of
    the split layers per head slice, and whole blocks of the whole layers when that rank is
    their source. None: ``base`` as it is (equal TP sizes, or no split layer)."""
    if plan.identity or not cfg.split_layers:
        return None
    rank = cfg.tp_rank
    out: list[BlockSegment] = []
    for seg in base:
        split, whole = _split(cfg, seg.layers)
        if split:
            out.extend(
                _with_heads(seg, split, s)
                for s in plan.head_sources(rank)
                if s.rank == prefill_rank
            )
        if whole and plan.whole_source(rank) == prefill_rank:
            out.append(replace(seg, layers=whole))
    return out


def write_segments(
    plan: TpPlan, cfg: PdConfig, decode_rank: int, layer: str, base: Sequence[BlockSegment]
) -> list[BlockSegment] | None:
    """The block segments prefill rank ``cfg.tp_rank`` writes of ``layer`` into decode rank
    ``decode_rank`` (``base``: the layer's segments over whole heads, local = prefill blocks):
    None for ``base`` as it is (equal TP sizes, or a whole layer this rank is the source of),
    [] for nothing (a whole layer another rank writes), else ``base`` cut to one head window
    per head slice."""
    if plan.identity or not cfg.split_layers:
        return None
    if layer not in cfg.split_layers:
        return None if plan.whole_source(decode_rank) == cfg.tp_rank else []
    return [
        _with_heads(seg, None, s)
        for seg in base
        for s in plan.head_targets(cfg.tp_rank)
        if s.rank == decode_rank
    ]


__all__ = [
    "HeadSlice",
    "TpPlan",
    "check_split",
    "heads_per_rank",
    "holders",
    "rank_heads",
    "read_segments",
    "write_segments",
]
