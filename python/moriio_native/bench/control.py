"""Control-plane round trips on loopback: what a request's messages cost, next to raw ZMQ.

Two processes on 127.0.0.1 (the responder is a spawned child, so the two sides share no GIL):

* ``remote_blocks -> write_done``: the decode side sends :class:`RemoteBlocks` (``--blocks``
  block ids) through a :class:`NotifySender` to the prefill side's :class:`NotifyListener`; the
  prefill side answers with :class:`WriteDone` to the decode side's listener. Timed from the
  send to the moment ``get`` returns the answer (the WRITE-mode round trip, without the data).
* ``handshake``: :func:`fetch_metadata` against a :class:`HandshakeServer` whose provider
  returns ``--metadata-bytes`` of engine metadata (a new socket and connection each time, as a
  worker meets a new peer).
* ``hold check``: :func:`ask_checksums` of a ``hold_only`` :class:`ChecksumRequest` naming
  ``--blocks`` block ids, answered by the same server (no checksums): the round trip
  ``confirm_reads`` adds to every READ, on the connection kept to the server and waited for by
  a :class:`PolledRequests` thread, as the decode's confirmer makes it (timed to the
  callback). Answered on the server's reading thread, as a prefill answers one for a transfer
  it knows; ``hold check, late``: one that came before its transfer's send task, as a prefill
  handles it (left to ``when_ready``, let go -- here at once: the wait itself is not timed --
  and answered on the reading thread's next round).
* ``raw zmq``: the baseline, measured in the same run: a DEALER sends a msgpack payload of the
  same size to a ROUTER in the child, which echoes it (no schema, no authentication, no queues).

Each with and without HMAC (``auth_secret``). Reported: p50 / p99 / max in microseconds and
p50 over the raw baseline's p50. Every answer is checked (transfer id, nonce, metadata bytes).

    PYTHONPATH=build/<dir>/python python3 -m moriio_native.bench.control [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import msgpack
import zmq

from moriio_native.control.channel import (
    HandshakeServer,
    NotifyListener,
    NotifySender,
    PolledRequests,
    ask_checksums,
    fetch_metadata,
)
from moriio_native.control.messages import (
    ChecksumRequest,
    ChecksumResponse,
    HandshakeRequest,
    HandshakeResponse,
    RemoteBlocks,
    WriteDone,
)
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.errors import MoriioError

logger = logging.getLogger("moriio_native.bench.control")

LOCAL = "127.0.0.1"
SECRET = "bench-secret-0123456789abcdef"
WAIT = 5.0  # seconds an answer may take before the benchmark fails


@dataclass
class Row:
    exchange: str
    hmac: bool
    samples: int
    p50_us: float
    p99_us: float
    max_us: float
    p50_over_raw: float


def _security(hmac: bool) -> ControlSecurity:
    return ControlSecurity(MessageAuth(SECRET if hmac else None), PeerAllowlist([LOCAL]))


def _responder(conn: Connection, hmac: bool, metadata_bytes: int) -> None:
    """The prefill side: answers remote_blocks with write_done, handshakes with metadata, and
    echoes raw frames. Reports its ports, then serves until told to stop."""
    security = _security(hmac)
    metadata = bytes(range(256)) * (metadata_bytes // 256) + b"\x00" * (metadata_bytes % 256)

    def provide(_request: HandshakeRequest) -> HandshakeResponse:
        return HandshakeResponse(engine_id="prefill", engine_metadata=metadata)

    def hold_check(request: ChecksumRequest) -> ChecksumResponse:
        if not request.hold_only:
            raise RuntimeError("the benchmark asks for hold checks only")
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    late_asked: set[str] = set()  # the late checks asked once (the reading thread's own)

    def hold_check_at_once(request: ChecksumRequest) -> ChecksumResponse | None:
        tid = request.transfer_id
        if tid.startswith(LATE) and tid not in late_asked:
            late_asked.add(tid)
            return None  # its send task has not come yet
        return hold_check(request)

    def send_task_came(_request: ChecksumRequest, go: Callable[[], None]) -> None:
        go()

    stop = threading.Event()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw_port = raw.bind_to_random_port(f"tcp://{LOCAL}")

    def echo() -> None:  # its own thread, so neither exchange waits on the other's poll
        while not stop.is_set():
            if raw.poll(100):
                raw.send_multipart(raw.recv_multipart())

    with (
        NotifyListener(0, security, bind_host=LOCAL) as listener,
        HandshakeServer(
            0,
            provide,
            security,
            bind_host=LOCAL,
            checksums=hold_check,
            at_once=hold_check_at_once,
            when_ready=send_task_came,
        ) as server,
        NotifySender(security) as sender,
    ):
        conn.send((listener.port, server.port, raw_port))
        decode_port = conn.recv()

        def answer() -> None:
            while not stop.is_set():
                msg = listener.get(timeout=0.1)
                if isinstance(msg, RemoteBlocks):
                    sender.send(LOCAL, decode_port, WriteDone(transfer_id=msg.transfer_id))

        threads = [threading.Thread(target=f, daemon=True) for f in (echo, answer)]
        for t in threads:
            t.start()
        conn.recv()  # "stop"
        stop.set()
        for t in threads:
            t.join(timeout=5)
    raw.close()


#: The transfer-id prefix of hold checks whose send task the responder has not had yet.
LATE = "late-"


def _percentiles(samples: list[float], raw_p50: float, exchange: str, hmac: bool) -> Row:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    p50 = statistics.median(ordered)
    return Row(exchange, hmac, len(ordered), p50, p99, ordered[-1], p50 / raw_p50)


def _raw_round_trips(port: int, payload_bytes: int, n: int) -> list[float]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{LOCAL}:{port}")
    payload = msgpack.packb({"type": "echo", "data": b"\x01" * payload_bytes})
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            sock.send(payload)
            if not sock.poll(int(WAIT * 1000)):
                raise TimeoutError("raw echo did not come back")
            if sock.recv() != payload:
                raise RuntimeError("raw echo came back different")
            out.append((time.perf_counter() - t) * 1e6)
    finally:
        sock.close()
    return out


def _notify_round_trips(
    security: ControlSecurity,
    prefill_port: int,
    listener: NotifyListener,
    blocks: int,
    n: int,
    phase: str,
) -> list[float]:
    out = []
    with NotifySender(security) as sender:
        for i in range(n):
            tid = f"{phase}-{i}"  # unique: the listeners drop repeated transfer ids
            msg = RemoteBlocks(
                transfer_id=tid,
                block_ids=(tuple(range(i, i + blocks)),),
                decode_engine_id="decode",
            )
            t = time.perf_counter()
            sender.send(LOCAL, prefill_port, msg)
            answer = listener.get(timeout=WAIT)
            elapsed = (time.perf_counter() - t) * 1e6
            if not isinstance(answer, WriteDone) or answer.transfer_id != tid:
                raise RuntimeError(f"expected write_done for {tid}, got {answer!r}")
            out.append(elapsed)
    return out


def _handshake_round_trips(
    security: ControlSecurity, port: int, metadata_bytes: int, n: int
) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        response = fetch_metadata(
            LOCAL, port, timeout=WAIT, security=security, requester_engine_id="decode"
        )
        out.append((time.perf_counter() - t) * 1e6)
        if len(response.engine_metadata) != metadata_bytes or response.engine_id != "prefill":
            raise RuntimeError("handshake answer carried the wrong metadata")
    return out


def _hold_check_round_trips(
    security: ControlSecurity, port: int, blocks: int, n: int, prefix: str = "hold-"
) -> list[float]:
    """``n`` hold checks of transfers named ``prefix<i>`` (:data:`LATE`: each before its send
    task)."""
    requests = PolledRequests(security, "bench-hold-checks")
    try:
        return [
            _hold_check(
                requests,
                port,
                ChecksumRequest(
                    requester_engine_id="decode",
                    transfer_id=f"{prefix}{i}",
                    block_ids=tuple(range(1, blocks + 1)),
                    hold_only=True,
                ),
            )
            for i in range(n)
        ]
    finally:
        requests.close()


def _hold_check(requests: PolledRequests, port: int, request: ChecksumRequest) -> float:
    """One hold check's microseconds from the ask to its callback (where a decode's verdict
    runs); raises unless it was answered, with no checksums."""
    answered: list[tuple[float, ChecksumResponse | MoriioError]] = []
    came = threading.Event()

    def done(outcome: ChecksumResponse | MoriioError) -> None:
        answered.append((time.perf_counter(), outcome))
        came.set()

    start = time.perf_counter()
    ask_checksums(requests, LOCAL, port, request, timeout=WAIT, done=done)
    if not came.wait(2 * WAIT):
        raise RuntimeError(f"hold check {request.transfer_id}: no callback")
    at, answer = answered[0]
    if isinstance(answer, MoriioError):
        raise answer
    if answer.checksums:
        raise RuntimeError("a hold check's answer carried checksums")
    return (at - start) * 1e6


def measure(hmac: bool, args: argparse.Namespace) -> list[Row]:
    """One responder process; raw, notify and handshake round trips against it."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_responder, args=(child, hmac, args.metadata_bytes), daemon=True)
    proc.start()
    security = _security(hmac)
    try:
        if not parent.poll(30):
            raise TimeoutError("the responder process did not report its ports")
        prefill_port, handshake_port, raw_port = parent.recv()
        with NotifyListener(0, security, bind_host=LOCAL) as listener:
            parent.send(listener.port)
            warm = max(10, args.iterations // 20)
            _raw_round_trips(raw_port, args.blocks * 8, warm)
            raw = _raw_round_trips(raw_port, args.blocks * 8, args.iterations)
            _notify_round_trips(security, prefill_port, listener, args.blocks, warm, "warm")
            notify = _notify_round_trips(
                security, prefill_port, listener, args.blocks, args.iterations, "timed"
            )
            _handshake_round_trips(security, handshake_port, args.metadata_bytes, warm)
            handshake = _handshake_round_trips(
                security, handshake_port, args.metadata_bytes, args.handshakes
            )
            _hold_check_round_trips(security, handshake_port, args.blocks, warm)
            hold = _hold_check_round_trips(security, handshake_port, args.blocks, args.handshakes)
            late = _hold_check_round_trips(
                security, handshake_port, args.blocks, args.handshakes, LATE
            )
    finally:
        parent.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    raw_p50 = statistics.median(raw)
    return [
        _percentiles(raw, raw_p50, "raw zmq echo", hmac),
        _percentiles(notify, raw_p50, "remote_blocks -> write_done", hmac),
        _percentiles(handshake, raw_p50, "handshake", hmac),
        _percentiles(hold, raw_p50, "hold check", hmac),
        _percentiles(late, raw_p50, "hold check, late", hmac),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000, help="notify round trips")
    parser.add_argument("--handshakes", type=int, default=500, help="handshakes, hold checks")
    parser.add_argument("--blocks", type=int, default=256, help="block ids per remote_blocks")
    parser.add_argument("--metadata-bytes", type=int, default=16384)
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [row for hmac in (False, True) for row in measure(hmac, args)]
    for r in rows:
        logger.info(
            "%-28s hmac=%-5s n=%5d  p50 %7.1f us  p99 %7.1f us  max %8.1f us  p50/raw %.2f",
            r.exchange,
            r.hmac,
            r.samples,
            r.p50_us,
            r.p99_us,
            r.max_us,
            r.p50_over_raw,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
