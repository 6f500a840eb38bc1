"""Ports for the tests' listeners, and the ``ip`` commands of the tests that build network
namespaces.

A port found by binding to port 0 comes from the kernel's ephemeral range, which every outbound
connection also draws from: between choosing it and the listener binding it, any connection (a ZMQ
dial, a demo running alongside) can take it. Ports below that range are only ever taken by
explicit binds, so choosing one that is bindable now is safe for a test run, provided no other
choice of this process hands it out again before its listener binds it: servers are often picked
for first and started later (a proxy, then the instances that register with it), so the last
4,096 ports handed out are remembered and not handed out again (an end-to-end run once gave a
prefill's handshake port to the proxy picked before it, and the prefill failed to bind). Only the
recent ones: a whole test run picks thousands, and a port picked long ago has long been bound.
"""

from __future__ import annotations

import random
import socket
import subprocess

_LOW, _HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
_REMEMBERED = 4096
_handed_out: dict[int, None] = {}  # an ordered set: oldest first


def _remember(ports: range) -> None:
    for port in ports:
        _handed_out[port] = None
    while len(_handed_out) > _REMEMBERED:
        del _handed_out[next(iter(_handed_out))]


def _bindable_now(host: str, ports: range) -> bool:
    """Whether no port of ``ports`` was handed out recently and ``host`` can bind every one."""
    if any(port in _handed_out for port in ports):
        return False
    held: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket()
            held.append(s)
            s.bind((host, port))
    except OSError:
        return False
    finally:
        for s in held:
            s.close()
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port in [20000, 32000) that ``host`` can bind right now and this process did not hand
    out recently."""
    return free_ports(1, host)


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports in [20000, 32000) that ``host`` can bind right
    now and this process did not hand out recently (a listener per rank: base + rank)."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(_LOW, _HIGH - count + 1)
        ports = range(base, base + count)
        if _bindable_now(host, ports):
            _remember(ports)
            return base
    raise RuntimeError(
        f"no {count} consecutive bindable ports in [{_LOW}, {_HIGH}) on {host} "
        f"({len(_handed_out)} handed out recently by this process)"
    )


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` (iproute2), bounded in time; raises on failure when ``check``."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def disable_ipv6(namespace: str, dev: str) -> None:
    """No IPv6 on ``dev`` inside ``namespace``: no link-local address, router solicitations or
    MLD reports, so the device carries only what a test sends."""
    key = f"net.ipv6.conf.{dev}.disable_ipv6=1"
    ip("netns", "exec", namespace, "sysctl", "-qw", key)
