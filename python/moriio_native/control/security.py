"""Who may talk to us and whom we may dial: message authentication and the peer allowlist.

Message authentication (optional). With a shared secret configured on every instance
(``auth_secret`` in the connector config, else the environment variable
``MORIIO_NATIVE_AUTH_SECRET``), every control message between prefill and decode carries one
extra ZMQ frame: ``HMAC-SHA256(secret, b"moriio-native/control/v1\\0" + payload)``. A receiver
drops (and logs) a message whose tag is missing or wrong, compared in constant time. Without a
secret, messages are one frame, as in vLLM's MoRIIO connector. The payload itself is never
altered, so what the tag covers is exactly what the schema check reads. Replays of a valid
message are not detected here; the receivers make them harmless (duplicates are dropped,
messages for finished transfers are ignored, handshake replies echo a fresh nonce, and a
handshake server with a secret answers a request only within a minute of its ``sent_ms`` and
each nonce once: :class:`FreshStamps`).

Transport security (the same secret). With a secret, every control connection -- handshake and
notify ports, and signed proxy registrations -- is also a ZMQ CURVE connection: both ends derive
one server and one client key pair from the secret (``HMAC-SHA256(secret, domain)`` as the
Curve25519 secret key), listeners are CURVE servers and dialers CURVE clients. A CURVE client
must know the server's public key, which is never sent on the wire and only a holder of the
secret can derive, so a peer without the secret fails ZMQ's handshake and is disconnected by
ZMQ's I/O thread before it can send a single message frame: what ZMQ would otherwise queue
without bound from anyone who can connect (a multipart message that never ends, the HMAC
checked only once it is whole), and what the listeners would read and drop one by one (a flood
of forged messages), never reaches them. What such a peer can still make a listener hold is a
handshake command it never finishes (ZMQ reads one up to the socket's MAXMSGSIZE), for at most
the listener's handshake limit (``listener_handshake_timeout``, 2 s by default). The traffic is
encrypted too. Without a secret the connections are plain ZMQ, as in vLLM's MoRIIO connector.

Prefill answers (same secret). A READ-mode prefill's answer -- the ``kv_transfer_params`` the
proxy carries to the decode: transfer id, block ids, engine id -- passes through the client-facing
HTTP path, where anyone who can send a request could write one of their own. With a secret the
prefill tags it (``remote_answer_tag``: hex ``HMAC-SHA256(secret,
b"moriio-native/answer/v2\0" + the answer's canonical bytes)``), and a decode with the secret
acts only on answers whose tag matches: a forged one would have it read another request's blocks
or release them.

Proxy registrations (optional, same secret). vLLM's router knows no secret, so a registration
ping is one frame unless the sender is told to sign it (``proxy_auth: true``). A signed ping is
three frames: ``payload``, a 24-byte stamp (8-byte big-endian milliseconds since the Unix epoch, 16
random bytes) and ``HMAC-SHA256(secret, b"moriio-native/registration/v1\0" + stamp +
payload)``. A proxy with the secret (:class:`RegistrationVerifier`) accepts a ping only when the
tag matches (not forged, not another message's tag: the domain differs from the control
messages'), the stamp is within ``window_s`` of its clock (not an old capture) and the stamp
was not seen before (not a replay within the window).

Peer allowlist. Before ANY outgoing connection (handshake fetch, notify, release) the target
host must pass :meth:`PeerAllowlist.require`; refusing logs the target and raises without
opening a socket or doing a DNS lookup. A host is allowed when

* it lies in one of the configured CIDRs (``allowed_peers``; ``"*"`` allows everything and is
  logged as a warning), or equals a configured host *name* exactly; or
* it was *learned*: the source address of a peer whose handshake request we accepted (and
  authenticated, when a secret is set). Learning the real TCP source address of a peer that
  already reached us cannot point us at any third party. At most ``max_learned`` hosts are
  kept (least recently learned dropped first).

With nothing configured, only learned hosts are allowed: dialling a peer named in a request
needs ``allowed_peers`` to cover it. That is the point -- vLLM's connector dialled whatever a
request named.

Contents:

* :data:`ENV_AUTH_SECRET`, :data:`MIN_SECRET_BYTES`
* :class:`AuthenticationError`, :class:`PeerNotAllowedError`
* :class:`MessageAuth` -- ``seal(payload) -> frames``, ``open(frames) -> payload``,
  ``tag_answer`` / ``answer_tag_matches`` (prefill answers), ``seal_registration``,
  ``secure_listener(socket)`` and ``secure_dialer(socket)`` (CURVE with the secret's keys,
  before bind or connect); immutable, safe from any thread.
* :class:`TransportKeys` -- the CURVE key pairs a secret derives.
* :class:`FreshStamps` -- each stamp once, within a window of the clock; thread-safe. Used by
  :class:`RegistrationVerifier` and, for signed handshake requests, by the handshake server.
* :class:`RegistrationVerifier` -- the proxy side of signed registrations; thread-safe.
* :class:`PeerAllowlist` -- ``check``, ``require``, ``learn``; internally locked, safe from any
  thread.
* :class:`ControlSecurity` -- both, and the listeners' handshake limit, built from a config
  mapping by ``from_config``.
* :func:`listener_handshake_ms` -- a ``listener_handshake_timeout`` value checked, in ms.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from moriio_native.errors import InvalidArgumentError, MoriioError

from .addressing import validate_host

logger = logging.getLogger("moriio_native.control.security")

ENV_AUTH_SECRET = "MORIIO_NATIVE_AUTH_SECRET"
CONFIG_AUTH_SECRET = "auth_secret"
CONFIG_ALLOWED_PEERS = "allowed_peers"
CONFIG_ACCEPT_ONLY_ALLOWED = "accept_only_allowed_peers"
CONFIG_LISTENER_HANDSHAKE_TIMEOUT = "listener_handshake_timeout"
# How long a listener keeps a connection that has not finished ZMQ's handshake (ZMQ's default:
# 30 s). ZMQ reads a handshake command as it reads a message, up to MAXMSGSIZE, so a peer
# without the secret that opens a CURVE handshake and sends a huge HELLO it never finishes
# holds that much of the listener's memory, on as many connections as it opens, until this
# ends them: what it can hold is what it sends in this time. A genuine handshake takes a few
# round trips (about four with CURVE); a dialer whose handshake is cut off reconnects.
DEFAULT_LISTENER_HANDSHAKE_TIMEOUT = 2.0
# The bounds of the key: below, a loaded host's own handshakes would fail; above, ZMQ's default,
# a stalled handshake holds its memory longer than ZMQ itself would.
MIN_LISTENER_HANDSHAKE_TIMEOUT = 0.05
MAX_LISTENER_HANDSHAKE_TIMEOUT = 30.0
MIN_SECRET_BYTES = 16
TAG_BYTES = 32
STAMP_BYTES = 24
_MAC_DOMAIN = b"moriio-native/control/v1\x00"
_REGISTRATION_DOMAIN = b"moriio-native/registration/v1\x00"
_ANSWER_DOMAIN = b"moriio-native/answer/v2\x00"
_CURVE_SERVER_DOMAIN = b"moriio-native/curve-server/v1\x00"
_CURVE_CLIENT_DOMAIN = b"moriio-native/curve-client/v1\x00"

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class AuthenticationError(MoriioError, PermissionError):
    """A control message's authentication tag is missing, malformed or wrong."""


class PeerNotAllowedError(MoriioError, PermissionError):
    """A host is not in the peer allowlist; nothing was dialled."""


@dataclass(frozen=True, slots=True)
class TransportKeys:
    """The CURVE key pairs (Z85-encoded, as ZMQ takes them) that every holder of one secret
    derives alike: the server pair for listeners, the client pair for dialers."""

    # The secret keys stay out of repr (logs, tracebacks): either lets its holder pass as a
    # listener or a dialer of every instance.
    server_secret: bytes = field(repr=False)
    server_public: bytes
    client_secret: bytes = field(repr=False)
    client_public: bytes

    @classmethod
    def derive(cls, secret: bytes) -> TransportKeys:
        """The pairs of ``secret``. InvalidArgumentError when this libzmq has no CURVE."""
        if not zmq.has("curve"):
            raise InvalidArgumentError(
                f"{CONFIG_AUTH_SECRET} is set, but this libzmq ({zmq.zmq_version()}) was built "
                "without CURVE security, which a secret's connections use; install a pyzmq "
                "wheel (they bundle a libzmq with CURVE)"
            )
        server = z85.encode(hmac.new(secret, _CURVE_SERVER_DOMAIN, hashlib.sha256).digest())
        client = z85.encode(hmac.new(secret, _CURVE_CLIENT_DOMAIN, hashlib.sha256).digest())
        return cls(server, zmq.curve_public(server), client, zmq.curve_public(client))

    def listen(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not bound yet) a CURVE server with the server pair."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)

    def dial(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not connected yet) a CURVE client of the server pair's holder."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)


class MessageAuth:
    """Tags outgoing payloads and checks incoming ones with an optional shared secret, and
    secures the sockets that carry them (CURVE with the secret's :class:`TransportKeys`).

    Immutable after construction; safe to share between threads. ``MessageAuth(None)`` is the
    no-secret mode: one frame out, exactly one frame accepted, plain sockets.
    """

    __slots__ = ("_key", "_transport")

    def __init__(self, secret: bytes | str | None) -> None:
        """``secret``: at least 16 bytes (str is UTF-8 encoded), or ``None`` for no
        authentication. Raises InvalidArgumentError for a shorter or wrongly typed secret."""
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if secret is not None:
            if not isinstance(secret, bytes):
                raise InvalidArgumentError(
                    f"{CONFIG_AUTH_SECRET} must be str or bytes, got {type(secret).__name__}"
                )
            if len(secret) < MIN_SECRET_BYTES:
                raise InvalidArgumentError(
                    f"{CONFIG_AUTH_SECRET} is {len(secret)} bytes; use at least "
                    f"{MIN_SECRET_BYTES} random bytes"
                )
        self._key = secret
        self._transport = TransportKeys.derive(secret) if secret is not None else None

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None) -> MessageAuth:
        """The secret from ``config["auth_secret"]``, else ``$MORIIO_NATIVE_AUTH_SECRET``, else
        none. An empty environment variable counts as unset; an empty config value is an
        error (it is almost certainly a templating mistake)."""
        value = None if config is None else config.get(CONFIG_AUTH_SECRET)
        if value is not None:
            return cls(value)
        env = os.environ.get(ENV_AUTH_SECRET)
        return cls(env if env else None)

    @property
    def enabled(self) -> bool:
        """True when a secret is configured."""
        return self._key is not None

    def secure_listener(self, sock: zmq.Socket) -> None:
        """With a secret, make ``sock`` (before its bind) accept only CURVE clients that hold
        the secret; without one, leave it plain."""
        if self._transport is not None:
            self._transport.listen(sock)

    def secure_dialer(self, sock: zmq.Socket) -> None:
        """With a secret, make ``sock`` (before its connect) a CURVE client of listeners that
        hold the secret; without one, leave it plain."""
        if self._transport is not None:
            self._transport.dial(sock)

    def _tag(self, payload: bytes, domain: bytes = _MAC_DOMAIN) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, domain + payload, hashlib.sha256).digest()

    def seal_registration(self, payload: bytes, *, now: float | None = None) -> list[bytes]:
        """The frames of one proxy registration ping: ``[payload]`` without a secret, else
        ``[payload, stamp, tag]`` with a fresh stamp (``now``: seconds since the epoch, for
        tests). Call once per ping: a stamp is accepted once."""
        if self._key is None:
            return [payload]
        millis = int((time.time() if now is None else now) * 1000)
        stamp = millis.to_bytes(8, "big") + os.urandom(STAMP_BYTES - 8)
        return [payload, stamp, self._tag(stamp + payload, _REGISTRATION_DOMAIN)]

    def registration_stamp(self, frames: Sequence[bytes]) -> tuple[bytes, bytes | None]:
        """``(payload, stamp)`` of a registration ping whose tag is right (``stamp`` is None
        without a secret). AuthenticationError when it is unsigned, forged, or signed while no
        secret is set here. Freshness is :class:`RegistrationVerifier`'s business."""
        if self._key is None:
            if len(frames) != 1:
                raise AuthenticationError(
                    f"registration has {len(frames)} frames; no auth_secret is configured here"
                )
            return frames[0], None
        if len(frames) != 3 or len(frames[1]) != STAMP_BYTES:
            raise AuthenticationError(
                f"registration is not signed ({len(frames)} frames; expected payload, stamp, "
                "tag: is auth_secret set on the instance and proxy_auth on?)"
            )
        payload, stamp, tag = frames
        if not hmac.compare_digest(self._tag(stamp + payload, _REGISTRATION_DOMAIN), tag):
            raise AuthenticationError("registration tag does not match (wrong secret or forged)")
        return payload, stamp

    def tag_answer(self, answer: bytes) -> str:
        """The hex tag of a prefill's answer (``answer``: its canonical bytes); needs a
        secret."""
        return self._tag(answer, _ANSWER_DOMAIN).hex()

    def answer_tag_matches(self, answer: bytes, tag: str | None) -> bool:
        """Whether ``tag`` is this secret's tag of ``answer`` (False when it is missing);
        compared in constant time. Needs a secret."""
        return tag is not None and hmac.compare_digest(self.tag_answer(answer), tag)

    def seal(self, payload: bytes) -> list[bytes]:
        """The frames to send for ``payload``: ``[payload]`` or ``[payload, tag]``."""
        if self._key is None:
            return [payload]
        return [payload, self._tag(payload)]

    def open(self, frames: Sequence[bytes]) -> bytes:
        """The payload of ``frames`` (identity and delimiter frames already removed).

        Raises AuthenticationError when a secret is set and the tag is missing or wrong, or
        when no secret is set but the sender tagged its message (the two ends disagree on
        configuration -- say so rather than fail on the schema).
        """
        if self._key is None:
            if len(frames) == 2 and len(frames[1]) == TAG_BYTES:
                raise AuthenticationError(
                    "message carries an authentication tag but no auth_secret is configured here"
                )
            if len(frames) != 1:
                raise AuthenticationError(f"expected 1 frame, got {len(frames)}")
            return frames[0]
        if len(frames) != 2:
            raise AuthenticationError(
                f"expected payload and authentication tag (2 frames), got {len(frames)} "
                "(is auth_secret configured on the sender?)"
            )
        payload, tag = frames
        if not hmac.compare_digest(self._tag(payload), tag):
            raise AuthenticationError("authentication tag does not match (wrong or forged)")
        return payload


class FreshStamps:
    """Accepts each stamp once, and only within ``window_s`` of this side's clock: an old
    capture is refused as stale, a replay within the window as seen before. Signed messages
    carry the stamp (a send time and random bytes), so it cannot be changed without the secret.

    Remembers the stamps of the last ``window_s`` seconds (at most ``max_stamps``; when that
    many unexpired stamps are held, new ones are refused rather than a remembered stamp
    forgotten, so a replay can never slip through). Thread-safe (one lock).
    """

    def __init__(
        self,
        what: str,
        *,
        window_s: float = 60.0,
        max_stamps: int = 65536,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``what``: the messages stamped (``"registration"``), for the errors' text;
        ``clock``: seconds since the Unix epoch."""
        if not window_s > 0 or max_stamps < 1:
            raise InvalidArgumentError("window_s must be > 0 and max_stamps >= 1")
        self._what = what
        self._window_ms = int(window_s * 1000)
        self._max_stamps = max_stamps
        self._clock = clock
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def accept(self, sent_ms: int, stamp: bytes) -> None:
        """Accept ``stamp``, sent at ``sent_ms`` (milliseconds since the Unix epoch), or raise
        AuthenticationError naming why not (stale, from the future, replayed, too many)."""
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - sent_ms) > self._window_ms:
            raise AuthenticationError(
                f"{self._what} stamp is {(now_ms - sent_ms) / 1000:.1f}s old; accepted within "
                f"{self._window_ms / 1000:.0f}s (replayed capture, or clocks apart)"
            )
        with self._lock:
            # Each stamp is remembered until it would be refused as stale anyway.
            while self._seen and next(iter(self._seen.values())) < now_ms:
                self._seen.popitem(last=False)
            if stamp in self._seen:
                raise AuthenticationError(f"{self._what} replayed (its stamp was used before)")
            if len(self._seen) >= self._max_stamps:
                # Stamps expire in the order of their send times, not of their arrival: one
                # sent ahead of this clock, at the head, hides expired ones behind it.
                self._seen = OrderedDict((s, u) for s, u in self._seen.items() if u >= now_ms)
            if len(self._seen) >= self._max_stamps:
                raise AuthenticationError(
                    f"more than {self._max_stamps} {self._what}s within the window; refused"
                )
            self._seen[stamp] = sent_ms + self._window_ms


class RegistrationVerifier:
    """Checks signed proxy registrations: tag, freshness and first use of each stamp
    (:class:`FreshStamps`). Thread-safe.
    """

    def __init__(
        self,
        auth: MessageAuth,
        *,
        window_s: float = 60.0,
        max_stamps: int = 65536,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._auth = auth
        self._stamps = FreshStamps(
            "registration", window_s=window_s, max_stamps=max_stamps, clock=clock
        )

    @property
    def enabled(self) -> bool:
        """True when registrations must be signed (a secret is configured)."""
        return self._auth.enabled

    def secure_listener(self, sock: zmq.Socket) -> None:
        """With a secret, make the registration socket (before its bind) a CURVE server, as
        signing pingers dial it (:meth:`MessageAuth.secure_listener`)."""
        self._auth.secure_listener(sock)

    def open(self, frames: Sequence[bytes]) -> bytes:
        """The payload of an accepted registration; AuthenticationError naming why it was
        refused (unsigned, forged, stale, from the future, replayed)."""
        payload, stamp = self._auth.registration_stamp(frames)
        if stamp is not None:
            self._stamps.accept(int.from_bytes(stamp[:8], "big"), stamp)
        return payload


def _ip_or_none(host: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class PeerAllowlist:
    """Configured CIDRs and host names plus hosts learned from accepted handshakes.

    All methods are thread-safe (one internal lock); none blocks on the network.
    """

    def __init__(
        self, allowed: Iterable[str] = (), *, max_learned: int = 4096, accept_only: bool = False
    ) -> None:
        """``allowed``: CIDRs (``10.0.0.0/16``), single addresses, exact host names, or ``"*"``
        for everything. ``accept_only``: the listeners also accept connections only from the
        configured addresses (:meth:`accept_filters`), which must then be CIDRs or addresses,
        at least one and not ``"*"``. Raises InvalidArgumentError naming the first bad entry."""
        if isinstance(allowed, str):
            raise InvalidArgumentError(f"{CONFIG_ALLOWED_PEERS} must be a list of strings")
        if max_learned < 0:
            raise InvalidArgumentError("max_learned must be >= 0")
        networks: list[IpNetwork] = []
        names: set[str] = set()
        everyone = False
        for entry in allowed:
            if not isinstance(entry, str) or not entry.strip():
                raise InvalidArgumentError(
                    f"{CONFIG_ALLOWED_PEERS} entry {entry!r} is not a non-empty string"
                )
            text = entry.strip()
            if text == "*":
                logger.warning(
                    "%s contains '*': any peer named in a request may be dialled",
                    CONFIG_ALLOWED_PEERS,
                )
                networks += [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
                everyone = True
                continue
            network = _network_or_none(text)
            if network is not None:
                networks.append(_unmapped(network))
                continue
            try:
                names.add(validate_host(text, what=f"{CONFIG_ALLOWED_PEERS} entry"))
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"{CONFIG_ALLOWED_PEERS} entry {text!r} is neither a CIDR, an IP address "
                    "nor a host name"
                ) from exc
        self._networks: tuple[IpNetwork, ...] = tuple(networks)
        self._names = frozenset(names)
        self._everyone = everyone  # "*": host names too
        if accept_only:
            _check_accept_filters(networks, names, everyone)
        self._accept_only = accept_only
        self._learned: OrderedDict[IpAddress, None] = OrderedDict()
        self._max_learned = max_learned
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None) -> PeerAllowlist:
        """From ``config["allowed_peers"]``: a list of strings or one comma-separated string."""
        value = None if config is None else config.get(CONFIG_ALLOWED_PEERS)
        if value is None:
            value = []
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise InvalidArgumentError(
                f"{CONFIG_ALLOWED_PEERS} must be a list or a comma-separated string, "
                f"got {type(value).__name__}"
            )
        accept_only = False if config is None else config.get(CONFIG_ACCEPT_ONLY_ALLOWED, False)
        if not isinstance(accept_only, bool):
            raise InvalidArgumentError(
                f"{CONFIG_ACCEPT_ONLY_ALLOWED} must be true or false, got {accept_only!r}"
            )
        return cls(value, accept_only=accept_only)

    def accept_filters(self, *, ipv6: bool) -> tuple[str, ...]:
        """The networks a listener accepts TCP connections from (ZMQ's accept filter), as
        ``address/prefix`` strings; empty: from anyone (``accept_only`` off). ``ipv6``: for a
        listener on an IPv6 address, which sees an IPv4 peer as an IPv4-mapped address: an
        IPv4 network is given as its mapped network (ZMQ would apply its prefix to all 128
        bits), an IPv6 network without the mapped range (``::/0`` would let every IPv4 peer in,
        which :meth:`check` refuses); on an IPv4 one, IPv6 networks cannot match and are left
        out. Raises InvalidArgumentError, naming the key, when no network is left for that
        listener."""
        if not self._accept_only:
            return ()
        if ipv6:
            filters = tuple(
                text for network in self._networks for text in _ipv6_listener_filters(network)
            )
        else:
            filters = tuple(str(network) for network in self._networks if network.version == 4)
        if not filters:  # only IPv6 networks, on an IPv4 listener (an IPv6 one takes both)
            raise InvalidArgumentError(
                f"{CONFIG_ACCEPT_ONLY_ALLOWED}: {CONFIG_ALLOWED_PEERS} holds only IPv6 networks, "
                "and this listener is on an IPv4 address: no peer could connect to it"
            )
        return filters

    def learn(self, host: str) -> bool:
        """Allow ``host`` (an IP literal: the source address of an accepted handshake) from now
        on. Returns False (and learns nothing) when it is not an IP literal."""
        ip = _ip_or_none(host.strip("[]")) if isinstance(host, str) else None
        if ip is None or self._max_learned == 0:
            return False
        with self._lock:
            self._learned[ip] = None
            self._learned.move_to_end(ip)
            while len(self._learned) > self._max_learned:
                self._learned.popitem(last=False)
        return True

    def check(self, host: str) -> bool:
        """Whether ``host`` may be dialled. Never raises for odd input (it is just not allowed)
        and never resolves names."""
        try:
            normalized = validate_host(host)
        except InvalidArgumentError:
            return False
        ip = _ip_or_none(normalized)
        if ip is None:
            return self._everyone or normalized in self._names
        if any(ip.version == net.version and ip in net for net in self._networks):
            return True
        with self._lock:
            return ip in self._learned

    def require(self, host: str, *, purpose: str) -> str:
        """``host`` normalized (canonical IP / lower-case name), or PeerNotAllowedError.

        ``purpose`` (e.g. ``"release to 10.0.0.7:61005"``) goes into the log line and the
        error. Call this before creating any socket toward ``host``.
        """
        if not self.check(host):
            logger.warning("refusing to connect for %s: peer %r is not allowed", purpose, host)
            raise PeerNotAllowedError(
                f"peer {host!r} is not in the allowlist ({purpose}); add it or its subnet to "
                f"'{CONFIG_ALLOWED_PEERS}', or let it handshake with us first"
            )
        return validate_host(host)

    def describe(self) -> str:
        """A one-line summary for logs (no learned hosts listed)."""
        with self._lock:
            n_learned = len(self._learned)
        nets = ", ".join(str(n) for n in self._networks) or "none"
        return f"networks: {nets}; names: {len(self._names)}; learned hosts: {n_learned}"


def _check_accept_filters(networks: list[IpNetwork], names: set[str], everyone: bool) -> None:
    """InvalidArgumentError when ``networks`` cannot stand for the allowlist as accept filters:
    with a name (a TCP accept sees addresses, and names are never resolved here), ``"*"``
    (``everyone``: no filter at all) or nothing (nobody could connect)."""
    if names:
        raise InvalidArgumentError(
            f"{CONFIG_ACCEPT_ONLY_ALLOWED} needs {CONFIG_ALLOWED_PEERS} as CIDRs or addresses: "
            f"{sorted(names)[0]!r} is a host name, and a connection is accepted by its address"
        )
    if everyone:
        raise InvalidArgumentError(
            f"{CONFIG_ACCEPT_ONLY_ALLOWED} with '*' in {CONFIG_ALLOWED_PEERS} accepts everyone: "
            "name the networks to accept, or turn it off"
        )
    if not networks:
        raise InvalidArgumentError(
            f"{CONFIG_ACCEPT_ONLY_ALLOWED} needs {CONFIG_ALLOWED_PEERS}: without it no peer "
            "could connect"
        )


def _mapped(network: ipaddress.IPv4Network) -> str:
    """``network`` as the IPv4-mapped IPv6 network an IPv6 listener sees its peers in."""
    return f"::ffff:{network.network_address}/{96 + network.prefixlen}"


# Where an IPv6 listener sees its IPv4 peers.
_IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def _network_or_none(text: str) -> IpNetwork | None:
    """``text`` as a network (an address alone: its own /32 or /128), None when it is none (a
    host name). InvalidArgumentError for a CIDR with host bits set ("10.1.2.3/8"): read as its
    network it would allow far more than the one host it names, so which was meant is asked."""
    try:
        return ipaddress.ip_network(text)
    except ValueError:
        pass
    try:
        widened = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None
    host = text.split("/", 1)[0]  # only a prefix length can set host bits
    raise InvalidArgumentError(
        f"{CONFIG_ALLOWED_PEERS} entry {text!r} has host bits set: write the network "
        f"({widened}) or the host alone ({host})"
    )


def _unmapped(network: IpNetwork) -> IpNetwork:
    """``network`` as IPv4 when it lies in the IPv4-mapped range (``::ffff:10.0.0.5``, how an
    IPv6 listener shows an IPv4 peer): :meth:`PeerAllowlist.check` judges such a peer by the
    IPv4 networks, so it would match no entry otherwise."""
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_IPV4_MAPPED):
        mapped = network.network_address.ipv4_mapped
        assert mapped is not None  # inside the mapped range
        return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


def _ipv6_listener_filters(network: IpNetwork) -> list[str]:
    """The accept filters that stand for ``network`` on an IPv6 listener: an IPv4 network
    mapped; an IPv6 network (never inside the IPv4-mapped range: :func:`_unmapped`) less that
    range, since :meth:`PeerAllowlist.check` judges an IPv4-mapped peer by the IPv4 networks
    alone."""
    if isinstance(network, ipaddress.IPv4Network):
        return [_mapped(network)]
    if network.supernet_of(_IPV4_MAPPED):
        return [str(part) for part in network.address_exclude(_IPV4_MAPPED)]
    return [str(network)]


def listener_handshake_ms(seconds: Any) -> int:
    """A ``listener_handshake_timeout`` (seconds, a number or its text) as ZMQ's HANDSHAKE_IVL in
    milliseconds. Raises InvalidArgumentError naming the key and the value when it is not a
    number within its bounds."""
    what = (
        f"{CONFIG_LISTENER_HANDSHAKE_TIMEOUT} must be a number of seconds from "
        f"{MIN_LISTENER_HANDSHAKE_TIMEOUT} to {MAX_LISTENER_HANDSHAKE_TIMEOUT}, got {seconds!r}"
    )
    if isinstance(seconds, bool):
        raise InvalidArgumentError(what)
    try:
        value = float(seconds)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond any float
        raise InvalidArgumentError(what) from None
    if not MIN_LISTENER_HANDSHAKE_TIMEOUT <= value <= MAX_LISTENER_HANDSHAKE_TIMEOUT:
        raise InvalidArgumentError(what)  # NaN fails this too
    return round(value * 1000)


DEFAULT_LISTENER_HANDSHAKE_MS = listener_handshake_ms(DEFAULT_LISTENER_HANDSHAKE_TIMEOUT)


@dataclass(frozen=True, slots=True)
class ControlSecurity:
    """The authentication mode and the allowlist one worker uses for all its channels, and how
    long its listeners give a connection to finish ZMQ's handshake."""

    auth: MessageAuth
    allowlist: PeerAllowlist
    listener_handshake_ms: int = DEFAULT_LISTENER_HANDSHAKE_MS

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None) -> ControlSecurity:
        """From a connector config mapping (``auth_secret``, ``allowed_peers``,
        ``accept_only_allowed_peers``, ``listener_handshake_timeout``) and the environment.
        Raises InvalidArgumentError for a bad value."""
        limit = None if config is None else config.get(CONFIG_LISTENER_HANDSHAKE_TIMEOUT)
        return cls(
            MessageAuth.from_config(config),
            PeerAllowlist.from_config(config),
            DEFAULT_LISTENER_HANDSHAKE_MS if limit is None else listener_handshake_ms(limit),
        )

    def limit_handshakes(self, sock: zmq.Socket) -> None:
        """Makes listening ``sock`` end a connection that has not finished ZMQ's handshake
        within the limit (before bind)."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, self.listener_handshake_ms)


__all__ = [
    "CONFIG_ACCEPT_ONLY_ALLOWED",
    "CONFIG_ALLOWED_PEERS",
    "CONFIG_AUTH_SECRET",
    "CONFIG_LISTENER_HANDSHAKE_TIMEOUT",
    "DEFAULT_LISTENER_HANDSHAKE_MS",
    "DEFAULT_LISTENER_HANDSHAKE_TIMEOUT",
    "ENV_AUTH_SECRET",
    "MIN_SECRET_BYTES",
    "AuthenticationError",
    "ControlSecurity",
    "FreshStamps",
    "MessageAuth",
    "PeerAllowlist",
    "PeerNotAllowedError",
    "RegistrationVerifier",
    "TransportKeys",
    "listener_handshake_ms",
]
