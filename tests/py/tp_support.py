"""Instances whose TP ranks run in separate processes (no tests here).

A :class:`RankedSide` is a :class:`test_vllm_support.Side` whose scheduler and output
aggregator run in the test process while each TP rank's worker (:class:`RankWorker`: the
connector made by vLLM's factory, its caches, the fake forward) runs in a child process of its
own (:class:`test_vllm_support.RemoteSides`), as vLLM runs one worker process per GPU. Each
step the driver sends every rank the :class:`StepWork` (pickled, connector metadata included)
and aggregates the ModelRunnerOutputs they send back.

The ``leg_*`` functions run in the child processes (``RemoteSides.run("tp_support:leg_...")``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from test_vllm_support import (
    ChildContext,
    RankSpec,
    RankWorker,
    Side,
    StepWork,
    backing_of,
    expected_backing,
    fill_random,
    logical_blocks,
)

LEGS = "tp_support"

# ---- in the child processes ---------------------------------------------------------------------


@dataclass
class _Rank:
    worker: RankWorker
    before: torch.Tensor | None = None  # the backing after fill_random
    loaded: torch.Tensor | None = None  # the backing before the forward that computes a request
    log: list[str] = field(default_factory=list)


_RANKS: dict[tuple[str, int], _Rank] = {}


class _Capture(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self._into = into

    def emit(self, record: logging.LogRecord) -> None:
        self._into.append(record.getMessage())


def leg_make_rank(ctx: ChildContext, spec: RankSpec, rank: int) -> None:
    """Build TP rank ``rank`` of instance ``spec.name`` here; its warnings are recorded."""
    made = _Rank(RankWorker(spec, rank))
    logging.getLogger("moriio_native").addHandler(_Capture(made.log))
    _RANKS[(spec.name, rank)] = made


def leg_handshake_metadata(ctx: ChildContext, name: str, rank: int) -> Any:
    """The rank's ``get_handshake_metadata()`` (its incarnation, for the scheduler)."""
    return _RANKS[(name, rank)].worker.connector.get_handshake_metadata()


def leg_step(ctx: ChildContext, name: str, rank: int, work: StepWork, snapshot: str) -> Any:
    """One step of the rank; when it computes request ``snapshot``, the backing is kept as it
    is right before the forward (what the load left)."""
    made = _RANKS[(name, rank)]
    hook: Callable[[], None] | None = None
    if snapshot and any(c[0] == snapshot for c in work.computed):

        def hook() -> None:
            made.worker.connector.wait_for_layer_load(made.worker.layer_names[0])
            made.loaded = backing_of(made.worker).clone()

    return made.worker.run(work, before_forward=hook)


def leg_fill(ctx: ChildContext, name: str, rank: int, seed: int) -> None:
    """Random bytes in the rank's whole backing, remembered as its state before a load."""
    made = _RANKS[(name, rank)]
    fill_random(made.worker, seed)
    made.before = backing_of(made.worker).clone()


def leg_blocks(ctx: ChildContext, name: str, rank: int, blocks: list[int]) -> dict[str, Any]:
    """Each layer's logical content of ``blocks`` (integers), whatever the physical layout."""
    return logical_blocks(_RANKS[(name, rank)].worker, blocks)


def leg_differing_bytes(
    ctx: ChildContext,
    name: str,
    rank: int,
    blocks: list[int],
    content: Mapping[str, torch.Tensor],
    at_load: bool,
) -> int:
    """Bytes of the backing (as the load left it with ``at_load``, else now) that differ from
    the state before the load with ``content`` written into ``blocks`` of every layer."""
    made = _RANKS[(name, rank)]
    assert made.before is not None, "leg_fill first"
    got = made.loaded if at_load else backing_of(made.worker)
    assert got is not None, "the request was not computed after its load"
    want = expected_backing(made.worker, made.before, blocks, content)
    return int((want != got).sum())


def leg_warnings(ctx: ChildContext, name: str, rank: int, text: str) -> int:
    """How many warnings of the rank contain ``text``."""
    return sum(text in line for line in _RANKS[(name, rank)].log)


def leg_drop_releases(ctx: ChildContext, name: str, rank: int, port: int) -> None:
    """The rank's release messages to notify port ``port`` are lost from now on."""
    from moriio_native.control.messages import Release

    sender = _RANKS[(name, rank)].worker.connector.worker.core.ctx.sender
    send = sender.send

    def lossy(host: str, to_port: int, message: Any) -> None:
        if isinstance(message, Release) and to_port == port:
            return
        send(host, to_port, message)

    sender.send = lossy  # type: ignore[method-assign]


def leg_close_rank(ctx: ChildContext, name: str, rank: int) -> None:
    _RANKS.pop((name, rank)).worker.shutdown()


# ---- in the test process ------------------------------------------------------------------------


@dataclass
class RankedSide(Side):
    """A Side whose TP rank ``r`` runs in ``procs[placement[r]]``."""

    procs: list[Any] = field(default_factory=list)
    placement: tuple[int, ...] = ()
    snapshot: str = ""  # the request whose post-load backing the ranks keep (leg_step)

    def _make_ranks(self) -> None:
        assert len(self.placement) == self.tp_size
        assert len(set(self.placement)) == self.tp_size, "one process per rank"
        self.ranks, self.workers, self.rank_caches = [], [], []
        self.each("leg_make_rank", lambda r: (self.rank_spec, r))

    def _handshake_metadata(self) -> list[Any]:
        return self.each("leg_handshake_metadata", lambda r: (self.name, r))

    def proc(self, rank: int) -> Any:
        return self.procs[self.placement[rank]]

    def each(self, leg: str, args: Callable[[int], tuple[Any, ...]]) -> list[Any]:
        """Run ``leg`` on every rank at once (each in its process); their results by rank."""
        for rank in range(self.tp_size):
            self.proc(rank).submit("run", f"{LEGS}:{leg}", args(rank))
        return [self.proc(rank).result("run", leg) for rank in range(self.tp_size)]

    def _run_ranks(
        self,
        work: StepWork,
        before_forward: Callable[[], None] | None,
        after_start_load: Callable[[], None] | None,
    ) -> list[Any]:
        assert before_forward is None and after_start_load is None, "hooks run in-process only"
        return self.each("leg_step", lambda r: (self.name, r, work, self.snapshot))

    def rank_leg(self, rank: int, leg: str, *args: Any) -> Any:
        return self.proc(rank).run(f"{LEGS}:{leg}", self.name, rank, *args)

    def shutdown(self) -> None:
        self.each("leg_close_rank", lambda r: (self.name, r))


__all__ = ["RankedSide"]
