"""Across "hosts" on one machine: the prefill and the decode in two network namespaces joined by
a veth pair, UCX over its TCP transport only (no shared memory, CMA or ``ucp_rkey_ptr``: the
peers share no address space a same-host shortcut could use), so every byte crosses the link as
it would between two hosts. Byte-verified READ and WRITE through the connector, then the link
taken down in the middle of a transfer, and brought back.

The network's own faults (loss, delay, reordering, a silent cut) come from a link emulator in
user space (tests/py/netem_link.py), not from ``tc netem``: one process owns a TUN device in each
namespace and carries every packet between them, impaired. For those scenarios a /32 route to
the peer through the TUN device overrides the veth's /30 on both sides, so the instances, their
UCX endpoints and ZMQ sockets, established over the veth, keep their addresses and continue over
the emulator; the veth must carry no packet meanwhile (checked). The emulator rather than kernel
netem, even where the kernel has netem: it runs on every kernel (this machine's lacks
``CONFIG_NET_SCH_NETEM``), so the rows are the same scenario everywhere, and it counts every
packet it dropped, delayed or reordered, so the test checks that each fault was injected.

Needs root (to create namespaces and TUN devices; the emulated scenarios skip without
/dev/net/tun); everything it creates it removes, and the emulator process it starts it stops by
its pid.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import faults_support as fs
from net_support import disable_ipv6
from net_support import ip as _ip
from netem_link import Emulator, Impairment, Stats
from test_vllm_support import write_model_dir

logger = logging.getLogger("moriio_native.tests.faults_netns")

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"mnf-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


UNAVAILABLE = _namespaces_unavailable()
if UNAVAILABLE:
    pytestmark.append(pytest.mark.skip(reason=UNAVAILABLE))


# The emulator's seed: the same draws in every run (the packets they fall on vary with timing).
EMULATOR_SEED = 14


class Link:
    """Two namespaces, one veth pair between them, a /30 of 10.201.0.0/16 on it; IPv6 off on
    the veth, so that nothing but the instances' own traffic crosses it."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.ns = {"p": f"mnf-p-{tag}", "d": f"mnf-d-{tag}"}
        self.dev = {"p": f"mnfp{tag}", "d": f"mnfd{tag}"}
        self.tun = {"p": f"mntp{tag}", "d": f"mntd{tag}"}
        net = random.randrange(1, 16000) * 4
        self.ip = {
            "p": f"10.201.{net // 256}.{net % 256 + 1}",
            "d": f"10.201.{net // 256}.{net % 256 + 2}",
        }
        self.cidr = f"10.201.{net // 256}.{net % 256}/30"
        for side in "pd":
            _ip("netns", "add", self.ns[side])
        _ip(
            "link", "add", self.dev["p"], "netns", self.ns["p"], "type", "veth",
            "peer", "name", self.dev["d"], "netns", self.ns["d"],
        )  # fmt: skip
        for side in "pd":
            disable_ipv6(self.ns[side], self.dev[side])
            _ip("-n", self.ns[side], "addr", "add", f"{self.ip[side]}/30", "dev", self.dev[side])
            _ip("-n", self.ns[side], "link", "set", "lo", "up")
            _ip("-n", self.ns[side], "link", "set", self.dev[side], "up")
        self.mac = {side: self._show(side, self.dev[side])["address"] for side in "pd"}

    def _show(self, side: str, dev: str, *opts: str) -> dict[str, Any]:
        shown = _ip("-n", self.ns[side], "-j", *opts, "link", "show", "dev", dev)
        return dict(json.loads(shown.stdout)[0])

    def set(self, state: str) -> None:
        _ip("-n", self.ns["p"], "link", "set", self.dev["p"], state)

    def start_emulator(self) -> Emulator:
        """The link emulator, its TUN devices moved into the namespaces and up (routed to only
        inside :meth:`through`)."""
        emulator = Emulator((self.tun["p"], self.tun["d"]), seed=EMULATOR_SEED)
        try:
            for side in "pd":
                _ip("link", "set", self.tun[side], "netns", self.ns[side])
                disable_ipv6(self.ns[side], self.tun[side])
                _ip("-n", self.ns[side], "link", "set", self.tun[side], "up")
        except BaseException:
            emulator.close()
            raise
        return emulator

    def veth_packets(self) -> int:
        """Packets both ends of the veth sent so far."""
        return sum(self._show(s, self.dev[s], "-s")["stats64"]["tx"]["packets"] for s in "pd")

    @contextmanager
    def through(self, emulator: Emulator, row: fs.Row) -> Iterator[None]:
        """Each side's traffic to the other routed through the emulator (a /32 beats the veth's
        /30, the source address stays the veth's, so established connections carry on); a
        violation in ``row`` if the veth carried a packet meanwhile."""
        for side, other in (("p", "d"), ("d", "p")):
            _ip(
                "-n", self.ns[side], "route", "add", f"{self.ip[other]}/32",
                "dev", self.tun[side], "src", self.ip[side],
            )  # fmt: skip
            # The peer's veth address pinned: an ARP entry the veth used just before would be
            # probed (a request and its reply on the veth) once TCP stops confirming it.
            _ip(
                "-n", self.ns[side], "neigh", "replace", self.ip[other],
                "lladdr", self.mac[other], "dev", self.dev[side], "nud", "permanent",
            )  # fmt: skip
        try:
            quiet = self.veth_packets()
            yield
            sent = self.veth_packets() - quiet
            row.check(sent == 0, f"the veth carried {sent} packets: not all crossed the emulator")
        finally:
            for side, other in (("p", "d"), ("d", "p")):
                ns, peer = self.ns[side], self.ip[other]
                _ip("-n", ns, "route", "del", f"{peer}/32", check=False)
                _ip("-n", ns, "neigh", "del", peer, "dev", self.dev[side], check=False)
            emulator.set(Impairment())  # the next scenario starts on an unimpaired link

    def side_args(self, side: str) -> dict[str, Any]:
        return {
            "extra": {"host_ip": self.ip[side], "allowed_peers": [self.cidr]},
            "env": {**fs.UCX_ENV, "UCX_NET_DEVICES": self.dev[side]},
            "netns": self.ns[side],
        }

    def close(self) -> None:
        for side in "pd":
            _ip("netns", "del", self.ns[side], check=False)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    made = Link()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def emulator(link: Link) -> Iterator[Emulator]:
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("the link emulator's TUN devices need /dev/net/tun")
    made = link.start_emulator()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module", params=["read", "write"])
def pair(
    request: pytest.FixtureRequest, link: Link, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[fs.Pair]:
    model_dir = write_model_dir(Path(tmp_path_factory.mktemp("model")))
    sides = {"kv_producer": link.side_args("p"), "kv_consumer": link.side_args("d")}
    made = fs.Pair(model_dir, request.param, sides)
    try:
        yield made
    finally:
        made.close()


def _transfer(pair: fs.Pair, row: fs.Row, **kw: Any) -> dict[str, Any]:
    if pair.mode == "read":
        return fs.read_transfer(pair, row, **kw)
    return fs.write_transfer(pair, row, **kw)


def test_byte_verified_across_namespaces(pair: fs.Pair) -> None:
    mode = pair.mode.upper()
    with fs.recorded(f"{mode} across namespaces (veth, UCX tcp), no fault") as row:
        for _ in range(fs.rounds(2)):
            out = _transfer(pair, row)
            fs.audit(pair, row, [out["rid"]])
            row.rounds += 1
        fs.finish(pair, row)


def _cut_mid_transfer(
    pair: fs.Pair, row: fs.Row, cut: Callable[[], None], restore: Callable[[], None]
) -> None:
    """Rounds of: a transfer (handshakes done, so the cut hits the next transfer), one cut by
    ``cut()`` as that transfer starts and ``restore()`` 3 s later, then a transfer over the
    restored link; invariants audited after each round."""
    for _ in range(fs.rounds(1)):
        _transfer(pair, row)

        def down() -> None:
            cut()
            row.faults += 1

        def up_later() -> None:
            time.sleep(3.0)
            restore()

        hooks = {"before": down, "during": up_later}
        if pair.mode == "write":
            hooks = {"between": down, "after": up_later}
        out = _transfer(pair, row, expect=("loaded", "recomputed"), **hooks)
        after = _transfer(pair, row)  # the link works again
        fs.audit(pair, row, [out["rid"], after["rid"]], wait=60)
        row.rounds += 1


def test_link_down_mid_transfer_then_up(pair: fs.Pair, link: Link) -> None:
    mode = pair.mode.upper()
    with fs.recorded(f"{mode} across namespaces, link down mid-transfer, up 3 s later") as row:
        _cut_mid_transfer(pair, row, lambda: link.set("down"), lambda: link.set("up"))
        fs.finish(pair, row)


# What ``tc netem delay 20ms 5ms loss 2% reorder 10%`` asks, in both directions.
NETEM = Impairment(delay_s=0.020, jitter_s=0.005, loss=0.02, reorder=0.10)
# The most rounds the scenario runs to see each kind of fault injected at least once.
MAX_NETEM_ROUNDS = 10


def test_netem_loss_delay_reorder(pair: fs.Pair, link: Link, emulator: Emulator) -> None:
    """Transfers over a link that delays, loses and reorders packets: TCP recovers, so every
    transfer is loaded, byte-exact. The rounds go on past the tier's until each kind of fault
    was injected (a round is 45 to 120 packets: at 2% a round may lose none), at most
    ``MAX_NETEM_ROUNDS`` (or the tier's rounds, if more)."""
    mode = pair.mode.upper()
    scenario = f"{mode} across namespaces, emulated link: 20 ± 5 ms each way, 2% loss, 10% reorder"
    with fs.recorded(scenario) as row:
        with link.through(emulator, row):
            start = emulator.stats()
            emulator.set(NETEM)
            got, rounds = Stats(), fs.rounds(2)
            cap = max(rounds, MAX_NETEM_ROUNDS)
            while row.rounds < cap and (row.rounds < rounds or not (got.dropped and got.reordered)):
                out = _transfer(pair, row)
                fs.audit(pair, row, [out["rid"]], wait=60)
                row.rounds += 1
                got = emulator.stats().since(start)
        logger.info("%s: %s", scenario, got)
        row.faults += got.faults()
        for kind in ("dropped", "delayed", "reordered"):
            row.check(getattr(got, kind) > 0, f"no packet {kind} in {row.rounds} rounds: {got}")
        fs.finish(pair, row)


def test_emulated_link_cut_mid_transfer_then_restored(
    pair: fs.Pair, link: Link, emulator: Emulator
) -> None:
    """A silent cut: both ends keep carrier and addresses while every packet is dropped (a
    cable cut beyond the switch), where the veth's link down tells both kernels."""
    mode = pair.mode.upper()
    scenario = f"{mode} across namespaces, emulated link cut mid-transfer, restored 3 s later"
    with fs.recorded(scenario) as row:
        with link.through(emulator, row):
            start = emulator.stats()
            _cut_mid_transfer(
                pair, row, lambda: emulator.set(Impairment(cut=True)),
                lambda: emulator.set(Impairment()),
            )  # fmt: skip
            got = emulator.stats().since(start)
        logger.info("%s: %s", scenario, got)
        row.check(got.cut > 0, f"the cuts dropped no packet: {got}")
        fs.finish(pair, row)
