"""What a flood of the control ports costs the listening process: one thread per listener against
the process's one listener thread, in one process, alternating.

Each trial opens ``L`` notify listeners (a vLLM worker has two listeners, a handshake server and
a notify listener; the flood benchmark's process four) and a spawned sender that floods all of
them in turn at ``--rate`` messages per second in all: every fourth message garbage (dropped at
its schema), the rest valid releases of unknown transfers (delivered, drained by the main
thread every 10 ms), the mix of ``tests/py/connector_flood.py``. Two arrangements, alternating:

- **own threads**: every listener read by a thread of its own (``own_thread=True``), as every
  listener was before the listener hub;
- **one thread**: every listener read by the process's listener hub (the default).

Printed per trial: the CPU per flood message of the threads that read the listeners and of the
whole process (from the sender's first message until the listeners counted its last), and per
``L`` the medians of each arrangement with their ratio (one thread / own threads). Every
message is checked to have been received and dropped or delivered. Runs anywhere::

    PYTHONPATH=build/dev/python python3 bench/listener_threads_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import zmq

from moriio_native.control.channel import NotifyListener
from moriio_native.control.messages import Release, encode
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist

logger = logging.getLogger("moriio_native.bench.listener_threads")

LOCAL = "127.0.0.1"
GARBAGE = (b"", b"\xc1\xc1", b"not msgpack at all", b"\x93\x01\x02\x03")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
OWN_THREADS, ONE_THREAD = "own threads", "one thread"  # the arrangements, baseline first


@dataclass
class Trial:
    listeners: int
    arrangement: str  # OWN_THREADS or ONE_THREAD
    messages: int
    reader_threads: int
    reader_cpu_us_per_message: float
    process_cpu_us_per_message: float


def _flood(ports: list[int], messages: int, rate: float) -> None:
    """Send ``messages`` to ``ports`` in turn at ``rate`` a second in all (sleeping between
    batches: a busy loop would take a core the measured process needs)."""
    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, -1)
        sock.connect(f"tcp://{LOCAL}:{port}")
        socks.append(sock)
    started = time.monotonic()
    sent = 0
    while sent < messages:
        due = min(int((time.monotonic() - started) * rate), messages) - sent
        if due <= 0:
            time.sleep(0.002)
            continue
        for n in range(sent, sent + due):
            frame = GARBAGE[(n // 4) % len(GARBAGE)] if n % 4 == 0 else encode(Release(f"f-{n}"))
            socks[n % len(socks)].send(frame)
        sent += due
    for sock in socks:
        sock.close()
    ctx.term()


def _thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def run_trial(listeners: int, own_threads: bool, messages: int, rate: float) -> Trial:
    security = ControlSecurity(MessageAuth(None), PeerAllowlist([f"{LOCAL}/32"]))
    opened = [
        NotifyListener(
            0,
            security,
            bind_host=LOCAL,
            max_pending=messages,
            max_pending_bytes=1 << 40,
            own_thread=own_threads,
        )
        for _ in range(listeners)
    ]
    try:
        readers = {listener.reader for listener in opened}
        ids = [thread.native_id for thread in readers if thread and thread.native_id]
        sender = mp.get_context("spawn").Process(
            target=_flood, args=([listener.port for listener in opened], messages, rate)
        )
        reader_cpu = sum(_thread_cpu_s(i) for i in ids)
        process_cpu = time.process_time()
        sender.start()
        deadline = time.monotonic() + 10 + 2 * messages / rate
        while sum(listener.stats()["received"] for listener in opened) < messages:
            if time.monotonic() > deadline:
                raise RuntimeError("the listeners did not receive every flood message in time")
            time.sleep(0.01)
            for listener in opened:
                listener.drain()
        reader_cpu = sum(_thread_cpu_s(i) for i in ids) - reader_cpu
        process_cpu = time.process_time() - process_cpu
        sender.join(30)
        stats = [listener.stats() for listener in opened]
        handled = sum(s["dropped_malformed"] + s["delivered"] for s in stats)
        if handled != messages or sum(s["dropped_malformed"] for s in stats) != messages // 4:
            raise RuntimeError(f"flood messages not all handled as expected: {stats}")
    finally:
        for listener in opened:
            listener.close()
    return Trial(
        listeners,
        OWN_THREADS if own_threads else ONE_THREAD,
        messages,
        len(ids),
        reader_cpu / messages * 1e6,
        process_cpu / messages * 1e6,
    )


def _medians(trials: list[Trial], listeners: int, field: str) -> tuple[float, float]:
    """The medians of ``field`` over the trials of ``listeners``: own threads, one thread."""
    own, one = (
        statistics.median(
            getattr(t, field) for t in trials if t.listeners == listeners and t.arrangement == a
        )
        for a in (OWN_THREADS, ONE_THREAD)
    )
    return own, one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listeners", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--messages", type=int, default=36_000, help="per trial")
    parser.add_argument("--rate", type=float, default=6000.0, help="flood messages a second")
    parser.add_argument("--rounds", type=int, default=3, help="trials of each arrangement")
    parser.add_argument("--json", help="write the trials as JSON to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The listeners' drop notices are made as in production (WARNING, rate limited), and not
    # shown: they would bury the figures.
    control = logging.getLogger("moriio_native.control")
    control.setLevel(logging.WARNING)
    control.propagate = False
    control.addHandler(logging.NullHandler())
    trials: list[Trial] = []
    for round_ in range(args.rounds):
        for listeners in args.listeners:
            for own_threads in (True, False):
                trial = run_trial(listeners, own_threads, args.messages, args.rate)
                trials.append(trial)
                logger.info(
                    "round %d, %d listeners, %-11s (%d reading threads): reader %.1f us, "
                    "process %.1f us of CPU per message",
                    round_ + 1,
                    listeners,
                    trial.arrangement,
                    trial.reader_threads,
                    trial.reader_cpu_us_per_message,
                    trial.process_cpu_us_per_message,
                )
    for listeners in args.listeners:
        own, one = _medians(trials, listeners, "reader_cpu_us_per_message")
        own_p, one_p = _medians(trials, listeners, "process_cpu_us_per_message")
        logger.info(
            "%d listeners, medians: reader %.1f -> %.1f us (%.2fx), process %.1f -> %.1f us "
            "(%.2fx) per message, own threads -> one thread",
            listeners,
            own,
            one,
            one / own,
            own_p,
            one_p,
            one_p / own_p,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(t) for t in trials], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
