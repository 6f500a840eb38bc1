"""State the puller, the pusher and the core share (one rank's protocol context)."""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from moriio_native.control.addressing import validate_host
from moriio_native.control.channel import NotifySender
from moriio_native.control.messages import HandshakeResponse
from moriio_native.control.ports import rank_port
from moriio_native.control.schema import new_incarnation
from moriio_native.engine import Engine
from moriio_native.errors import FailedPreconditionError, IncompatiblePeerError
from moriio_native.pd.config import HOLD_MARGIN_S, PdConfig
from moriio_native.pd.groups import (
    GroupedBlocks,
    Segment,
    Side,
    check_groups,
    describe_group,
    plan_segments,
)
from moriio_native.pd.heads import TpPlan, heads_per_rank
from moriio_native.pd.peers import Peer, PeerDirectory, PeerKey

if TYPE_CHECKING:
    from moriio_native.pd.tasks import RecvTask
    from moriio_native.pd.verify import ReadConfirmer, Verifier

logger = logging.getLogger("moriio_native.pd.context")

# Plans Context keeps for reuse (_made_plan): a rank pairs with a handful of TP sizes.
PLAN_CACHE = 16
# TP sizes up to which a plan's log line lists what this rank moves, rank by rank. A request's
# remote_tp_size is the client's word (up to 65,536): that plan's list took 2.3 MB and 1.4 s to
# make, in vLLM's engine step. Past it the line gives the sizes alone.
MAX_DESCRIBED_TP = 64
#: Peers (host, TP size, side) whose plan was logged that are remembered, so that each is
#: logged once; past it the oldest is forgotten (and logged again if it comes back).
MAX_LOGGED_PLANS = 1024


class StatsSink(Protocol):
    """Where the core counts what happened (the vLLM adapter passes its KVConnectorStats)."""

    def record(self, *, ok: bool) -> None: ...
    def record_transfer(self, event: Any, groups: int = 1) -> None: ...
    def record_handshake(self) -> None: ...
    def record_peer_bound(self, *, evicted: bool) -> None: ...
    def record_quarantine(self, blocks: int) -> None: ...
    def record_verify(self, *, ok: bool) -> None: ...
    def record_confirm(self, *, ok: bool) -> None: ...


@dataclass
class Reports:
    """What the caller learns at its next poll (guarded by the context lock)."""

    done_sending: set[str] = field(default_factory=set)  # prefill: blocks may be freed
    done_recving: set[str] = field(default_factory=set)  # decode: async load ended
    failed_recving: set[str] = field(default_factory=set)  # decode: ... and failed
    invalid_blocks: set[int] = field(default_factory=set)  # decode: recompute these
    failures: dict[str, str] = field(default_factory=dict)  # failed request -> why

    def take(self) -> Reports:
        out = Reports(
            self.done_sending,
            self.done_recving,
            self.failed_recving,
            self.invalid_blocks,
            self.failures,
        )
        self.done_sending, self.done_recving, self.failed_recving = set(), set(), set()
        self.invalid_blocks, self.failures = set(), {}
        return out


@dataclass
class Context:
    """One rank's shared protocol state. ``lock`` guards every machine and ``reports``; it is
    never held across a network call, a queue put that may wait, or a future's result."""

    cfg: PdConfig
    engine: Callable[[], Engine]
    sender: NotifySender
    directory: PeerDirectory
    stats: StatsSink
    mark_terminal: Callable[[str], None]  # late control messages for the id are dropped
    lock: threading.RLock = field(default_factory=threading.RLock)
    reports: Reports = field(default_factory=Reports)
    stop: threading.Event = field(default_factory=threading.Event)
    verifier: Verifier | None = None  # set when cfg.verify: the integrity check
    # Set when cfg.confirm_reads without cfg.verify (whose checksum request confirms already).
    confirmer: ReadConfirmer | None = None
    # (prefill TP, decode TP, total KV heads) -> the plan, most recently used last (_made_plan)
    plans: OrderedDict[tuple[int, int, int], TpPlan] = field(default_factory=OrderedDict)
    # (peer host, its TP size, we are the prefill) whose different-TP plan was logged, most
    # recent last; at most MAX_LOGGED_PLANS (requests name the hosts: a bound, not a record)
    logged_plans: OrderedDict[tuple[str, int, bool], None] = field(default_factory=OrderedDict)
    # This rank's incarnation (random, made when its core starts): in its handshake answers,
    # and in the announcements it makes (WRITE), so peers never take another process for it.
    incarnation: str = field(default_factory=new_incarnation)

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    def _made_plan(self, prefill_tp: int, decode_tp: int, total: int) -> TpPlan:
        """TpPlan.make's plan, the same object for the same sizes while it stays among the last
        PLAN_CACHE made: a plan works out its rank tables once (O(TP size)), so a release that
        checks its rank against the plan costs that once, not per message."""
        key = (prefill_tp, decode_tp, total)
        with self.lock:
            plan = self.plans.get(key)
            if plan is not None:
                self.plans.move_to_end(key)
                return plan
        plan = TpPlan.make(prefill_tp, decode_tp, total, whole=True)
        with self.lock:
            self.plans[key] = plan
            while len(self.plans) > PLAN_CACHE:
                self.plans.popitem(last=False)
        return plan

    def tp_plan(self, host: str, remote_tp_size: int, *, prefill: bool) -> TpPlan:
        """The rank plan between us (the ``prefill`` side, or the decode side) and a peer
        instance of ``remote_tp_size`` ranks at ``host`` (:mod:`moriio_native.pd.heads`; 0:
        ours). Raises FailedPreconditionError or IncompatiblePeerError naming both TP sizes
        when they cannot pair (also when they differ and we have several KV-cache groups),
        before any network."""
        cfg = self.cfg
        remote_tp_size = remote_tp_size or cfg.tp_size
        total = cfg.total_kv_heads if cfg.split_layers else 0
        if prefill:
            prefill_tp, decode_tp = cfg.tp_size, remote_tp_size
        else:
            prefill_tp, decode_tp = remote_tp_size, cfg.tp_size
        if remote_tp_size != cfg.tp_size:
            mismatch = f"peer {host}: prefill TP {prefill_tp} and decode TP {decode_tp} differ"
            if cfg.context_parallel:
                raise FailedPreconditionError(
                    f"{mismatch}, and context parallelism splits the caches by token across ranks"
                )
            if cfg.split_layers and not total:
                raise FailedPreconditionError(
                    f"{mismatch}, and layer {cfg.split_layers[0]} is split across TP ranks "
                    "(attention heads) but the model's total KV heads are not known"
                )
            if len(cfg.groups) > 1:
                # Head windows of several groups' segments (each group with its own block
                # ids and token ranges) are not byte-tested: refused rather than guessed.
                kinds = ", ".join(describe_group(i, g) for i, g in enumerate(cfg.groups))
                raise FailedPreconditionError(
                    f"{mismatch}, and the model has {len(cfg.groups)} KV-cache groups ({kinds}): "
                    "different TP sizes with several KV-cache groups are not supported; run "
                    "both instances with the same TP size"
                )
        try:
            plan = self._made_plan(prefill_tp, decode_tp, total)
        except IncompatiblePeerError as exc:
            raise IncompatiblePeerError(f"peer {host}: {exc}") from None
        if not plan.identity:
            with self.lock:
                first = _remember(self.logged_plans, (host, remote_tp_size, prefill))
            if first:  # once per peer instance and size: what this rank moves, for operators
                logger.info("peer %s: %s", host, self._described(plan, prefill=prefill))
        return plan

    def _described(self, plan: TpPlan, *, prefill: bool) -> str:
        """What this rank moves under ``plan``, for the log: rank by rank up to
        MAX_DESCRIBED_TP ranks a side, the sizes alone past it."""
        if max(plan.prefill_tp, plan.decode_tp) > MAX_DESCRIBED_TP:
            return (
                f"prefill TP {plan.prefill_tp} -> decode TP {plan.decode_tp}, "
                f"{plan.total_kv_heads} KV heads (more than {MAX_DESCRIBED_TP} ranks a side: "
                "not listed)"
            )
        cfg = self.cfg
        return plan.describe(cfg.tp_rank, prefill=prefill, whole_layers=bool(cfg.whole_layers))

    def peer_check(self, key: PeerKey) -> Callable[[HandshakeResponse], None]:
        """Checks a handshake answer at ``key`` can pair with us at all, whoever asked for it:
        our transfer mode and verify setting, and the same KV heads when its TP size differs
        from ours (see :meth:`rank_check` for which rank it must be)."""
        cfg = self.cfg

        def validate(response: HandshakeResponse) -> None:
            tp_size = response.tp_size
            if response.verify != cfg.verify:
                raise IncompatiblePeerError(
                    f"peer {response.engine_id} at {key} "
                    f"{'verifies' if response.verify else 'does not verify'} transfers, we "
                    f"{'do' if cfg.verify else 'do not'}; set the same 'verify' on both instances"
                )
            if cfg.verify and tp_size != cfg.tp_size:
                raise IncompatiblePeerError(
                    f"peer {response.engine_id} at {key} runs TP {tp_size}, we run TP "
                    f"{cfg.tp_size}: 'verify' compares whole blocks and needs equal TP sizes; "
                    "turn it off on both instances for different TP sizes"
                )
            if response.transfer_mode != cfg.transfer_mode:
                raise IncompatiblePeerError(
                    f"peer {response.engine_id} at {key} runs {response.transfer_mode} mode, we "
                    f"run {cfg.transfer_mode}; set the same 'mode' on both instances"
                )
            if tp_size != cfg.tp_size and cfg.split_layers:
                theirs, ours = response.total_kv_heads, cfg.total_kv_heads
                if theirs != ours:
                    raise IncompatiblePeerError(
                        f"peer {response.engine_id} at {key} (TP {tp_size}) splits "
                        f"{theirs or 'an unstated number of'} KV heads, we (TP {cfg.tp_size}) "
                        f"split {ours}: different TP sizes need the same model"
                    )
                self._check_heads_pair(response, key, tp_size)

        return validate

    @staticmethod
    def rank_check(
        key: PeerKey, dp_rank: int, rank: int, tp_size: int
    ) -> Callable[[HandshakeResponse], None]:
        """Checks a handshake answer at ``key`` is the rank one caller expects there (a
        request's or a message's word, which may be wrong: its refusal fails that caller
        only)."""

        def expect(response: HandshakeResponse) -> None:
            if (response.dp_rank, response.tp_rank, response.tp_size) != (dp_rank, rank, tp_size):
                raise IncompatiblePeerError(
                    f"peer at {key} is dp{response.dp_rank}/tp{response.tp_rank} of "
                    f"{response.tp_size}, expected dp{dp_rank}/tp{rank} of {tp_size} "
                    "(do both sides use the same handshake base port?)"
                )

        return expect

    def _check_heads_pair(self, response: HandshakeResponse, key: PeerKey, tp_size: int) -> None:
        """At the handshake, refuse a peer of another TP size whose heads cannot pair with
        ours (the plan every transfer with it would use: heads a TP size cannot split, heads
        not known, context parallelism), naming a split layer, the heads per rank and both
        TP sizes, instead of failing each request when its plan is made. Only an instance of
        one role knows which side the peer is; one that is both (``kv_both``) leaves the
        check to each request's plan."""
        cfg = self.cfg
        if cfg.producer == cfg.consumer:
            return
        prefill_tp, decode_tp = (cfg.tp_size, tp_size) if cfg.producer else (tp_size, cfg.tp_size)
        total = cfg.total_kv_heads
        try:
            self.tp_plan(key.host, tp_size, prefill=cfg.producer)
        except (IncompatiblePeerError, FailedPreconditionError) as exc:
            per_rank = (
                f"{heads_per_rank(total, prefill_tp)} of {total} KV heads per rank at prefill TP "
                f"{prefill_tp} and {heads_per_rank(total, decode_tp)} per rank at decode TP"
                if total
                else f"an unknown share of the KV heads at prefill TP {prefill_tp} and decode TP"
            )
            heads = f"holds {per_rank} {decode_tp}"
            raise IncompatiblePeerError(
                f"peer {response.engine_id} at {key}: layer {cfg.split_layers[0]} (and every "
                f"layer TP splits by head) {heads}; the two cannot pair: {exc}"
            ) from None

    def connect_rank(
        self,
        host: str,
        base_handshake_port: int,
        base_notify_port: int,
        dp_rank: int,
        tp_size: int,
        rank: int,
        *,
        incarnation: str = "",
        recover: bool = False,
    ) -> Future[Peer]:
        """A future of peer rank ``rank`` of an instance of ``tp_size`` ranks (see
        :class:`PeerDirectory`; ``incarnation``: never a cached handshake of another one;
        ``recover``: a remembered failure that answers this caller retries in the background);
        never waits on the network."""
        host = validate_host(host)
        key = PeerKey(host, rank_port(base_handshake_port, dp_rank, rank, tp_size))
        notify = rank_port(base_notify_port, dp_rank, rank, tp_size)
        return self.directory.connect(
            key,
            notify,
            self.peer_check(key),
            expect=self.rank_check(key, dp_rank, rank, tp_size),
            incarnation=incarnation,
            recover=recover,
        )


def _remember(seen: OrderedDict[tuple[str, int, bool], None], key: tuple[str, int, bool]) -> bool:
    """Whether ``key`` is new to ``seen``, which keeps the MAX_LOGGED_PLANS most recent."""
    new = key not in seen
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > MAX_LOGGED_PLANS:
        seen.popitem(last=False)
    return new


def plan_grouped(cfg: PdConfig, peer: Peer, blocks: GroupedBlocks, dest: Side) -> list[Segment]:
    """The segments of a grouped transfer with ``peer`` (``dest``: the side written), once
    its handshake's KV-cache groups proved to pair with ours (IncompatiblePeerError
    otherwise; InvalidArgumentError for ids that do not fit the groups)."""
    remote = peer.response.kv_groups
    check_groups(cfg.groups, remote, f"{peer.response.engine_id} at {peer.key}")
    return plan_segments(cfg.groups, remote, blocks, dest=dest)


def expected_incarnation(cfg: PdConfig, task: RecvTask, plan: TpPlan, rank: int) -> str:
    """The incarnation of prefill rank ``rank`` that computed ``task`` (READ); "" when the
    request states none and ``cfg.require_incarnation`` is off. Raises FailedPreconditionError
    naming the transfer otherwise: without it a READ could take another process's bytes under
    the same block ids."""
    stated = task.remote_incarnations
    if stated is None and not cfg.require_incarnation:
        return ""
    if stated is None:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: the request names no prefill incarnation "
            "('remote_incarnations' missing from kv_transfer_params: a prefill older than this "
            "version, or a proxy that drops the key); not reading, since a prefill restarted "
            "after computing it would hold other bytes under the same block ids (set "
            "'require_incarnation': false to read such requests anyway)"
        )
    if len(stated) != plan.prefill_tp:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: the request names {len(stated)} prefill "
            f"incarnations for a prefill of TP {plan.prefill_tp}; not reading"
        )
    return stated[rank]


def check_incarnation(peer: Peer, task: RecvTask, expect: str) -> None:
    """The handshaken rank must be the process that computed the request (``expect``; ""
    checks nothing): another one holds other bytes under the request's block ids (it
    restarted after computing it)."""
    if expect and peer.response.incarnation != expect:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: prefill {peer.response.engine_id} at {peer.key} is "
            f"incarnation {peer.response.incarnation or '(none stated)'}, the request was "
            f"computed by incarnation {expect}: the prefill restarted after computing it and its "
            "blocks are gone; not reading (recomputed)"
        )


def check_hold(peer: Peer, task: RecvTask, cfg: PdConfig, now: float) -> None:
    """A READ posted at ``now`` (``time.monotonic()``) may run for ``cfg.transfer_timeout``; it
    must end, with ``HOLD_MARGIN_S`` to spare, before the prefill may free the request's blocks
    (``task.remote_hold_until_ms``, its clock): after that the prefill may have given them to
    another request, and the READ would load that request's bytes. The prefill's clock is
    bounded through its handshake (:meth:`Peer.clock_at_most`), so the two clocks need not
    agree. A request that states no hold is refused unless ``cfg.require_hold`` is off. Raises
    FailedPreconditionError naming the transfer otherwise."""
    hold_until = task.remote_hold_until_ms
    if hold_until is None:
        if not cfg.require_hold:
            return
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: the request states no hold of the prefill's blocks "
            "('remote_hold_until_ms' missing from kv_transfer_params: a prefill older than "
            "protocol version 4, or a proxy that drops the key); not reading blocks the prefill "
            "may have freed (set 'require_hold': false to read such requests anyway)"
        )
    if peer.response.answered_ms <= 0:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: prefill {peer.response.engine_id} at {peer.key} "
            "stated no time in its handshake answer (answered_ms 0), so how long it still "
            "holds the request's blocks cannot be bounded; not reading"
        )
    prefill_now = peer.clock_at_most(now)
    needed_ms = math.ceil((cfg.transfer_timeout + HOLD_MARGIN_S) * 1000)
    if prefill_now + needed_ms > hold_until:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: prefill {peer.response.engine_id} at {peer.key} "
            f"holds the request's blocks for {(hold_until - prefill_now) / 1000:.1f} s more at "
            f"most, and a READ may take transfer_timeout ({cfg.transfer_timeout:g} s) + "
            f"{HOLD_MARGIN_S:g} s: not reading blocks it may free meanwhile (recomputed); either "
            "the request waited on this decode too long, or the prefill's abort_timeout is not "
            "above this decode's transfer_timeout + 1 s"
        )


def check_held_until(peer: Peer, task: RecvTask, now: float) -> None:
    """A READ of ``task`` from ``peer`` completed by ``now`` (``time.monotonic()``): the prefill
    must still have held the blocks then, with ``HOLD_MARGIN_S`` to spare, by its clock as the
    handshake bounds it; the hold is a stretch from the request's end, so they were held for all
    of the READ. Whatever delayed the READ (a pause before or inside the post, a slow transfer)
    it cannot have read blocks the prefill had freed. No stated hold: nothing to check. Raises
    FailedPreconditionError naming the transfer otherwise (its bytes are not used)."""
    hold_until = task.remote_hold_until_ms
    if hold_until is None:
        return
    prefill_now = peer.clock_at_most(now)
    if prefill_now + math.ceil(HOLD_MARGIN_S * 1000) > hold_until:
        raise FailedPreconditionError(
            f"transfer {task.transfer_id}: the READ from prefill {peer.response.engine_id} at "
            f"{peer.key} completed when the prefill's hold of the blocks may have ended "
            f"({(hold_until - prefill_now) / 1000:.1f} s left at most, {HOLD_MARGIN_S:g} s "
            "needed): the prefill may have freed them before the READ ended; its bytes are "
            "not used (recomputed)"
        )


def check_engine(peer: Peer, expect_engine: str | None) -> None:
    """The request named an instance: the handshaken rank must belong to it."""
    if expect_engine and not peer.response.engine_id.startswith(expect_engine + "/"):
        raise IncompatiblePeerError(
            f"the request names engine {expect_engine!r} but {peer.host} serves "
            f"{peer.response.engine_id!r}"
        )


__all__ = [
    "Context",
    "Reports",
    "StatsSink",
    "check_engine",
    "check_held_until",
    "check_hold",
    "check_incarnation",
    "expected_incarnation",
    "plan_grouped",
]
