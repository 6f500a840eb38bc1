"""State the puller, the pusher and the core share (one rank's protocol context)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from moriio_native.control.addressing import validate_host
from moriio_native.control.channel import NotifySender
from moriio_native.control.messages import HandshakeResponse
from moriio_native.control.ports import rank_port
from moriio_native.engine import Engine
from moriio_native.errors import FailedPreconditionError, IncompatiblePeerError
from moriio_native.pd.config import PdConfig
from moriio_native.pd.groups import GroupedBlocks, Segment, Side, check_groups, plan_segments
from moriio_native.pd.peers import Peer, PeerDirectory, PeerKey
from moriio_native.pd.tp import read_source


class StatsSink(Protocol):
    """Where the core counts what happened (the vLLM adapter passes its KVConnectorStats)."""

    def record(self, *, ok: bool) -> None: ...
    def record_transfer(self, event: Any) -> None: ...
    def record_handshake(self) -> None: ...
    def record_quarantine(self, blocks: int) -> None: ...


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

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    def peer_key(
        self, host: str, base_handshake_port: int, dp_rank: int, tp_size: int
    ) -> tuple[PeerKey, int]:
        """The key of the peer rank that pairs with ours in an instance of ``tp_size`` ranks
        (the one we read from / write to), and that rank's index."""
        rank = read_source(self.cfg.tp_rank, tp_size)
        return PeerKey(host, rank_port(base_handshake_port, dp_rank, rank, tp_size)), rank

    def check_tp_mismatch_allowed(self, host: str, remote_tp_size: int) -> None:
        """Different TP sizes work only where any peer rank holds what we need: READ mode over
        caches every rank holds whole (MLA). Raises FailedPreconditionError otherwise."""
        cfg = self.cfg
        mismatch = f"peer {host}: TP size {remote_tp_size} differs from ours ({cfg.tp_size})"
        if cfg.mode != "read":
            raise FailedPreconditionError(
                f"{mismatch}; different TP sizes are supported in READ mode only"
            )
        if cfg.context_parallel:
            raise FailedPreconditionError(
                f"{mismatch}, and context parallelism splits the caches by token across ranks"
            )
        if cfg.split_layer is not None:
            raise FailedPreconditionError(
                f"{mismatch}, and layer {cfg.split_layer} is split across TP ranks (attention "
                "heads); different TP sizes need caches every rank holds whole (MLA)"
            )

    def validator(
        self, key: PeerKey, dp_rank: int, rank: int, tp_size: int
    ) -> Callable[[HandshakeResponse], None]:
        """Checks a handshake answer at ``key`` is the rank we expect, in our transfer mode."""
        cfg = self.cfg

        def validate(response: HandshakeResponse) -> None:
            if response.transfer_mode != cfg.transfer_mode:
                raise IncompatiblePeerError(
                    f"peer {response.engine_id} at {key} runs {response.transfer_mode} mode, we "
                    f"run {cfg.transfer_mode}; set the same 'mode' on both instances"
                )
            if (response.dp_rank, response.tp_rank, response.tp_size) != (dp_rank, rank, tp_size):
                raise IncompatiblePeerError(
                    f"peer at {key} is dp{response.dp_rank}/tp{response.tp_rank} of "
                    f"{response.tp_size}, expected dp{dp_rank}/tp{rank} of {tp_size} "
                    "(do both sides use the same handshake base port?)"
                )

        return validate

    def connect(
        self,
        host: str,
        base_handshake_port: int,
        base_notify_port: int,
        dp_rank: int,
        tp_size: int,
    ) -> Any:
        """A future of the peer rank that pairs with ours (see :class:`PeerDirectory`). Raises
        (synchronously, before any network) when the TP sizes cannot pair."""
        host = validate_host(host)
        tp_size = tp_size or self.cfg.tp_size
        if tp_size != self.cfg.tp_size:
            self.check_tp_mismatch_allowed(host, tp_size)
        key, rank = self.peer_key(host, base_handshake_port, dp_rank, tp_size)
        notify = rank_port(base_notify_port, dp_rank, rank, tp_size)
        return self.directory.connect(key, notify, self.validator(key, dp_rank, rank, tp_size))


def plan_grouped(cfg: PdConfig, peer: Peer, blocks: GroupedBlocks, dest: Side) -> list[Segment]:
    """The segments of a grouped transfer with ``peer`` (``dest``: the side written), once
    its handshake's KV-cache groups proved to pair with ours (IncompatiblePeerError
    otherwise; InvalidArgumentError for ids that do not fit the groups)."""
    remote = peer.response.kv_groups
    check_groups(cfg.groups, remote, f"{peer.response.engine_id} at {peer.key}")
    return plan_segments(cfg.groups, remote, blocks, dest=dest)


def check_engine(peer: Peer, expect_engine: str | None) -> None:
    """The request named an instance: the handshaken rank must belong to it."""
    if expect_engine and not peer.response.engine_id.startswith(expect_engine + "/"):
        raise IncompatiblePeerError(
            f"the request names engine {expect_engine!r} but {peer.host} serves "
            f"{peer.response.engine_id!r}"
        )


__all__ = ["Context", "Reports", "StatsSink", "check_engine", "plan_grouped"]
