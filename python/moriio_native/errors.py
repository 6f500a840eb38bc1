"""Exceptions raised by moriio_native. Each native status code maps to one class that also
inherits the matching builtin, so ``except ValueError`` keeps working for callers that do not
know this package."""

from __future__ import annotations


class MoriioError(Exception):
    """Base class of every moriio_native error."""


class InvalidArgumentError(MoriioError, ValueError):
    """The caller passed something wrong; nothing changed."""


class NotFoundError(MoriioError, LookupError):
    """A named layer, peer or transfer does not exist."""


class AlreadyExistsError(MoriioError, ValueError):
    """A named thing exists already."""


class FailedPreconditionError(MoriioError, RuntimeError):
    """The object is not in a state that allows the call."""


class OutOfRangeError(MoriioError, IndexError):
    """A block id or offset lies outside its valid range."""


class IncompatiblePeerError(MoriioError, ValueError):
    """A peer's layout or protocol version does not match ours."""


class BackendUnavailableError(MoriioError, RuntimeError):
    """A transport backend cannot run on this machine; the message says why."""


class TransportError(MoriioError, ConnectionError):
    """The transport reported an error."""


class TransferTimeoutError(MoriioError, TimeoutError):
    """A deadline passed."""


class AbortedError(MoriioError, RuntimeError):
    """The operation was aborted."""


class InternalError(MoriioError, RuntimeError):
    """An invariant did not hold: a bug in moriio_native."""


_BY_CODE: dict[str, type[MoriioError]] = {
    "InvalidArgument": InvalidArgumentError,
    "NotFound": NotFoundError,
    "AlreadyExists": AlreadyExistsError,
    "FailedPrecondition": FailedPreconditionError,
    "OutOfRange": OutOfRangeError,
    "Incompatible": IncompatiblePeerError,
    "BackendUnavailable": BackendUnavailableError,
    "Transport": TransportError,
    "Timeout": TransferTimeoutError,
    "Aborted": AbortedError,
    "Internal": InternalError,
}


def error_class_for(code_name: str) -> type[MoriioError]:
    """The exception class for a native status code name (InternalError when unknown)."""
    return _BY_CODE.get(code_name, InternalError)


__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "BackendUnavailableError",
    "FailedPreconditionError",
    "IncompatiblePeerError",
    "InternalError",
    "InvalidArgumentError",
    "MoriioError",
    "NotFoundError",
    "OutOfRangeError",
    "TransferTimeoutError",
    "TransportError",
    "error_class_for",
]
