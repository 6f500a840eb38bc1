"""The schema machinery of the control plane: bounded msgspec types and checked structs.

Every message, address and ``kv_transfer_params`` value is a :class:`Schema` -- a
``msgspec.Struct(frozen=True, forbid_unknown_fields=True)`` whose fields carry ``Meta`` bounds
(lengths, ranges, patterns). msgspec checks them while it decodes the wire bytes; a
constructor checks them too (the struct is encoded and decoded once), so an invalid value can
be neither received nor built. Cross-field rules (a rank below its size) live in each struct's
``_check``; msgspec reports what a ``_check`` raises with the field's path.

Errors: :func:`explain` turns a ``msgspec.ValidationError`` into one line naming the field (the
wire name) and the bad value, e.g. ``release message: 'consumer_tp_size' = 0: expected `int` >=
1``; callers wrap it into their own InvalidArgumentError subclass.

Contents (pure; thread-safe -- the construction check's re-entrancy flag is thread-local):

* bounds ``MAX_*`` and the bounded types :data:`Id`, :data:`Port`, :data:`Rank`, :data:`Size`,
  :data:`BlockId`, :func:`printable` (a bounded printable string type)
* :class:`Schema`, :func:`decoder`, :func:`encoder`, :func:`load`, :func:`convert`,
  :func:`explain`; :class:`NestedTooDeeplyError`, what :func:`load` raises for msgpack nested
  deeper than the interpreter's recursion limit (never RecursionError)
* :class:`WireValue` -- the protocol of a non-struct value with its own wire form (a zmq address
  string, block ids flat or per group), encoded and decoded through msgspec's hooks
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import reprlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Annotated, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import msgspec

MAX_HOST_LEN = 253
MAX_ID_LEN = 256
MAX_REQUEST_ID_LEN = 2048
MAX_BLOCK_ID = 2**31 - 1
MAX_BLOCK_IDS = 1 << 20
MAX_KV_GROUPS = 64
MAX_PARALLEL_SIZE = 1 << 16

# Ids and reasons end up in logs and socket names: no C0/C1 control characters, no line or
# paragraph separators, no bidirectional overrides (they let a peer forge log lines).
_UNPRINTABLE = "\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_PRINTABLE = f"^[^{_UNPRINTABLE}]*$"


@functools.lru_cache(maxsize=64)
def printable(min_length: int, max_length: int) -> Any:
    """A str type of ``min_length..max_length`` printable characters."""
    return Annotated[
        str, msgspec.Meta(min_length=min_length, max_length=max_length, pattern=_PRINTABLE)
    ]


Id = printable(1, MAX_ID_LEN)
#: What separates a transfer id from the engine's name of one part of it: a READ from several
#: prefill ranks moves ``<id>#p<rank>``, a WRITE into several decode ranks ``<id>#d<rank>``. A
#: request's own transfer id therefore never holds it (a request ``tx#p0`` took over a part of
#: request ``tx`` and was reported loaded by that part's completion).
PART_SEPARATOR = "#"
_TRANSFER_ID = f"^[^{_UNPRINTABLE}{PART_SEPARATOR}]*$"
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN, pattern=_TRANSFER_ID)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_PARALLEL_SIZE - 1)]
Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_PARALLEL_SIZE)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
# A process's incarnation: random hex made when a rank's protocol core starts. A prefill's answer
# names the incarnation of each rank that computed the request; a handshake names the one that
# answers now. Equal means the same process, so the same bytes under the request's block ids.
INCARNATION_BYTES = 16
_INCARNATION = "^[0-9a-f]{16,64}$"
#: 64 lower-case hex characters (a SHA-256 digest or HMAC tag, as .hex() writes it).
HEX64 = "^[0-9a-f]{64}$"
_INCARNATION_OR_EMPTY = "^(?:[0-9a-f]{16,64})?$"
Incarnation = Annotated[str, msgspec.Meta(pattern=_INCARNATION)]
#: An incarnation, or "" where a peer states none (it predates them).
IncarnationOrEmpty = Annotated[str, msgspec.Meta(pattern=_INCARNATION_OR_EMPTY)]


def new_incarnation() -> str:
    """A fresh incarnation id (32 lower-case hex characters)."""
    return os.urandom(INCARNATION_BYTES).hex()


@runtime_checkable
class WireValue(Protocol):
    """A value whose wire form is a plain msgpack value of its own (not a map of fields)."""

    def to_wire(self) -> Any:
        """The msgpack-able wire form."""

    @classmethod
    def from_wire(cls, value: Any) -> Any:
        """The value of ``value`` (already msgpack-decoded); ValueError naming what is wrong."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, WireValue):
        return obj.to_wire()
    raise NotImplementedError(f"{type(obj).__name__} has no wire form")


def _dec_hook(cls: type, obj: Any) -> Any:
    from_wire = getattr(cls, "from_wire", None)
    if from_wire is None:
        raise NotImplementedError(f"{cls.__name__} has no wire form")
    try:
        return from_wire(obj)
    except msgspec.ValidationError as exc:
        # A nested check's path ("$[3]") is relative to this field: keep it in the text.
        raise ValueError(str(exc).replace(" - at `$", " - at `")) from None


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODERS: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_DECODERS_LOCK = threading.Lock()
_local = threading.local()


def encoder() -> msgspec.msgpack.Encoder:
    """The shared encoder (knows :class:`WireValue` types). Thread-safe."""
    return _ENCODER


def decoder(target: Any) -> msgspec.msgpack.Decoder[Any]:
    """A cached decoder for ``target`` (a type or a union of tagged structs)."""
    # Without the lock first: a listener asks for the same few decoders for every message it
    # reads, and a dict lookup is atomic.
    dec = _DECODERS.get(target)
    if dec is not None:
        return dec
    with _DECODERS_LOCK:
        dec = _DECODERS.get(target)
        if dec is None:
            dec = _DECODERS[target] = msgspec.msgpack.Decoder(target, dec_hook=_dec_hook)
        return dec


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    """While msgspec builds structs from checked input, their construction check is skipped
    (their ``_check`` still runs)."""
    outer = getattr(_local, "checking", False)
    _local.checking = True
    try:
        yield
    finally:
        _local.checking = outer


class NestedTooDeeplyError(msgspec.DecodeError):
    """msgpack nested deeper than the decoder can follow. msgspec descends one interpreter
    frame per level of a container it decodes untyped (``Any``, a key it skips) and raises
    RecursionError past the recursion limit: about 1,000 levels, a 1 KB message. A
    ``msgspec.DecodeError``, so that whoever handles undecodable input handles this too."""


def load(target: Any, payload: bytes | bytearray | memoryview) -> Any:
    """``payload`` (msgpack) decoded straight into ``target``; msgspec errors propagate, and
    input nested too deeply raises :class:`NestedTooDeeplyError` (a ``msgspec.DecodeError``)."""
    # What _checking() does, inline: its generator costs a listener more than the decode of a
    # small message, once per message it reads.
    outer = getattr(_local, "checking", False)
    _local.checking = True
    try:
        return decoder(target).decode(payload)
    except RecursionError:
        raise NestedTooDeeplyError(
            f"nested too deeply (more than about {sys.getrecursionlimit()} levels)"
        ) from None
    finally:
        _local.checking = outer


def convert(value: Any, target: Any, *, strict: bool = True) -> Any:
    """``value`` (builtins) checked against ``target``'s bounds; ``strict=False`` also reads
    numbers and booleans from strings ("6301", "true")."""
    with _checking():
        return msgspec.convert(value, target, strict=strict, dec_hook=_dec_hook)


_T = TypeVar("_T", bound="Schema")


class Schema(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every checked struct: constructing one checks every field's bounds, then
    ``_check``. Raises the class's ``ERROR`` type (an InvalidArgumentError subclass) whose text
    starts with ``WHAT`` and names the field and the value."""

    WHAT: ClassVar[str] = "value"
    ERROR: ClassVar[Callable[[str], Exception]]

    def __post_init__(self) -> None:
        if getattr(_local, "checking", False):
            self._check()
            return
        try:
            payload = _ENCODER.encode(self)
        except (TypeError, ValueError, OverflowError) as exc:  # a value with no wire form
            raise self.ERROR(f"{self.WHAT}: {exc}") from None
        try:
            checked = load(type(self), payload)
        except msgspec.ValidationError as exc:
            raise self.ERROR(explain(self.WHAT, exc, payload)) from None
        for name in self.__struct_fields__:
            msgspec.structs.force_setattr(self, name, getattr(checked, name))

    def _check(self) -> None:
        """Cross-field rules and normalisation (``force_setattr``); raise ValueError naming
        the wire field. Runs inside the decoder."""

    def replace(self: _T, **changes: Any) -> _T:
        """A checked copy with ``changes`` applied."""
        return msgspec.structs.replace(self, **changes)


_PATH_RE = re.compile(r"^(?P<text>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)
_STEP_RE = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_MISSING_RE = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")

# A position inside a field (from a WireValue's own check) and the printable-text pattern, said
# in words.
_NESTED_AT_RE = re.compile(r" - at `(\[[^`]*\])`")
_REGEX_RE = re.compile(r"Expected `str` matching regex '(?P<regex>.*)'", re.DOTALL)
# What a value failing each pattern should have been (the printable-text pattern otherwise), by
# the pattern as msgspec's errors show it (control characters escaped).
_PATTERN_MEANS = {
    _TRANSFER_ID.encode("unicode_escape").decode("ascii"): (
        f"expected printable characters other than '{PART_SEPARATOR}' (reserved: the engine "
        "names a transfer's parts <id>#p<rank> and <id>#d<rank>)"
    ),
    _INCARNATION: "expected 16..64 lower-case hex characters (an incarnation)",
    _INCARNATION_OR_EMPTY: "expected 16..64 lower-case hex characters (an incarnation) or ''",
    HEX64: "expected 64 lower-case hex characters",
}

_NOTHING = object()


def describe(value: Any) -> str:
    """``repr(value)``, cut to 80 characters."""
    try:
        text = repr(value)
    except RecursionError:  # nested deeper than the stack left allows: a bounded repr
        text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _lookup(raw: Any, path: str) -> Any:
    value = raw
    for name, index in _STEP_RE.findall(path.removeprefix("$")):
        try:
            value = value[name] if name else value[int(index)]
        except (KeyError, IndexError, TypeError):
            return _NOTHING
    return value


def explain(what: str, exc: msgspec.ValidationError, raw: Any) -> str:
    """One line: ``what``, the field path, the bad value and msgspec's reason.

    ``raw`` is what was decoded (bytes of msgpack, decoded again untyped to show the value, or
    the builtins that were converted); the value is left out when it cannot be found.
    """
    text = str(exc)
    if text.endswith(" - at `key` in `$`"):
        return f"{what}: a map key is not a string"
    for pattern, verb in ((_MISSING_RE, "lacks"), (_UNKNOWN_RE, "has unknown keys")):
        match = pattern.match(text)
        if match:
            return f"{what} {verb} {match.group('name')}"
    match = _PATH_RE.match(text)
    assert match is not None
    reason = _NESTED_AT_RE.sub(r" at \1", match.group("text"))
    reason = _REGEX_RE.sub(
        lambda m: _PATTERN_MEANS.get(m.group("regex"), "expected printable characters only"),
        reason,
    )
    reason = reason[:1].lower() + reason[1:]
    path = match.group("path")
    if "got `ext`" in reason:
        return f"{what}: msgpack extension types are not allowed"
    if path is None:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            return f"{what}: {reason}"
        return f"{what} = {describe(raw)}: {reason}"
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = load(Any, raw)
        except msgspec.DecodeError:
            raw = _NOTHING
    value = _lookup(raw, path) if raw is not _NOTHING else _NOTHING
    shown = path.removeprefix("$.").removeprefix("$")
    if not shown:
        return f"{what}: {reason}"
    if value is _NOTHING:
        return f"{what}: '{shown}': {reason}"
    return f"{what}: '{shown}' = {describe(value)}: {reason}"


__all__ = [
    "INCARNATION_BYTES",
    "MAX_BLOCK_ID",
    "MAX_BLOCK_IDS",
    "MAX_HOST_LEN",
    "MAX_ID_LEN",
    "MAX_KV_GROUPS",
    "MAX_PARALLEL_SIZE",
    "MAX_REQUEST_ID_LEN",
    "PART_SEPARATOR",
    "BlockId",
    "Id",
    "Incarnation",
    "IncarnationOrEmpty",
    "NestedTooDeeplyError",
    "Port",
    "Rank",
    "Schema",
    "Size",
    "TransferId",
    "WireValue",
    "convert",
    "decoder",
    "describe",
    "encoder",
    "explain",
    "load",
    "new_incarnation",
    "printable",
]
