"""Control-plane messages: typed, immutable, msgpack on the wire, strictly checked on receipt.

Every message is a msgpack map with a string ``"type"``. Decoding refuses -- with
:class:`InvalidMessageError` naming the message type and field -- anything that is not
msgpack, is larger than the channel's bound, has trailing bytes, is not a map, has an unknown
``type``, lacks a required key, carries a key the schema does not know, or has a value of the
wrong type or out of range. No pickle, no msgpack extension types. Constructors run the same
checks, so an invalid message can be neither built nor sent. Each message is a
``msgspec.Struct(frozen=True, forbid_unknown_fields=True)`` tagged by ``type`` whose fields carry
their bounds (:mod:`.schema`); msgspec decodes the wire bytes straight into it, after the size
check. docs/protocol.md describes every message for peers in other runtimes.

Notify channel (fire-and-forget, DEALER -> ROUTER), field names as vLLM's MoRIIO connector:

===================== ========== ==============================================================
type                  direction  fields (wire name)
===================== ========== ==============================================================
``remote_blocks``     D -> P     ``transfer_id``, ``block_notify_list`` (ints, or one int list
                      (WRITE)    per KV group), ``decode_rank``, ``decode_engine_id``, ``req_id``,
                                 ``decode_tp_rank``
``write_done``        P -> D     ``transfer_id``, ``writer_rank``, ``num_writers``
``write_failed``      P -> D     ``transfer_id``, ``writer_rank``, ``reason``
``misaddressed``      P -> D     ``transfer_id``, ``writer_rank``, ``writer_incarnation``,
                      (WRITE)    ``addressed_incarnation``: P restarted since D's handshake,
                                 wrote nothing and waits for the blocks announced again
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
requester engine id, a fresh nonce, when it was sent) answered by ``handshake_response`` (our
native engine metadata as opaque bytes, engine id, dp/tp rank and size, transfer mode, the
nonce echoed, the model's total KV heads) or ``handshake_rejected`` (reason, nonce). With
``verify`` on, the same channel carries ``checksum_request`` (transfer id, the prefill block
ids a READ moved, a window, a nonce) answered by ``checksum_response`` (per layer, the blocks'
checksums) or ``handshake_rejected``.

Proxy registration (DEALER -> the router's ROUTER, exactly vLLM's format):
``{"type": "P"|"D", "http_address": "ip:port", "zmq_address": "host:..,handshake:..,notify:..",
"dp_size": n, "tp_size": n, "transfer_mode": "READ"|"WRITE"}``.

Contents (all values immutable; functions pure and thread-safe):

* :class:`InvalidMessageError`
* notify messages :class:`RemoteBlocks`, :class:`WriteDone`, :class:`WriteFailed`,
  :class:`Misaddressed`, :class:`Release`, :class:`AbortWrite`, :class:`WriteAborted` (union
  :data:`NotifyMessage`, tuple :data:`NOTIFY_TYPES`)
* :class:`HandshakeRequest`, :class:`HandshakeResponse`, :class:`HandshakeRejected`
* :class:`ChecksumRequest`, :class:`ChecksumResponse` (``verify``: the prefill's block checksums
  after a READ, on the handshake channel)
* :class:`ProxyRegistration`
* :func:`encode` (message -> bytes), :func:`decode` (bytes -> one of the accepted classes)
* size bounds ``MAX_*_BYTES`` and :data:`PROTOCOL_VERSION`
"""

from __future__ import annotations

import math
import os
import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from moriio_native.errors import InvalidArgumentError

from .addressing import BlockIdGroups, ZmqAddress, validate_host, validate_port
from .schema import (
    MAX_BLOCK_ID,
    MAX_BLOCK_IDS,
    MAX_KV_GROUPS,
    MAX_REQUEST_ID_LEN,
    BlockId,
    Id,
    Incarnation,
    IncarnationOrEmpty,
    NestedTooDeeplyError,
    Port,
    Rank,
    Schema,
    Size,
    TransferId,
    describe,
    encoder,
    explain,
    load,
    printable,
)

# 2: the handshake response's kv_groups carry tokens_per_state and its incarnation, the
# kv_transfer_params remote_incarnations and RemoteBlocks decode_incarnation. 3: the handshake
# request carries sent_ms (a server with a secret answers it only while fresh). 4: the
# handshake response carries answered_ms, the kv_transfer_params remote_hold_until_ms (a decode
# reads a prefill's blocks only while the prefill still holds them). 5: write_aborted carries
# the decode rank it answers (decode_engine_id). 6: the handshake request carries
# confirm_reads, the checksum request hold_only (a decode's READ confirmed by the prefill's
# hold). 7: remote_blocks carries the prefill incarnation the decode handshook (a prefill of
# another incarnation writes nothing), write_failed the writer's incarnation. 8: misaddressed
# (such a prefill keeps the job and asks for the blocks announced to it), remote_blocks'
# deduplication key names the prefill incarnation (the announcement to the new process is not a
# copy of the first). 9: the checksum request states the answer's block ids as the READ used
# them (answer_ids), refused unless they are the prefill's own in its order. A peer of another
# version is refused at the handshake by its version, before any field of it is checked. 10:
# the handshake's KV-cache groups state their layers' element types (element_types): layers of
# one element size but another type (bfloat16 and float16, fp8_e4m3 and fp8_e5m2) no longer pair.
# 11: the checksum request states how many ids each group's list holds (answer_sizes).
PROTOCOL_VERSION = 11

MAX_NOTIFY_BYTES = 8 << 20
MAX_HANDSHAKE_REQUEST_BYTES = 4 << 10
MAX_HANDSHAKE_RESPONSE_BYTES = 64 << 20
MAX_PING_BYTES = 4 << 10
# A checksum request carries the block ids the decode read and the answer's (answer_ids), each
# at most MAX_BLOCK_IDS of up to 5 bytes of msgpack: about 10 MiB at the schema's bounds. It may
# be larger than a handshake request, and is accepted only by instances that verify.
MAX_CHECKSUM_REQUEST_BYTES = 12 << 20
# Layers one checksum message may name.
MAX_CHECKSUM_LAYERS = 4096
MAX_REASON_LEN = 1024
NONCE_BYTES = 16
TRANSFER_MODES = ("READ", "WRITE")

TransferMode = Literal["READ", "WRITE"]
Reason = printable(0, MAX_REASON_LEN)


def reason_text(text: str) -> str:
    """``text`` as a message's reason may carry it: one line of printable characters (runs of
    whitespace, line breaks included, made one space; any other unprintable one "?"), at most
    MAX_REASON_LEN. Reasons are often an exception's text, which need be neither (a CUDA error
    spans lines)."""
    text = "".join(ch if ch.isprintable() else "?" for ch in " ".join(text.split()))
    return text[:MAX_REASON_LEN]


RejectReason = printable(1, MAX_REASON_LEN)
RequestId = printable(0, MAX_REQUEST_ID_LEN)
ProtocolVersion = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]
FreshNonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=64)]
#: Milliseconds since the Unix epoch.
EpochMs = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
EngineMetadata = Annotated[bytes, msgspec.Meta(max_length=MAX_HANDSHAKE_RESPONSE_BYTES)]
HttpAddress = Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
#: One layer's block checksums: little-endian uint64, one per block (moriio_native.verify.pack).
LayerChecksums = Annotated[bytes, msgspec.Meta(max_length=8 * MAX_BLOCK_IDS)]
#: Layer name -> its checksums, for the blocks of one transfer.
Checksums = Annotated[dict[Id, LayerChecksums], msgspec.Meta(max_length=MAX_CHECKSUM_LAYERS)]
WindowStart = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
WindowCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
KvHeads = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class InvalidMessageError(InvalidArgumentError):
    """A control message failed its schema check (or could not be decoded at all)."""


class ProtocolVersionError(InvalidMessageError):
    """A handshake message of another protocol version (``version``): its other fields are
    not checked, since that version may define them differently."""

    def __init__(self, version: int, nonce: bytes) -> None:
        super().__init__(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
        self.version = version
        self.nonce = nonce  # the message's nonce (b"" when it had none fit to echo)


class _VersionPeek(msgspec.Struct):
    """The keys of a message that say which protocol version it is (every other key ignored)."""

    type: Any = None
    protocol_version: Any = None
    nonce: Any = None


class _Message(Schema, frozen=True, tag_field="type"):
    """A control message: a msgpack map whose ``type`` key is the class's ``TYPE``."""

    TYPE: ClassVar[str]  #: the wire ``type`` (the struct's tag), set by :func:`_tagged`
    ERROR: ClassVar[type[Exception]] = InvalidMessageError


_T = TypeVar("_T", bound=type[_Message])


def _tagged(cls: _T) -> _T:
    """Names the message class after its tag (msgspec sets the tag after ``__init_subclass__``)."""
    cls.TYPE = str(cls.__struct_config__.tag)
    cls.WHAT = f"{cls.TYPE} message"
    return cls


def _rank_below(name: str, rank: int, size_name: str, size: int) -> None:
    if rank >= size:
        raise ValueError(f"'{name}' = {rank} is outside 0..{size - 1} ({size_name} is {size})")


# ---- notify messages --------------------------------------------------------------------------


@_tagged
class RemoteBlocks(_Message, frozen=True, tag="remote_blocks"):
    """D -> P (WRITE mode): the decode blocks P must write ``transfer_id`` into.

    ``block_ids`` holds one tuple per KV-cache group (one group unless the model mixes
    attention types; wire ``block_notify_list``: a flat list for one group). ``decode_dp_rank``
    (wire ``decode_rank``) is the decode DP rank owning the request; P derives the
    ``write_done`` port from it. An empty group is schema-valid (nothing to write); deciding
    what that means is the receiver's business.
    """

    transfer_id: TransferId
    block_ids: BlockIdGroups = msgspec.field(name="block_notify_list")
    decode_engine_id: Id
    decode_dp_rank: Rank = msgspec.field(default=0, name="decode_rank")
    req_id: RequestId = ""
    # The decode TP rank announcing (with different TP sizes one prefill rank writes into
    # several decode ranks, each announcing its own blocks); P checks it against the handshake.
    decode_tp_rank: Rank = 0
    # Grouped announcements (both sides describe KV-cache groups in their handshakes): the
    # groups' block lists are positional from the request's first token, with the null block
    # (0) where the decode needs nothing written, and the decode needs the KV of its first
    # ``num_tokens`` tokens. 0: the classic form (the tail of the prompt's blocks).
    num_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)] = 0
    # The announcing decode rank's incarnation ("": a decode that predates them): P writes only
    # into that process, never into another one restarted under the same address since.
    decode_incarnation: IncarnationOrEmpty = ""
    # The incarnation of the prefill rank the decode handshook before announcing ("": not
    # stated): only that process writes, never another one restarted under the address since
    # (which a stale handshake or a message queued across the restart could reach), so that
    # the decode's view of its writer (its probes: another incarnation answering there means
    # the writer died) is the process that writes.
    prefill_incarnation: IncarnationOrEmpty = ""

    @property
    def dedup_key(self) -> tuple[str, ...]:
        """Equal for copies of the same notification (one allocation per decode rank and
        transfer, announced to one prefill incarnation: after a :class:`Misaddressed` the same
        blocks go to the process that answered it)."""
        return (self.TYPE, self.transfer_id, self.decode_engine_id, self.prefill_incarnation)


@_tagged
class WriteDone(_Message, frozen=True, tag="write_done"):
    """P -> D (WRITE mode): writer ``writer_rank`` finished all writes of ``transfer_id``.

    D has the KV once ``num_writers`` distinct writers reported (several prefill TP ranks may
    write into one decode rank).
    """

    transfer_id: TransferId
    writer_rank: Rank = 0
    num_writers: Size = 1
    # With ``verify`` on: per layer, the checksums of the prefill blocks written, in the order
    # of the decode's announced blocks; the decode compares them with its own.
    checksums: Checksums | None = None

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id, str(self.writer_rank))


@_tagged
class WriteFailed(_Message, frozen=True, tag="write_failed"):
    """P -> D (WRITE mode): writer ``writer_rank`` gave up on ``transfer_id`` (``reason`` says
    why), so D fails the request now instead of waiting for its timeout."""

    transfer_id: TransferId
    writer_rank: Rank = 0
    reason: Reason = ""
    # The failing writer's incarnation ("": not stated). Another one than D's handshake of the
    # rank names means the rank restarted since D's handshake (it refused an announcement
    # addressed to its predecessor): D handshakes it again for the next request.
    writer_incarnation: IncarnationOrEmpty = ""

    @property
    def dedup_key(self) -> tuple[str, ...]:
        return (self.TYPE, self.transfer_id, str(self.writer_rank))


@_tagged
class Misaddressed(_Message, frozen=True, tag="misaddressed"):
    """P -> D (WRITE mode): writer ``writer_rank`` got ``remote_blocks`` of ``transfer_id``
    addressed to ``addressed_incarnation``, a predecessor of this process at the rank's address
    (D's handshake of the rank was cached across a restart). It wrote nothing and keeps the job
    for the same blocks announced to ``writer_incarnation``: D handshakes the rank again and, when
    it answers with that incarnation, announces them once more (once per pair of ranks; otherwise D
    fails the load, which is recomputed)."""

    transfer_id: TransferId
    writer_incarnation: Incarnation
    addressed_incarnation: Incarnation
    writer_rank: Rank = 0

    def _check(self) -> None:
        if self.writer_incarnation == self.addressed_incarnation:
            raise ValueError(
                "'writer_incarnation' equals 'addressed_incarnation': the announcement reached "
                "the process it was addressed to"
            )

    @property
    def dedup_key(self) -> tuple[str, ...]:
        # With the incarnation it answers: a process restarted again at the rank answers the
        # second announcement, and its answer is not a copy of the first one's.
        return (self.TYPE, self.transfer_id, str(self.writer_rank), self.addressed_incarnation)


@_tagged
class Release(_Message, frozen=True, tag="release"):
    """D -> P: P may free the blocks of ``transfer_id`` (READ finished or failed, or a WRITE
    request ended before D allocated). One per consumer rank that read from this producer
    rank; ``consumer_tp_size`` lets P count the fan-in (see vLLM's expected-ack rule)."""

    transfer_id: TransferId
    consumer_tp_size: Size = 1
    consumer_tp_rank: Rank = 0

    def _check(self) -> None:
        _rank_below(
            "consumer_tp_rank", self.consumer_tp_rank, "consumer_tp_size", self.consumer_tp_size
        )

    @property
    def dedup_key(self) -> tuple[str, ...]:
        # With the TP size it names: the prefill counts only releases of the request's decode
        # TP size, so one naming another size must not take the genuine one's place here.
        return (
            self.TYPE,
            self.transfer_id,
            str(self.consumer_tp_rank),
            str(self.consumer_tp_size),
        )


@_tagged
class AbortWrite(_Message, frozen=True, tag="abort_write"):
    """D -> P (WRITE mode): D gave up on ``transfer_id`` (timeout or abort) and keeps its blocks
    quarantined until P answers :class:`WriteAborted`: P stops the transfer and answers once
    none of its writes can land any more. ``decode_engine_id`` names the decode rank, so P
    answers the handshaken peer, never an address from a message."""

    transfer_id: TransferId
    decode_engine_id: Id
    decode_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    decode_handshake_port: Port
    decode_notify_port: Port
    decode_dp_rank: Rank = 0
    # The decode rank and its instance's TP size (they may differ from P's): P acknowledges
    # that rank when it has no handshake with it yet.
    decode_tp_rank: Rank = 0
    decode_tp_size: Size = 1

    def _check(self) -> None:
        _rank_below("decode_tp_rank", self.decode_tp_rank, "decode_tp_size", self.decode_tp_size)
        try:
            host = validate_host(self.decode_host, what="'decode_host'")
        except InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        msgspec.structs.force_setattr(self, "decode_host", host)

    @property
    def decode_address(self) -> ZmqAddress:
        """The decode instance's base ports: P handshakes it (allowlist and engine id checked)
        when it has no handshake with that rank yet."""
        return ZmqAddress(self.decode_host, self.decode_handshake_port, self.decode_notify_port)

    @property
    def dedup_key(self) -> tuple[str, ...]:
        """One per decode rank and transfer (several decode ranks may abort writes of one
        prefill rank)."""
        return (self.TYPE, self.transfer_id, self.decode_engine_id)


@_tagged
class WriteAborted(_Message, frozen=True, tag="write_aborted"):
    """P -> D (WRITE mode): writer ``writer_rank`` stopped ``transfer_id`` and none of its
    writes into decode rank ``decode_engine_id`` can land any more; that rank may free
    (recompute) the blocks. Any other rank ignores it: an acknowledgement steered to its port
    (by an ``abort_write`` naming a wrong one) must not end its wait while writes of the same
    transfer into it may still land."""

    transfer_id: TransferId
    decode_engine_id: Id
    writer_rank: Rank = 0

    @property
    def dedup_key(self) -> tuple[str, ...]:
        # With the rank it names: one naming another rank (ignored) must not take the genuine
        # one's place in the listener's deduplication.
        return (self.TYPE, self.transfer_id, str(self.writer_rank), self.decode_engine_id)


NotifyMessage = (
    RemoteBlocks | WriteDone | WriteFailed | Misaddressed | Release | AbortWrite | WriteAborted
)
NOTIFY_TYPES: tuple[type[NotifyMessage], ...] = (
    RemoteBlocks,
    WriteDone,
    WriteFailed,
    Misaddressed,
    Release,
    AbortWrite,
    WriteAborted,
)

# ---- handshake --------------------------------------------------------------------------------


def new_nonce() -> bytes:
    """A fresh random handshake nonce."""
    return os.urandom(NONCE_BYTES)


def now_ms() -> int:
    """This side's clock, in milliseconds since the Unix epoch (a request's ``sent_ms``)."""
    return time.time_ns() // 1_000_000


def hold_until_ms(abort_timeout: float) -> int:
    """A READ prefill's ``remote_hold_until_ms`` for a request finishing now: its workers free
    the blocks ``abort_timeout`` after they learn the request finished, which is after now."""
    return now_ms() + math.floor(abort_timeout * 1000)


@_tagged
class HandshakeRequest(_Message, frozen=True, tag="handshake_request"):
    """Asks a worker for its engine metadata. ``nonce`` must come back in the reply, which
    binds the reply to this request (a replayed reply is refused). With a secret, a server
    answers the request only within a minute of ``sent_ms`` (its own clock) and each nonce once,
    so a captured request replayed gets no answer. Every key is required on the wire."""

    requester_engine_id: Id
    nonce: FreshNonce = msgspec.field(default_factory=new_nonce)
    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    # Whether the requester checks every transfer end to end (both sides must agree).
    verify: bool = False
    # When the requester made the request (ms since the Unix epoch): its freshness.
    sent_ms: EpochMs = msgspec.field(default_factory=now_ms)
    # Whether the requester (a READ-mode decode) confirms each READ with a hold check
    # (ChecksumRequest.hold_only): a server that does not answer them refuses it.
    confirm_reads: bool = False


KvGroupKind = Literal["full", "sliding", "mamba"]
MAX_KV_GROUP_LAYERS = 4096


class KvGroup(Schema, frozen=True):
    """One KV-cache group of a worker, as its handshake describes it: what the group holds
    (``full`` attention, ``sliding`` window attention, ``mamba`` state: one state slot per
    block, no token axis), how many tokens one of its blocks covers, the window in tokens
    (sliding only, else 0), the layers it holds, in order, and how many tokens one stored
    state of an attention block covers, as a fraction ``(numerator, denominator)``: ``(1, 1)``
    for one K/V cell per token (and for mamba groups), ``(4, 1)`` when four tokens are
    compressed into one state, ``(1, 2)`` for two states per token (vLLM's
    ``AttentionSpec.tokens_per_state``). ``element_types`` names what the layers' bytes are
    (``bfloat16``, ``fp8_e4m3``, a Mamba state's ``float16+float32``): one name for every
    layer, or one per layer in ``layers``' order; two layers pair only with the same name, since
    equal element sizes say nothing about the number format."""

    WHAT: ClassVar[str] = "KV-cache group"
    ERROR: ClassVar[type[Exception]] = InvalidMessageError

    kind: KvGroupKind
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    layers: Annotated[tuple[Id, ...], msgspec.Meta(min_length=1, max_length=MAX_KV_GROUP_LAYERS)]
    element_types: Annotated[
        tuple[Id, ...], msgspec.Meta(min_length=1, max_length=MAX_KV_GROUP_LAYERS)
    ]
    sliding_window: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0
    tokens_per_state: tuple[
        Annotated[int, msgspec.Meta(ge=1, le=1 << 24)],
        Annotated[int, msgspec.Meta(ge=1, le=1 << 24)],
    ] = (1, 1)

    def _check(self) -> None:
        if (self.kind == "sliding") != (self.sliding_window > 0):
            raise ValueError(
                f"'sliding_window' = {self.sliding_window} does not fit kind {self.kind!r} "
                "(a window > 0 for sliding groups only)"
            )
        if len(self.element_types) not in (1, len(self.layers)):
            raise ValueError(
                f"'element_types' names {len(self.element_types)} types for "
                f"{len(self.layers)} layers (one for all of them, or one per layer)"
            )
        if self.kind == "mamba" and self.tokens_per_state != (1, 1):
            raise ValueError(
                f"'tokens_per_state' = {self.tokens_per_state} does not fit a mamba group "
                "(its state has no token axis: (1, 1))"
            )

    def element_type(self, index: int) -> str:
        """The element type of the group's ``index``-th layer."""
        return self.element_types[0 if len(self.element_types) == 1 else index]

    @property
    def compressed(self) -> bool:
        """Whether a stored state of the group's blocks covers other than one token."""
        return self.tokens_per_state != (1, 1)


@_tagged
class HandshakeResponse(_Message, frozen=True, tag="handshake_response"):
    """A worker's answer: its native engine metadata (opaque bytes, produced and checked by
    the native engine) and where it sits in its instance. Every key is required on the wire.

    A provider builds one with ``nonce=b""``; the server fills in the request's nonce.
    """

    engine_id: Id
    engine_metadata: EngineMetadata
    dp_rank: Rank = 0
    tp_rank: Rank = 0
    dp_size: Size = 1
    tp_size: Size = 1
    transfer_mode: TransferMode = "READ"
    # The worker's KV-cache groups (vLLM's hybrid KV-cache manager); empty: one group holding
    # every registered layer, with the block size of its layouts.
    kv_groups: Annotated[tuple[KvGroup, ...], msgspec.Meta(max_length=MAX_KV_GROUPS)] = ()
    nonce: Nonce = b""
    protocol_version: ProtocolVersion = PROTOCOL_VERSION
    verify: bool = False
    # The model's KV heads over all TP ranks in the layers TP splits by head (0: none, or not
    # stated): a peer of another TP size must split the same heads.
    total_kv_heads: KvHeads = 0
    # The answering process's incarnation (random, made at its start); "": a peer that predates
    # it. A READ whose request names another incarnation is not made: those blocks are gone.
    incarnation: IncarnationOrEmpty = ""
    # When the server answered, by its clock (ms since the Unix epoch; the server fills it in,
    # 0 in a provider's answer): bounds how far the peer's clock is ahead of the requester's,
    # which a READ needs to know whether the prefill still holds the request's blocks.
    answered_ms: EpochMs = 0

    def _check(self) -> None:
        _rank_below("dp_rank", self.dp_rank, "dp_size", self.dp_size)
        _rank_below("tp_rank", self.tp_rank, "tp_size", self.tp_size)


@_tagged
class HandshakeRejected(_Message, frozen=True, tag="handshake_rejected"):
    """The server understood the request but cannot answer (e.g. KV caches not registered
    yet, incompatible protocol version); ``reason`` says why. Every key is required on the
    wire."""

    reason: RejectReason
    nonce: Nonce = b""


@_tagged
class ChecksumRequest(_Message, frozen=True, tag="checksum_request"):
    """D -> P on the handshake channel (READ mode, ``verify`` on): after a READ completed, the
    checksums of the prefill blocks it read, per layer, over the window's cells (``heads`` /
    ``tokens`` 0: to the end of the block). Sent before the decode's ``release``, so the blocks
    cannot have changed; the prefill answers only while it still holds them (freed, they may
    hold another request's KV). With ``hold_only`` (``confirm_reads``, verify off) it asks for
    no checksums, only that hold. Answered by :class:`ChecksumResponse` or
    :class:`HandshakeRejected` echoing ``nonce``."""

    requester_engine_id: Id
    transfer_id: TransferId
    block_ids: Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
    nonce: FreshNonce = msgspec.field(default_factory=new_nonce)
    # As a handshake request's: with a secret, answered only while fresh and once (a replay
    # would make the prefill read the blocks again and hand their checksums to the replayer).
    sent_ms: EpochMs = msgspec.field(default_factory=now_ms)
    head_begin: WindowStart = 0
    heads: WindowCount = 0
    token_begin: WindowStart = 0
    tokens: WindowCount = 0
    # A hold check (confirm_reads): no checksums, answered (with none) only while the prefill
    # still holds the transfer's blocks and ``block_ids`` are among those its answer named.
    hold_only: bool = False
    # The hold the READ's answer stated (remote_hold_until_ms; 0: none): the prefill answers
    # only while it holds the transfer under that answer, not a later one reusing the id.
    hold_until_ms: EpochMs = 0
    # The answer's block ids as the READ used them (every group's, flat, in the answer's
    # order): the prefill answers only when they are exactly its answer's (empty: refused).
    answer_ids: Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)] = ()
    # How many of ``answer_ids`` each KV-cache group's list holds, in order (empty: the answer
    # has no groups): the flat ids alone do not say where a group's list ends, and an answer
    # whose ids moved between groups (same flat order) loads another position's KV.
    answer_sizes: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_IDS)], ...],
        msgspec.Meta(max_length=MAX_KV_GROUPS),
    ] = ()


@_tagged
class ChecksumResponse(_Message, frozen=True, tag="checksum_response"):
    """P -> D: per layer, the checksums of the requested blocks, in the request's order."""

    transfer_id: TransferId
    checksums: Checksums
    nonce: Nonce = b""


# Handshakes carry every key on the wire: a default only serves the constructor ...
_EVERY_KEY_REQUIRED = (HandshakeRequest, HandshakeResponse, HandshakeRejected)
# ... except the keys added while protocol version 1 was current: a peer of version 1 that
# predated them sent none, which meant their default (e.g. verify: false).
_OPTIONAL_KEYS = frozenset({"verify", "incarnation"})

# ---- proxy registration -----------------------------------------------------------------------


class ProxyRegistration(Schema, frozen=True):
    """The registration a worker sends to vLLM's MoRIIO proxy/router every few seconds.

    ``role`` is ``"P"`` or ``"D"`` (the wire ``type``); ``zmq_address`` advertises the
    instance's *base* handshake and notify ports (see :mod:`.ports`), on the wire as
    ``host:..,handshake:..,notify:..``; ``http_address`` is ``host:port``.
    """

    TYPE: ClassVar[str] = "P|D"
    WHAT: ClassVar[str] = "proxy registration"
    ERROR: ClassVar[type[Exception]] = InvalidMessageError
    role: Literal["P", "D"] = msgspec.field(name="type")
    http_address: HttpAddress
    zmq_address: ZmqAddress
    dp_size: Size
    tp_size: Size
    transfer_mode: TransferMode

    def _check(self) -> None:
        host, sep, port = self.http_address.rpartition(":")
        try:
            if not sep:
                raise InvalidArgumentError("it has no ':port'")
            validate_host(host, what="its host")
            validate_port(port, what="its port")
        except InvalidArgumentError as exc:
            raise ValueError(
                f"'http_address' = {describe(self.http_address)} is not 'host:port': {exc}"
            ) from None

    def to_wire(self) -> dict[str, Any]:
        """The registration as the proxy reads it (a map with vLLM's key names)."""
        return msgspec.msgpack.decode(encode(self))  # type: ignore[no-any-return]


# ---- encode / decode --------------------------------------------------------------------------


M = TypeVar("M")


def encode(message: Any) -> bytes:
    """The msgpack bytes of ``message`` (any message class of this module)."""
    if not isinstance(message, (_Message, ProxyRegistration)):
        raise InvalidArgumentError(f"{type(message).__name__} is not a control message")
    return encoder().encode(message)


# What decode() derives from its ``accept`` tuple, per tuple: callers pass the same few tuples
# for every message a listener reads.
_TARGETS: dict[tuple[type[Any], ...], Any] = {}
_VERSIONED: dict[tuple[type[Any], ...], frozenset[str]] = {}


def _target(accept: tuple[type[Any], ...]) -> Any:
    target = _TARGETS.get(accept)
    if target is None:
        target = _TARGETS[accept] = _union(accept)
    return target


def _union(accept: tuple[type[Any], ...]) -> Any:
    if ProxyRegistration in accept:
        if len(accept) != 1:
            raise InvalidArgumentError("a proxy registration is decoded on its own channel")
        return ProxyRegistration
    union: Any = accept[0]
    for cls in accept[1:]:
        union = union | cls
    return union


def _message_error(exc: msgspec.ValidationError, payload: Any, accept: tuple[type, ...]) -> str:
    """The text of a failed decode: what kind of message, which field, which value."""
    text = str(exc)
    if text.startswith("Expected `object`") and " - at " not in text and "`ext`" not in text:
        return f"message must be a map, got {text.split('got ', 1)[-1].strip('`')}"
    try:
        wire_type: Any = load(dict[str, Any], payload).get("type")
    except NestedTooDeeplyError as nested:
        return f"message is {nested}"  # its type and field cannot be read either
    except (msgspec.DecodeError, msgspec.ValidationError):
        wire_type = None
    if text.endswith("- at `$.type`") or text == "Object missing required field `type`":
        expected = ", ".join(sorted(c.TYPE for c in accept))  # type: ignore[attr-defined]
        shown = describe(wire_type[:64] if isinstance(wire_type, str) else wire_type)
        return f"unknown message type {shown} (expected one of {expected})"
    if accept == (ProxyRegistration,):
        what = "proxy registration"
    else:
        what = f"{wire_type} message" if isinstance(wire_type, str) else "message"
    return explain(what, exc, payload)


def _require_every_key(message: Any, payload: Any) -> None:
    """Handshakes carry every key (defaults serve constructors only)."""
    if isinstance(message, _EVERY_KEY_REQUIRED):
        keys = load(dict[str, msgspec.Raw], payload).keys()
        missing = sorted(set(message.__struct_encode_fields__) - {"type", *_OPTIONAL_KEYS, *keys})
        if missing:
            raise InvalidMessageError(f"{message.TYPE} message lacks {', '.join(missing)}")


def _check_protocol_version(payload: Any, accept: tuple[type, ...]) -> None:
    """ProtocolVersionError for a handshake message in ``accept`` whose ``protocol_version``
    is an integer other than ours: checked before the schema, so that a peer of another
    version gets that error instead of one about a field its version lacks or adds."""
    versioned = _VERSIONED.get(accept)
    if versioned is None:
        versioned = _VERSIONED[accept] = frozenset(
            c.TYPE  # type: ignore[attr-defined]
            for c in accept
            if c in (HandshakeRequest, HandshakeResponse)
        )
    if not versioned:
        return
    try:
        peek = load(_VersionPeek, payload)
    except NestedTooDeeplyError:
        raise  # no check can read it: decode() says so
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # not a map: the schema check says what is wrong
    version = peek.protocol_version
    if (
        isinstance(peek.type, str)
        and peek.type in versioned
        and isinstance(version, int)
        and not isinstance(version, bool)
        and version != PROTOCOL_VERSION
    ):
        nonce = peek.nonce if isinstance(peek.nonce, bytes) and len(peek.nonce) <= 64 else b""
        raise ProtocolVersionError(version, nonce)


def decode(payload: Any, accept: tuple[type[M], ...], *, max_bytes: int, explain: bool = True) -> M:
    """Decode and schema-check ``payload`` into one of the classes in ``accept``.

    The size is checked before anything is parsed. Raises InvalidMessageError (never anything
    else) for oversized, non-msgpack, too deeply nested, non-map, unknown-type, unknown-key,
    missing-key or out-of-range input; the message names the field and the bad value. A
    handshake request or response of another protocol version raises ProtocolVersionError (a
    subclass) instead.
    ``explain=False`` (a listener whose log of drops is rate limited and will not show this
    one) skips what only the text needs -- parsing the payload again to name its type and
    field -- and says what msgspec says; the same inputs fail.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidMessageError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise InvalidMessageError(f"message is {len(payload)} bytes, more than {max_bytes}")
    try:
        _check_protocol_version(payload, accept)
        message = load(_target(accept), payload)
    except msgspec.ValidationError as exc:
        text = _message_error(exc, payload, accept) if explain else f"fails the schema: {exc}"
        raise InvalidMessageError(text) from None
    except NestedTooDeeplyError as exc:
        raise InvalidMessageError(f"message is {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidMessageError(f"not a msgpack message ({exc})") from None
    _require_every_key(message, payload)
    return message  # type: ignore[no-any-return]


__all__ = [
    "MAX_CHECKSUM_REQUEST_BYTES",
    "MAX_HANDSHAKE_REQUEST_BYTES",
    "MAX_HANDSHAKE_RESPONSE_BYTES",
    "MAX_NOTIFY_BYTES",
    "MAX_PING_BYTES",
    "NOTIFY_TYPES",
    "PROTOCOL_VERSION",
    "TRANSFER_MODES",
    "AbortWrite",
    "ChecksumRequest",
    "ChecksumResponse",
    "HandshakeRejected",
    "HandshakeRequest",
    "HandshakeResponse",
    "InvalidMessageError",
    "KvGroup",
    "Misaddressed",
    "NotifyMessage",
    "ProtocolVersionError",
    "ProxyRegistration",
    "Release",
    "RemoteBlocks",
    "WriteAborted",
    "WriteDone",
    "WriteFailed",
    "decode",
    "encode",
    "hold_until_ms",
    "new_nonce",
    "now_ms",
    "reason_text",
]
