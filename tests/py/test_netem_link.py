"""The user-space link emulator (tests/py/netem_link.py) on its own: numbered UDP datagrams from
one network namespace to another through it, and what arrived compared with what it says it
did. Needs root, iproute2 and /dev/net/tun; everything it creates it removes."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from net_support import disable_ipv6
from net_support import ip as _ip
from netem_link import Emulator, Impairment, Stats


def _unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "network namespaces and TUN devices need root"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

DATAGRAMS = 300
# The receiver stops once no datagram came for this long (the longest delay here is 20 ms).
IDLE_S = 1.0

_RECEIVER = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
s.settimeout(float(sys.argv[2]))
print(s.getsockname()[1], flush=True)
got = []
try:
    while True:
        got.append(int(s.recv(64)))
except TimeoutError:
    pass
print(json.dumps(got), flush=True)
"""

_SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(str(i).encode(), (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.0005)  # well below the devices' queues: every datagram reaches the emulator
"""


class Namespaces:
    """Two namespaces, "a" and "b", joined only by the emulator's TUN devices."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.ns = {"a": f"mnl-a-{tag}", "b": f"mnl-b-{tag}"}
        self.ip = {"a": "10.202.0.1", "b": "10.202.0.2"}
        self.emulator: Emulator | None = None
        try:
            for side in "ab":
                _ip("netns", "add", self.ns[side])
            self.emulator = Emulator((f"mnla{tag}", f"mnlb{tag}"), seed=7)
            for side, other, dev in (("a", "b", f"mnla{tag}"), ("b", "a", f"mnlb{tag}")):
                self._attach(side, other, dev)
        except BaseException:
            self.close()
            raise

    def _attach(self, side: str, other: str, dev: str) -> None:
        ns = self.ns[side]
        _ip("link", "set", dev, "netns", ns)
        disable_ipv6(ns, dev)  # only the test's datagrams cross the link
        _ip("-n", ns, "addr", "add", self.ip[side], "peer", self.ip[other], "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")

    def send(self, impairment: Impairment) -> tuple[list[int], Stats]:
        """``DATAGRAMS`` numbered datagrams from a to b over the link so impaired; the numbers
        in the order they arrived, and what the emulator did meanwhile."""
        assert self.emulator is not None
        self.emulator.set(impairment)
        start = self.emulator.stats()
        in_b = ["ip", "netns", "exec", self.ns["b"], sys.executable, "-c", _RECEIVER]
        receiver = subprocess.Popen(
            [*in_b, self.ip["b"], str(IDLE_S)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert receiver.stdout is not None
            port = receiver.stdout.readline().strip()
            in_a = ["ip", "netns", "exec", self.ns["a"], sys.executable, "-c", _SENDER]
            subprocess.run([*in_a, self.ip["b"], port, str(DATAGRAMS)], check=True, timeout=60)
            out, _ = receiver.communicate(timeout=60)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        return json.loads(out.splitlines()[-1]), self.emulator.stats().since(start)

    def close(self) -> None:
        if self.emulator is not None:
            self.emulator.close()
        for side in "ab":
            _ip("netns", "del", self.ns[side], check=False)


@pytest.fixture(scope="module")
def link() -> Iterator[Namespaces]:
    made = Namespaces()
    try:
        yield made
    finally:
        made.close()


def _overtakers(arrived: list[int]) -> int:
    """Datagrams that arrived before one sent earlier (that arrived too)."""
    count, smallest_after = 0, DATAGRAMS
    for n in reversed(arrived):
        if smallest_after < n:
            count += 1
        smallest_after = min(smallest_after, n)
    return count


def test_loss_and_reordering_are_what_it_counts(link: Namespaces) -> None:
    imp = Impairment(delay_s=0.020, jitter_s=0.005, loss=0.1, reorder=0.2)
    arrived, stats = link.send(imp)
    assert len(set(arrived)) == len(arrived), "a datagram arrived twice"
    assert set(arrived) <= set(range(DATAGRAMS))
    assert stats.dropped == DATAGRAMS - len(arrived) > 0
    assert stats.forwarded == len(arrived)
    assert stats.reordered == _overtakers(arrived) > 0
    assert stats.delayed + stats.reordered <= len(arrived)
    assert stats.cut == 0


def test_jitter_alone_keeps_the_order(link: Namespaces) -> None:
    arrived, stats = link.send(Impairment(delay_s=0.020, jitter_s=0.010))
    assert arrived == list(range(DATAGRAMS))
    assert stats.delayed == DATAGRAMS
    assert stats.dropped == stats.reordered == stats.cut == 0


def test_a_cut_drops_every_packet_and_a_restore_ends_it(link: Namespaces) -> None:
    arrived, stats = link.send(Impairment(cut=True))
    assert arrived == []
    assert stats.cut == DATAGRAMS
    arrived, stats = link.send(Impairment())
    assert arrived == list(range(DATAGRAMS))
    assert stats.forwarded == DATAGRAMS
    assert stats.faults() == 0
