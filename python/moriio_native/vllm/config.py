"""The connector's configuration: ``kv_connector_extra_config`` parsed and checked once.

Every key, its default and its meaning (docs/vllm.md has the same table for operators):

===================== ============ ==============================================================
key                   default      meaning
===================== ============ ==============================================================
``backend``           ``"auto"``   transfer backend: ``ucx``, ``mori``, ``loopback`` (one
                                   process only) or ``auto`` (``mori`` if available, else ``ucx``)
``mode``              ``"write"``  ``write``: prefill pushes each layer into decode's blocks;
                                   ``read``: decode pulls prefill's blocks. Both instances of a
                                   pair must agree. The legacy key ``read_mode`` (true/false) is
                                   read when ``mode`` is absent.
``handshake_port``    ``6301``     base port of the metadata handshake listeners
``notify_port``       ``61005``    base port of the notify listeners
``host_ip``           local IP     the address peers and the proxy should use for this instance
``bind_host``         ``host_ip``  the address the handshake and notify listeners bind: only the
                                   interface peers use, by default; ``"*"`` binds every
                                   interface (e.g. behind NAT, where ``host_ip`` is not local)
``proxy_ip``          unset        the proxy/router's host; no registration ping when unset
``proxy_ping_port``   ``36367``    the proxy's registration port
``http_port``         unset        this instance's HTTP port (``vllm serve --port``); required
                                   with ``proxy_ip``
``ping_interval``     ``3.0``      seconds between registration pings
``transfer_timeout``  ``30.0``     seconds one transfer (and one handshake) may take
``read_loading``      ``"async"``  READ mode: ``async`` -- requests wait in WAITING_FOR_REMOTE_KVS
                                   while their KV is pulled, the batch keeps running; ``sync`` --
                                   the step that needs the KV waits for it (a slow prefill
                                   stalls the whole batch); for vLLM versions without
                                   asynchronous loads
``abort_timeout``     ``120.0``    seconds a stranded request may hold blocks: prefill blocks
                                   nobody released, decode requests whose KV never arrived.
                                   ``defer_timeout`` is read when absent.
``quarantine_timeout`` ``300.0``   seconds decode blocks stay quarantined at most: a transfer
                                   into them ended (timed out / aborted) while writes may still
                                   land, so they are neither recomputed into nor freed until the
                                   writer proved them drained (its drain ack, its death, or for
                                   READ our own engine); past this bound a WRITE's blocks are
                                   freed anyway (logged); a READ's blocks wait for our engine's
                                   drain (logged past the bound)
``allowed_peers``     none         CIDRs / IPs / host names this instance may dial besides hosts
                                   that handshook with it (list or comma-separated string);
                                   ``"*"`` allows all (insecure)
``auth_secret``       unset        shared secret (>= 16 bytes) -> HMAC-SHA256 on every control
                                   message; else ``$MORIIO_NATIVE_AUTH_SECRET``
``engine_options``    ``{}``       extra options for the native backend (string -> string)
``ucx_*``, ``mori_*`` --           passed through to the backend as engine options, as are
                                   ``qp_per_transfer``, ``post_batch_size``, ``num_workers``,
                                   ``poll_mode`` (MoRI) and ``progress_mode`` (UCX)
===================== ============ ==============================================================

Port formula for every (dp_rank, tp_rank): ``base + dp_rank * tp_size + tp_rank``
(:mod:`moriio_native.control.ports`).

Contents: :class:`ConnectorConfig` (immutable; ``from_extra_config``) and the constants
``DEFAULT_*``. Pure, thread-safe.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from moriio_native.control.addressing import validate_host, validate_port
from moriio_native.control.ports import PortPlan
from moriio_native.control.security import ENV_AUTH_SECRET, MIN_SECRET_BYTES, PeerAllowlist
from moriio_native.errors import InvalidArgumentError

logger = logging.getLogger("moriio_native.vllm.config")

Mode = Literal["read", "write"]
Role = Literal["kv_producer", "kv_consumer", "kv_both"]
ReadLoading = Literal["async", "sync"]

DEFAULT_BACKEND = "auto"
DEFAULT_MODE: Mode = "write"
DEFAULT_HANDSHAKE_PORT = 6301
DEFAULT_NOTIFY_PORT = 61005
DEFAULT_PROXY_PING_PORT = 36367
DEFAULT_PING_INTERVAL = 3.0
DEFAULT_TRANSFER_TIMEOUT = 30.0
DEFAULT_ABORT_TIMEOUT = 120.0
DEFAULT_QUARANTINE_TIMEOUT = 300.0
DEFAULT_READ_LOADING: ReadLoading = "async"
BACKENDS = ("auto", "ucx", "mori", "loopback")
BACKEND_OPTION_PREFIXES = ("ucx_", "mori_")
# Backend tuning keys without a prefix (vLLM's MoRIIO connector spells MoRI's this way; the UCX
# backend's progress_mode): passed through to the engine like the prefixed ones.
BACKEND_OPTION_KEYS = frozenset(
    {"qp_per_transfer", "post_batch_size", "num_workers", "poll_mode", "progress_mode"}
)

_KNOWN_KEYS = frozenset(
    {
        "backend",
        "mode",
        "read_mode",
        "handshake_port",
        "notify_port",
        "host_ip",
        "bind_host",
        "proxy_ip",
        "proxy_ping_port",
        "http_port",
        "ping_interval",
        "transfer_timeout",
        "abort_timeout",
        "defer_timeout",
        "quarantine_timeout",
        "allowed_peers",
        "auth_secret",
        "engine_options",
        "read_loading",
    }
)
# Keys of vLLM's MoRIIO connector that have no meaning here; accepted so configurations can be
# switched over unchanged, and logged once.
_IGNORED_LEGACY_KEYS = frozenset({"recv_abort_timeout"})


def _truthy(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
    raise InvalidArgumentError(f"kv_connector_extra_config.{key} must be true/false, got {value!r}")


def _seconds(value: Any, key: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"kv_connector_extra_config.{key} must be a number of seconds, got {value!r}"
        ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgumentError(
            f"kv_connector_extra_config.{key} must be a positive number of seconds, got {value!r}"
        )
    return seconds


def _port(value: Any, key: str) -> int:
    try:
        return validate_port(value, what=f"kv_connector_extra_config.{key}")
    except InvalidArgumentError:
        raise
    except Exception as exc:  # validate_port only raises InvalidArgumentError; be defensive
        raise InvalidArgumentError(f"kv_connector_extra_config.{key}: {exc}") from None


def local_ip() -> str:
    """This host's outward-facing IP (no packet is sent), or 127.0.0.1 when there is none."""
    for family, probe in (
        (socket.AF_INET, ("192.0.2.1", 9)),
        (socket.AF_INET6, ("2001:db8::1", 9)),
    ):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


@dataclass(frozen=True)
class ConnectorConfig:
    """The parsed connector configuration of one instance. Immutable; safe to share.

    ``dp_size``/``tp_size`` are the instance's parallel sizes (from vLLM's ParallelConfig);
    ``ports`` validates at construction that every rank's two listener ports fit.
    """

    role: Role
    mode: Mode = DEFAULT_MODE
    backend: str = DEFAULT_BACKEND
    host_ip: str = "127.0.0.1"
    bind_host: str = "127.0.0.1"
    handshake_port: int = DEFAULT_HANDSHAKE_PORT
    notify_port: int = DEFAULT_NOTIFY_PORT
    proxy_ip: str | None = None
    proxy_ping_port: int = DEFAULT_PROXY_PING_PORT
    http_port: int | None = None
    ping_interval: float = DEFAULT_PING_INTERVAL
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    abort_timeout: float = DEFAULT_ABORT_TIMEOUT
    quarantine_timeout: float = DEFAULT_QUARANTINE_TIMEOUT
    allowed_peers: tuple[str, ...] = ()
    auth_secret: str | None = field(default=None, repr=False)
    engine_options: Mapping[str, str] = field(default_factory=dict)
    dp_size: int = 1
    tp_size: int = 1
    read_loading: ReadLoading = DEFAULT_READ_LOADING

    def __post_init__(self) -> None:
        if self.role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise InvalidArgumentError(
                f"kv_role must be kv_producer/kv_consumer/kv_both, got {self.role!r}"
            )
        if self.mode not in ("read", "write"):
            raise InvalidArgumentError(
                f"kv_connector_extra_config.mode must be 'read' or 'write', got {self.mode!r}"
            )
        if self.read_loading not in ("async", "sync"):
            raise InvalidArgumentError(
                "kv_connector_extra_config.read_loading must be 'async' or 'sync', "
                f"got {self.read_loading!r}"
            )
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(
                f"kv_connector_extra_config.backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.backend!r}"
            )
        if self.proxy_ip is not None and self.http_port is None:
            raise InvalidArgumentError(
                "kv_connector_extra_config.http_port is required with proxy_ip (the proxy "
                "forwards requests to it): set it to this instance's `vllm serve --port`"
            )
        if self.auth_secret is not None and len(self.auth_secret.encode()) < MIN_SECRET_BYTES:
            raise InvalidArgumentError(
                f"kv_connector_extra_config.auth_secret must be at least {MIN_SECRET_BYTES} bytes"
            )
        # Both checks raise InvalidArgumentError naming the bad value.
        PeerAllowlist(self.allowed_peers)
        self.ports  # noqa: B018 -- validates every rank's ports now, not at bind time

    @property
    def ports(self) -> PortPlan:
        """Every rank's handshake and notify port (the one formula, both sides)."""
        return PortPlan(self.handshake_port, self.notify_port, self.dp_size, self.tp_size)

    @property
    def engine_id(self) -> str:
        """The instance id advertised as ``remote_engine_id``: ``host:handshake_port``."""
        return f"{self.host_ip}:{self.handshake_port}"

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def transfer_mode(self) -> str:
        """``READ``/``WRITE`` as the proxy protocol spells it."""
        return self.mode.upper()

    def control_config(self) -> dict[str, Any]:
        """The mapping ``moriio_native.control`` builds its security from."""
        out: dict[str, Any] = {"allowed_peers": list(self.allowed_peers)}
        if self.auth_secret is not None:
            out["auth_secret"] = self.auth_secret
        return out

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None,
        *,
        role: str,
        dp_size: int = 1,
        tp_size: int = 1,
    ) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``. Raises InvalidArgumentError naming the first bad
        key; unknown keys are logged (a typo must not pass silently)."""
        extra = dict(extra or {})
        unknown = sorted(
            k
            for k in extra
            if k not in _KNOWN_KEYS
            and k not in _IGNORED_LEGACY_KEYS
            and k not in BACKEND_OPTION_KEYS
            and not k.startswith(BACKEND_OPTION_PREFIXES)
        )
        if unknown:
            logger.warning(
                "ignoring unknown kv_connector_extra_config keys: %s", ", ".join(unknown)
            )
        legacy = sorted(k for k in extra if k in _IGNORED_LEGACY_KEYS)
        if legacy:
            logger.info("kv_connector_extra_config keys without effect here: %s", ", ".join(legacy))

        if "mode" in extra and extra["mode"] is not None:
            mode = str(extra["mode"]).strip().lower()
        elif "read_mode" in extra:
            mode = "read" if _truthy(extra["read_mode"], "read_mode") else "write"
        else:
            mode = DEFAULT_MODE

        def get(key: str) -> Any:
            value = extra.get(key)
            return None if value is None or value == "" else value

        host = get("host_ip")
        host_ip = (
            validate_host(host, what="kv_connector_extra_config.host_ip") if host else local_ip()
        )
        bind = get("bind_host")
        bind_host = (
            host_ip
            if bind is None
            else "*"
            if bind == "*"
            else validate_host(bind, what="kv_connector_extra_config.bind_host")
        )
        proxy = get("proxy_ip")
        abort = get("abort_timeout") if get("abort_timeout") is not None else get("defer_timeout")
        options: dict[str, str] = {}
        raw_options = get("engine_options")
        if raw_options is not None:
            if not isinstance(raw_options, Mapping):
                raise InvalidArgumentError(
                    "kv_connector_extra_config.engine_options must be a mapping"
                )
            options.update({str(k): str(v) for k, v in raw_options.items()})
        options.update(
            {
                k: str(v)
                for k, v in extra.items()
                if k.startswith(BACKEND_OPTION_PREFIXES) or k in BACKEND_OPTION_KEYS
            }
        )
        allowed = get("allowed_peers")
        if isinstance(allowed, str):
            allowed_peers = tuple(p.strip() for p in allowed.split(",") if p.strip())
        elif allowed is None:
            allowed_peers = ()
        elif isinstance(allowed, (list, tuple)):
            allowed_peers = tuple(str(p) for p in allowed)
        else:
            raise InvalidArgumentError(
                "kv_connector_extra_config.allowed_peers must be a list or a comma-separated string"
            )
        secret = get("auth_secret")
        if secret is None:
            secret = os.environ.get(ENV_AUTH_SECRET) or None
        return cls(
            role=role,  # type: ignore[arg-type]
            mode=mode,  # type: ignore[arg-type]
            backend=str(get("backend") or DEFAULT_BACKEND).strip().lower(),
            host_ip=host_ip,
            bind_host=bind_host,
            handshake_port=_port(get("handshake_port") or DEFAULT_HANDSHAKE_PORT, "handshake_port"),
            notify_port=_port(get("notify_port") or DEFAULT_NOTIFY_PORT, "notify_port"),
            proxy_ip=validate_host(proxy, what="kv_connector_extra_config.proxy_ip")
            if proxy
            else None,
            proxy_ping_port=_port(
                get("proxy_ping_port") or DEFAULT_PROXY_PING_PORT, "proxy_ping_port"
            ),
            http_port=_port(get("http_port"), "http_port")
            if get("http_port") is not None
            else None,
            ping_interval=_seconds(get("ping_interval") or DEFAULT_PING_INTERVAL, "ping_interval"),
            transfer_timeout=_seconds(
                get("transfer_timeout") or DEFAULT_TRANSFER_TIMEOUT, "transfer_timeout"
            ),
            abort_timeout=_seconds(abort or DEFAULT_ABORT_TIMEOUT, "abort_timeout"),
            quarantine_timeout=_seconds(
                get("quarantine_timeout") or DEFAULT_QUARANTINE_TIMEOUT, "quarantine_timeout"
            ),
            allowed_peers=allowed_peers,
            auth_secret=str(secret) if secret is not None else None,
            engine_options=options,
            dp_size=dp_size,
            tp_size=tp_size,
            read_loading=str(get("read_loading") or DEFAULT_READ_LOADING).strip().lower(),  # type: ignore[arg-type]
        )


__all__ = [
    "BACKENDS",
    "DEFAULT_ABORT_TIMEOUT",
    "DEFAULT_HANDSHAKE_PORT",
    "DEFAULT_MODE",
    "DEFAULT_NOTIFY_PORT",
    "DEFAULT_PROXY_PING_PORT",
    "DEFAULT_QUARANTINE_TIMEOUT",
    "DEFAULT_READ_LOADING",
    "DEFAULT_TRANSFER_TIMEOUT",
    "ConnectorConfig",
    "Mode",
    "ReadLoading",
    "Role",
    "local_ip",
]
