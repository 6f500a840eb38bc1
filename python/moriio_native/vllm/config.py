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
``proxy_auth``        ``false``    sign the registration pings with ``auth_secret`` (when one is
                                   set), as the example proxy holding the same secret requires;
                                   off for a router that knows no secret (vllm-router, vLLM's
                                   toy proxy), which reads one-frame pings only
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
``accept_only_allowed_peers`` ``false`` the listening ports also accept TCP connections only
                                   from ``allowed_peers`` (then CIDRs / IPs only, at least
                                   one): ZMQ closes any other as it accepts it, so a stranger's
                                   messages are never read. On a prefill every decode's
                                   source addresses must be inside them, on a WRITE-mode
                                   decode every prefill's
``auth_secret``       unset        shared secret (>= 16 bytes) -> HMAC-SHA256 on every control
                                   message; else ``$MORIIO_NATIVE_AUTH_SECRET``
``listener_handshake_timeout`` ``2.0`` seconds (0.05-30) the handshake and notify listeners give
                                   a new connection to finish ZMQ's handshake (about four round
                                   trips with a secret) before closing it: bounds what a peer
                                   without the secret holds with a half-sent handshake. Raise
                                   it for links with round trips near half a second
``verify``            ``false``    check every transfer end to end: both sides compute block
                                   checksums over the transferred cells and compare them; a
                                   mismatch fails the load (its blocks are recomputed). Both
                                   instances of a pair must agree. Costs a pass over the
                                   transferred bytes on each side (docs/benchmarks.md)
``confirm_reads``     ``false``    (``true`` with ``auth_secret``) READ: before a load counts, the
                                   decode asks the prefill (one
                                   round trip on its handshake port) whether it still holds the
                                   request's blocks and the READ took those its answer named; if
                                   not (the answer handed to a second decode after the first
                                   released it, or changed on its way) the load fails and is
                                   recomputed. ``verify`` includes this check. A decode that sets
                                   it needs a prefill that sets it too (else the handshake is
                                   refused, naming the key)
``require_incarnation`` ``true``   READ: load only from the prefill processes the request names
                                   (``remote_incarnations`` of the prefill's answer, which the
                                   proxy must pass on); a request without them is recomputed.
                                   ``false``: such a request is read from the handshaken prefill
                                   (a prefill restarted after computing it cannot be detected);
                                   for a proxy that drops the key
``require_hold``      ``true``     READ: load only while the prefill still holds the request's
                                   blocks (``remote_hold_until_ms`` of its answer, which the
                                   proxy must pass on); a request without it is recomputed.
                                   ``false``: such a request is read whenever it comes (the
                                   prefill may have freed the blocks by then)
``require_prompt_match`` ``true`` READ: load only for the prompt the prefill answered for
                                   (``remote_num_tokens`` and ``remote_prompt_digest`` of its
                                   answer, which the proxy must pass on); an answer without
                                   them is recomputed. ``false``: such an answer is read
                                   without the check (a longer or other prompt than the
                                   prefill's may then load KV that is not its own); for a proxy
                                   that drops the keys. Answers that state them are checked
``max_peers``         ``1024``     peers one rank keeps connected (and addresses it caches) at
                                   most: before one more connects, the least recently used
                                   that no request is using (no transfer pending or
                                   quarantined, no live job) is disconnected;
                                   with every one busy the handshake fails (the request is
                                   recomputed). Bounds what a peer answering from ever new
                                   engine ids can make a rank hold
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

import difflib
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from moriio_native.control.addressing import HostText, validate_host
from moriio_native.control.ports import PortPlan
from moriio_native.control.schema import Port, Schema, Size, convert, explain
from moriio_native.control.security import (
    CONFIG_LISTENER_HANDSHAKE_TIMEOUT,
    DEFAULT_LISTENER_HANDSHAKE_TIMEOUT,
    ENV_AUTH_SECRET,
    MAX_LISTENER_HANDSHAKE_TIMEOUT,
    MIN_LISTENER_HANDSHAKE_TIMEOUT,
    MIN_SECRET_BYTES,
    PeerAllowlist,
)
from moriio_native.errors import InvalidArgumentError
from moriio_native.pd.config import DEFAULT_MAX_PEERS as DEFAULT_PD_MAX_PEERS
from moriio_native.pd.config import HOLD_MARGIN_S, MAX_HOLD_TIMEOUT_S, MAX_TRANSFER_TIMEOUT_S

logger = logging.getLogger("moriio_native.vllm.config")

Mode = Literal["read", "write"]
Role = Literal["kv_producer", "kv_consumer", "kv_both"]
Backend = Literal["auto", "ucx", "mori", "loopback"]
#: A positive, finite number of seconds (at most ~30 years: PdConfig's abort and quarantine
#: bound).
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_HOLD_TIMEOUT_S)]
#: What the engine takes as transfer_timeout: at least a millisecond, at most a year.
TransferSeconds = Annotated[float, msgspec.Meta(ge=0.001, le=MAX_TRANSFER_TIMEOUT_S)]
PeerCount = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
#: Seconds between registration pings: not a busy loop (tests ping every 0.05 s), and well
#: inside the example proxy's staleness bound (30 s), so one lost ping keeps the instance routed.
PingSeconds = Annotated[float, msgspec.Meta(ge=0.01, le=15.0)]
HandshakeSeconds = Annotated[
    float, msgspec.Meta(ge=MIN_LISTENER_HANDSHAKE_TIMEOUT, le=MAX_LISTENER_HANDSHAKE_TIMEOUT)
]
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
DEFAULT_MAX_PEERS = DEFAULT_PD_MAX_PEERS
DEFAULT_READ_LOADING: ReadLoading = "async"
BACKENDS = ("auto", "ucx", "mori", "loopback")
BACKEND_OPTION_PREFIXES = ("ucx_", "mori_")
# Backend tuning keys without a prefix (vLLM's MoRIIO connector spells MoRI's this way; the UCX
# backend's progress_mode): passed through to the engine like the prefixed ones.
BACKEND_OPTION_KEYS = frozenset(
    {"qp_per_transfer", "post_batch_size", "num_workers", "poll_mode", "progress_mode"}
)

# Keys read as they are (a missing or empty value takes the field's default).
_PLAIN_KEYS = (
    "mode",
    "backend",
    "handshake_port",
    "notify_port",
    "proxy_ping_port",
    "http_port",
    "ping_interval",
    "proxy_auth",
    "transfer_timeout",
    "quarantine_timeout",
    "read_loading",
    "verify",
    "confirm_reads",
    "require_incarnation",
    "require_hold",
    "require_prompt_match",
    "max_peers",
    "accept_only_allowed_peers",
    CONFIG_LISTENER_HANDSHAKE_TIMEOUT,
)
_KNOWN_KEYS = frozenset(
    {
        *_PLAIN_KEYS,
        "read_mode",
        "host_ip",
        "bind_host",
        "proxy_ip",
        "abort_timeout",
        "defer_timeout",
        "allowed_peers",
        "auth_secret",
        "engine_options",
    }
)
# Keys of vLLM's MoRIIO connector that have no meaning here; accepted so configurations can be
# switched over unchanged, and logged once.
_IGNORED_LEGACY_KEYS = frozenset({"recv_abort_timeout"})
# Keys of vLLM's other KV connectors (P2pNccl's proxy_port and send_type, Nixl's backends, an
# early MoRIIO connector's local_ping_port) that a carried-over config may hold: ignored with a
# warning as any unknown key, never refused as a near miss of one of ours.
_OTHER_CONNECTORS_KEYS = frozenset({"proxy_port", "local_ping_port", "backends", "send_type"})
_WHAT = "kv_connector_extra_config"


def _short_secret(secret: str) -> str:
    """The refusal of a secret shorter than MIN_SECRET_BYTES (troubleshooting.md quotes it)."""
    return (
        f"{_WHAT}.auth_secret is {len(secret.encode())} bytes; use at least "
        f"{MIN_SECRET_BYTES} random bytes"
    )


def _near_miss(key: str, known: list[str]) -> str | None:
    """The known key ``key`` is a typo of, if any: the same but for case, blanks or ``-`` for
    ``_``; two neighbouring letters swapped (``mdoe``: short keys are too short for a ratio);
    or close by difflib's ratio."""
    norm = key.strip().lower().replace("-", "_")
    if norm in known or norm.startswith(BACKEND_OPTION_PREFIXES):  # UCX_TLS: ucx_tls
        return norm
    for k in known:
        if len(k) == len(norm):
            diff = [i for i in range(len(k)) if k[i] != norm[i]]
            if (
                len(diff) == 2
                and diff[1] == diff[0] + 1
                and sorted(k[diff[0] : diff[1] + 1]) == sorted(norm[diff[0] : diff[1] + 1])
            ):
                return k
    match = difflib.get_close_matches(norm, known, n=1, cutoff=0.8)
    return match[0] if match else None


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


class ConnectorConfig(Schema, frozen=True):
    """The parsed connector configuration of one instance. Immutable; safe to share.

    ``dp_size``/``tp_size`` are the instance's parallel sizes (from vLLM's ParallelConfig);
    ``ports`` validates at construction that every rank's two listener ports fit. Every field
    is bounded by its type; constructing one with a bad value raises InvalidArgumentError
    naming the key and the value.
    """

    WHAT: ClassVar[str] = _WHAT
    ERROR: ClassVar[type[Exception]] = InvalidArgumentError

    role: Role
    mode: Mode = DEFAULT_MODE
    backend: Backend = DEFAULT_BACKEND
    host_ip: HostText = "127.0.0.1"
    bind_host: HostText = "127.0.0.1"
    handshake_port: Port = DEFAULT_HANDSHAKE_PORT
    notify_port: Port = DEFAULT_NOTIFY_PORT
    proxy_ip: HostText | None = None
    proxy_ping_port: Port = DEFAULT_PROXY_PING_PORT
    http_port: Port | None = None
    ping_interval: PingSeconds = DEFAULT_PING_INTERVAL
    proxy_auth: bool = False
    transfer_timeout: TransferSeconds = DEFAULT_TRANSFER_TIMEOUT
    abort_timeout: Seconds = DEFAULT_ABORT_TIMEOUT
    quarantine_timeout: Seconds = DEFAULT_QUARANTINE_TIMEOUT
    allowed_peers: tuple[str, ...] = ()
    accept_only_allowed_peers: bool = False
    listener_handshake_timeout: HandshakeSeconds = DEFAULT_LISTENER_HANDSHAKE_TIMEOUT
    auth_secret: str | None = None
    engine_options: dict[str, str] = msgspec.field(default_factory=dict)
    dp_size: Size = 1
    tp_size: Size = 1
    read_loading: ReadLoading = DEFAULT_READ_LOADING
    verify: bool = False
    confirm_reads: bool = False
    require_incarnation: bool = True
    require_hold: bool = True
    require_prompt_match: bool = True
    max_peers: PeerCount = DEFAULT_MAX_PEERS

    def _check(self) -> None:
        for key in ("host_ip", "bind_host", "proxy_ip"):
            value = getattr(self, key)
            if value is not None and not (key == "bind_host" and value == "*"):
                value = validate_host(value, what=f"{_WHAT}.{key}")
                msgspec.structs.force_setattr(self, key, value)
                if key != "bind_host":
                    try:
                        ip = ipaddress.ip_address(value)
                    except ValueError:
                        continue
                    if ip.is_unspecified or ip.is_multicast:
                        raise ValueError(
                            f"{_WHAT}.{key} {value!r} is not an address a peer can dial (to "
                            "listen on every interface, set bind_host '*' (IPv4) or '::' "
                            "(IPv6 too))"
                        )
        if self.proxy_auth and self.auth_secret is None:
            raise ValueError(
                f"{_WHAT}.proxy_auth signs registration pings with auth_secret, and none is "
                f"set (nor ${ENV_AUTH_SECRET})"
            )
        if self.proxy_ip is not None and self.http_port is None:
            raise ValueError(
                f"{_WHAT}.http_port is required with proxy_ip (the proxy forwards requests to "
                "it): set it to this instance's `vllm serve --port`"
            )
        if self.auth_secret is not None and len(self.auth_secret.encode()) < MIN_SECRET_BYTES:
            raise ValueError(_short_secret(self.auth_secret))
        # Both raise InvalidArgumentError naming the bad value.
        PeerAllowlist(
            self.allowed_peers, accept_only=self.accept_only_allowed_peers
        ).accept_filters(ipv6=":" in self.bind_host)
        self.ports  # noqa: B018 -- validates every rank's ports now, not at bind time

    def __repr__(self) -> str:
        shown = {
            name: "<hidden>" if name == "auth_secret" and value is not None else value
            for name, value in msgspec.structs.asdict(self).items()
        }
        return f"ConnectorConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

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
        out: dict[str, Any] = {
            "allowed_peers": list(self.allowed_peers),
            "accept_only_allowed_peers": self.accept_only_allowed_peers,
            CONFIG_LISTENER_HANDSHAKE_TIMEOUT: self.listener_handshake_timeout,
        }
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
        """Parse ``kv_connector_extra_config``. Numbers and booleans may be strings (vLLM's
        command line passes them so). Raises InvalidArgumentError naming the first bad key and
        its value; unknown keys are logged (a typo must not pass silently)."""
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
            # A near miss of a known key is a typo whose key would silently stay at its default
            # (auth_secert: no authentication): refused. Others may be meant for another tool.
            known = sorted(_KNOWN_KEYS | BACKEND_OPTION_KEYS)
            typos = {k: _near_miss(k, known) for k in unknown if k not in _OTHER_CONNECTORS_KEYS}
            typos = {k: m for k, m in typos.items() if m}
            if typos:
                raise InvalidArgumentError(
                    f"unknown {_WHAT} keys: "
                    + ", ".join(f"{k!r} (did you mean {m!r}?)" for k, m in sorted(typos.items()))
                )
            logger.warning("ignoring unknown %s keys: %s", _WHAT, ", ".join(unknown))
        legacy = sorted(k for k in extra if k in _IGNORED_LEGACY_KEYS)
        if legacy:
            logger.info("%s keys without effect here: %s", _WHAT, ", ".join(legacy))

        def get(key: str) -> Any:
            value = extra.get(key)
            return None if value is None or value == "" else value

        raw: dict[str, Any] = {"role": role, "dp_size": dp_size, "tp_size": tp_size}
        raw.update({k: get(k) for k in _PLAIN_KEYS if get(k) is not None})
        if isinstance(raw.get("mode"), str):
            raw["mode"] = raw["mode"].strip().lower()
        if get("read_mode") is not None:
            raw["read_mode"] = get("read_mode")
        if isinstance(raw.get("backend"), str):
            raw["backend"] = raw["backend"].strip().lower()
        abort = get("abort_timeout") if get("abort_timeout") is not None else get("defer_timeout")
        if get("abort_timeout") is not None and get("defer_timeout") is not None:
            try:
                same = float(get("abort_timeout")) == float(get("defer_timeout"))
            except (TypeError, ValueError):
                same = False
            if not same:
                raise InvalidArgumentError(
                    f"{_WHAT}: abort_timeout {get('abort_timeout')!r} and its legacy name "
                    f"defer_timeout {get('defer_timeout')!r} disagree; set abort_timeout only"
                )
        if abort is not None:
            raw["abort_timeout"] = abort
        host = get("host_ip")
        raw["host_ip"] = (
            validate_host(host, what=f"{_WHAT}.host_ip") if host is not None else local_ip()
        )
        raw["bind_host"] = get("bind_host") if get("bind_host") is not None else raw["host_ip"]
        if get("proxy_ip") is not None:
            raw["proxy_ip"] = get("proxy_ip")
        allowed = get("allowed_peers")
        if isinstance(allowed, str):
            allowed = [p.strip() for p in allowed.split(",") if p.strip()]
        if allowed is not None:
            raw["allowed_peers"] = allowed
        secret = get("auth_secret")
        if secret is not None and not isinstance(secret, str):
            raise InvalidArgumentError(
                f"{_WHAT}.auth_secret must be a string, got {type(secret).__name__} (value not "
                "shown)"
            )
        if secret is None:
            secret = os.environ.get(ENV_AUTH_SECRET) or None
        if secret is not None:
            if len(secret.encode()) < MIN_SECRET_BYTES:  # before the checks that dump raw
                raise InvalidArgumentError(_short_secret(secret))
            raw["auth_secret"] = secret
            # A signed answer is still a bearer token: replayed after its decode released the
            # blocks (to another decode, or the same one), its READ would load whatever the
            # prefill put there since. The hold check is what refuses it, so a secret turns it
            # on unless the key says otherwise (both sides share the secret, so both turn it on).
            raw.setdefault("confirm_reads", True)
        options = get("engine_options") or {}
        if not isinstance(options, Mapping):
            raise InvalidArgumentError(
                f"{_WHAT}.engine_options must be a mapping, got {type(options).__name__}"
            )
        passed = {
            k: v
            for k, v in extra.items()
            if k.startswith(BACKEND_OPTION_PREFIXES) or k in BACKEND_OPTION_KEYS
        }
        for key, value in {**options, **passed}.items():
            if value is None or isinstance(value, (Mapping, list, tuple, set)):
                raise InvalidArgumentError(
                    f"{_WHAT}: backend option {key!r} must be a string or number, got "
                    f"{type(value).__name__}"
                )
        for key in options.keys() & passed.keys():
            if str(options[key]) != str(passed[key]):
                raise InvalidArgumentError(
                    f"{_WHAT}: backend option {key!r} is set twice, {passed[key]!r} and "
                    f"engine_options {options[key]!r}; set it once"
                )
        raw["engine_options"] = {str(k): str(v) for k, v in {**options, **passed}.items()}
        if "read_mode" in raw:
            read = raw.pop("read_mode")
            try:
                legacy = "read" if convert(read, bool, strict=False) else "write"
            except msgspec.ValidationError as exc:
                raise InvalidArgumentError(explain(f"{_WHAT}.read_mode", exc, read)) from None
            if "mode" in raw and raw["mode"] != legacy:
                raise InvalidArgumentError(
                    f"{_WHAT}: mode {raw['mode']!r} and legacy read_mode {read!r} disagree; "
                    "set mode only"
                )
            raw["mode"] = legacy
        try:
            config: ConnectorConfig = convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise InvalidArgumentError(explain(_WHAT, exc, raw)) from None
        config._warn_timeouts()
        return config

    def _warn_timeouts(self) -> None:
        """The timeouts' documented relations (docs/configuration.md), checked against this
        instance's own values (its peer's usually match): logged, since a peer may differ."""
        if (
            self.mode == "read"
            and self.is_producer
            and not (self.abort_timeout > self.transfer_timeout + HOLD_MARGIN_S)
        ):
            logger.warning(
                "%s: abort_timeout %g s is not above transfer_timeout %g s + %g s: this READ "
                "prefill holds a request's blocks abort_timeout after its answer, and a decode "
                "with this transfer_timeout reads only when its READ can end within the hold, so "
                "every READ would be recomputed",
                _WHAT,
                self.abort_timeout,
                self.transfer_timeout,
                HOLD_MARGIN_S,
            )
        if (
            self.mode == "write"
            and self.is_consumer
            and self.transfer_timeout >= self.abort_timeout
        ):
            logger.warning(
                "%s: transfer_timeout %g s is not below abort_timeout %g s: this WRITE decode "
                "gives up on a request's KV after abort_timeout, so a prefill forward longer than "
                "that is recomputed whatever transfer_timeout allows",
                _WHAT,
                self.transfer_timeout,
                self.abort_timeout,
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
