"""Rank pairing when the prefill and decode instances run different TP sizes.

Only for READ mode over caches that every TP rank holds whole (MLA latent and indexer caches):
any prefill rank then has the bytes a decode rank needs. Decode rank ``r`` reads from prefill
rank ``r mod P``. Every prefill rank must still learn when it may free its blocks, also a rank
no decode rank reads (when the decode has fewer ranks): decode rank ``r`` releases the rank it
read from and the unread ranks ``p >= D`` with ``p mod D == r``. A prefill rank frees once it
has a release from every decode rank that reads from it, or from the one assigned to it.
With equal sizes this is the usual pairing: rank ``r`` with rank ``r``, one release each.
"""

from __future__ import annotations


def read_source(tp_rank: int, remote_tp_size: int) -> int:
    """The prefill rank that decode rank ``tp_rank`` reads from."""
    return tp_rank % remote_tp_size


def release_targets(tp_rank: int, tp_size: int, remote_tp_size: int) -> list[int]:
    """The prefill ranks decode rank ``tp_rank`` (of ``tp_size``) sends its release to: the one
    it read from first, then the unread ranks assigned to it."""
    unread = [p for p in range(tp_size, remote_tp_size) if p % tp_size == tp_rank]
    return [read_source(tp_rank, remote_tp_size), *unread]


def releases(tp_rank: int, tp_size: int, prefill_rank: int, prefill_tp_size: int) -> bool:
    """Whether decode rank ``tp_rank`` (of ``tp_size``) is one that releases prefill rank
    ``prefill_rank`` (of ``prefill_tp_size``): the same as ``prefill_rank in
    release_targets(tp_rank, tp_size, prefill_tp_size)``, in constant time."""
    if read_source(tp_rank, prefill_tp_size) == prefill_rank:
        return True
    return prefill_rank >= tp_size and prefill_rank % tp_size == tp_rank


def expected_releases(tp_rank: int, tp_size: int, consumer_tp_size: int) -> int:
    """How many decode ranks (of ``consumer_tp_size``) release prefill rank ``tp_rank`` (of
    ``tp_size``): those that read from it, or the one assigned when none does."""
    readers = len(range(tp_rank, consumer_tp_size, tp_size))
    return readers or 1
