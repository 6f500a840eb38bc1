"""A raw ZMTP 3.0 client, as a stranger's program would speak to a listening port: the NULL
mechanism's greeting and READY, message frames, and a multipart message that never ends.

ZMQ's own sockets cannot be made to send a message without end or garbage on a new connection
each time; these bytes can.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


def zmtp_greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting of a client with ``mechanism`` (``b"NULL"``, ``b"CURVE"``)."""
    return b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32


# What any ZMQ peer without CURVE keys sends first.
ZMTP_GREETING = zmtp_greeting(b"NULL")
# The NULL mechanism's READY command of a DEALER, which must follow the greetings.
_READY_BODY = b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
ZMTP_READY = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY
# One empty frame with the MORE flag (a short frame): a multipart message that goes on.
MORE_EMPTY_FRAME = b"\x01\x00"


def zmtp_message(frames: list[bytes]) -> bytes:
    """``frames`` as ZMTP 3.0 message frames (MORE on all but the last)."""
    out = []
    for i, frame in enumerate(frames):
        more = 0x01 if i < len(frames) - 1 else 0
        if len(frame) > 255:
            out.append(bytes([more | 0x02]) + len(frame).to_bytes(8, "big") + frame)
        else:
            out.append(bytes([more, len(frame)]) + frame)
    return b"".join(out)


def greeted(conn: socket.socket) -> bool:
    """Send the greeting on ``conn`` and read the listener's, as a ZMQ peer waits for it;
    False when the listener closed the connection instead."""
    conn.sendall(ZMTP_GREETING)
    got = 0
    while got < len(ZMTP_GREETING):
        part = conn.recv(len(ZMTP_GREETING) - got)
        if not part:
            return False
        got += len(part)
    return True


@dataclass(frozen=True)
class EndlessMessage:
    """What a listener did with a multipart message that never ends: the frames the sender
    got into the connection, and whether the listener closed it."""

    frames_sent: int
    closed: bool


def send_endless_message(
    host: str, port: int, *, frames: int, linger_s: float, chunk: int = 10_000
) -> EndlessMessage:
    """Greeting, READY, then up to ``frames`` empty frames with the MORE flag to ``host:port``
    (never the last one), then wait ``linger_s`` seconds for the listener to close the
    connection."""
    sent = 0
    with socket.create_connection((host, port), timeout=10) as conn:
        try:
            if not greeted(conn):
                return EndlessMessage(0, True)
            conn.sendall(ZMTP_READY)
            while sent < frames:
                conn.sendall(MORE_EMPTY_FRAME * chunk)
                sent += chunk
            conn.settimeout(linger_s)
            while conn.recv(65536):  # its READY, then its close
                pass
        except ConnectionError:  # reset by the listener, or a send into the closed connection
            return EndlessMessage(sent, True)
        except TimeoutError:
            return EndlessMessage(sent, False)
    return EndlessMessage(sent, True)


def stalled_handshake(
    host: str, port: int, *, mechanism: bytes, declared: int, sent: int, wait_s: float
) -> bool:
    """Open a ZMQ handshake with ``mechanism``'s greeting, then send the first ``sent`` bytes
    of a handshake command declared ``declared`` bytes long (a CURVE HELLO is 200, a READY
    tens) and stall; whether the listener closed the connection within ``wait_s`` seconds."""
    with socket.create_connection((host, port), timeout=10) as conn:
        try:
            conn.sendall(zmtp_greeting(mechanism))
            got = 0
            while got < len(ZMTP_GREETING):  # the listener's greeting: it took the mechanism
                part = conn.recv(len(ZMTP_GREETING) - got)
                if not part:
                    return True
                got += len(part)
            conn.sendall(b"\x06" + declared.to_bytes(8, "big") + b"\0" * sent)
            conn.settimeout(wait_s)
            while conn.recv(65536):
                pass
        except ConnectionError:
            return True
        except TimeoutError:
            return False
    return True
