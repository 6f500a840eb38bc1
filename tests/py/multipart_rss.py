"""What a multipart message that never ends costs a listening process, without and with a
shared secret (docs/reliability.md, Security).

ZMQ queues every frame of a message until its last one and bounds only one frame's size
(``MAXMSGSIZE``), not their number, before the application sees anything. For each mode a
notify listener is opened in this process and a raw ZMTP client (tests/py/zmtp_support.py)
sends it the greeting, READY and ``--frames`` empty frames with the MORE flag; printed: the
frames the client got in, whether the listener closed the connection, the messages the listener
read (none can be: the message never ends), and the process's RSS before and after (its growth
is what ZMQ queued). With a secret the listener is a CURVE server and the client, holding no
key, is closed at its greeting. Runs anywhere::

    PYTHONPATH=build/dev/python python3 tests/py/multipart_rss.py [--frames 8000000]
"""

from __future__ import annotations

import argparse
import json
import time

from moriio_native.control.channel import NotifyListener
from moriio_native.control.security import ControlSecurity
from zmtp_support import send_endless_message

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=8_000_000)
    args = parser.parse_args()
    for secret in (True, False):  # the secret first: the other grows the RSS it measures from
        print(json.dumps(measure(secret, args.frames)))


if __name__ == "__main__":
    main()
