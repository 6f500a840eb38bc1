"""Ports for the tests' listeners, and the ``ip`` commands of the tests that build network
namespaces.

A port found by binding to port 0 comes from the kernel's ephemeral range, which every outbound
connection also draws from: between choosing it and the listener binding it, any connection (a ZMQ
dial, a demo running alongside) can take it. Ports below that range are only ever taken by
explicit binds, so choosing one that is bindable now is safe for a test run.
"""

from __future__ import annotations

import random
import socket
import subprocess

_LOW, _HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)


def free_port(host: str = "127.0.0.1") -> int:
    """A port in [20000, 32000) that ``host`` can bind right now."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(_LOW, _HIGH)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no bindable port in [{_LOW}, {_HIGH}) on {host}")


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports in [20000, 32000) that ``host`` can bind right
    now (a listener per rank: base + rank)."""
    if count == 1:
        return free_port(host)
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(_LOW, _HIGH - count)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive bindable ports in [{_LOW}, {_HIGH}) on {host}")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` (iproute2), bounded in time; raises on failure when ``check``."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def disable_ipv6(namespace: str, dev: str) -> None:
    """No IPv6 on ``dev`` inside ``namespace``: no link-local address, router solicitations or
    MLD reports, so the device carries only what a test sends."""
    key = f"net.ipv6.conf.{dev}.disable_ipv6=1"
    ip("netns", "exec", namespace, "sysctl", "-qw", key)
