"""Control-plane messages: typed, immutable, msgpack on the wire, strictly checked on receipt.

Every message is a msgpack map with a string ``"type"``. Decoding refuses -- with
:class:`InvalidMessageError` naming the message type and field -- anything that is not
msgpack, is larger than the channel's bound, has trailing bytes, is not a map, has an unknown
``type``, lacks a required key, carries a key the schema does not know, or has a value of the
wrong type or out of range. No pickle, no msgpack extension types. Constructors run the same
checks, so an invalid message can be neither built nor sent.

Notify channel (fire-and-forget, DEALER -> ROUTER), field names as vLLM's MoRIIO connector:

===================== ========== ==============================================================
type                  direction  fields (wire name)
===================== ========== ==============================================================
``remote_blocks``     D -> P     ``transfer_id``, ``block_notify_list`` (ints, or one int list
                      (WRITE)    per KV group), ``decode_rank``, ``decode_engine_id``, ``req_id``
``write_done``        P -> D     ``transfer_id``, ``writer_rank``, ``num_writers``
``write_failed``      P -> D     ``transfer_id``, ``writer_rank``, ``reason``
``release``           D -> P     ``transfer_id``, ``consumer_tp_size``, ``consumer_tp_rank``
                      (READ)
``abort_write``       D -> P     ``transfer_id``, ``decode_engine_id``, ``decode_host``,
                      (WRITE)    ``decode_handshake_port``, ``decode_notify_port``,
                                 ``decode_dp_rank``: D gave up on the transfer; P stops
                                 writing it and acknowledges once drained
``write_aborted``     P -> D     ``transfer_id``, ``writer_rank``: nothing of the transfer can
                      (WRITE)    write D's blocks any more (the ack of ``abort_write``)
===================== ========== ==============================================================

Handshake channel (request/reply, DEALER <-> ROUTER): ``handshake_request`` (protocol version,
requester engine id, a fresh nonce) answered by ``handshake_response`` (our native engine
metadata as opaque bytes, engine id, dp/tp rank and size, transfer mode, the nonce echoed) or
``handshake_rejected`` (reason, nonce).

Proxy registration (DEALER -> the router's ROUTER, exactly vLLM's format):
``{"type": "P"|"D", "http_address": "ip:port", "zmq_address": "host:..,handshake:..,notify:..",
"dp_size": n, "tp_size": n, "transfer_mode": "READ"|"WRITE"}``.

Contents (all values immutable; functions pure and thread-safe):

* :class:`InvalidMessageError`
* notify messages :class:`RemoteBlocks`, :class:`WriteDone`, :class:`WriteFailed`,
  :class:`Release`, :class:`AbortWrite`, :class:`WriteAborted` (union :data:`NotifyMessage`,
  tuple :data:`NOTIFY_TYPES`)
* :class:`HandshakeRequest`, :class:`HandshakeResponse`, :class:`HandshakeRejected`
* :class:`ProxyRegistration`
* :func:`encode` (message -> bytes), :func:`decode` (bytes -> one of the accepted classes)
* size bounds ``MAX_*_BYTES`` and :data:`PROTOCOL_VERSION`
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from moriio_native.errors import InvalidArgumentError

from .addressing import (
    MAX_PARALLEL_SIZE,
    MAX_REQUEST_ID_LEN,
    ZmqAddress,
    block_ids_to_wire,
    validate_block_ids,
    validate_host,
    validate_id,
    validate_port,
)

PROTOCOL_VERSION = 1

MAX_NOTIFY_BYTES = 8 << 20
MAX_HANDSHAKE_REQUEST_BYTES = 4 << 10
MAX_HANDSHAKE_RESPONSE_BYTES = 64 << 20
MAX_PING_BYTES = 4 << 10
MAX_REASON_LEN = 1024
NONCE_BYTES = 16
TRANSFER_MODES = ("READ", "WRITE")


class InvalidMessageError(InvalidArgumentError):
    """A control message failed its schema check (or could not be decoded at all)."""


def _fail(msg_type: str, text: str) -> InvalidMessageError:
    return InvalidMessageError(f"{msg_type} message: {text}")


def _check_int(msg_type: str, name: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(msg_type, f"'{name}' must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise _fail(msg_type, f"'{name}' = {value} is outside {lo}..{hi}")
    return value


def _check_id(msg_type: str, name: str, value: Any, max_len: int = 256) -> str:
    try:
        return validate_id(value, what=f"'{name}'", max_len=max_len)
    except InvalidArgumentError as exc:
        raise _fail(msg_type, str(exc)) from None


def _check_text(msg_type: str, name: str, value: Any, max_len: int) -> str:
    """Like _check_id but may be empty."""
    if value == "":
        return value
    return _check_id(msg_type, name, value, max_len)


def _check_bytes(msg_type: str, name: str, value: Any, lo: int, hi: int) -> bytes:
    if not isinstance(value, bytes):
        raise _fail(msg_type, f"'{name}' must be bytes, got {type(value).__name__}")
    if not lo <= len(value) <= hi:
        raise _fail(msg_type, f"'{name}' is {len(value)} bytes, expected {lo}..{hi}")
    return value


def _check_choice(msg_type: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices or not isinstance(value, str):
        raise _fail(msg_type, f"'{name}' = {value!r} is not one of {', '.join(choices)}")
    return value


# ---- notify messages --------------------------------------------------------------------------


_P = TypeVar("_P", bound="_PlainWire")


class _PlainWire:
    """Wire form of a message whose wire keys are its field names (RemoteBlocks and
    ProxyRegistration spell theirs out). A field with a default may be left out on the wire
    unless the class sets ``_EVERY_KEY_REQUIRED`` (handshakes always carry every key)."""

    __slots__ = ()
    TYPE: ClassVar[str]
    _EVERY_KEY_REQUIRED: ClassVar[bool] = False

    def to_wire(self) -> dict[str, Any]:
        names = (f.name for f in fields(self))  # type: ignore[arg-type]
        return {"type": self.TYPE, **{name: getattr(self, name) for name in names}}

    @classmethod
    def from_wire(cls: type[_P], d: Mapping[str, Any]) -> _P:
        names = (f.name for f in fields(cls))  # type: ignore[arg-type]
        return cls(**{name: d[name] for name in names if name in d})

    @classmethod
    def wire_keys(cls) -> tuple[frozenset[str], frozenset[str]]:
        """(required, optional) wire keys besides ``type``."""
        every = fields(cls)  # type: ignore[arg-type]
        optional = frozenset(
            f.name
            for f in every
            if not cls._EVERY_KEY_REQUIRED
            and (f.default is not MISSING or f.default_factory is not MISSING)
        )
        return frozenset(f.name for f in every) - optional, optional


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """D -> P (WRITE mode): the decode blocks P must write ``transfer_id`` into.

    ``block_ids`` holds one tuple per KV-cache group (one group unless the model mixes
    attention types). ``decode_dp_rank`` is the decode DP rank owning the request; P derives
    the ``write_done`` port from it. An empty group is schema-valid (nothing to write);
    deciding what that means is the receiver's business.
    """

    TYPE: ClassVar[str] = "remote_blocks"
    transfer_id: str
    block_ids: tuple[tuple[int, ...], ...]
    decode_engine_id: str
    decode_dp_rank: int = 0
    req_id: str = ""

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "transfer_id", self.transfer_id)
        try:
            groups = validate_block_ids(self.block_ids, what="'block_notify_list'")
        except InvalidArgumentError as exc:
            raise _fail(self.TYPE, str(exc)) from None
        object.__setattr__(self, "block_ids", groups)
        _check_id(self.TYPE, "decode_engine_id", self.decode_engine_id)
        _check_int(self.TYPE, "decode_rank", self.decode_dp_rank, 0, MAX_PARALLEL_SIZE - 1)
        _check_text(self.TYPE, "req_id", self.req_id, MAX_REQUEST_ID_LEN)

    @property
    def dedup_key(self) -> tuple[str, ...]:
        """Equal for copies of the same notification (one allocation per transfer)."""
        return (self.TYPE, self.transfer_id)

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "transfer_id": self.transfer_id,
            "block_notify_list": block_ids_to_wire(self.block_ids),
            "decode_rank": self.decode_dp_rank,
            "decode_engine_id": self.decode_engine_id,
            "req_id": self.req_id,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RemoteBlocks:
        return cls(
            transfer_id=d["transfer_id"],
            block_ids=d["block_notify_list"],
            decode_engine_id=d["decode_engine_id"],
            decode_dp_rank=d.get("decode_rank", 0),
            req_id=d.get("req_id", ""),
        )

    @classmethod
    def wire_keys(cls) -> tuple[frozenset[str], frozenset[str]]:
        """(required, optional) wire keys besides ``type``."""
        required = frozenset({"transfer_id", "block_notify_list", "decode_engine_id"})
        return required, frozenset({"decode_rank", "req_id"})


@dataclass(frozen=True, slots=True)
class WriteDone(_PlainWire):
    """P -> D (WRITE mode): writer ``writer_rank`` finished all writes of ``transfer_id``.

    D has the KV once ``num_writers`` distinct writers reported (several prefill TP ranks may
    write into one decode rank).
    """

    TYPE: ClassVar[str] = "write_done"
    transfer_id: str
    writer_rank: int = 0
    num_writers: int = 1

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "transfer_id", self.transfer_id)
        _check_int(self.TYPE, "writer_rank", self.writer_rank, 0, MAX_PARALLEL_SIZE - 1)
        _check_int(self.TYPE, "num_writers", self.num_writers, 1, MAX_PARALLEL_SIZE)

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id, str(self.writer_rank))


@dataclass(frozen=True, slots=True)
class WriteFailed(_PlainWire):
    """P -> D (WRITE mode): writer ``writer_rank`` gave up on ``transfer_id`` (``reason`` says
    why), so D fails the request now instead of waiting for its timeout."""

    TYPE: ClassVar[str] = "write_failed"
    transfer_id: str
    writer_rank: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "transfer_id", self.transfer_id)
        _check_int(self.TYPE, "writer_rank", self.writer_rank, 0, MAX_PARALLEL_SIZE - 1)
        _check_text(self.TYPE, "reason", self.reason, MAX_REASON_LEN)

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id, str(self.writer_rank))


@dataclass(frozen=True, slots=True)
class Release(_PlainWire):
    """D -> P: P may free the blocks of ``transfer_id`` (READ finished or failed, or a WRITE
    request ended before D allocated). One per consumer rank that read from this producer
    rank; ``consumer_tp_size`` lets P count the fan-in (see vLLM's expected-ack rule)."""

    TYPE: ClassVar[str] = "release"
    transfer_id: str
    consumer_tp_size: int = 1
    consumer_tp_rank: int = 0

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "transfer_id", self.transfer_id)
        _check_int(self.TYPE, "consumer_tp_size", self.consumer_tp_size, 1, MAX_PARALLEL_SIZE)
        _check_int(
            self.TYPE, "consumer_tp_rank", self.consumer_tp_rank, 0, self.consumer_tp_size - 1
        )

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id, str(self.consumer_tp_rank))


@dataclass(frozen=True, slots=True)
class AbortWrite(_PlainWire):
    """D -> P (WRITE mode): D gave up on ``transfer_id`` (timeout or abort) and keeps its blocks
    quarantined until P answers :class:`WriteAborted`: P stops the transfer and answers once
    none of its writes can land any more. ``decode_engine_id`` names the decode rank, so P
    answers the handshaken peer, never an address from a message."""

    TYPE: ClassVar[str] = "abort_write"
    transfer_id: str
    decode_engine_id: str
    decode_host: str
    decode_handshake_port: int
    decode_notify_port: int
    decode_dp_rank: int = 0

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "transfer_id", self.transfer_id)
        _check_id(self.TYPE, "decode_engine_id", self.decode_engine_id)
        try:
            object.__setattr__(self, "decode_host", validate_host(self.decode_host))
        except InvalidArgumentError as exc:
            raise _fail(self.TYPE, str(exc)) from None
        _check_int(self.TYPE, "decode_handshake_port", self.decode_handshake_port, 1, 65535)
        _check_int(self.TYPE, "decode_notify_port", self.decode_notify_port, 1, 65535)
        _check_int(self.TYPE, "decode_dp_rank", self.decode_dp_rank, 0, MAX_PARALLEL_SIZE - 1)

    @property
    def decode_address(self) -> ZmqAddress:
        """The decode instance's base ports: P handshakes it (allowlist and engine id checked)
        when it has no handshake with that rank yet."""
        return ZmqAddress(self.decode_host, self.decode_handshake_port, self.decode_notify_port)

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id)


@dataclass(frozen=True, slots=True)
class WriteAborted(_PlainWire):
    """P -> D (WRITE mode): writer ``writer_rank`` stopped ``transfer_id`` and none of its
    writes can land any more; D may free (recompute) the blocks."""

    TYPE: ClassVar[str] = "write_aborted"
    transfer_id: str
    writer_rank: int = 0

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "transfer_id", self.transfer_id)
        _check_int(self.TYPE, "writer_rank", self.writer_rank, 0, MAX_PARALLEL_SIZE - 1)

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id, str(self.writer_rank))


NotifyMessage = RemoteBlocks | WriteDone | WriteFailed | Release | AbortWrite | WriteAborted
NOTIFY_TYPES: tuple[type[NotifyMessage], ...] = (
    RemoteBlocks,
    WriteDone,
    WriteFailed,
    Release,
    AbortWrite,
    WriteAborted,
)

# ---- handshake --------------------------------------------------------------------------------


def new_nonce() -> bytes:
    """A fresh random handshake nonce."""
    return os.urandom(NONCE_BYTES)


@dataclass(frozen=True, slots=True)
class HandshakeRequest(_PlainWire):
    """Asks a worker for its engine metadata. ``nonce`` must come back in the reply, which
    binds the reply to this request (a replayed reply is refused)."""

    TYPE: ClassVar[str] = "handshake_request"
    _EVERY_KEY_REQUIRED: ClassVar[bool] = True
    requester_engine_id: str
    nonce: bytes = field(default_factory=new_nonce)
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "requester_engine_id", self.requester_engine_id)
        _check_bytes(self.TYPE, "nonce", self.nonce, NONCE_BYTES, 64)
        _check_int(self.TYPE, "protocol_version", self.protocol_version, 1, 1 << 16)


@dataclass(frozen=True, slots=True)
class HandshakeResponse(_PlainWire):
    """A worker's answer: its native engine metadata (opaque bytes, produced and checked by
    the native engine) and where it sits in its instance.

    A provider builds one with ``nonce=b""``; the server fills in the request's nonce.
    """

    TYPE: ClassVar[str] = "handshake_response"
    _EVERY_KEY_REQUIRED: ClassVar[bool] = True
    engine_id: str
    engine_metadata: bytes
    dp_rank: int = 0
    tp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str = "READ"
    nonce: bytes = b""
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "engine_id", self.engine_id)
        _check_bytes(
            self.TYPE, "engine_metadata", self.engine_metadata, 0, MAX_HANDSHAKE_RESPONSE_BYTES
        )
        _check_int(self.TYPE, "dp_size", self.dp_size, 1, MAX_PARALLEL_SIZE)
        _check_int(self.TYPE, "tp_size", self.tp_size, 1, MAX_PARALLEL_SIZE)
        _check_int(self.TYPE, "dp_rank", self.dp_rank, 0, self.dp_size - 1)
        _check_int(self.TYPE, "tp_rank", self.tp_rank, 0, self.tp_size - 1)
        _check_choice(self.TYPE, "transfer_mode", self.transfer_mode, TRANSFER_MODES)
        _check_bytes(self.TYPE, "nonce", self.nonce, 0, 64)
        _check_int(self.TYPE, "protocol_version", self.protocol_version, 1, 1 << 16)


@dataclass(frozen=True, slots=True)
class HandshakeRejected(_PlainWire):
    """The server understood the request but cannot answer (e.g. KV caches not registered
    yet, incompatible protocol version); ``reason`` says why."""

    TYPE: ClassVar[str] = "handshake_rejected"
    _EVERY_KEY_REQUIRED: ClassVar[bool] = True
    reason: str
    nonce: bytes = b""

    def __post_init__(self) -> None:
        _check_id(self.TYPE, "reason", self.reason, MAX_REASON_LEN)
        _check_bytes(self.TYPE, "nonce", self.nonce, 0, 64)


# ---- proxy registration -----------------------------------------------------------------------


def _check_http_address(value: Any) -> str:
    if not isinstance(value, str) or ":" not in value or len(value) > 300:
        raise _fail("proxy registration", f"'http_address' {value!r} is not 'host:port'")
    host, _, port = value.rpartition(":")
    try:
        validate_host(host, what="http_address host")
        validate_port(port, what="http_address port")
    except InvalidArgumentError as exc:
        raise _fail("proxy registration", str(exc)) from None
    return value


@dataclass(frozen=True, slots=True)
class ProxyRegistration:
    """The registration a worker sends to vLLM's MoRIIO proxy/router every few seconds.

    ``role`` is ``"P"`` or ``"D"`` (the wire ``type``); ``zmq_address`` advertises the
    instance's *base* handshake and notify ports (see :mod:`.ports`).
    """

    TYPE: ClassVar[str] = "P|D"
    role: str
    http_address: str
    zmq_address: ZmqAddress
    dp_size: int
    tp_size: int
    transfer_mode: str

    def __post_init__(self) -> None:
        what = "proxy registration"
        _check_choice(what, "type", self.role, ("P", "D"))
        _check_http_address(self.http_address)
        if not isinstance(self.zmq_address, ZmqAddress):
            raise _fail(what, "'zmq_address' must be a ZmqAddress")
        _check_int(what, "dp_size", self.dp_size, 1, MAX_PARALLEL_SIZE)
        _check_int(what, "tp_size", self.tp_size, 1, MAX_PARALLEL_SIZE)
        _check_choice(what, "transfer_mode", self.transfer_mode, TRANSFER_MODES)

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.role,
            "http_address": self.http_address,
            "zmq_address": self.zmq_address.format(),
            "dp_size": self.dp_size,
            "tp_size": self.tp_size,
            "transfer_mode": self.transfer_mode,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> ProxyRegistration:
        try:
            zmq_address = ZmqAddress.parse(d["zmq_address"])
        except InvalidArgumentError as exc:
            raise _fail("proxy registration", str(exc)) from None
        return cls(
            role=d["type"],
            http_address=d["http_address"],
            zmq_address=zmq_address,
            dp_size=d["dp_size"],
            tp_size=d["tp_size"],
            transfer_mode=d["transfer_mode"],
        )

    @classmethod
    def wire_keys(cls) -> tuple[frozenset[str], frozenset[str]]:
        """(required, optional) wire keys besides ``type``."""
        required = frozenset({"http_address", "zmq_address", "dp_size", "tp_size", "transfer_mode"})
        return required, frozenset()


# ---- encode / decode --------------------------------------------------------------------------


M = TypeVar("M")


def encode(message: Any) -> bytes:
    """The msgpack bytes of ``message`` (any message class of this module)."""
    to_wire = getattr(message, "to_wire", None)
    if to_wire is None:
        raise InvalidArgumentError(f"{type(message).__name__} is not a control message")
    return msgpack.packb(to_wire(), use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    raise InvalidMessageError(f"msgpack extension type {code} is not allowed")


def _wire_type_of(cls: type) -> tuple[str, ...]:
    return ("P", "D") if cls is ProxyRegistration else (cls.TYPE,)  # type: ignore[attr-defined]


def decode(payload: Any, accept: tuple[type[M], ...], *, max_bytes: int) -> M:
    """Decode and schema-check ``payload`` into one of the classes in ``accept``.

    Raises InvalidMessageError (never anything else) for oversized, non-msgpack, non-map,
    unknown-type, unknown-key, missing-key or out-of-range input; the message names what was
    wrong.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidMessageError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise InvalidMessageError(f"message is {len(payload)} bytes, more than {max_bytes}")
    limit = max(len(payload), 1)
    try:
        data = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=64,
            max_ext_len=0,
        )
    except InvalidMessageError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InvalidMessageError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise InvalidMessageError(f"message must be a map, got {type(data).__name__}")
    msg_type = data.get("type")
    by_type: dict[str, type[M]] = {}
    for cls in accept:
        for wire_type in _wire_type_of(cls):
            by_type[wire_type] = cls
    if not isinstance(msg_type, str) or msg_type not in by_type:
        shown = repr(msg_type) if not isinstance(msg_type, str) else repr(msg_type[:64])
        raise InvalidMessageError(
            f"unknown message type {shown} (expected one of {', '.join(sorted(by_type))})"
        )
    cls = by_type[msg_type]
    keys = set(data) - {"type"}
    required, optional = cls.wire_keys()  # type: ignore[attr-defined]
    missing = required - keys
    if missing:
        raise InvalidMessageError(f"{msg_type} message lacks {', '.join(sorted(missing))}")
    unknown = keys - required - optional
    if unknown:
        names = ", ".join(repr(k[:32]) for k in sorted(unknown)[:5])
        raise InvalidMessageError(f"{msg_type} message has unknown keys {names}")
    try:
        return cls.from_wire(data)  # type: ignore[attr-defined,no-any-return]
    except InvalidMessageError:
        raise
    except InvalidArgumentError as exc:
        raise InvalidMessageError(f"{msg_type} message: {exc}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidMessageError(f"{msg_type} message: {exc}") from None


__all__ = [
    "MAX_HANDSHAKE_REQUEST_BYTES",
    "MAX_HANDSHAKE_RESPONSE_BYTES",
    "MAX_NOTIFY_BYTES",
    "MAX_PING_BYTES",
    "NOTIFY_TYPES",
    "PROTOCOL_VERSION",
    "TRANSFER_MODES",
    "AbortWrite",
    "HandshakeRejected",
    "HandshakeRequest",
    "HandshakeResponse",
    "InvalidMessageError",
    "NotifyMessage",
    "ProxyRegistration",
    "Release",
    "RemoteBlocks",
    "WriteAborted",
    "WriteDone",
    "WriteFailed",
    "decode",
    "encode",
    "new_nonce",
]
