"""Across "hosts" on one machine: the prefill and the decode in two network namespaces joined by
a veth pair, UCX over its TCP transport only (no shared memory, CMA or ``ucp_rkey_ptr``: the
peers share no address space a same-host shortcut could use), so every byte crosses the link as
it would between two hosts. Byte-verified READ and WRITE through the connector, then the link
taken down in the middle of a transfer, and brought back. The network's own faults (loss,
delay, reordering) need ``tc netem``: where the kernel lacks it, that test says so and skips.

Needs root (to create namespaces); everything it creates it removes.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import faults_support as fs
from test_vllm_support import write_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


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


class Link:
    """Two namespaces, one veth pair between them, a /30 of 10.201.0.0/16 on it."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.ns = {"p": f"mnf-p-{tag}", "d": f"mnf-d-{tag}"}
        self.dev = {"p": f"mnfp{tag}", "d": f"mnfd{tag}"}
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
            _ip("-n", self.ns[side], "addr", "add", f"{self.ip[side]}/30", "dev", self.dev[side])
            _ip("-n", self.ns[side], "link", "set", "lo", "up")
            _ip("-n", self.ns[side], "link", "set", self.dev[side], "up")

    def set(self, state: str) -> None:
        _ip("-n", self.ns["p"], "link", "set", self.dev["p"], state)

    def netem(self, *spec: str) -> subprocess.CompletedProcess[str]:
        cmd = ["ip", "netns", "exec", self.ns["p"], "tc", "qdisc", "replace", "dev"]
        return subprocess.run(
            [*cmd, self.dev["p"], "root", "netem", *spec], capture_output=True, text=True
        )

    def netem_off(self) -> None:
        cmd = ["ip", "netns", "exec", self.ns["p"], "tc", "qdisc", "del", "dev", self.dev["p"]]
        subprocess.run([*cmd, "root"], capture_output=True, text=True)

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


def test_link_down_mid_transfer_then_up(pair: fs.Pair, link: Link) -> None:
    mode = pair.mode.upper()
    with fs.recorded(f"{mode} across namespaces, link down mid-transfer, up 3 s later") as row:
        for _ in range(fs.rounds(1)):
            _transfer(pair, row)  # handshakes done: the cut hits the transfer

            def down() -> None:
                link.set("down")
                row.faults += 1

            def up_later() -> None:
                time.sleep(3.0)
                link.set("up")

            hooks = {"before": down, "during": up_later}
            if pair.mode == "write":
                hooks = {"between": down, "after": up_later}
            out = _transfer(pair, row, expect=("loaded", "recomputed"), **hooks)
            after = _transfer(pair, row)  # the link works again
            fs.audit(pair, row, [out["rid"], after["rid"]], wait=60)
            row.rounds += 1
        fs.finish(pair, row)


def test_netem_loss_delay_reorder(pair: fs.Pair, link: Link) -> None:
    made = link.netem("delay", "20ms", "5ms", "loss", "2%", "reorder", "10%")
    if made.returncode != 0:
        pytest.skip(
            f"tc netem is unavailable on this kernel ({made.stderr.strip()}): loss, delay and "
            "reordering cannot be injected here"
        )
    mode = pair.mode.upper()
    try:
        with fs.recorded(f"{mode} across namespaces, netem 20 ms delay, 2% loss, reorder") as row:
            for _ in range(fs.rounds(2)):
                out = _transfer(pair, row)
                row.faults += 1
                fs.audit(pair, row, [out["rid"]], wait=60)
                row.rounds += 1
            fs.finish(pair, row)
    finally:
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                link.ns["p"],
                "tc",
                "qdisc",
                "del",
                "dev",
                link.dev["p"],
                "root",
            ],
            capture_output=True,
        )
