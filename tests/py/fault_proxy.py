"""A fault-injecting proxy on the control plane's ZMQ path (no tests here).

The connector's control sockets are DEALER clients talking to ROUTER listeners (handshake
request/response, one-way notify messages). :class:`FaultProxy` binds a ROUTER on 127.0.0.1,
opens one DEALER to the real listener per client identity, and forwards frames both ways, so an
instance pointed at the proxy's port (through the request id's embedded address) reaches its
peer only through it. A :class:`Rule` per message type decides the fate of each message:
forwarded, dropped, duplicated, delayed, or held back until the next message in the same
direction has passed (reordered). One thread owns every socket; counters say what was seen and
which faults were injected.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

import msgpack
import zmq

from net_support import free_port

logger = logging.getLogger("moriio_native.tests.fault_proxy")

_POLL_MS = 20


class Fault(Enum):
    PASS = "pass"
    DROP = "drop"
    DUPLICATE = "duplicate"
    DELAY = "delay"
    REORDER = "reorder"


@dataclass
class Rule:
    """The fault for the messages of one type: applied to the ``first`` ones of that type after
    :meth:`FaultProxy.set_rules` when given (later ones pass), to every one otherwise."""

    fault: Fault
    delay_s: float = 0.0  # DELAY: how long; REORDER: the longest a message is held back
    first: int | None = None


@dataclass
class _Stats:
    seen: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)


def message_type(frames: list[bytes]) -> str:
    """The control message type of a frame list (optional empty delimiter, the payload, an
    optional HMAC tag)."""
    payload = next((f for f in frames if f), b"")
    try:
        data = msgpack.unpackb(payload, raw=False)
    except Exception:
        return "?"
    if isinstance(data, dict):
        kind = data.get("type")
        if isinstance(kind, str):
            return kind
    return "?"


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port`` with faults from ``rules``
    (message type -> :class:`Rule`; types without a rule pass). Thread-safe: ``set_rules``,
    ``stats`` and ``close`` may be called from any thread."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.port = free_port()
        self._target = f"tcp://{target_host}:{target_port}"
        self._lock = threading.Lock()
        self._rules: dict[str, Rule] = {}
        # Per type: the messages a rule with ``first`` was applied to since set_rules.
        self._applied: Counter[str] = Counter()
        self._stats = _Stats()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fault-proxy-{self.port}")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"fault proxy on port {self.port} did not start")

    def set_rules(self, rules: dict[str, Rule]) -> None:
        with self._lock:
            self._rules = dict(rules)
            self._applied = Counter()

    def stats(self) -> tuple[dict[str, int], dict[str, int]]:
        """(messages seen per type, faults injected per ``type:fault``)."""
        with self._lock:
            return dict(self._stats.seen), dict(self._stats.injected)

    def injected(self) -> int:
        with self._lock:
            return sum(self._stats.injected.values())

    def _decide(self, kind: str) -> Rule | None:
        with self._lock:
            self._stats.seen[kind] += 1
            rule = self._rules.get(kind)
            if rule is None or rule.fault is Fault.PASS:
                return None
            if rule.first is not None and self._applied[kind] >= rule.first:
                return None
            self._applied[kind] += 1
            self._stats.injected[f"{kind}:{rule.fault.value}"] += 1
            return rule

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        front = ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.bind(f"tcp://127.0.0.1:{self.port}")
        backs: dict[bytes, zmq.Socket] = {}
        owner: dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        seq = itertools.count()
        # (when, seq, socket, frames): messages whose delay runs; held: per direction, the
        # message waiting for the next one to overtake it.
        timed: list[tuple[float, int, zmq.Socket, list[bytes]]] = []
        held: dict[str, tuple[float, zmq.Socket, list[bytes]] | None] = {"up": None, "down": None}
        self._ready.set()

        def route(direction: str, sock: zmq.Socket, frames: list[bytes], payload: list[bytes]):
            rule = self._decide(message_type(payload))
            waiting = held[direction]
            if rule is None or rule.fault is Fault.PASS:
                sock.send_multipart(frames)
            elif rule.fault is Fault.DROP:
                pass
            elif rule.fault is Fault.DUPLICATE:
                sock.send_multipart(frames)
                sock.send_multipart(frames)
            elif rule.fault is Fault.DELAY:
                heapq.heappush(timed, (time.monotonic() + rule.delay_s, next(seq), sock, frames))
            elif waiting is None:  # REORDER: hold this one back
                held[direction] = (time.monotonic() + rule.delay_s, sock, frames)
                return
            else:
                sock.send_multipart(frames)
            if waiting is not None and held[direction] is waiting:
                held[direction] = None  # this message overtook the held one: release it
                waiting[1].send_multipart(waiting[2])

        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is front:
                        frames = front.recv_multipart()
                        ident, payload = frames[0], frames[1:]
                        back = backs.get(ident)
                        if back is None:
                            back = ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(self._target)
                            backs[ident], owner[back] = back, ident
                            poller.register(back, zmq.POLLIN)
                        route("up", back, payload, payload)
                    else:
                        payload = sock.recv_multipart()
                        route("down", front, [owner[sock], *payload], payload)
                now = time.monotonic()
                while timed and timed[0][0] <= now:
                    _, _, sock, frames = heapq.heappop(timed)
                    sock.send_multipart(frames)
                for direction, waiting in held.items():
                    if waiting is not None and waiting[0] <= now:
                        held[direction] = None
                        waiting[1].send_multipart(waiting[2])
        finally:
            for back in backs.values():
                back.close(linger=0)
            front.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
