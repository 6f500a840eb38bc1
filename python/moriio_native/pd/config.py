"""The settings the protocol core needs, free of any framework's configuration type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moriio_native.control.addressing import validate_host
from moriio_native.control.messages import KvGroup
from moriio_native.errors import InvalidArgumentError

Mode = Literal["read", "write"]
# Peers one rank keeps connected (and peer addresses it caches) at most (pd/peers.py).
DEFAULT_MAX_PEERS = 1024
# What a READ leaves, past its own transfer_timeout, before the prefill may free the blocks: the
# prefill's scheduler (which states the hold) and the worker that answered the handshake may sit
# on two hosts whose clocks agree only to NTP's milliseconds, and the READ is posted a moment
# after the check.
HOLD_MARGIN_S = 1.0
# The longest transfer_timeout: a year, what the engine takes.
MAX_TRANSFER_TIMEOUT_S = 365 * 86400
# The longest abort_timeout and quarantine_timeout (about 31 years: "never", finite so that a
# hold's end in milliseconds stays an integer a message carries).
MAX_HOLD_TIMEOUT_S = 1e9
_BOOLS = (
    "producer",
    "consumer",
    "sync_read",
    "context_parallel",
    "verify",
    "confirm_reads",
    "require_incarnation",
    "require_hold",
)
_INTS = (
    "handshake_port",
    "notify_port",
    "dp_rank",
    "tp_rank",
    "dp_size",
    "tp_size",
    "total_kv_heads",
    "max_peers",
)


@dataclass(frozen=True)
class PdConfig:
    """One rank's protocol settings. Immutable; safe to share between threads.

    ``engine_id`` is this rank's engine id (``<instance>/dp<d>/tp<t>``); ``handshake_port`` and
    ``notify_port`` are the instance's BASE ports (what requests and announcements carry; each
    rank's own port follows :mod:`moriio_native.control.ports`). ``split_layers`` names the
    layers whose caches TP ranks split by KV head (dense attention; empty when every rank holds
    every layer whole, MLA), ``total_kv_heads`` the model's KV heads in them over all ranks (0:
    unknown, which rules out pairing different TP sizes when there are split layers), and
    ``whole_layers`` the layers every rank holds whole (:mod:`moriio_native.pd.heads`)."""

    engine_id: str
    mode: Mode
    producer: bool
    consumer: bool
    host_ip: str
    handshake_port: int
    notify_port: int
    dp_rank: int = 0
    tp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    transfer_timeout: float = 30.0
    abort_timeout: float = 120.0
    quarantine_timeout: float = 300.0
    # READ: True waits for this step's reads in the caller's load hook (the peer handshakes
    # still run in the background); False reports each load's end asynchronously.
    sync_read: bool = False
    context_parallel: bool = False
    split_layers: tuple[str, ...] = ()
    whole_layers: tuple[str, ...] = ()
    total_kv_heads: int = 0
    # Check every transfer end to end (block checksums on both sides, pd/verify.py); both
    # sides of a pair must agree.
    verify: bool = False
    # READ: after each READ, ask the prefill rank whether it still holds the transfer's blocks
    # and the READ's blocks are those its answer named, before the load counts (what verify's
    # checksum request also proves). A decode that confirms needs its prefill to answer: the
    # prefill refuses its handshake unless it confirms too.
    confirm_reads: bool = False
    # This rank's KV-cache groups (vLLM's hybrid KV-cache manager; moriio_native.pd.groups);
    # empty: one group of every registered layer, moved with the classic (ungrouped) protocol.
    groups: tuple[KvGroup, ...] = ()
    # READ: refuse (recompute) a request that names no prefill incarnation; False reads it from
    # whichever process answers the handshake (what peers without incarnations allow).
    require_incarnation: bool = True
    # READ: refuse (recompute) a request that states no hold of the prefill's blocks
    # (remote_hold_until_ms); False reads it whenever it comes (the prefill may have freed them).
    require_hold: bool = True
    # At most this many peer addresses cached and peers connected per rank (pd/peers.py): the
    # least recently used idle one goes before another connects.
    max_peers: int = DEFAULT_MAX_PEERS

    def __post_init__(self) -> None:
        if self.mode not in ("read", "write"):
            raise InvalidArgumentError(f"mode must be 'read' or 'write', got {self.mode!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in _INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
        for name, most in (
            ("transfer_timeout", MAX_TRANSFER_TIMEOUT_S),
            ("abort_timeout", MAX_HOLD_TIMEOUT_S),
            ("quarantine_timeout", MAX_HOLD_TIMEOUT_S),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value <= most
            ):
                raise InvalidArgumentError(
                    f"{name} must be a number of seconds in (0, {most:g}], got {value!r}"
                )
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.dp_rank < self.dp_size:
            raise InvalidArgumentError(
                f"rank dp{self.dp_rank}/tp{self.tp_rank} outside dp_size {self.dp_size} / "
                f"tp_size {self.tp_size}"
            )
        for name in ("handshake_port", "notify_port"):
            port = getattr(self, name)
            # 0: a port the system picks (each listener reports the one it bound).
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise InvalidArgumentError(f"{name} must be 0..65535, got {port!r}")
        if not self.engine_id:
            raise InvalidArgumentError("engine_id must not be empty")
        validate_host(self.host_ip, what="host_ip")
        both = sorted(set(self.split_layers) & set(self.whole_layers))
        if both:
            raise InvalidArgumentError(
                f"split_layers and whole_layers both name {both[:4]}: a layer is split by "
                "heads or held whole, not both"
            )
        if self.max_peers < 1:
            raise InvalidArgumentError(f"max_peers must be >= 1, got {self.max_peers}")
        if self.verify and len(self.groups) > 1:
            kinds = ", ".join(f"{g.kind} (block size {g.block_size})" for g in self.groups)
            raise InvalidArgumentError(
                f"verify compares whole blocks of one KV-cache group; this model has "
                f"{len(self.groups)} ({kinds}): turn verify off"
            )
        if self.total_kv_heads < 0:
            raise InvalidArgumentError(f"total_kv_heads must be >= 0, got {self.total_kv_heads}")

    @property
    def confirms_reads(self) -> bool:
        """Whether this rank confirms its READs with a hold check of their own: a READ-mode
        decode with ``confirm_reads`` and without ``verify`` (whose checksum request is one)."""
        return self.confirm_reads and self.consumer and self.mode == "read" and not self.verify

    @property
    def answers_hold_checks(self) -> bool:
        """Whether this rank answers decodes' hold checks: a READ-mode prefill rank with
        ``confirm_reads`` (any other would refuse them)."""
        return self.confirm_reads and self.mode == "read" and self.producer

    @property
    def transfer_mode(self) -> str:
        """``READ``/``WRITE`` as the handshake (and vLLM's MoRIIO proxy protocol) spells it."""
        return self.mode.upper()


__all__ = ["DEFAULT_MAX_PEERS", "Mode", "PdConfig"]
