"""Peer addresses as the vLLM MoRIIO proxy/router passes them, and ``kv_transfer_params``.

The router tells each instance where its peer is in two ways, both kept compatible with vLLM's
MoRIIO connector so existing routers (vllm-router ``--kv-connector moriio``, the toy proxy)
keep working:

* embedded in the request id::

      [prefix]___prefill_addr_{P}___decode_addr_{D}_{32 hex uuid}[-suffix]

  where ``{P}``/``{D}`` are *zmq addresses* ``host:{ip},handshake:{port},notify:{port}`` and
  vLLM may wrap the id (``cmpl-`` prefix, ``-<n>-<8 hex>`` suffix);
* explicitly in ``kv_transfer_params`` (``remote_host``, ``remote_handshake_port``,
  ``remote_notify_port``), as llm-d style sidecars do.

Unlike vLLM, every part is validated strictly: a host must be an IP literal or an RFC 1123
host name, a port 1..65535, each marker must appear exactly once and in order, and anything
else raises :class:`~moriio_native.errors.InvalidArgumentError` naming what was wrong. Where a
validated address may then be dialled is decided by
:class:`moriio_native.control.security.PeerAllowlist`, never by this module.

Contents (all pure functions / immutable values, safe from any thread):

* :func:`validate_host` -- an IP literal (canonical form) or a host name, else an error.
* :func:`validate_port` -- an int 1..65535 (decimal strings accepted), else an error.
* :class:`ZmqAddress` -- ``host``/``handshake_port``/``notify_port``; ``format()``/``parse()``.
* :class:`RequestAddresses` -- both peers plus the uuid; :func:`format_request_id`,
  :func:`parse_request_id` (``None`` when the id embeds no addresses),
  :func:`peer_address_from_request_id` (the *other* side's address).
* ``KEY_*`` constants and :data:`KV_TRANSFER_PARAM_KEYS` -- the exact key names.
* :class:`KvTransferParams` -- the typed form of ``kv_transfer_params`` (a bounded msgspec
  struct); :func:`parse_kv_transfer_params` validates a mapping into it.
* :class:`BlockIdGroups` -- block ids per KV-cache group with vLLM's flat-or-nested wire form.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import msgspec

from moriio_native.errors import InvalidArgumentError

from .schema import (
    HEX64,
    MAX_BLOCK_IDS,
    MAX_HOST_LEN,
    MAX_ID_LEN,
    MAX_KV_GROUPS,
    MAX_PARALLEL_SIZE,
    MAX_REQUEST_ID_LEN,
    BlockId,
    Id,
    Incarnation,
    Port,
    Rank,
    Schema,
    Size,
    TransferId,
    convert,
    describe,
    explain,
    printable,
)

PREFILL_MARKER = "___prefill_addr_"
DECODE_MARKER = "___decode_addr_"

# ---- kv_transfer_params key names (exactly as vLLM's MoRIIO connector and proxy use them) ---
KEY_TRANSFER_ID = "transfer_id"
KEY_DO_REMOTE_PREFILL = "do_remote_prefill"
KEY_DO_REMOTE_DECODE = "do_remote_decode"
KEY_REMOTE_BLOCK_IDS = "remote_block_ids"
KEY_REMOTE_ENGINE_ID = "remote_engine_id"
KEY_REMOTE_HOST = "remote_host"
KEY_REMOTE_HANDSHAKE_PORT = "remote_handshake_port"
KEY_REMOTE_NOTIFY_PORT = "remote_notify_port"
KEY_REMOTE_DP_RANK = "remote_dp_rank"
KEY_REMOTE_TP_SIZE = "remote_tp_size"
KEY_REMOTE_DP_SIZE = "remote_dp_size"
#: This project's own key (not vLLM's): the incarnation of each prefill TP rank that computed the
#: request, by TP rank. The decode reads only from those processes (docs/protocol.md section 5).
KEY_REMOTE_INCARNATIONS = "remote_incarnations"
#: This project's own key: until when the prefill holds the request's blocks for a READ, by the
#: prefill's clock (ms since the Unix epoch). The decode reads only if its READ ends before then
#: (docs/protocol.md section 5).
KEY_REMOTE_HOLD_UNTIL_MS = "remote_hold_until_ms"
#: This project's own key: the prefill's tag of its answer, with ``auth_secret`` set (hex
#: HMAC-SHA256 of :meth:`KvTransferParams.answer_bytes`); a decode with the secret acts only on
#: answers it matches (docs/protocol.md section 5).
KEY_REMOTE_ANSWER_TAG = "remote_answer_tag"
#: The prompt tokens whose KV the prefill's answered blocks hold (vLLM's NIXL connector's name).
#: A READ decode loads no position at or past it (docs/protocol.md section 5).
KEY_REMOTE_NUM_TOKENS = "remote_num_tokens"
#: This project's own key: a digest of the prompt positions the prefill computed (token ids,
#: multimodal items, cache salt, LoRA); a READ decode loads them only for a prompt of the same
#: digest over those positions (docs/protocol.md section 5).
KEY_REMOTE_PROMPT_DIGEST = "remote_prompt_digest"
#: Older name of ``remote_tp_size``; vLLM's prefill side still returns it. Read, never written.
KEY_LEGACY_TP_SIZE = "tp_size"

KV_TRANSFER_PARAM_KEYS: tuple[str, ...] = (
    KEY_TRANSFER_ID,
    KEY_DO_REMOTE_PREFILL,
    KEY_DO_REMOTE_DECODE,
    KEY_REMOTE_BLOCK_IDS,
    KEY_REMOTE_ENGINE_ID,
    KEY_REMOTE_HOST,
    KEY_REMOTE_HANDSHAKE_PORT,
    KEY_REMOTE_NOTIFY_PORT,
    KEY_REMOTE_DP_RANK,
    KEY_REMOTE_TP_SIZE,
    KEY_REMOTE_DP_SIZE,
    KEY_REMOTE_INCARNATIONS,
    KEY_REMOTE_HOLD_UNTIL_MS,
    KEY_REMOTE_NUM_TOKENS,
    KEY_REMOTE_PROMPT_DIGEST,
    KEY_REMOTE_ANSWER_TAG,
)
# Integer keys vLLM may pass as decimal strings (its kv_connector_extra_config ports).
_DECIMAL_KEYS = (
    KEY_REMOTE_HANDSHAKE_PORT,
    KEY_REMOTE_NOTIFY_PORT,
    KEY_REMOTE_DP_RANK,
    KEY_REMOTE_TP_SIZE,
    KEY_REMOTE_DP_SIZE,
)

#: A host as it arrives (IP literal, bracketed IPv6 literal or host name); canonicalised by
#: :func:`validate_host`.
HostText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_LEN + 2)]
_FlatBlockIds = Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
_GroupedBlockIds = Annotated[tuple[_FlatBlockIds, ...], msgspec.Meta(max_length=MAX_KV_GROUPS)]

_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_DIGITS_RE = re.compile(r"[0-9]{1,5}")
# What may surround the embedded addresses: vLLM's "cmpl-"/"chatcmpl-" prefixes and
# "-<n>-<hex>" style suffixes. Deliberately no ':' ',' or whitespace.
_AFFIX_RE = re.compile(r"[A-Za-z0-9._-]*")
_DECODE_TAIL_RE = re.compile(r"(?P<addr>[^_]+)_(?P<uid>[0-9a-f]{32})(?P<suffix>-[A-Za-z0-9._-]*)?")

_describe = describe


def _checked(value: Any, target: Any, what: str) -> Any:
    try:
        return convert(value, target)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(explain(what, exc, value)) from None


def validate_host(host: Any, *, what: str = "host") -> str:
    """``host`` as an IP literal in canonical form, or a lower-cased RFC 1123 host name.

    IPv6 literals may come bracketed (``[::1]``); zone ids (``%eth0``) are refused. Raises
    InvalidArgumentError naming ``what`` on anything else (empty, too long, ``_``, spaces...).
    """
    if not isinstance(host, str):
        raise InvalidArgumentError(f"{what} must be a string, got {type(host).__name__}")
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text or len(text) > MAX_HOST_LEN:
        raise InvalidArgumentError(f"{what} {_describe(host)} is empty or too long")
    if "%" in text:
        raise InvalidArgumentError(f"{what} {_describe(host)}: IP address zone ids are not allowed")
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if ":" in text:
        raise InvalidArgumentError(f"{what} {_describe(host)} is not a valid IP address")
    labels = text.rstrip(".").split(".")
    if not all(_HOST_LABEL_RE.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise InvalidArgumentError(
            f"{what} {_describe(host)} is neither an IP address nor a valid host name"
        )
    return text.rstrip(".").lower()


def validate_port(port: Any, *, what: str = "port") -> int:
    """``port`` as an int in 1..65535. Decimal strings are accepted (vLLM passes its
    ``kv_connector_extra_config`` ports through as strings); bools and floats are not."""
    if isinstance(port, str) and _DIGITS_RE.fullmatch(port.strip()):
        port = int(port.strip())
    return int(_checked(port, Port, what))


def validate_id(value: Any, *, what: str, max_len: int = MAX_ID_LEN) -> str:
    """A non-empty printable string of at most ``max_len`` characters (ids end up in logs and
    socket names, so control characters are refused)."""
    return str(_checked(value, printable(1, max_len), what))


class BlockIdGroups(Sequence[tuple[int, ...]]):
    """Block ids as one tuple per KV-cache group; immutable, compares equal to the same
    tuple of tuples.

    Wire form (vLLM's): a flat list for one group (the common case, what vLLM sends without
    HMA), a list of lists otherwise. Every id is an int 0..2**31-1; at most 64 groups and 2**20
    ids in all.
    """

    __slots__ = ("_groups",)

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        """Unchecked; use :meth:`from_wire` (or a struct field, which does) for input."""
        self._groups: tuple[tuple[int, ...], ...] = tuple(tuple(g) for g in groups)

    @classmethod
    def from_wire(cls, value: Any) -> BlockIdGroups:
        """Check ``value`` (flat or grouped); ``msgspec.ValidationError`` or ValueError naming
        the bad position."""
        nested = (
            isinstance(value, (list, tuple))
            and bool(value)
            and all(isinstance(g, (list, tuple)) for g in value)
        )
        with_groups = msgspec.convert(value, _GroupedBlockIds if nested else _FlatBlockIds)
        groups = with_groups if nested else (with_groups,)
        total = sum(len(g) for g in groups)
        if total > MAX_BLOCK_IDS:
            raise ValueError(f"{total} block ids, more than {MAX_BLOCK_IDS}")
        return cls(groups)

    def to_wire(self) -> list[int] | list[list[int]]:
        return block_ids_to_wire(self._groups)

    def __getitem__(self, index: Any) -> Any:
        return self._groups[index]

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._groups)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockIdGroups):
            return self._groups == other._groups
        return isinstance(other, tuple) and self._groups == other

    def __hash__(self) -> int:
        return hash(self._groups)

    def __repr__(self) -> str:
        return repr(self._groups)


def validate_block_ids(value: Any, *, what: str) -> tuple[tuple[int, ...], ...]:
    """Block ids as one tuple per KV-cache group (see :class:`BlockIdGroups` for the rules).
    Raises InvalidArgumentError naming ``what`` and the bad position."""
    return tuple(_checked(value, BlockIdGroups, what))


def block_ids_to_wire(groups: Sequence[Sequence[int]]) -> list[int] | list[list[int]]:
    """The wire form vLLM uses: a flat list for one group, a list of lists otherwise."""
    if len(groups) == 1:
        return list(groups[0])
    return [list(g) for g in groups]


def answer_bytes(
    transfer_id: str,
    block_id_groups: Sequence[Sequence[int]] | None,
    engine_id: str | None,
    incarnations: Sequence[str] | None,
    hold_until_ms: int | None,
    num_tokens: int | None,
    prompt_digest: str | None,
) -> bytes:
    """What ``remote_answer_tag`` covers: the fields of the prefill's answer a proxy passes on
    (transfer id, block ids per group, engine id, incarnations, hold, tokens computed and their
    digest), canonically encoded, so
    a proxy that re-serialises the JSON changes nothing. The prefill encodes the values it
    sends, a decode the ones it parsed: no groups encode as the one empty group that their
    wire form (:func:`block_ids_to_wire`) reads back as. The address comes from the proxy's own
    registry, not the answer; the decode's handshake there must prove the engine id and
    incarnations named here."""
    groups = None if block_id_groups is None else (tuple(block_id_groups) or ((),))
    return msgspec.json.encode(
        (
            transfer_id,
            groups,
            engine_id,
            None if incarnations is None else tuple(incarnations),
            hold_until_ms,
            num_tokens,
            prompt_digest,
        )
    )


class ZmqAddress:
    """Where one instance's control plane listens: ``host:{ip},handshake:{port},notify:{port}``.

    The ports are *base* ports; the rank of the peer picks the actual port with
    :mod:`moriio_native.control.ports`. Immutable; validated on construction (InvalidArgumentError
    naming the part). Its wire form (in a proxy registration) is :meth:`format`'s string.
    """

    __slots__ = ("handshake_port", "host", "notify_port")
    host: str
    handshake_port: int
    notify_port: int

    def __init__(self, host: str, handshake_port: int, notify_port: int) -> None:
        for name, value in (
            ("host", validate_host(host, what="zmq address host")),
            ("handshake_port", int(_checked(handshake_port, Port, "handshake port"))),
            ("notify_port", int(_checked(notify_port, Port, "notify port"))),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ZmqAddress is immutable (cannot set {name})")

    def __reduce__(self) -> tuple[type[ZmqAddress], tuple[str, int, int]]:
        # Pickled inside vLLM's connector metadata (scheduler -> worker processes): rebuilt
        # through the validating constructor, since the default path sets the slots one by one.
        return (ZmqAddress, self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZmqAddress) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"ZmqAddress(host={self.host!r}, handshake_port={self.handshake_port}, "
            f"notify_port={self.notify_port})"
        )

    def _key(self) -> tuple[str, int, int]:
        return (self.host, self.handshake_port, self.notify_port)

    def to_wire(self) -> str:
        return self.format()

    @classmethod
    def from_wire(cls, value: Any) -> ZmqAddress:
        return cls.parse(value)

    def format(self) -> str:
        """The wire form, ``host:{host},handshake:{port},notify:{port}``."""
        return f"host:{self.host},handshake:{self.handshake_port},notify:{self.notify_port}"

    @classmethod
    def parse(cls, text: Any) -> ZmqAddress:
        """Parse the wire form. Exactly the keys ``host``, ``handshake`` and ``notify``, each
        once; each segment splits on its first ``:`` so ``host:::1`` is the IPv6 host ``::1``.
        Raises InvalidArgumentError naming the address and the problem."""
        if not isinstance(text, str) or len(text) > 512:
            raise InvalidArgumentError(f"zmq address {_describe(text)} is not a short string")
        parts: dict[str, str] = {}
        for segment in text.split(","):
            key, sep, value = segment.partition(":")
            key = key.strip()
            if not sep or key not in ("host", "handshake", "notify"):
                raise InvalidArgumentError(
                    f"malformed zmq address {_describe(text)}: unexpected segment "
                    f"{_describe(segment)} (expected 'host:IP,handshake:PORT,notify:PORT')"
                )
            if key in parts:
                raise InvalidArgumentError(
                    f"malformed zmq address {_describe(text)}: '{key}' appears twice"
                )
            parts[key] = value.strip()
        missing = [k for k in ("host", "handshake", "notify") if k not in parts]
        if missing:
            raise InvalidArgumentError(
                f"malformed zmq address {_describe(text)}: missing {', '.join(missing)}"
            )
        port_texts = (parts["handshake"], parts["notify"])
        if not all(_DIGITS_RE.fullmatch(p) for p in port_texts):
            raise InvalidArgumentError(
                f"malformed zmq address {_describe(text)}: ports must be decimal 1..65535"
            )
        return cls(parts["host"], int(parts["handshake"]), int(parts["notify"]))


@dataclass(frozen=True, slots=True)
class RequestAddresses:
    """The two peer addresses and the uuid a request id embeds. Immutable."""

    prefill: ZmqAddress
    decode: ZmqAddress
    uid: str

    def peer(self, *, is_producer: bool) -> ZmqAddress:
        """The *other* side: the decode address for the producer (prefill), else prefill's."""
        return self.decode if is_producer else self.prefill


def format_request_id(prefill: ZmqAddress, decode: ZmqAddress, uid: str | None = None) -> str:
    """``___prefill_addr_{P}___decode_addr_{D}_{uid}`` as vLLM's MoRIIO proxy builds it.

    ``uid`` must be 32 lower-case hex digits; a fresh uuid4 when omitted.
    """
    uid = uuid.uuid4().hex if uid is None else uid
    if not isinstance(uid, str) or not re.fullmatch(r"[0-9a-f]{32}", uid):
        raise InvalidArgumentError(f"request id uid {_describe(uid)} must be 32 lower-case hex")
    return f"{PREFILL_MARKER}{prefill.format()}{DECODE_MARKER}{decode.format()}_{uid}"


def parse_request_id(request_id: Any) -> RequestAddresses | None:
    """The addresses embedded in ``request_id``, or ``None`` when it embeds none.

    Tolerates vLLM's wrapping (a ``[A-Za-z0-9._-]*`` prefix and a ``-...`` suffix after the
    uuid). An id that carries a marker but is otherwise malformed -- a marker twice, markers
    out of order, a bad address, no 32-hex uuid, odd characters around them -- raises
    InvalidArgumentError: it is a crafted or corrupted id, not an id without addresses.
    """
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"request id must be a string, got {type(request_id).__name__}")
    n_prefill = request_id.count(PREFILL_MARKER)
    n_decode = request_id.count(DECODE_MARKER)
    if n_prefill == 0 and n_decode == 0:
        return None
    shown = _describe(request_id)
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgumentError(f"request id {shown} is longer than {MAX_REQUEST_ID_LEN}")
    if n_prefill != 1 or n_decode != 1:
        raise InvalidArgumentError(
            f"request id {shown} must embed exactly one prefill and one decode address"
        )
    prefix, rest = request_id.split(PREFILL_MARKER)
    if DECODE_MARKER not in rest:
        raise InvalidArgumentError(f"request id {shown}: decode address precedes prefill address")
    prefill_text, tail = rest.split(DECODE_MARKER)
    match = _DECODE_TAIL_RE.fullmatch(tail)
    if not _AFFIX_RE.fullmatch(prefix) or match is None:
        raise InvalidArgumentError(
            f"request id {shown} is not '[prefix]{PREFILL_MARKER}<addr>{DECODE_MARKER}<addr>"
            f"_<32 hex>[-suffix]'"
        )
    try:
        prefill = ZmqAddress.parse(prefill_text)
        decode = ZmqAddress.parse(match.group("addr"))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"request id {shown}: {exc}") from exc
    return RequestAddresses(prefill, decode, match.group("uid"))


def peer_address_from_request_id(request_id: Any, *, is_producer: bool) -> ZmqAddress | None:
    """The peer's address embedded in ``request_id`` (decode's for the producer, prefill's for
    the consumer); ``None`` when the id embeds none; InvalidArgumentError when malformed."""
    parsed = parse_request_id(request_id)
    return None if parsed is None else parsed.peer(is_producer=is_producer)


class KvTransferParams(Schema, frozen=True):
    """``kv_transfer_params`` of one request, validated. Immutable.

    ``remote_tp_size == 0`` means "unknown" (treat as the same TP size as ours), as in vLLM.
    ``remote_block_ids`` is one tuple per KV-cache group, or ``None`` when not yet known
    (WRITE mode: the decode side allocates its own blocks).
    """

    WHAT: ClassVar[str] = "kv_transfer_params"
    ERROR: ClassVar[type[Exception]] = InvalidArgumentError

    transfer_id: TransferId
    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: BlockIdGroups | None = None
    remote_engine_id: Id | None = None
    remote_host: HostText | None = None
    remote_handshake_port: Port | None = None
    remote_notify_port: Port | None = None
    remote_dp_rank: Rank = 0
    remote_tp_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_PARALLEL_SIZE)] = 0
    remote_dp_size: Size = 1
    # The prefill ranks' incarnations, by TP rank (its answer; None: not stated).
    remote_incarnations: (
        Annotated[tuple[Incarnation, ...], msgspec.Meta(min_length=1, max_length=MAX_PARALLEL_SIZE)]
        | None
    ) = None
    # Until when the prefill holds the blocks for a READ (its clock, ms since the Unix epoch;
    # None: not stated).
    remote_hold_until_ms: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    # The prompt tokens whose KV the prefill's answered blocks hold (None: not stated).
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    # The digest of the prompt positions the prefill computed (None: not stated).
    remote_prompt_digest: Annotated[str, msgspec.Meta(pattern=HEX64)] | None = None
    # The prefill's tag of its answer (None: not stated; see answer_bytes).
    remote_answer_tag: Annotated[str, msgspec.Meta(pattern=HEX64)] | None = None

    def answer_bytes(self) -> bytes:
        """What ``remote_answer_tag`` covers (see :func:`answer_bytes`), from the validated
        values."""
        return answer_bytes(
            self.transfer_id,
            self.remote_block_ids,
            self.remote_engine_id,
            self.remote_incarnations,
            self.remote_hold_until_ms,
            self.remote_num_tokens,
            self.remote_prompt_digest,
        )

    def _check(self) -> None:
        if self.do_remote_prefill and self.do_remote_decode:
            raise ValueError(
                f"transfer {self.transfer_id}: {KEY_DO_REMOTE_PREFILL} and "
                f"{KEY_DO_REMOTE_DECODE} cannot both be true"
            )
        if self.remote_host is not None:
            msgspec.structs.force_setattr(
                self, "remote_host", validate_host(self.remote_host, what=KEY_REMOTE_HOST)
            )
        if self.remote_dp_rank >= self.remote_dp_size:
            raise ValueError(
                f"'{KEY_REMOTE_DP_RANK}' = {self.remote_dp_rank} is outside "
                f"0..{self.remote_dp_size - 1} ({KEY_REMOTE_DP_SIZE} is {self.remote_dp_size})"
            )

    def explicit_peer(self) -> ZmqAddress | None:
        """The peer address from ``remote_host``/``remote_*_port``; ``None`` if none of the three
        is set; InvalidArgumentError naming the missing key if only some are."""
        values = {
            KEY_REMOTE_HOST: self.remote_host,
            KEY_REMOTE_HANDSHAKE_PORT: self.remote_handshake_port,
            KEY_REMOTE_NOTIFY_PORT: self.remote_notify_port,
        }
        missing = [k for k, v in values.items() if v is None]
        if len(missing) == len(values):
            return None
        if missing:
            raise InvalidArgumentError(
                f"transfer {self.transfer_id}: kv_transfer_params lacks {', '.join(missing)} "
                f"(needed with {', '.join(k for k in values if k not in missing)})"
            )
        assert self.remote_host is not None
        assert self.remote_handshake_port is not None and self.remote_notify_port is not None
        return ZmqAddress(self.remote_host, self.remote_handshake_port, self.remote_notify_port)

    def peer_address(self, request_id: str, *, is_producer: bool) -> ZmqAddress:
        """Where the peer listens: the address embedded in ``request_id`` when there is one
        (vLLM's order), else the explicit ``remote_*`` keys. Raises InvalidArgumentError when
        neither gives a complete address or the embedded one is malformed."""
        embedded = peer_address_from_request_id(request_id, is_producer=is_producer)
        if embedded is not None:
            return embedded
        explicit = self.explicit_peer()
        if explicit is None:
            raise InvalidArgumentError(
                f"transfer {self.transfer_id}: request id {_describe(request_id)} embeds no peer "
                f"address and kv_transfer_params has no {KEY_REMOTE_HOST}/"
                f"{KEY_REMOTE_HANDSHAKE_PORT}/{KEY_REMOTE_NOTIFY_PORT}"
            )
        return explicit

    def to_dict(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` dict with vLLM's key names (``None`` fields omitted, except
        ``remote_block_ids``/``remote_engine_id`` which vLLM always carries)."""
        out: dict[str, Any] = {
            KEY_TRANSFER_ID: self.transfer_id,
            KEY_DO_REMOTE_PREFILL: self.do_remote_prefill,
            KEY_DO_REMOTE_DECODE: self.do_remote_decode,
            KEY_REMOTE_BLOCK_IDS: (
                None if self.remote_block_ids is None else block_ids_to_wire(self.remote_block_ids)
            ),
            KEY_REMOTE_ENGINE_ID: self.remote_engine_id,
            KEY_REMOTE_DP_RANK: self.remote_dp_rank,
            KEY_REMOTE_TP_SIZE: self.remote_tp_size,
            KEY_REMOTE_DP_SIZE: self.remote_dp_size,
        }
        for key in (KEY_REMOTE_HOST, KEY_REMOTE_HANDSHAKE_PORT, KEY_REMOTE_NOTIFY_PORT):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.remote_incarnations is not None:
            out[KEY_REMOTE_INCARNATIONS] = list(self.remote_incarnations)
        if self.remote_hold_until_ms is not None:
            out[KEY_REMOTE_HOLD_UNTIL_MS] = self.remote_hold_until_ms
        if self.remote_num_tokens is not None:
            out[KEY_REMOTE_NUM_TOKENS] = self.remote_num_tokens
        if self.remote_prompt_digest is not None:
            out[KEY_REMOTE_PROMPT_DIGEST] = self.remote_prompt_digest
        if self.remote_answer_tag is not None:
            out[KEY_REMOTE_ANSWER_TAG] = self.remote_answer_tag
        return out


def parse_kv_transfer_params(params: Any) -> KvTransferParams:
    """Validate ``params`` (a request's ``kv_transfer_params``) into a :class:`KvTransferParams`.

    ``transfer_id`` is required; every other key is optional, and a ``None`` value counts as
    absent (vLLM's proxy sends ``remote_engine_id: None``). ``tp_size`` is read when
    ``remote_tp_size`` is absent; integer keys may be decimal strings. Keys this module does not
    know are ignored (vLLM and routers add their own). Raises InvalidArgumentError naming the
    first bad key and its value; never mutates ``params``.
    """
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(
            f"kv_transfer_params must be a mapping, got {type(params).__name__}"
        )
    if params.get(KEY_TRANSFER_ID) is None:
        raise InvalidArgumentError(f"kv_transfer_params lacks the required key '{KEY_TRANSFER_ID}'")
    known = {k: params[k] for k in KV_TRANSFER_PARAM_KEYS if params.get(k) is not None}
    if KEY_REMOTE_TP_SIZE not in known and params.get(KEY_LEGACY_TP_SIZE) is not None:
        known[KEY_REMOTE_TP_SIZE] = params[KEY_LEGACY_TP_SIZE]
    for key in _DECIMAL_KEYS:
        value = known.get(key)
        if isinstance(value, str) and _DIGITS_RE.fullmatch(value.strip()):
            known[key] = int(value.strip())
    try:
        return convert(known, KvTransferParams)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(explain("invalid kv_transfer_params", exc, known)) from None


__all__ = [
    "DECODE_MARKER",
    "KEY_DO_REMOTE_DECODE",
    "KEY_DO_REMOTE_PREFILL",
    "KEY_LEGACY_TP_SIZE",
    "KEY_REMOTE_ANSWER_TAG",
    "KEY_REMOTE_BLOCK_IDS",
    "KEY_REMOTE_DP_RANK",
    "KEY_REMOTE_DP_SIZE",
    "KEY_REMOTE_ENGINE_ID",
    "KEY_REMOTE_HANDSHAKE_PORT",
    "KEY_REMOTE_HOLD_UNTIL_MS",
    "KEY_REMOTE_HOST",
    "KEY_REMOTE_INCARNATIONS",
    "KEY_REMOTE_NOTIFY_PORT",
    "KEY_REMOTE_TP_SIZE",
    "KEY_TRANSFER_ID",
    "KV_TRANSFER_PARAM_KEYS",
    "PREFILL_MARKER",
    "BlockIdGroups",
    "KvTransferParams",
    "RequestAddresses",
    "ZmqAddress",
    "answer_bytes",
    "block_ids_to_wire",
    "format_request_id",
    "parse_kv_transfer_params",
    "parse_request_id",
    "peer_address_from_request_id",
    "validate_block_ids",
    "validate_host",
    "validate_id",
    "validate_port",
]
