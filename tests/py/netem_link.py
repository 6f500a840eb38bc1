"""A network link emulator in user space, for kernels without ``tc netem``.

Two TUN devices (layer 3, no packet information header) and one process that owns both: every
IP packet the kernel routes into one device is read by the process and written into the other
one, after the link's impairment: a delay with jitter, random loss, reordering, or a cut (every
packet dropped). Moved into two network namespaces and routed to, the devices make a link between
them that only this process carries, so every byte the namespaces exchange over it crosses the
emulator, and the emulator counts what it did to them.

The impairment, per direction, as ``tc netem delay D J loss L reorder R`` words it:

* loss: each packet is dropped with probability ``loss``;
* reorder: each packet that is not dropped skips the delay with probability ``reorder`` and goes
  out at once, ahead of the packets still held (counted as reordered only when it overtook one);
* delay: every other packet is held ``delay`` plus a jitter drawn uniformly from
  [-jitter, +jitter], but never sent before a packet held before it. Unlike netem, the jitter
  alone reorders nothing: at TCP's packet rates it would reorder nearly every packet, and the
  reordering measured would be the jitter's, not the configured fraction;
* cut: every packet is dropped, and those held are dropped too (a cable cut beyond the switch:
  both ends keep their carrier and addresses, nothing tells them).

Drops, delays and reorders are mutually exclusive per packet, so their sum counts the packets
that met a fault. The random draws come from one seeded generator.

The process is this file run as a script (``python3 netem_link.py DEV_A DEV_B --seed N``); it
creates the devices (non-persistent: they vanish when it exits, wherever they were moved), says
``ready`` on stdout and serves one JSON request per stdin line: ``{"op": "set", ...}`` (an
:class:`Impairment`'s fields) and ``{"op": "stats"}``, answering one JSON line each. It ends at
the end of stdin or on SIGTERM. :class:`Emulator` starts and drives it from a test.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import json
import logging
import os
import random
import select
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("moriio_native.tests.netem_link")

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MAX_PACKET = 65535
# Packets read from one device per wake-up: the other direction and the held queues get their
# turn at least this often.
_READ_BATCH = 64
_STOP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Impairment:
    """What the link does to each packet, in both directions (see the module docstring)."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    reorder: float = 0.0
    cut: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter_s <= self.delay_s:
            raise ValueError(f"jitter {self.jitter_s}s must lie in [0, delay {self.delay_s}s]")
        for name in ("loss", "reorder"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} {getattr(self, name)} is not a probability")


@dataclasses.dataclass
class Stats:
    """What the emulator did, both directions together, since it started."""

    forwarded: int = 0  # packets written to the other device, at once or after their delay
    bytes: int = 0  # of those packets
    dropped: int = 0  # by the random loss
    cut: int = 0  # dropped while the link was cut (arriving or held)
    delayed: int = 0  # sent after their delay
    reordered: int = 0  # sent at once, ahead of at least one packet held before them

    def faults(self) -> int:
        """Packets that met a fault (the kinds are exclusive per packet)."""
        return self.dropped + self.cut + self.delayed + self.reordered

    def since(self, earlier: Stats) -> Stats:
        """What the emulator did between ``earlier`` and these counts."""
        fields = dataclasses.fields(self)
        return Stats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields})


# ---- the emulator process -----------------------------------------------------------------------


def open_tun(name: str) -> int:
    """A new non-blocking layer-3 TUN device ``name`` (no packet information header); its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class _Direction:
    """Packets read from ``src`` on their way into ``dst``. The held ones, with the time each
    is due, stay in arrival order: one goes when it is due and all ahead of it went, so the
    jitter reorders nothing."""

    def __init__(self, src: int, dst: int) -> None:
        self.src = src
        self.dst = dst
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()


class _Forwarder:
    """The loop of the emulator process: both directions and the request channel on stdin."""

    def __init__(self, fds: tuple[int, int], seed: int) -> None:
        a, b = fds
        self.directions = (_Direction(a, b), _Direction(b, a))
        self.rng = random.Random(seed)
        self.impairment = Impairment()
        self.stats = Stats()
        self.requests = b""
        self.done = False

    def run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for d in self.directions:
                sel.register(d.src, selectors.EVENT_READ, d)
            sel.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
            while not self.done:
                for key, _ in sel.select(self._wait_s()):
                    if key.data is None:
                        self._serve_requests()
                    else:
                        self._receive(key.data)
                self._send_due(time.monotonic())

    def _wait_s(self) -> float | None:
        dues = [d.held[0][0] for d in self.directions if d.held]
        return max(0.0, min(dues) - time.monotonic()) if dues else None

    def _receive(self, d: _Direction) -> None:
        for _ in range(_READ_BATCH):
            try:
                packet = os.read(d.src, _MAX_PACKET)
            except BlockingIOError:
                return
            self._impair(d, packet, time.monotonic())

    def _impair(self, d: _Direction, packet: bytes, now: float) -> None:
        imp = self.impairment
        if imp.cut:
            self.stats.cut += 1
        elif self.rng.random() < imp.loss:
            self.stats.dropped += 1
        elif imp.delay_s == 0.0:
            self._write(d, packet)
        elif self.rng.random() < imp.reorder:
            if d.held:
                self.stats.reordered += 1
            self._write(d, packet)
        else:
            jitter = self.rng.uniform(-imp.jitter_s, imp.jitter_s)
            d.held.append((now + imp.delay_s + jitter, packet))

    def _send_due(self, now: float) -> None:
        for d in self.directions:
            while d.held and d.held[0][0] <= now:
                self._write(d, d.held.popleft()[1])
                self.stats.delayed += 1

    def _write(self, d: _Direction, packet: bytes) -> None:
        try:
            os.write(d.dst, packet)
        except OSError as exc:  # the receiving device is down or gone: the packet is lost
            logger.debug("writing a packet failed: %s", exc)
            return
        self.stats.forwarded += 1
        self.stats.bytes += len(packet)

    def _serve_requests(self) -> None:
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            self.done = True
            return
        self.requests += chunk
        while b"\n" in self.requests:
            line, self.requests = self.requests.split(b"\n", 1)
            _answer(self._handle(json.loads(line)))

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.pop("op")
        if op == "stats":
            return dataclasses.asdict(self.stats)
        if op == "set":
            self.impairment = Impairment(**request)
            if self.impairment.cut:
                for d in self.directions:
                    self.stats.cut += len(d.held)
                    d.held.clear()
            return {"ok": True}
        raise ValueError(f"unknown request {op!r}")


def _answer(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A link emulator between two new TUN devices.")
    parser.add_argument("devices", nargs=2, help="names of the two TUN devices to create")
    parser.add_argument("--seed", type=int, default=0, help="of the loss/reorder/jitter draws")
    args = parser.parse_args(argv)
    # The test stops this process by its pid: SIGTERM ends it like the end of stdin.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fds = (open_tun(args.devices[0]), open_tun(args.devices[1]))
    _answer({"ready": True})
    _Forwarder(fds, args.seed).run()
    return 0


# ---- in the test process ------------------------------------------------------------------------


class Emulator:
    """The emulator process with its two TUN devices ``devices`` (created in this process's
    network namespace, ready to be moved); the link starts unimpaired. ``timeout_s`` bounds
    every answer (a hang guard)."""

    def __init__(self, devices: tuple[str, str], seed: int, timeout_s: float = 30.0) -> None:
        self.devices = devices
        self._timeout_s = timeout_s
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *devices, "--seed", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._pending = b""
        try:
            ready = self._reply()
        except Exception:
            self.close()
            raise
        if ready != {"ready": True}:
            self.close()
            raise RuntimeError(f"netem_link did not start: {ready}")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def set(self, impairment: Impairment) -> None:
        self._request({"op": "set", **dataclasses.asdict(impairment)})

    def stats(self) -> Stats:
        return Stats(**self._request({"op": "stats"}))

    def close(self) -> None:
        """Ends the process (end of stdin; SIGKILL by pid if it does not exit in time); its
        devices vanish with it."""
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError as exc:  # it already exited
                logger.debug("closing the emulator's stdin: %s", exc)
        try:
            self._proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(_STOP_TIMEOUT_S)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        out = self._proc.stdout.fileno()
        deadline = time.monotonic() + self._timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                raise TimeoutError(f"netem_link (pid {self.pid}) did not answer")
            chunk = os.read(out, 4096)
            if not chunk:
                raise RuntimeError(f"netem_link (pid {self.pid}) exited: {self._proc.wait()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return dict(json.loads(line))


if __name__ == "__main__":
    sys.exit(main())
