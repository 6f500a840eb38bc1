"""The one port formula of the control plane, used by listeners and by dialers alike.

Every worker of an instance listens on two ports derived from the instance's two *base* ports
(the ``handshake_port`` and ``notify_port`` an instance advertises to the router)::

    offset(dp_rank, tp_rank, tp_size) = dp_rank * tp_size + tp_rank
    handshake listener = handshake_base + offset
    notify listener    = notify_base    + offset

A peer that dials rank ``(d, t)`` of an instance with TP size ``T`` uses the *same* function
with that instance's ``T`` -- so listener and dialer always agree. Example, ``dp_size=2``,
``tp_size=4``, ``handshake_base=6301``, ``notify_base=61005``:

    ======= ======= ======== =========== ========
    dp_rank tp_rank offset   handshake   notify
    ======= ======= ======== =========== ========
    0       0       0        6301        61005
    0       3       3        6304        61008
    1       0       4        6305        61009
    1       3       7        6308        61012
    ======= ======= ======== =========== ========

Compatibility with vLLM's MoRIIO connector: identical whenever ``dp_rank == 0`` or
``tp_size == 1`` (its TP-only and DP+EP deployments). For DP>1 *and* TP>1 vLLM's listeners use
``base + dp_rank + tp_rank`` while its dialers use ``dp_rank * tp_size + tp_rank``, so its own
ranks disagree (and ranks collide); this module never does that.

Contents (pure functions / immutable values, safe from any thread):

* :func:`port_offset` -- the offset above, with argument checks.
* :func:`rank_port` -- ``base + port_offset(...)``, checked to stay within 1..65535.
* :class:`PortPlan` -- both bases plus the instance's dp/tp sizes; ``handshake_port``,
  ``notify_port``, ``all_ports``; refuses plans whose two port ranges overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from moriio_native.errors import InvalidArgumentError

from .addressing import MAX_PARALLEL_SIZE, validate_port


def _check_size(value: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_PARALLEL_SIZE:
        raise InvalidArgumentError(
            f"{what} must be an integer 1..{MAX_PARALLEL_SIZE}, got {value!r}"
        )
    return value


def port_offset(dp_rank: int, tp_rank: int, tp_size: int, dp_size: int | None = None) -> int:
    """``dp_rank * tp_size + tp_rank``; requires ``0 <= tp_rank < tp_size`` and ``dp_rank >= 0``
    (and ``dp_rank < dp_size`` when ``dp_size`` is given). Distinct (dp, tp) pairs always give
    distinct offsets."""
    _check_size(tp_size, "tp_size")
    for value, what in ((dp_rank, "dp_rank"), (tp_rank, "tp_rank")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgumentError(f"{what} must be a non-negative integer, got {value!r}")
    if tp_rank >= tp_size:
        raise InvalidArgumentError(f"tp_rank {tp_rank} is not below tp_size {tp_size}")
    if dp_size is not None and dp_rank >= _check_size(dp_size, "dp_size"):
        raise InvalidArgumentError(f"dp_rank {dp_rank} is not below dp_size {dp_size}")
    return dp_rank * tp_size + tp_rank


def rank_port(
    base: int, dp_rank: int, tp_rank: int, tp_size: int, dp_size: int | None = None
) -> int:
    """The port rank ``(dp_rank, tp_rank)`` listens on above ``base``; InvalidArgumentError if
    it would leave 1..65535."""
    base = validate_port(base, what="base port")
    port = base + port_offset(dp_rank, tp_rank, tp_size, dp_size)
    if port > 65535:
        raise InvalidArgumentError(
            f"port for dp_rank {dp_rank}, tp_rank {tp_rank} (tp_size {tp_size}) above base "
            f"{base} is {port}, beyond 65535: choose a lower base port"
        )
    return port


@dataclass(frozen=True, slots=True)
class PortPlan:
    """The control ports of one instance with ``dp_size * tp_size`` workers. Immutable.

    Construction fails (InvalidArgumentError) if any port would exceed 65535 or the handshake
    and notify ranges overlap, so a bad configuration is caught at start-up, not as a bind
    error on some rank.
    """

    handshake_base: int
    notify_base: int
    dp_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "handshake_base", validate_port(self.handshake_base, what="handshake_port")
        )
        object.__setattr__(self, "notify_base", validate_port(self.notify_base, what="notify_port"))
        _check_size(self.dp_size, "dp_size")
        _check_size(self.tp_size, "tp_size")
        n = self.dp_size * self.tp_size
        for base, what in (
            (self.handshake_base, "handshake_port"),
            (self.notify_base, "notify_port"),
        ):
            if base + n - 1 > 65535:
                raise InvalidArgumentError(
                    f"{what} {base} + {n} ranks exceeds 65535: choose a lower base port"
                )
        lo, hi = sorted((self.handshake_base, self.notify_base))
        if hi < lo + n:
            raise InvalidArgumentError(
                f"handshake ports {self.handshake_base}..{self.handshake_base + n - 1} and notify "
                f"ports {self.notify_base}..{self.notify_base + n - 1} overlap for {n} ranks"
            )

    def handshake_port(self, dp_rank: int, tp_rank: int) -> int:
        """Port of rank ``(dp_rank, tp_rank)``'s handshake listener."""
        return rank_port(self.handshake_base, dp_rank, tp_rank, self.tp_size, self.dp_size)

    def notify_port(self, dp_rank: int, tp_rank: int) -> int:
        """Port of rank ``(dp_rank, tp_rank)``'s notify listener."""
        return rank_port(self.notify_base, dp_rank, tp_rank, self.tp_size, self.dp_size)

    def all_ports(self) -> list[tuple[int, int, int, int]]:
        """``(dp_rank, tp_rank, handshake_port, notify_port)`` for every rank, in rank order."""
        return [
            (d, t, self.handshake_port(d, t), self.notify_port(d, t))
            for d in range(self.dp_size)
            for t in range(self.tp_size)
        ]


__all__ = ["PortPlan", "port_offset", "rank_port"]
