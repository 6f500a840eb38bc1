"""A flood against a connector pair, measured: genuine requests' latency with and without a
concurrent flood of garbage and valid-schema messages on every listening port, in one run.

A prefill and a decode instance (each vLLM 0.33's real ``Scheduler`` plus the connector's worker
half, loopback engines, the real ZMQ control plane on 127.0.0.1; tests/py/test_vllm_support.py)
run in this process. A spawned child floods their four listening ports (the handshake and notify
port of each) at a stated rate: on every port garbage frames (empty, invalid msgpack, vLLM's
``get_meta_msg``, truncated maps, a map of an unknown type), on the handshake ports also
handshake requests that fail the schema, on the notify ports valid messages of transfers nobody
knows (the prefill's: ``release``; the decode's: ``write_done``, ``write_failed``,
``write_aborted``), each with a transfer id never sent before (every one is new to the
listeners' deduplication memories, and each release to the prefill's memory of early releases,
so those fill up to their bounds). With ``--kind valid`` only the notify ports are flooded, and
only with those valid messages: they pass every check of the listeners (no drop), so only the
protocol core can tell them from genuine ones (the handshake ports get nothing: a well-formed
handshake request is no stray, it is answered).

``--mode write`` runs both instances in WRITE mode: the prefill's notify port then gets
``remote_blocks`` and ``abort_write`` of transfers it does not know instead of releases, each of
which makes an orphan job (kept for a save task that never comes, up to the bound of 65,536, the
oldest dropped); every ``abort_write`` names the decode's address and an engine id that is not
the decode's, so the prefill's acknowledgement finds the decode's cached handshake, sees the
engine id differ and sends nothing. ``--secret`` sets a shared secret on both instances and the
genuine rounds; the flood does not know it. With a secret every listener is a ZMQ CURVE server
whose keys only a holder of the secret can derive, so a ZMQ socket without them never gets a
message through (it would queue its messages and reconnect every 100 ms); the flood is then one
of connections instead: each message is a new TCP connection carrying a ZMTP greeting, READY and
the message (unsigned, or every other one with a forged tag), closed with a reset at once, which
the listening process's ZMQ must accept and refuse at the handshake. Nothing is read, so nothing
reaches the memories (no fill then).

A genuine round is one fresh handshake with the rank that is dialled (``fetch_metadata`` to its
handshake port, the answer checked: the prefill's in READ mode, the decode's in WRITE mode) plus
one request through the connector. READ: the prefill computes it (not timed), then the decode's
scheduler gets it, READs the KV, and the prefill frees its blocks on the decode's release
(timed: handshake + transfer + release). WRITE: the decode gets it and announces its blocks, the
prefill computes it and writes each layer as it is computed, and the decode loads it on the
prefill's ``write_done`` (timed: handshake + announcement + the prefill's forward and writes +
the load). Phases alternate without and with the flood (``--phases`` of ``--rounds`` each), so
drift of the shared machine falls on both; before the first flood phase the flood runs until the
memories are full (``--fill``), so the flood phases run at the bounds. Printed: each phase's p50
/ p99 and the CPU time the process and its listener threads (one hub thread) spent in it (a
flood phase's until the listeners read its last message); p50 / p99 / max of all rounds of each
kind and their ratio; the ratio of the median over phases of each kind (drift between phases
moves it less); the CPU the flood cost per 1,000 messages (the flood phases' CPU less the
baseline phases', which ran the same genuine rounds, over the flood's messages) -- the figure
the code controls: on shared cores the latency ratio is bounded by it; the flood rate achieved
and what the listeners counted. The moriio_native loggers run at production's WARNING level
(``--log-level``): what the flood makes the connector log is part of what it costs.

Checked by code (each a violation): every genuine request loaded (no load error) and freed on
both sides; every flood message was received and dropped or ignored (nothing answered, nothing
delivered to a transfer); the remembered-message gauges within their bounds (deduplication keys,
early releases, orphan jobs, queued messages); with ``--secret``, no flood message read at all
(none dropped, none remembered); the process's RSS over the flood
phases after the fill grew by at most ``--rss-slack-mib``.

    PYTHONPATH=build/dev/python python3 tests/py/connector_flood.py [--rate 6000] [--rounds 100]

``--kind unanswered`` (WRITE mode) floods the prefill's notify port with ``abort_write`` of
transfers it never knew, each naming another decode address where nothing answers: every other
one a port of 127.0.0.1 where nothing listens (refused), the others one of ``--silent-listeners``
ports of 127.0.0.1 whose listener (a thread of the flooder, stopped with it) accepts the TCP
connection and never answers. The prefill acknowledges such an abort only after a handshake
with that address, so each message asks for a handshake that can only time out
(``--transfer-timeout``). Every genuine round first drops the prefill's cached handshake with
the decode, so its WRITE needs a handshake through the same handshake threads as the flood's.
Checked too (sampled every 0.2 s, peaks and end): the peer directory's handshakes in flight
at most its threads (none waits behind the flood's), none left once the flood stopped for twice
the handshake timeout (nothing blocked past its deadline), the pusher's acknowledgements
waiting to be tried again at most their bound, the process's threads and fds at most a few
handshakes' worth above where they started, and fewer log lines than one per 100 messages (or
than LOG_LINES_SHORT in a short run: each rate limit allows 20 lines per 10 s).

``--kind answering`` (WRITE mode) is the same flood, each ``abort_write`` naming one of
``--answering`` addresses of the flooder that DO answer, each a handshake server of its own
engine id with valid metadata (loopback engines the measured process made over the decode's
memory, so that its engine accepts them; the answer otherwise the genuine decode's). The
prefill handshakes each, connects it in its engine and acknowledges the abort -- what anyone
who can point it at addresses of theirs makes it do. With more addresses than the instances'
``max_peers`` (``--max-peers``) the prefill's peer directory evicts as the flood goes on.
Checked too: the prefill's engine peers and cached addresses at most ``max_peers`` (sampled
every 0.2 s and at the end), the strangers' handshakes answered, and the rest as for
``unanswered``. After the measured phases, under the flood again, ``--abort-rounds`` genuine
aborts: the decode announces a request the prefill does not have yet and aborts it, the
prefill's cached handshake of the decode dropped first (as an eviction drops it); the decode's
blocks must be freed on the prefill's ``write_aborted`` within ``--abort-wait`` seconds (printed:
abort to blocks freed). With ``--answer-delay S`` each of those addresses answers S seconds after
a handshake's request (slow, not dead: below ``--transfer-timeout``), so every acknowledgement's
handshake holds one of the prefill's handshake threads for S.

``--stages`` (WRITE mode) also times each genuine round's stages (the announcement's and
write_done's way through the listeners' queues, the prefill's step to its forward, the load),
the main thread's CPU, run-queue wait and sleeps in them, its waits for the pusher's locks and
the pusher's time per flood message (:class:`Stages`); printed for the median and the slowest
rounds, all in the JSON's ``stages``.

``--sink`` adds a third kind of phase: the same flood, at the same rate, to the ports of a
spawned sink process that reads and counts it and does nothing else (phases in turn: baseline,
flood, sink). Its rounds against the baseline's are what the flood costs the shared machine
itself (its sender, ZMQ's delivery over loopback TCP, a reader that costs next to nothing); the
flood phases' rounds against the sink phases' are what the instances' reading, checking and
dropping of it adds -- the part their code controls. Checked too: the sink read every message
sent to it. Printed: both ratios, and the CPU per 1,000 messages of the sink and of this
process in the sink phases (beyond the baseline's).

``--remember N`` shrinks the listeners' and the prefill's memories to N entries (production:
65536) so that a short run fills them; tests/py/test_connector_flood.py runs a short one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import itertools
import json
import logging
import multiprocessing as mp
import os
import selectors
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack
import msgspec
import zmq

from moriio_native.control import channel as channel_module
from moriio_native.control.channel import HandshakeServer, NotifyListener, fetch_metadata
from moriio_native.control.messages import (
    MAX_HANDSHAKE_REQUEST_BYTES,
    AbortWrite,
    HandshakeResponse,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    encode,
)
from moriio_native.control.schema import new_incarnation
from moriio_native.control.security import ControlSecurity
from moriio_native.engine import Engine
from moriio_native.pd import core as core_module
from moriio_native.pd import pusher as pusher_module
from moriio_native.pd.peers import HANDSHAKE_THREADS, PeerKey
from moriio_native.vllm import worker as worker_module
from test_vllm_support import (
    Side,
    decode_params,
    load,
    pd_request_id,
    prefill_params,
    transfer_id,
    write_model_dir,
)
from zmtp_support import ZMTP_GREETING, ZMTP_READY, zmtp_message

logger = logging.getLogger("moriio_native.tests.connector_flood")

LOCAL = "127.0.0.1"
PRODUCTION_BOUND = 65536
# Garbage and valid-schema messages; valid-schema ones only; abort_write naming addresses that
# never answer.
KINDS = ("mixed", "valid", "unanswered", "answering")
# Kinds whose abort_writes name decode addresses the prefill must handshake to acknowledge.
ACK_KINDS = ("unanswered", "answering")
MODES = ("read", "write")
# The prefill's memories of messages for transfers it does not know yet, in _counts.
MEMORIES = ("prefill-early-releases", "prefill-orphans")
# The instances' shared secret with --secret; the flood sends what it cannot sign unsigned or
# with this tag (of no secret: as good as one of another secret to the receiver, which computes
# the right tag and compares).
SECRET = "the flood benchmark's shared secret"
FORGED_TAG = bytes(range(32))
FLOOD_ENGINE = "flood:1/dp0/tp0"  # the engine id the flood's WRITE-mode messages name
# --kind unanswered: the ports of 127.0.0.1 tried for refused ones (below the ephemeral range,
# so no outgoing connection takes one meanwhile), and the most connections a silent listener
# holds (the oldest closed past it).
REFUSED_PORTS = range(10000, 30000)
MAX_SILENT_HELD = 4096
# Fds the process may hold above where the flood phases started: a handshake's socket and its
# TCP connection for each handshake thread, ZMQ's own.
FD_SLACK = 32
# A notify socket's fds in this process: its TCP connection and ZMQ's mailbox of the socket.
FDS_PER_NOTIFY_SOCKET = 2
# Log lines a short run of --kind unanswered may write whatever its messages: a few rate limits'
# bursts (a line per message would be thousands).
LOG_LINES_SHORT = 200
SINK_BURST = 256  # messages a sink reads from one socket between polls
# --kind answering: how long a genuine abort round waits for the decode's blocks to be freed
# (--abort-wait); an acknowledgement given up, or tried again every 5 s behind the flood's,
# takes longer.
ABORT_ACK_WAIT_S = 4.0
ABORT_FLOOD_LEAD_S = 0.5  # the flood's start before the first of them
GARBAGE = [
    b"",
    b"\xc1",
    b"get_meta_msg",
    b"\x91" * 64,
    msgpack.packb({"type": "release"}),
    msgpack.packb({"type": "no_such_type", "transfer_id": "x"}),
]
BAD_HANDSHAKES = [
    msgpack.packb({"type": "handshake_request"}),
    msgpack.packb({"type": "handshake_request", "requester_engine_id": "x", "nonce": b"short"}),
    b"\x00" * (MAX_HANDSHAKE_REQUEST_BYTES + 1),
]


# ---- the flooder (a spawned child) ------------------------------------------------------------


@dataclass(frozen=True)
class FloodSpec:
    """What the flooder sends: ``kind`` (one of KINDS) in ``mode`` (one of MODES), with forged
    tags on every other message (``forge``: the instances have a secret), the WRITE-mode
    ``abort_write`` naming the decode's base ports."""

    kind: str
    mode: str
    forge: bool
    decode_ports: tuple[int, int]  # handshake, notify
    silent_listeners: int = 0  # --kind unanswered
    # --kind answering: the answer of each of the flooder's handshake servers (its own engine
    # id and metadata), given after ``answer_delay`` seconds.
    strangers: tuple[HandshakeResponse, ...] = ()
    answer_delay: float = 0.0


_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset


def _send_on_a_new_connection(port: int, frames: list[bytes]) -> bool:
    """One keyless peer's try: a TCP connection to ``port`` with a NULL greeting, READY and the
    message, closed with a reset at once; whether it connected."""
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        try:
            conn.connect((LOCAL, port))
            conn.sendall(ZMTP_GREETING + ZMTP_READY + zmtp_message(frames))
        except OSError:
            return False
    return True


def _frames(
    spec: FloodSpec, port_kind: str, n: int, silent: list[int], refused: list[int]
) -> list[bytes]:
    """The ``n``-th flood message for a port of ``port_kind``, with a forged tag on every other
    one when ``spec.forge``; ``--kind unanswered``: an abort naming, in turn, one of the
    ``silent`` listeners' ports and one of the ``refused`` ports."""
    if spec.kind == "unanswered":
        port = silent[(n // 2) % len(silent)] if n % 2 else refused[(n // 2) % len(refused)]
        return [encode(AbortWrite(f"flood-{n}", FLOOD_ENGINE, LOCAL, port, port))]
    if spec.kind == "answering":  # ``silent``: the answering servers' ports, in turn
        i = n % len(silent)
        engine_id = spec.strangers[i].engine_id
        return [encode(AbortWrite(f"flood-{n}", engine_id, LOCAL, silent[i], silent[i]))]
    frames = _payload(spec, port_kind, n)
    return [*frames, FORGED_TAG] if spec.forge and n % 2 else frames


class SilentListeners:
    """``count`` TCP listeners on 127.0.0.1 that accept every connection and never read or
    write (a handshake to one times out); at most MAX_SILENT_HELD connections held, the oldest
    closed past it. A thread of the flooder; :meth:`close` stops it and closes every socket."""

    def __init__(self, count: int) -> None:
        self._selector = selectors.DefaultSelector()
        self.ports: list[int] = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOCAL, 0))
            sock.listen(128)
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
            self.ports.append(sock.getsockname()[1])
        self._held: collections.deque[socket.socket] = collections.deque()
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silent-listeners", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.1):
                with contextlib.suppress(BlockingIOError):
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    self.accepted += 1
                    self._held.append(conn)
                    if len(self._held) > MAX_SILENT_HELD:
                        self._held.popleft().close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        for conn in self._held:
            conn.close()


class AnsweringServers:
    """One handshake server on 127.0.0.1 per answer in ``strangers``, each answering every
    handshake with it ``delay`` seconds after the request came (a thread of the flooder each,
    which answers one request at a time); :meth:`close` stops them."""

    def __init__(self, strangers: tuple[HandshakeResponse, ...], delay: float) -> None:
        security = ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})

        def answering(answer: HandshakeResponse) -> Callable[[object], HandshakeResponse]:
            def answer_late(_request: object) -> HandshakeResponse:
                time.sleep(delay)
                return answer

            return answer_late

        # Each on a thread of its own, as another process's would be: a late answer holds no
        # other address's.
        self._servers = [
            HandshakeServer(0, answering(answer), security, bind_host=LOCAL, own_thread=True)
            for answer in strangers
        ]
        self.ports = [server.port for server in self._servers]

    @property
    def answered(self) -> int:
        return sum(server.stats()["answered"] for server in self._servers)

    def close(self) -> None:
        for server in self._servers:
            server.close()


def refused_ports(exclude: set[int]) -> list[int]:
    """Ports of REFUSED_PORTS where nothing is bound on 127.0.0.1 now (a connection there is
    refused), ``exclude`` left out."""
    free = []
    for port in REFUSED_PORTS:
        if port in exclude:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOCAL, port))
            except OSError:
                continue
        free.append(port)
    return free


def _payload(spec: FloodSpec, port_kind: str, n: int) -> list[bytes]:
    """In a mixed flood every fourth is garbage, the rest bad handshakes (handshake ports) or
    valid messages of unknown transfers (notify ports: the prefill's get releases in READ mode,
    which it must remember in case their request comes later, and announcements and aborts in
    WRITE mode, each an orphan job kept for the same reason; the decode's get the messages a
    prefill sends it); in a valid flood all are the latter."""
    if spec.kind == "mixed" and n % 4 == 0:
        return [GARBAGE[(n // 4) % len(GARBAGE)]]
    if port_kind == "handshake":
        return [BAD_HANDSHAKES[n % len(BAD_HANDSHAKES)]]
    tid = f"flood-{n}"
    if port_kind == "prefill-notify" and spec.mode == "read":
        return [encode(Release(tid))]
    if port_kind == "prefill-notify" and n % 2:
        handshake, notify = spec.decode_ports
        return [encode(AbortWrite(tid, FLOOD_ENGINE, LOCAL, handshake, notify))]
    if port_kind == "prefill-notify":
        return [encode(RemoteBlocks(tid, ((n % 1000 + 1, n % 1000 + 2),), FLOOD_ENGINE))]
    message = (WriteDone(tid), WriteFailed(tid, reason="flood"), WriteAborted(tid, "flood"))[n % 3]
    return [encode(message)]


def _flood(conn: Connection, ports: list[tuple[str, int]], rate: float, spec: FloodSpec) -> None:
    """Send to every port in turn at ``rate`` messages per second in all, while the parent
    says so: ``("go",)`` starts, ``("stop",)`` pauses and answers the counts, ``("quit",)``
    ends. A full socket (ZMQ's high-water mark) counts the message as refused, not sent. With
    ``--kind unanswered`` it runs the silent listeners too (closed when it ends)."""
    silent = SilentListeners(spec.silent_listeners) if spec.kind == "unanswered" else None
    answering = None
    if spec.kind == "answering":
        answering = AnsweringServers(spec.strangers, spec.answer_delay)
    silent_ports = silent.ports if silent is not None else []
    refused = refused_ports({*silent_ports, *spec.decode_ports}) if silent is not None else []
    if answering is not None:
        silent_ports = answering.ports
    ctx = zmq.Context()
    socks = []
    for kind, port in ports:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{LOCAL}:{port}")
        socks.append((kind, port, sock))
    ready = {"silent": len(silent_ports), "refused": len(refused)}
    if answering is not None:
        ready = {"silent": 0, "refused": 0, "answering": len(answering.ports)}
    conn.send(ready)
    sent = {port: 0 for _, port in ports}
    dropped = 0
    n = 0
    running = False
    started = 0.0
    sent_at_start = 0
    while True:
        if conn.poll(0 if running else None):
            cmd = conn.recv()[0]
            if cmd == "go":
                running, started = True, time.monotonic()
                sent_at_start = n
            elif cmd == "stop":
                running = False
                accepted = silent.accepted if silent is not None else 0
                answered = answering.answered if answering is not None else 0
                conn.send(
                    {
                        "sent": dict(sent),
                        "refused": dropped,
                        "total": n,
                        "accepted": accepted,
                        "answered": answered,
                    }
                )
            else:
                break
            continue
        # Catch up to the rate in small batches (sleep between them: a busy loop would
        # take a core the measured process needs).
        due = int((time.monotonic() - started) * rate) - (n - sent_at_start)
        if due <= 0:
            time.sleep(0.002)
            continue
        for _ in range(min(due, 500)):
            kind, port, sock = socks[n % len(socks)]
            frames = _frames(spec, kind, n // len(socks), silent_ports, refused)
            if spec.forge:  # CURVE listeners: a keyless peer's flood is one of connections
                delivered = _send_on_a_new_connection(port, frames)
            else:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                    delivered = True
                except zmq.Again:
                    delivered = False
            if delivered:
                sent[port] += 1
            else:
                dropped += 1
            n += 1
    for _, _, sock in socks:
        sock.close(linger=0)
    ctx.term()
    if silent is not None:
        silent.close()
    if answering is not None:
        answering.close()


class _Child:
    """A spawned child process spoken to over a pipe: its first message says it is ready (it
    imports this module, and vLLM's, first); ``("quit",)`` ends it."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], what: str) -> None:
        ctx = mp.get_context("spawn")
        self._what = what
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(300):
            self._proc.kill()
            self._proc.join(5)
            raise AssertionError(f"the {what} did not start")
        self.ready: Any = self._conn.recv()

    def _ask(self, command: str) -> Any:
        self._conn.send((command,))
        if not self._conn.poll(30):
            raise AssertionError(f"the {self._what} did not answer")
        return self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("quit",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


class Flooder(_Child):
    def __init__(self, ports: list[tuple[str, int]], rate: float, spec: FloodSpec) -> None:
        # Ready before the first phase: a phase that started before it would flood less.
        super().__init__(_flood, (ports, rate, spec), "flooder")
        # --kind unanswered: how many silent listeners and refused ports its aborts name.
        self.targets: dict[str, int] = self.ready
        self._taken = 0

    def go(self) -> None:
        self._conn.send(("go",))

    def stop(self) -> dict[str, Any]:
        """The counts so far (``sent`` per port, ``refused``, ``total``) plus ``delivered``:
        the messages ZMQ took since the previous stop."""
        counts: dict[str, Any] = self._ask("stop")
        taken = counts["total"] - counts["refused"]
        counts["delivered"], self._taken = taken - self._taken, taken
        return counts


def _sink(conn: Connection, count: int) -> None:
    """Bind ``count`` ROUTER sockets on 127.0.0.1 (their ports go to the parent first) and read
    and count whatever comes, doing nothing else, until ``("quit",)``; ``("count",)`` answers
    the messages read so far and this process's CPU seconds."""
    ctx = zmq.Context()
    socks = []
    for _ in range(count):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port(f"tcp://{LOCAL}")
        socks.append(sock)
    conn.send([int(sock.getsockopt(zmq.LAST_ENDPOINT).rsplit(b":", 1)[1]) for sock in socks])
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    read = 0
    while True:
        if conn.poll(0):
            if conn.recv()[0] != "count":
                break
            conn.send({"read": read, "cpu_s": time.process_time()})
        for sock, _ in poller.poll(50):
            for _ in range(SINK_BURST):
                try:
                    sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                read += 1
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


class Sink(_Child):
    """A spawned process whose ports take a flood in place of the instances' (--sink): the same
    messages at the same rate, read and counted and nothing else, so the flood's sender and
    ZMQ's delivery load the shared machine as in a flood phase while the instances read none
    of it."""

    def __init__(self, count: int) -> None:
        super().__init__(_sink, (count,), "sink")
        self.ports: list[int] = self.ready

    def count(self) -> dict[str, float]:
        """``read``: the messages read so far; ``cpu_s``: the sink process's CPU seconds."""
        counts: dict[str, float] = self._ask("count")
        return counts


# ---- the measured process ---------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process (/proc, clock-tick resolution)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _listener_threads(p: Side, d: Side) -> list[int]:
    """The threads that read the instances' listeners (one hub thread, shared by all four)."""
    ids = set()
    for side in (p, d):
        for router in _listeners(side):
            thread = router.reader
            assert thread is not None and thread.native_id is not None
            ids.add(thread.native_id)
    return sorted(ids)


def _cpu(threads: list[int]) -> tuple[float, float]:
    """(the whole process's CPU seconds, its listener threads' CPU seconds)."""
    return time.process_time(), sum(thread_cpu_s(t) for t in threads)


def _listeners(side: Side) -> tuple[Any, Any]:
    worker = side.worker.worker
    return worker._server, worker._listener


def _counts(p: Side, d: Side) -> dict[str, dict[str, int]]:
    out = {}
    for name, side in (("prefill", p), ("decode", d)):
        server, listener = _listeners(side)
        out[f"{name}-handshake"] = server.stats()
        out[f"{name}-notify"] = listener.stats()
    pusher = p.worker.worker.core.pusher
    out["prefill-early-releases"] = {"held": len(pusher._early_releases)}
    out["prefill-orphans"] = {"held": len(pusher._orphans)}
    out["prefill-acks"] = {"retries": len(pusher._ack_retries)}
    out["prefill-directory"] = _directory(p)
    out["prefill-sender"] = _sender(p)
    out["process"] = _process()
    return out


def _sender(p: Side) -> dict[str, int]:
    """The prefill's notify sockets (an LRU of NotifySender's bound): one per address it sent
    to, an acknowledged abort's among them."""
    return {"sockets": len(p.worker.worker.core.ctx.sender._sockets)}


def _directory(p: Side) -> dict[str, int]:
    """The prefill's peer directory: handshakes in flight (running or queued for a thread),
    work queued for its threads, remembered failures (backoff records), cached peers."""
    directory = p.worker.worker.core.ctx.directory
    return {
        "inflight": len(directory._inflight),
        "queued": directory._pool.queued,
        "failures": len(directory._failures),
        "peers": len(directory),
        "engine_peers": len(p.worker.worker.core.ctx.engine().peers()),
        **{k: v for k, v in directory.stats().items() if k != "cached"},
    }


def _process() -> dict[str, int]:
    """This process's threads (all, and the handshake threads of both instances' directories)
    and open fds."""
    names = [t.name for t in threading.enumerate()]
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "handshake_threads": sum(n.startswith("moriio-native-handshake") for n in names),
        "fds": len(os.listdir("/proc/self/fd")),
    }


class Peaks:
    """The largest figures of the prefill's directory, its pusher's retries and the process
    (threads, fds) seen while it runs, sampled every 0.2 s by a thread (the same in baseline
    and flood phases)."""

    KEYS = ("prefill-acks", "prefill-directory", "prefill-sender", "process")

    def __init__(self, p: Side) -> None:
        self._p = p
        self.peak: dict[str, dict[str, int]] = {}

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood-peaks", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        pusher = self._p.worker.worker.core.pusher
        now = {
            "prefill-acks": {"retries": len(pusher._ack_retries)},
            "prefill-directory": _directory(self._p),
            "prefill-sender": _sender(self._p),
            "process": _process(),
        }
        for name, figures in now.items():
            peak = self.peak.setdefault(name, {})
            for key, value in figures.items():
                peak[key] = max(peak.get(key, value), value)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def close(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join(5)
        self._sample()
        return self.peak


class LogCount(logging.Handler):
    """Records the moriio_native loggers emit (at their level) while attached."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


@dataclass
class Window:
    """One phase: its rounds' latency and the CPU time the process and its four listener
    threads spent from its start until the flood it sent was read (a flood phase's tail)."""

    flood: bool
    ms: dict[str, float]
    seconds: float  # of the rounds (the flood ran as long)
    messages: int
    cpu_s: float
    listener_cpu_s: float
    # --sink: the flood went to the sink's ports (``flood`` False), which spent ``sink_cpu_s``.
    sink: bool = False
    sink_cpu_s: float = 0.0
    received: int = 0  # messages the instances' listeners read in the phase

    @property
    def baseline(self) -> bool:
        return not self.flood and not self.sink


@dataclass
class Result:
    rounds_per_phase: int
    phases: int
    rate: float
    remember: int
    kind: str
    mode: str
    secret: bool
    baseline_ms: dict[str, float] = field(default_factory=dict)
    flood_ms: dict[str, float] = field(default_factory=dict)
    ratio_p50: float = 0.0
    ratio_p99: float = 0.0
    windows: list[Window] = field(default_factory=list)
    window_ratio_p50: float = 0.0
    window_ratio_p99: float = 0.0
    cpu_ms_per_1000: dict[str, float] = field(default_factory=dict)
    flood_seconds: float = 0.0
    flood_messages: int = 0
    flood_refused: int = 0
    achieved_rate: float = 0.0
    rss_mib: dict[str, float] = field(default_factory=dict)
    # Full collections CPython ran by itself (each a stall of the process) during the fill and
    # the measured phases.
    full_collections: dict[str, int] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)  # --stages: Stages.report
    # --kind unanswered: what the flood named (silent listeners, refused ports), the silent
    # listeners' accepted connections, the figures' peaks over the flood phases and their
    # values where those started, the moriio_native log lines in them.
    targets: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    at_start: dict[str, dict[str, int]] = field(default_factory=dict)
    log_lines: int = 0
    drained_s: float = 0.0  # after the flood, until no handshake was in flight
    # --kind answering: each genuine abort round's ms, abort to the decode's blocks freed (at
    # most --abort-wait: not freed).
    abort_acks_ms: list[float] = field(default_factory=list)
    after_drain: dict[str, int] = field(default_factory=dict)  # the directory then
    # --sink: the rounds whose flood went to the sink instead, their ratios to the baseline's and
    # the flood phases' to theirs (what the instances' reading of the flood adds), the sink's CPU
    # and the process's CPU beyond the baseline's in those phases, per 1,000 messages.
    sink_ms: dict[str, float] = field(default_factory=dict)
    sink_ratio: dict[str, float] = field(default_factory=dict)
    sink_window_ratio: dict[str, float] = field(default_factory=dict)
    flood_over_sink: dict[str, float] = field(default_factory=dict)
    sink_cpu_ms_per_1000: dict[str, float] = field(default_factory=dict)
    sink_messages: int = 0
    # The listener hub's flood pause and CPython's switch interval the phases ran with.
    flood_pause_s: float = 0.0
    switch_interval_s: float = 0.0
    violations: list[str] = field(default_factory=list)


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "p50": statistics.median(ordered) * 1e3,
        "p99": p99 * 1e3,
        "max": ordered[-1] * 1e3,
        "n": len(ordered),
    }


GENUINE_PREFIX = "tx-"  # transfer_id()'s; the flood's are "flood-N"
# A WRITE round's marks, in order (--stages): the main thread's (start, handshake, announced:
# the decode's step that sends remote_blocks returned, prefill_added, written: the prefill's
# finished_sending seen, loaded) and the instances' threads' (ann_read: the prefill's notify
# listener read the announcement; ann_handled: its notify thread handed it to the pusher;
# forward: the prefill's first forward_done after the request was added; done_sent: the
# pusher sent write_done; done_read, done_handled: the decode's listener and notify thread).
MARKS = (
    "start",
    "handshake",
    "announced",
    "ann_read",
    "ann_handled",
    "prefill_added",
    "forward",
    "done_sent",
    "done_read",
    "done_handled",
    "written",
    "loaded",
)

# The marks the main thread passes (with "forward", in its forward_done), whose stages --stages
# splits into the thread's CPU, its run-queue wait and the prefill steps between them.
MAIN_MARKS = ("start", "handshake", "announced", "prefill_added", "forward", "written", "loaded")


def _sleeps() -> float:
    """The calling thread's voluntary context switches so far: each time it slept (a wait for
    the GIL, a lock, a sleep, the network)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return float(line.split()[1])
    return float("nan")


def _schedstat_ms() -> tuple[float, float]:
    """(ms on a CPU, ms runnable but waiting for one) of the calling thread so far."""
    with open("/proc/thread-self/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    return int(run_ns) / 1e6, int(wait_ns) / 1e6


class TimedLock:
    """A lock of the prefill's pusher, timed (``--stages``): how long each thread waited to
    take it and held it (outermost acquire to release: the context lock is reentrant).
    Acquires through the context's condition bypass it (the writer's waits)."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._local = threading.local()
        self.waits: dict[str, list[float]] = {}
        self.holds: dict[str, list[float]] = {}

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        depth = getattr(self._local, "depth", 0)
        asked = time.perf_counter()
        taken = self._lock.acquire(blocking, timeout)
        if taken and depth == 0:
            now = time.perf_counter()
            name = threading.current_thread().name
            self.waits.setdefault(name, []).append(now - asked)
            self._local.since = now
        if taken:
            self._local.depth = depth + 1
        return taken

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            name = threading.current_thread().name
            self.holds.setdefault(name, []).append(time.perf_counter() - self._local.since)
        self._lock.release()

    def take_main_wait(self) -> float:
        """Seconds the main thread waited for the lock since the last call."""
        waits = self.waits.pop(threading.main_thread().name, [])
        return sum(waits)


def _durations_us(seconds: list[float]) -> dict[str, float]:
    """Count, mean, p99 and max of ``seconds`` (not empty), the times in microseconds."""
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "mean_us": statistics.fmean(ordered) * 1e6,
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
        "max_us": ordered[-1] * 1e6,
    }


class Stages:
    """``--stages``: when each genuine WRITE round passed each of MARKS, the queue it found in
    each notify listener; between the main thread's marks (MAIN_MARKS) its CPU, its run-queue
    wait (runnable, no core free), how often it slept (voluntary context switches: waits for
    the GIL, a lock, a sleep, the network) and the prefill's steps; how long it waited for the
    pusher's two locks, and how long each thread held them; the pusher's time per flood
    message. Wraps the instances' methods (instance attributes, so nothing else changes): each
    flood message costs one more Python call, and the per-message samples count in the RSS
    figure (a few MiB: give ``--rss-slack-mib`` room)."""

    def __init__(self, pair: Pair) -> None:
        self.marks: dict[str, dict[str, float]] = {}
        self.backlog: dict[str, dict[str, int]] = {}
        self.forwards: list[float] = []
        self.flood_calls: dict[str, list[float]] = {"remote_blocks": [], "abort_write": []}
        self.flood_cpu: dict[str, list[float]] = {"remote_blocks": [], "abort_write": []}
        self.rounds: list[dict[str, float]] = []  # per round: the main thread's lock waits
        self._tid = ""
        self.main: dict[str, dict[str, tuple[float, float, float, float]]] = {}
        self.steps = 0  # the prefill's steps in the round
        p_core, d_core = pair.p.worker.worker.core, pair.d.worker.worker.core
        self.lock = TimedLock(p_core.ctx.lock)
        p_core.ctx.lock = self.lock
        # The lock that orders feeding the writer queue (taken by the main thread's hooks and
        # by the notify thread after each message).
        self.feed = TimedLock(p_core.pusher._feed)
        p_core.pusher._feed = self.feed
        self._wrap_listener(_listeners(pair.p)[1], "ann_read")
        self._wrap_listener(_listeners(pair.d)[1], "done_read")
        pusher = p_core.pusher
        self._wrap_handler(pusher, "on_remote_blocks", "remote_blocks", "ann_handled")
        self._wrap_handler(pusher, "on_abort_write", "abort_write", None)
        send, forward_done = pusher._send, pusher.forward_done

        def sent(host: str, port: int, message: Any) -> None:
            send(host, port, message)
            if isinstance(message, WriteDone):
                self._mark(message.transfer_id, "done_sent")

        def forwarded(layers: list[str], event: Any) -> None:
            forward_done(layers, event)
            self.forwards.append(time.perf_counter())
            if "prefill_added" in self.main.get(self._tid, {}):
                here = (*_schedstat_ms(), float(self.steps), _sleeps())
                self.main[self._tid].setdefault("forward", here)

        pusher._send, pusher.forward_done = sent, forwarded
        puller = d_core.puller
        on_write_result = puller.on_write_result

        def write_result(tid: str, **kwargs: Any) -> None:
            self._mark(tid, "done_handled")
            on_write_result(tid, **kwargs)

        puller.on_write_result = write_result
        step = pair.p.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            return step(*args, **kwargs)

        pair.p.step = counted  # type: ignore[method-assign]

    def _mark(self, tid: str, mark: str) -> None:
        if tid.startswith(GENUINE_PREFIX):
            self.marks.setdefault(tid, {}).setdefault(mark, time.perf_counter())

    def _main_mark(self, mark: str) -> None:
        """A mark of the main thread, with its CPU and run-queue wait and the prefill steps
        it ran so far in the round."""
        self._mark(self._tid, mark)
        self.main[self._tid][mark] = (*_schedstat_ms(), float(self.steps), _sleeps())

    def _wrap_listener(self, listener: NotifyListener, mark: str) -> None:
        """Marks a genuine message when the listener opened it, with the queue ahead of it."""
        open_ = listener._open

        def opened(*args: Any) -> Any:
            message = open_(*args)
            if message is not None and message.transfer_id.startswith(GENUINE_PREFIX):
                self._mark(message.transfer_id, mark)
                self.backlog.setdefault(message.transfer_id, {})[mark] = len(listener._pending)
            return message

        listener._open = opened  # type: ignore[method-assign]

    def _wrap_handler(self, pusher: Any, name: str, kind: str, mark: str | None) -> None:
        handler = getattr(pusher, name)

        def timed(message: Any) -> None:
            if message.transfer_id.startswith(GENUINE_PREFIX):
                if mark is not None:
                    self._mark(message.transfer_id, mark)
                handler(message)
                return
            wall, cpu = time.perf_counter(), time.thread_time()
            handler(message)
            self.flood_calls[kind].append(time.perf_counter() - wall)
            self.flood_cpu[kind].append(time.thread_time() - cpu)

        setattr(pusher, name, timed)

    def begin(self, tid: str) -> None:
        self._tid = tid
        self.lock.take_main_wait()
        self.feed.take_main_wait()
        self.steps = 0
        self.main[tid] = {}
        self._main_mark("start")

    def mark(self, mark: str) -> None:
        self._main_mark(mark)

    def end(self) -> None:
        marks = self.marks[self._tid]
        added = marks.get("prefill_added", 0.0)
        marks["forward"] = next((t for t in self.forwards if t >= added), float("nan"))
        self.forwards.clear()
        self.rounds.append(
            {
                "lock_wait_ms": self.lock.take_main_wait() * 1e3,
                "feed_wait_ms": self.feed.take_main_wait() * 1e3,
            }
        )

    def report(self, samples: list[float], flood: list[bool]) -> dict[str, Any]:
        """Per kind of phase: the median round's and the slowest rounds' stages (ms between
        consecutive MARKS), queues ahead and main-thread CPU; the flood messages' pusher time."""
        tids = list(self.marks)[-len(samples) :]
        rows = []
        for tid, took, with_flood, waits in zip(tids, samples, flood, self.rounds, strict=True):
            m = self.marks[tid]
            stages = {
                f"{a}->{b}": (m.get(b, float("nan")) - m.get(a, float("nan"))) * 1e3
                for a, b in itertools.pairwise(MARKS)
            }
            main = self.main.get(tid, {})
            for a, b in [*itertools.pairwise(MAIN_MARKS), ("start", "loaded")]:
                if a in main and b in main:
                    stages[f"{a}->{b} run"] = main[b][0] - main[a][0]
                    stages[f"{a}->{b} runq"] = main[b][1] - main[a][1]
                    stages[f"{a}->{b} steps"] = main[b][2] - main[a][2]
                    stages[f"{a}->{b} sleeps"] = main[b][3] - main[a][3]
            rows.append(
                {
                    "flood": with_flood,
                    "ms": took * 1e3,
                    **stages,
                    **{f"queued@{k}": v for k, v in self.backlog.get(tid, {}).items()},
                    "main_lock_wait_ms": waits["lock_wait_ms"],
                    "main_feed_wait_ms": waits["feed_wait_ms"],
                }
            )
        out: dict[str, Any] = {}
        for with_flood in (False, True):
            kind = sorted((r for r in rows if r["flood"] == with_flood), key=lambda r: r["ms"])
            if not kind:
                continue
            name = "flood" if with_flood else "baseline"
            out[name] = {
                "median": kind[len(kind) // 2],
                "slowest": kind[-max(1, len(kind) // 50) :],
            }
            out[name]["mean"] = {
                k: statistics.fmean(r[k] for r in kind if k in r) for k in kind[0] if k != "flood"
            }
        for (lock, name), holds in [
            *((("context", n), h) for n, h in self.lock.holds.items()),
            *((("feed", n), h) for n, h in self.feed.holds.items()),
        ]:
            out[f"{lock} lock held by {name}"] = {
                **_durations_us(holds),
                "over_1ms": sum(h > 1e-3 for h in holds),
            }
        for kind, calls in self.flood_calls.items():
            if calls:
                out[f"pusher.on_{kind} per flood message"] = {
                    **_durations_us(calls),
                    "cpu_mean_us": statistics.fmean(self.flood_cpu[kind]) * 1e6,
                }
        return out


class Pair:
    def __init__(
        self,
        model_dir: str,
        mode: str = "read",
        secret: bool = False,
        *,
        transfer_timeout: float = 30.0,
        fresh_peer: bool = False,
        max_peers: int | None = None,
    ) -> None:
        extra: dict[str, Any] = {"abort_timeout": 600, "transfer_timeout": transfer_timeout}
        if max_peers is not None:
            extra["max_peers"] = max_peers
        if secret:
            extra["auth_secret"] = SECRET
        self.mode = mode
        self.p = Side("prefill", "kv_producer", mode, model_dir, salt=1, extra=extra)
        self.d = Side("decode", "kv_consumer", mode, model_dir, salt=2, extra=extra)
        self.security = ControlSecurity.from_config(
            {"allowed_peers": [f"{LOCAL}/32"], **({"auth_secret": SECRET} if secret else {})}
        )
        self.seed = 0
        # The side a genuine round's handshake dials (the one the other side dials in that
        # mode); the other's handshake port gets only the other side's first handshake.
        self.dialled = "prefill" if mode == "read" else "decode"
        self.stages: Stages | None = None  # --stages (WRITE mode)
        # Each WRITE round drops the prefill's cached handshake with the decode first, so its
        # write needs a handshake (--kind unanswered: through the threads the flood keeps busy).
        self.fresh_peer = fresh_peer

    def ports(self, flood: str) -> list[tuple[str, int]]:
        """The ports a ``flood`` (one of KINDS) goes to, with their kind."""
        ports = [
            ("handshake", self.p.handshake_port),
            ("prefill-notify", self.p.notify_port),
            ("handshake", self.d.handshake_port),
            ("decode-notify", self.d.notify_port),
        ]
        if flood in ACK_KINDS:
            return [("prefill-notify", self.p.notify_port)]
        return [port for port in ports if flood == "mixed" or port[0] != "handshake"]

    def _handshake(self, violations: list[str]) -> None:
        """A fresh handshake with the dialled side's rank, its answer checked."""
        side = self.p if self.dialled == "prefill" else self.d
        response = fetch_metadata(
            LOCAL, side.handshake_port, timeout=30, security=self.security, requester_engine_id="b"
        )
        if response.engine_id != side.worker.worker.engine_id:
            violations.append(f"handshake answered as {response.engine_id}")

    def _new_request(self) -> tuple[list[int], str, str]:
        """A fresh genuine request: (prompt, request id, transfer id)."""
        self.seed += 1
        prompt = [(self.seed * 7919 + i * 13) % 30011 + 1 for i in range(40)]
        return prompt, pd_request_id(self.p, self.d), transfer_id()

    def _drop_prefills_handshake_of_decode(self) -> None:
        """The prefill's cached handshake with the decode goes (as an eviction drops it)."""
        directory = self.p.worker.worker.core.ctx.directory
        directory.forget(directory.cached(PeerKey(LOCAL, self.d.handshake_port)))

    def round(self, violations: list[str]) -> float:
        """One genuine request: (fresh handshake + READ + release) seconds in READ mode,
        (fresh handshake + announcement + the prefill's forward and writes + load) in WRITE."""
        p, d = self.p, self.d
        prompt, rid, tid = self._new_request()
        if self.mode == "read":
            p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
            finished = p.step().finished()
            if rid not in finished:
                violations.append(f"{rid}: the prefill did not finish it in one step")
                return 0.0
            returned = finished[rid].kv_transfer_params
            started = time.perf_counter()
            self._handshake(violations)
            d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
            loaded = load(d, rid)
            p.run_until(lambda r: rid in r.transfer.finished_sending, what=f"release of {rid}")
        else:
            stages = self.stages
            mark = stages.mark if stages is not None else lambda _: None
            if stages is not None:
                stages.begin(tid)
            if self.fresh_peer:
                self._drop_prefills_handshake_of_decode()
            started = time.perf_counter()
            self._handshake(violations)
            mark("handshake")
            d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
            d.step()  # its remote_blocks goes out
            mark("announced")
            p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
            mark("prefill_added")
            p.run_until(lambda r: rid in r.transfer.finished_sending, what=f"write of {rid}")
            mark("written")
            loaded = load(d, rid)
            mark("loaded")
            if stages is not None:
                stages.end()
        took = time.perf_counter() - started
        if loaded.invalid_blocks:
            violations.append(f"{rid}: load error on blocks {sorted(loaded.invalid_blocks)}")
        if not all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt)):
            violations.append(f"{rid}: the decode's blocks do not hold the prefill's bytes")
        d.run_until(lambda r: rid not in d.scheduler.requests, what=f"decode of {rid}")
        return took

    def abort_round(self, violations: list[str], wait: float = ABORT_ACK_WAIT_S) -> float:
        """A genuine request the decode announces and then aborts (a client that gave up while
        the prompt queued) before the prefill has it, with the prefill's cached handshake of
        the decode dropped (as an eviction at max_peers drops it): seconds from the abort until
        the decode freed the blocks on the prefill's write_aborted (at most ``wait``;
        unacknowledged, they stay quarantined for quarantine_timeout)."""
        p, d = self.p, self.d
        prompt, rid, tid = self._new_request()
        self._drop_prefills_handshake_of_decode()
        d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
        d.step()  # its remote_blocks goes out: an orphan job at the prefill
        if not _orphan_arrives(p, tid):
            violations.append(f"{rid}: its announcement did not reach the prefill")
            return wait
        started = time.perf_counter()
        d.abort(rid)  # announced: the blocks stay quarantined until the prefill answers
        try:
            d.run_until(
                lambda r: d.free_blocks() == d.initial_free,
                max_wait=wait,
                what=f"write_aborted of {rid}",
            )
        except AssertionError:
            violations.append(
                f"{rid}: the decode's blocks still quarantined {wait:.0f} s after its abort "
                "(no write_aborted)"
            )
            return wait
        return time.perf_counter() - started

    def shutdown(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


@contextlib.contextmanager
def _memories(bound: int) -> Iterator[None]:
    """Listeners and the prefill's early-message memory of ``bound`` entries while the pair
    is made and runs (short runs fill them); the production bounds again afterwards."""
    saved = core_module.NotifyListener, pusher_module.MAX_EARLY_MESSAGES
    if bound != PRODUCTION_BOUND:
        core_module.NotifyListener = functools.partial(  # type: ignore[misc]
            NotifyListener, dedup_capacity=bound, terminal_capacity=bound, max_pending=bound
        )
        pusher_module.MAX_EARLY_MESSAGES = bound
    try:
        yield
    finally:
        core_module.NotifyListener, pusher_module.MAX_EARLY_MESSAGES = saved  # type: ignore[misc]


def run(args: argparse.Namespace) -> Result:
    res = Result(
        args.rounds, args.phases, args.rate, args.remember, args.kind, args.mode, args.secret
    )
    with (
        tempfile.TemporaryDirectory(prefix="flood-model-") as tmp,
        _memories(args.remember),
        _registrations() as registered,
    ):
        answering = args.kind == "answering"
        pair = Pair(
            write_model_dir(Path(tmp)),
            args.mode,
            args.secret,
            transfer_timeout=args.transfer_timeout,
            fresh_peer=args.kind in ACK_KINDS,
            max_peers=args.max_peers if answering else None,
        )
        decode_ports = (pair.d.handshake_port, pair.d.notify_port)
        silent = args.silent_listeners if args.kind == "unanswered" else 0
        engines = _stranger_engines(pair, registered, args.answering) if answering else []
        strangers = _answers_as(pair, engines) if answering else ()
        spec = FloodSpec(
            args.kind,
            args.mode,
            args.secret,
            decode_ports,
            silent,
            strangers,
            args.answer_delay if answering else 0.0,
        )
        flooder: Flooder | None = None
        sink: SinkFlood | None = None
        try:
            flooder = Flooder(pair.ports(args.kind), args.rate, spec)
            res.targets = dict(flooder.targets)
            if args.sink:
                sink = _sink_flood(pair.ports(args.kind), args.rate, spec)
            with _process_settings(args, res):
                _measure(pair, flooder, args, res, sink)
        finally:
            if flooder is not None:
                flooder.close()
            if sink is not None:
                sink.flooder.close()
                sink.sink.close()
            pair.shutdown()
    return res


@contextlib.contextmanager
def _process_settings(args: argparse.Namespace, res: Result) -> Iterator[None]:
    """The hub's flood pause (--flood-pause) and CPython's switch interval (--switch-interval)
    as asked while the phases run, each recorded in ``res``; as before afterwards."""
    saved = channel_module._FLOOD_PAUSE_S, sys.getswitchinterval()
    if args.flood_pause is not None:
        channel_module._FLOOD_PAUSE_S = args.flood_pause
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    res.flood_pause_s = channel_module._FLOOD_PAUSE_S
    res.switch_interval_s = sys.getswitchinterval()
    try:
        yield
    finally:
        channel_module._FLOOD_PAUSE_S = saved[0]
        sys.setswitchinterval(saved[1])


def _sink_flood(ports: list[tuple[str, int]], rate: float, spec: FloodSpec) -> SinkFlood:
    """A sink with a port for each of ``ports`` and a flooder sending to those what the
    instances' flooder sends to ``ports``."""
    sink = Sink(len(ports))
    try:
        sunk = [(kind, port) for (kind, _), port in zip(ports, sink.ports, strict=True)]
        return SinkFlood(sink, Flooder(sunk, rate, spec))
    except BaseException:
        sink.close()
        raise


@contextlib.contextmanager
def _registrations() -> Iterator[dict[str, list[Any]]]:
    """Every layer registration the connector's engines get while the pair is made, by engine
    id (--kind answering builds its strangers' engines over the decode's memory)."""
    seen: dict[str, list[Any]] = {}
    original = worker_module.Engine

    class Recording(original):  # type: ignore[misc,valid-type]
        def register_kv_caches(self, layers: Any) -> bytes:
            seen[self.engine_id] = list(layers)
            return super().register_kv_caches(layers)

    worker_module.Engine = Recording  # type: ignore[misc]
    try:
        yield seen
    finally:
        worker_module.Engine = original  # type: ignore[misc]


def _stranger_engines(pair: Pair, registered: dict[str, list[Any]], count: int) -> list[Any]:
    """``count`` loopback engines of their own ids over the decode's memory: metadata this
    process's prefill engine accepts (a loopback peer lives in the same process), served by the
    flooder's handshake servers. Nothing is ever transferred with them."""
    layers = registered[pair.d.worker.worker.engine_id]
    engines = []
    for i in range(count):
        engine = Engine(f"{FLOOD_ENGINE.split('/')[0]}-stranger-{i}/dp0/tp0", "loopback")
        engine.register_kv_caches(layers)
        engines.append(engine)
    return engines


def _answers_as(pair: Pair, engines: list[Any]) -> tuple[HandshakeResponse, ...]:
    """The genuine decode's handshake answer (fetched once) with each of ``engines``' id and
    metadata: answers that pass every check of the prefill's (rank, TP size, mode, groups) and
    name other engines."""
    genuine = fetch_metadata(
        LOCAL, pair.d.handshake_port, timeout=30, security=pair.security, requester_engine_id="b"
    )
    return tuple(
        msgspec.structs.replace(
            genuine,
            engine_id=engine.engine_id,
            engine_metadata=engine.local_metadata(),
            incarnation=new_incarnation(),
            nonce=b"",
        )
        for engine in engines
    )


def _received(counts: dict[str, dict[str, int]]) -> int:
    return sum(c.get("received", 0) for k, c in counts.items() if k not in MEMORIES)


def _dropped(counts: dict[str, dict[str, int]]) -> int:
    """Messages dropped before the schema (with a secret: none, the flood's never read)."""
    return sum(c.get("dropped_auth", 0) + c.get("dropped_malformed", 0) for c in counts.values())


def _settle(pair: Pair, want: int, limit: float) -> dict[str, dict[str, int]]:
    """Wait until the listeners counted ``want`` messages in all (the flood's tail drained)."""
    deadline = time.monotonic() + limit
    while True:
        counts = _counts(pair.p, pair.d)
        queued = sum(c.get("queued", 0) for c in counts.values())
        if (_received(counts) >= want and queued == 0) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _fill(pair: Pair, flooder: Flooder, args: argparse.Namespace, res: Result) -> int:
    """Flood until the memories are at their bounds; the messages it sent."""
    flooder.go()
    bound = args.remember
    deadline = time.monotonic() + args.fill_limit
    memory = "prefill-early-releases" if args.mode == "read" else "prefill-orphans"
    while time.monotonic() < deadline:
        c = _counts(pair.p, pair.d)
        decode_filled = args.kind in ACK_KINDS or c["decode-notify"]["remembered"] >= bound
        if (
            c["prefill-notify"]["remembered"] >= bound
            and decode_filled
            and c[memory]["held"] >= bound
        ):
            break
        time.sleep(0.2)
    else:
        res.violations.append(f"the flood did not fill the memories within {args.fill_limit}s")
    sent = flooder.stop()
    _settle(pair, sent["total"] - sent["refused"], 60)
    return int(sent["total"])


@dataclass
class SinkFlood:
    """--sink: the sink and the flooder of its ports."""

    sink: Sink
    flooder: Flooder


def _sink_settle(sink: Sink, want: float, limit: float) -> dict[str, float]:
    """The sink's counts once it read ``want`` messages in all, or after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while True:
        counts = sink.count()
        if counts["read"] >= want or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def _window(
    pair: Pair, flooder: Flooder | None, rounds: int, res: Result, sink: Sink | None = None
) -> tuple[Window, list[float]]:
    """One phase of ``rounds`` genuine rounds (and their seconds), with the flood when
    ``flooder`` is given (to the instances' ports, or to the ``sink``'s when given: it floods
    those); its CPU is counted until the listeners (or the sink) read every message the flood
    sent in it."""
    threads = _listener_threads(pair.p, pair.d)
    counts = _counts(pair.p, pair.d)
    received_before = _received(counts)
    sink_before = sink.count() if sink is not None else {"read": 0, "cpu_s": 0.0}
    sink_cpu = 0.0
    cpu0, lcpu0 = _cpu(threads)
    sent = 0
    t0 = time.monotonic()
    if flooder is not None:
        flooder.go()
    samples = [pair.round(res.violations) for _ in range(rounds)]
    seconds = time.monotonic() - t0
    if flooder is not None:
        sent = flooder.stop()["delivered"]
        if sink is not None:
            after = _sink_settle(sink, sink_before["read"] + sent, 60)
            sink_cpu = after["cpu_s"] - sink_before["cpu_s"]
            if after["read"] - sink_before["read"] != sent:
                read = after["read"] - sink_before["read"]
                res.violations.append(f"the sink read {read:.0f} of {sent} messages")
        elif not res.secret:  # (with a secret no flood message is read: nothing to wait for)
            _settle(pair, received_before + sent + rounds, 60)  # each round: its handshake
    cpu1, lcpu1 = _cpu(threads)
    window = Window(
        flooder is not None and sink is None,
        _summary(samples),
        seconds,
        sent,
        cpu1 - cpu0,
        lcpu1 - lcpu0,
        sink is not None,
        sink_cpu,
        _received(_counts(pair.p, pair.d)) - received_before,
    )
    return window, samples


def _orphan_arrives(p: Side, tid: str, limit: float = 10.0) -> bool:
    """Whether the prefill holds transfer ``tid`` as an orphan job (its announcement came,
    no request yet) within ``limit`` seconds."""
    pusher = p.worker.worker.core.pusher
    deadline = time.monotonic() + limit
    while tid not in pusher.job_states():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _aborts_under_flood(
    pair: Pair, flooder: Flooder, args: argparse.Namespace, res: Result
) -> None:
    """``--abort-rounds`` genuine aborts (:meth:`Pair.abort_round`) under the flood, after the
    measured phases (their waits are in no phase's figures), once the flood has had a moment
    to take the acknowledgement handshakes' budget."""
    flooder.go()
    time.sleep(ABORT_FLOOD_LEAD_S)
    res.abort_acks_ms = [
        pair.abort_round(res.violations, args.abort_wait) * 1e3 for _ in range(args.abort_rounds)
    ]
    flooder.stop()


def _drain(pair: Pair, limit: float) -> float:
    """Seconds until the prefill's directory had no handshake in flight, at most ``limit``
    (then ``limit``, with some still in flight)."""
    started = time.monotonic()
    while _directory(pair.p)["inflight"] and time.monotonic() - started < limit:
        time.sleep(0.1)
    return time.monotonic() - started


def _per_1000(windows: list[Window], attr: str, *, sink: bool = False) -> float:
    """CPU milliseconds per 1,000 flood messages (``sink``: of the flood to the sink): those
    windows' CPU less as many baseline windows' (the same genuine rounds), over their
    messages."""
    flooded = [w for w in windows if (w.sink if sink else w.flood)]
    extra = sum(getattr(w, attr) for w in flooded) - sum(
        getattr(w, attr) for w in windows if w.baseline
    )
    return extra * 1e6 / max(1, sum(w.messages for w in flooded))


def _measure(
    pair: Pair,
    flooder: Flooder,
    args: argparse.Namespace,
    res: Result,
    sink: SinkFlood | None = None,
) -> None:
    pair.round(res.violations)  # warm-up: the decode's handshake cached, first allocations
    full = gc.get_stats()[2]["collections"]
    if args.fill and not args.secret:  # a flood without the secret fills nothing
        _fill(pair, flooder, args, res)
    res.full_collections["fill"] = gc.get_stats()[2]["collections"] - full
    full = gc.get_stats()[2]["collections"]
    rss_start = rss_bytes()
    # Phases in turn: without the flood, with it (to the instances' ports) and, with --sink,
    # with it to the sink's ports.
    targets = ("baseline", "flood", "sink") if sink is not None else ("baseline", "flood")
    samples: dict[str, list[float]] = {target: [] for target in targets}
    in_order: list[float] = []
    if args.stages:
        pair.stages = Stages(pair)
    res.at_start = {k: v for k, v in _counts(pair.p, pair.d).items() if k in Peaks.KEYS}
    peaks = Peaks(pair.p)
    lines = LogCount()
    logging.getLogger("moriio_native").addHandler(lines)
    try:
        for phase in range(len(targets) * args.phases):
            target = targets[phase % len(targets)]
            if target == "sink":
                assert sink is not None
                window, took = _window(pair, sink.flooder, args.rounds, res, sink.sink)
            else:
                phase_flooder = flooder if target == "flood" else None
                window, took = _window(pair, phase_flooder, args.rounds, res)
            res.windows.append(window)
            samples[target] += took
            if target == "flood":
                # The listeners count as flooded for up to two gauge windows after their last
                # drop: the next phase starts once that is over, not under the flood's pause.
                time.sleep(2 * channel_module._FLOOD_WINDOW_S)
            if target != "sink":  # --stages splits the baseline and flood rounds
                in_order += took
        if args.kind == "answering":
            _aborts_under_flood(pair, flooder, args, res)
        sent = flooder.stop()
        flood_read = 0 if args.secret else sent["total"] - sent["refused"]
        counts = _settle(pair, flood_read, 60)
    finally:
        logging.getLogger("moriio_native").removeHandler(lines)
        res.peaks = peaks.close()

    res.log_lines = lines.count
    res.targets["accepted"] = sent.get("accepted", 0)
    res.targets["answered"] = sent.get("answered", 0)
    if args.kind in ACK_KINDS:
        res.drained_s = _drain(pair, 2 * args.transfer_timeout + 5)
        res.after_drain = _directory(pair.p)
    rss_end = rss_bytes()
    res.full_collections["phases"] = gc.get_stats()[2]["collections"] - full
    base = [w for w in res.windows if w.baseline]
    flood = [w for w in res.windows if w.flood]
    res.baseline_ms, res.flood_ms = _summary(samples["baseline"]), _summary(samples["flood"])
    res.ratio_p50 = res.flood_ms["p50"] / res.baseline_ms["p50"]
    res.ratio_p99 = res.flood_ms["p99"] / res.baseline_ms["p99"]
    for key in ("p50", "p99"):
        setattr(res, f"window_ratio_{key}", _windows_ratio(flood, base, key))
    res.cpu_ms_per_1000 = {
        "process": _per_1000(res.windows, "cpu_s"),
        "listener_threads": _per_1000(res.windows, "listener_cpu_s"),
    }
    res.flood_seconds = sum(w.seconds for w in flood)
    res.flood_messages = sent["total"]
    res.flood_refused = sent["refused"]
    res.achieved_rate = sum(w.messages for w in flood) / max(res.flood_seconds, 1e-9)
    res.rss_mib = {
        "start_of_flood_phases": rss_start / 2**20,
        "end": rss_end / 2**20,
        "growth": (rss_end - rss_start) / 2**20,
    }
    res.counts = counts
    if sink is not None:
        _sink_figures(res, samples["sink"])
    if pair.stages is not None:
        flooded = [w.flood for w in res.windows if not w.sink for _ in range(args.rounds)]
        res.stages = pair.stages.report(in_order, flooded)
    _check(res, counts, sent, args)


def _windows_ratio(phases: list[Window], against: list[Window], key: str) -> float:
    """The median over ``phases`` of their ``key`` latency (p50 or p99) over that of
    ``against`` (drift between phases moves it less than the ratio of all rounds)."""
    return statistics.median(w.ms[key] for w in phases) / statistics.median(
        w.ms[key] for w in against
    )


def _sink_figures(res: Result, samples: list[float]) -> None:
    """--sink: the rounds under the flood to the sink against the baseline's, the flood phases'
    against theirs, and the CPU per 1,000 messages of the sink and of this process."""
    base = [w for w in res.windows if w.baseline]
    sunk = [w for w in res.windows if w.sink]
    flood = [w for w in res.windows if w.flood]
    res.sink_ms = _summary(samples)
    res.sink_messages = sum(w.messages for w in sunk)
    for key in ("p50", "p99"):
        res.sink_ratio[key] = res.sink_ms[key] / res.baseline_ms[key]
        res.flood_over_sink[key] = res.flood_ms[key] / res.sink_ms[key]
        res.sink_window_ratio[key] = _windows_ratio(sunk, base, key)
        res.flood_over_sink[f"windows_{key}"] = _windows_ratio(flood, sunk, key)
    res.sink_cpu_ms_per_1000 = {
        "sink": sum(w.sink_cpu_s for w in sunk) * 1e6 / max(1, res.sink_messages),
        "process": _per_1000(res.windows, "cpu_s", sink=True),
    }
    # The instances read only the genuine rounds' messages then -- as many as in a baseline
    # phase (the same rounds) -- and what the flood phase before left unread: it is settled once
    # its flood and one message a round were read, so fewer than a baseline phase's.
    bound = 2 * max(w.received for w in base)
    for w in sunk:
        if w.received > bound:
            res.violations.append(
                f"the instances read {w.received} messages in a sink phase; a baseline phase's "
                f"rounds and a flood phase's leftovers bring at most {bound}"
            )


def _check(
    res: Result, counts: dict[str, dict[str, int]], sent: dict[str, Any], args: argparse.Namespace
) -> None:
    v = res.violations
    received = _received(counts)
    flood = sent["total"] - sent["refused"]
    # Every genuine handshake and message of the rounds is counted too: at least the flood
    # (with a secret none of it: checked below).
    if received < flood and not res.secret:
        v.append(f"listeners received {received} of {flood} sent")
    # Only genuine handshakes are answered: each round's and the warm-up's on the dialled
    # side, plus the other side's one of it in either direction (WRITE: each dials the other).
    rounds = res.rounds_per_phase * len(res.windows)
    genuine = rounds + 2
    if res.kind in ACK_KINDS:  # the prefill handshakes the decode afresh in each round too
        genuine += rounds
    if res.kind == "answering":  # the genuine answer the strangers' answers are made of
        genuine += 1
    other = "decode" if res.mode == "read" else "prefill"
    want = {f"{other}-handshake": 0 if res.mode == "read" else 1}
    want[f"{'prefill' if other == 'decode' else 'decode'}-handshake"] = genuine
    for name, answered in want.items():
        if counts[name]["answered"] != answered:
            v.append(f"{name}: answered {counts[name]['answered']} handshakes, expected {answered}")
    if res.secret:
        dropped = _dropped(counts)
        if dropped:  # a keyless peer got past CURVE
            v.append(f"{dropped} messages read and dropped, none expected ({flood} sent)")
        for name in MEMORIES:
            if counts[name]["held"]:
                v.append(f"{name}: {counts[name]['held']} held, none expected")
    for name in ("prefill-notify", "decode-notify"):
        c = counts[name]
        if c["remembered"] > args.remember:
            v.append(f"{name}: {c['remembered']} keys remembered, bound {args.remember}")
        if c["queued"] > args.remember:
            v.append(f"{name}: {c['queued']} queued, bound {args.remember}")
    for name in MEMORIES:
        if counts[name]["held"] > args.remember:
            v.append(f"{name}: {counts[name]['held']} held, bound {args.remember}")
    if res.rss_mib["growth"] > args.rss_slack_mib:
        v.append(
            f"RSS grew {res.rss_mib['growth']:.1f} MiB over the flood phases "
            f"(slack {args.rss_slack_mib} MiB)"
        )
    if res.kind in ACK_KINDS:
        _check_unanswered(res, counts, sent, args)
    if res.kind == "answering":
        _check_answering(res, args)


def _check_unanswered(
    res: Result, counts: dict[str, dict[str, int]], sent: dict[str, Any], args: argparse.Namespace
) -> None:
    """--kind unanswered: the handshakes, retries, threads, fds and log lines the flood's
    aborts cost stayed bounded, and none outlived its deadline."""
    v = res.violations
    peak, start = res.peaks, res.at_start
    directory = peak["prefill-directory"]
    # More in flight than threads: some wait for a thread (the queue's own figure also counts
    # a handshake submitted a moment before an idle thread takes it).
    if directory["inflight"] > HANDSHAKE_THREADS:
        v.append(
            f"the prefill's directory had up to {directory['inflight']} handshakes in flight "
            f"for its {HANDSHAKE_THREADS} threads (genuine ones wait behind them)"
        )
    if res.after_drain["inflight"]:
        v.append(
            f"{res.after_drain['inflight']} handshakes still in flight {res.drained_s:.0f} s "
            f"after the flood (timeout {args.transfer_timeout:.0f} s)"
        )
    retries = peak["prefill-acks"]["retries"]
    if retries > pusher_module.MAX_ACK_RETRIES:
        v.append(f"{retries} acknowledgements waiting, bound {pusher_module.MAX_ACK_RETRIES}")
    process = peak["process"]
    # Both instances' directories run in this process, each with its own threads.
    if process["handshake_threads"] > 2 * HANDSHAKE_THREADS:
        v.append(
            f"{process['handshake_threads']} handshake threads, {2 * HANDSHAKE_THREADS} at most"
        )
    if process["threads"] > start["process"]["threads"] + HANDSHAKE_THREADS:
        v.append(f"threads grew from {start['process']['threads']} to {process['threads']}")
    # Each notify socket opened since (an address acknowledged for the first time, within the
    # sender's bound) holds its own fds.
    sockets = peak["prefill-sender"]["sockets"] - start["prefill-sender"]["sockets"]
    if process["fds"] > start["process"]["fds"] + FD_SLACK + FDS_PER_NOTIFY_SOCKET * sockets:
        v.append(
            f"fds grew from {start['process']['fds']} to {process['fds']} "
            f"({sockets} notify sockets more)"
        )
    if res.log_lines > max(sent["total"] / 100, LOG_LINES_SHORT):
        v.append(f"{res.log_lines} log lines for {sent['total']} flood messages")


def _check_answering(res: Result, args: argparse.Namespace) -> None:
    """--kind answering: the prefill never held more than max_peers engine peers or cached
    addresses, and the strangers were handshaken (once more of them than max_peers answered --
    they are named in turn, so as many distinct ones -- it evicted; slow answers may leave
    fewer in a short run)."""
    v = res.violations
    for name in ("engine_peers", "peers"):
        peak = res.peaks["prefill-directory"][name]
        if peak > args.max_peers:
            v.append(f"the prefill's directory: {name} reached {peak}, max_peers {args.max_peers}")
    answered = res.targets.get("answered", 0)
    if not answered:
        v.append("no stranger's handshake was answered")
    if answered > args.max_peers and not res.after_drain["evicted"]:
        v.append(
            f"the prefill's directory evicted nothing (max_peers {args.max_peers}, "
            f"{answered} handshakes answered)"
        )
    if len(res.abort_acks_ms) != args.abort_rounds:
        v.append(f"{len(res.abort_acks_ms)} genuine abort rounds of {args.abort_rounds}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=6000.0, help="flood messages/s in all")
    parser.add_argument("--rounds", type=int, default=200, help="genuine requests per phase")
    parser.add_argument("--phases", type=int, default=3, help="pairs of (baseline, flood)")
    parser.add_argument("--remember", type=int, default=PRODUCTION_BOUND)
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default="mixed",
        help="mixed: garbage and valid-schema messages on every port; valid: valid-schema "
        "messages of unknown transfers on the notify ports only; unanswered (WRITE mode): "
        "abort_write of unknown transfers naming decode addresses that never answer; "
        "answering (WRITE mode): the same, naming addresses that answer as new engines",
    )
    parser.add_argument("--mode", choices=MODES, default="read", help="of both instances")
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        help="of both instances: a handshake's timeout (--kind unanswered: each flood message's)",
    )
    parser.add_argument(
        "--silent-listeners",
        type=int,
        default=128,
        help="--kind unanswered: listeners on 127.0.0.1 that accept and never answer",
    )
    parser.add_argument(
        "--answering",
        type=int,
        default=256,
        help="--kind answering: addresses that answer, each as its own engine",
    )
    parser.add_argument(
        "--answer-delay",
        type=float,
        default=0.0,
        help="--kind answering: seconds each answering address takes to answer a handshake "
        "(below --transfer-timeout: slow, not dead)",
    )
    parser.add_argument(
        "--max-peers",
        type=int,
        default=64,
        help="--kind answering: the instances' max_peers (below --answering, so it evicts)",
    )
    parser.add_argument(
        "--abort-rounds",
        type=int,
        default=3,
        help="--kind answering: genuine aborts under the flood after the phases (Pair.abort_round)",
    )
    parser.add_argument(
        "--abort-wait",
        type=float,
        default=ABORT_ACK_WAIT_S,
        help="--kind answering: seconds a genuine abort may take until the decode's blocks are "
        "freed (the flood goes on meanwhile)",
    )
    parser.add_argument(
        "--secret",
        action="store_true",
        help="a shared secret on both instances and the genuine rounds; the flood goes unsigned "
        "or with forged tags",
    )
    parser.add_argument(
        "--sink",
        action="store_true",
        help="a third kind of phase: the same flood to a sink process's ports (read and "
        "counted, nothing else) -- what the flood's sender and ZMQ's delivery cost the shared "
        "machine while the instances read none of it",
    )
    parser.add_argument("--no-fill", dest="fill", action="store_false")
    parser.add_argument("--fill-limit", type=float, default=300.0)
    parser.add_argument("--rss-slack-mib", type=float, default=32.0)
    parser.add_argument(
        "--stages",
        action="store_true",
        help="WRITE mode: time each genuine round's stages, the queues ahead of its messages and "
        "the pusher's time per flood message (in the JSON's 'stages')",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval for the measured process (CPython's default: 0.005 s): how "
        "long a thread that wants the GIL waits before it asks the holder to drop it",
    )
    parser.add_argument(
        "--flood-pause",
        type=float,
        help="how long the listener hub leaves a flooded listener unread after each burst "
        f"(control/channel.py's _FLOOD_PAUSE_S, {channel_module._FLOOD_PAUSE_S} s)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log-level", default="warning", help="of the moriio_native loggers")
    args = parser.parse_args(argv)
    if args.stages and args.mode != "write":
        parser.error("--stages times WRITE rounds: it needs --mode write")
    if args.sink and args.kind in ACK_KINDS:
        parser.error(f"--sink compares floods the listeners drop: not --kind {args.kind}")
    if args.sink and args.stages:
        parser.error("--stages splits the baseline and flood rounds: not with --sink")
    if args.flood_pause is not None and args.flood_pause < 0:
        parser.error(f"--flood-pause {args.flood_pause}: a pause is at least 0 s")
    if args.switch_interval is not None and args.switch_interval <= 0:
        parser.error(f"--switch-interval {args.switch_interval}: CPython needs more than 0 s")
    if args.kind in ACK_KINDS and (args.mode != "write" or args.secret):
        parser.error(
            f"--kind {args.kind} floods a WRITE-mode prefill's aborts: --mode write, no --secret"
        )
    return args


def _log_stages(report: dict[str, Any]) -> None:
    """--stages: the baseline's median round against the flood's median and slowest rounds
    (their mean), where the time went."""
    step = "prefill_added->forward"
    for name, rows in (
        ("baseline median", [report["baseline"]["median"]]),
        ("flood median", [report["flood"]["median"]]),
        (f"flood slowest {len(report['flood']['slowest'])}", report["flood"]["slowest"]),
    ):

        def mean(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.fmean(r.get(key, float("nan")) for r in rows)

        logger.warning(
            "stages, %s: round %.1f ms (main thread CPU %.1f ms, run-queue %.1f ms, %.0f "
            "sleeps; waited %.2f ms for the context lock, %.2f ms for the feed lock); the "
            "prefill's step to its forward_done %.1f ms (CPU %.1f, run-queue %.1f, %.0f sleeps, "
            "%.0f steps); written to loaded %.1f ms; the announcement found %.0f flood messages "
            "queued and waited %.1f ms for the notify thread, write_done %.0f and %.1f ms",
            name,
            mean("ms"),
            mean("start->loaded run"),
            mean("start->loaded runq"),
            mean("start->loaded sleeps"),
            mean("main_lock_wait_ms"),
            mean("main_feed_wait_ms"),
            mean(step),
            mean(f"{step} run"),
            mean(f"{step} runq"),
            mean(f"{step} sleeps"),
            mean(f"{step} steps"),
            mean("written->loaded"),
            mean("queued@ann_read"),
            mean("ann_read->ann_handled"),
            mean("queued@done_read"),
            mean("done_read->done_handled"),
        )
    for key, value in report.items():
        if " per flood message" in key or " held by " in key:
            logger.warning("stages, %s: %s", key, {k: round(v, 1) for k, v in value.items()})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Production's level: what the flood makes the connector log is part of its cost.
    logging.getLogger("moriio_native").setLevel(args.log_level.upper())
    res = run(args)
    b, f = res.baseline_ms, res.flood_ms
    for i, w in enumerate(res.windows):
        logger.warning(
            "window %d %s: p50 %.2f ms p99 %.2f ms; %d flood messages; CPU: process %.2f s, "
            "listener threads %.2f s",
            i,
            "flood   " if w.flood else "sink    " if w.sink else "baseline",
            w.ms["p50"],
            w.ms["p99"],
            w.messages,
            w.cpu_s,
            w.listener_cpu_s,
        )
    logger.warning(
        "%s flood, %s mode%s; genuine rounds, %d each: baseline p50 %.2f ms p99 "
        "%.2f ms max %.2f ms; under the flood p50 %.2f ms p99 %.2f ms max %.2f ms; ratio p50 "
        "%.2fx p99 %.2fx; flood %d messages (%d refused by ZMQ's high-water mark), %.0f/s "
        "asked, %.0f/s sent over %.1f s of flood phases; ratio of the windows' medians p50 "
        "%.2fx p99 %.2fx; CPU per 1,000 flood messages: process %.1f ms, listener threads "
        "%.1f ms; RSS %+.1f MiB; at the end: %d / %d keys (prefill / decode notify), %d early "
        "releases, %d orphan jobs, %d / %d queued; full collections: %d in the fill, %d in the "
        "phases; violations %d",
        res.kind,
        res.mode.upper(),
        ", shared secret" if res.secret else "",
        b["n"],
        b["p50"],
        b["p99"],
        b["max"],
        f["p50"],
        f["p99"],
        f["max"],
        res.ratio_p50,
        res.ratio_p99,
        res.flood_messages,
        res.flood_refused,
        res.rate,
        res.achieved_rate,
        res.flood_seconds,
        res.window_ratio_p50,
        res.window_ratio_p99,
        res.cpu_ms_per_1000["process"],
        res.cpu_ms_per_1000["listener_threads"],
        res.rss_mib["growth"],
        res.counts["prefill-notify"]["remembered"],
        res.counts["decode-notify"]["remembered"],
        res.counts["prefill-early-releases"]["held"],
        res.counts["prefill-orphans"]["held"],
        res.counts["prefill-notify"]["queued"],
        res.counts["decode-notify"]["queued"],
        res.full_collections["fill"],
        res.full_collections["phases"],
        len(res.violations),
    )
    if res.kind in ACK_KINDS:
        logger.warning(
            "%s: aborts named %d silent listeners (%d connections accepted), %d "
            "refused ports, %d answering ones (%d handshakes answered); peaks over the phases "
            "(at their start): directory %s (%s), "
            "acknowledgements waiting %d, process %s (%s); %d log lines; no handshake in "
            "flight %.1f s after the flood (then %s)",
            res.kind,
            res.targets.get("silent", 0),
            res.targets.get("accepted", 0),
            res.targets.get("refused", 0),
            res.targets.get("answering", 0),
            res.targets.get("answered", 0),
            res.peaks["prefill-directory"],
            res.at_start["prefill-directory"],
            res.peaks["prefill-acks"]["retries"],
            res.peaks["process"],
            res.at_start["process"],
            res.log_lines,
            res.drained_s,
            res.after_drain,
        )
    if res.sink_ms:
        logger.warning(
            "the same flood to a sink's ports (%d messages): genuine rounds p50 %.2f ms p99 "
            "%.2f ms, ratio to the baseline p50 %.2fx p99 %.2fx (windows' medians %.2fx / "
            "%.2fx); the flood to the instances over it p50 %.2fx p99 %.2fx (windows' "
            "medians %.2fx / %.2fx); CPU per 1,000 messages: the sink %.1f ms, this process "
            "%.1f ms",
            res.sink_messages,
            res.sink_ms["p50"],
            res.sink_ms["p99"],
            res.sink_ratio["p50"],
            res.sink_ratio["p99"],
            res.sink_window_ratio["p50"],
            res.sink_window_ratio["p99"],
            res.flood_over_sink["p50"],
            res.flood_over_sink["p99"],
            res.flood_over_sink["windows_p50"],
            res.flood_over_sink["windows_p99"],
            res.sink_cpu_ms_per_1000["sink"],
            res.sink_cpu_ms_per_1000["process"],
        )
    if res.abort_acks_ms:
        logger.warning(
            "genuine aborts under the flood: %d, abort to blocks freed median %.1f ms, max %.1f ms",
            len(res.abort_acks_ms),
            statistics.median(res.abort_acks_ms),
            max(res.abort_acks_ms),
        )
    if res.stages:
        _log_stages(res.stages)
    for line in res.violations:
        logger.error("violation: %s", line)
    text = json.dumps(asdict(res), indent=2, sort_keys=True)
    if args.json is not None:
        args.json.write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 1 if res.violations else 0


if __name__ == "__main__":
    sys.exit(main())
