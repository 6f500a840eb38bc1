"""What a multipart message that never ends costs a listening process, without and with a
shared secret (docs/reliability.md, Security).

ZMQ queues every frame of a message until its last one and bounds only one frame's size
(``MAXMSGSIZE``), not their number, before the application sees anything. For each mode a
notify listener is opened in this process and a raw ZMTP client (tests/py/zmtp_support.py)
sends it the greeting, READY and ``--frames`` empty frames with the MORE flag; printed: the
frames the client got in, whether the listener closed the connection, the messages the listener
read (none can be: the message never ends), and the process's RSS before and after (its growth
is what ZMQ queued). With a secret the listener is a CURVE server and the client, holding no
key, is closed at its greeting.

``--stalled N``: instead, N keyless connections each open a CURVE handshake and send all but the
last MiB of a HELLO command declared 16 MiB long (a real one is 200 bytes), then stall: printed,
the RSS right after and once the listener's handshake limit (2 s by default) is over,
and how many of the connections the listener had closed by then. Runs anywhere::

    PYTHONPATH=build/dev/python python3 tests/py/multipart_rss.py [--frames 8000000] [--stalled 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import time

from moriio_native.control.channel import NotifyListener
from moriio_native.control.security import DEFAULT_LISTENER_HANDSHAKE_MS, ControlSecurity
from zmtp_support import ZMTP_GREETING, send_endless_message, zmtp_greeting

HELLO_BYTES = 16 << 20  # the declared size of the stalled HELLO

LOCAL = "127.0.0.1"
SECRET = "the multipart benchmark's secret"


def rss_mib() -> float:
    """This process's resident set size, MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(secret: bool, frames: int) -> dict[str, object]:
    """One listener, one endless message; the figures of it."""
    config: dict[str, object] = {"allowed_peers": [f"{LOCAL}/32"]}
    if secret:
        config["auth_secret"] = SECRET
    with NotifyListener(0, ControlSecurity.from_config(config), bind_host=LOCAL) as listener:
        time.sleep(0.2)  # the listener thread up, its allocations made
        before = rss_mib()
        endless = send_endless_message(LOCAL, listener.port, frames=frames, linger_s=1.0)
        return {
            "secret": secret,
            "frames_sent": endless.frames_sent,
            "closed_by_listener": endless.closed,
            "messages_read": listener.stats()["received"],
            "rss_before_mib": round(before, 1),
            "rss_after_mib": round(rss_mib(), 1),
        }


def _stall(port: int) -> socket.socket:
    """One keyless connection stalled in a CURVE handshake with most of a huge HELLO sent."""
    conn = socket.create_connection((LOCAL, port), timeout=10)
    conn.sendall(zmtp_greeting(b"CURVE"))
    conn.recv(len(ZMTP_GREETING))
    conn.sendall(b"\x06" + HELLO_BYTES.to_bytes(8, "big"))
    with contextlib.suppress(OSError):  # closed by the listener meanwhile
        conn.sendall(b"\0" * (HELLO_BYTES - (1 << 20)))
    return conn


def _closed(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(65536) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def measure_stalled(connections: int) -> dict[str, object]:
    """``connections`` stalled handshakes to a listener with a secret; the figures of them."""
    config = {"allowed_peers": [f"{LOCAL}/32"], "auth_secret": SECRET}
    with NotifyListener(0, ControlSecurity.from_config(config), bind_host=LOCAL) as listener:
        time.sleep(0.2)
        before = rss_mib()
        conns = [_stall(listener.port) for _ in range(connections)]
        during = rss_mib()
        time.sleep(DEFAULT_LISTENER_HANDSHAKE_MS / 1000 + 1)
        after = rss_mib()
        closed = sum(_closed(conn) for conn in conns)
        for conn in conns:
            conn.close()
        return {
            "stalled_connections": connections,
            "closed_by_listener": closed,
            "rss_before_mib": round(before, 1),
            "rss_stalled_mib": round(during, 1),
            "rss_after_limit_mib": round(after, 1),
            "handshake_limit_ms": DEFAULT_LISTENER_HANDSHAKE_MS,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=8_000_000)
    parser.add_argument("--stalled", type=int, default=0, help="stalled handshakes instead")
    args = parser.parse_args()
    if args.stalled:
        print(json.dumps(measure_stalled(args.stalled)))
        return
    for secret in (True, False):  # the secret first: the other grows the RSS it measures from
        print(json.dumps(measure(secret, args.frames)))


if __name__ == "__main__":
    main()
