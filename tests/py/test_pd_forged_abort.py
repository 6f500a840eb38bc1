"""A WRITE-mode prefill against an abort_write whose own fields are wrong (found by a review):
it names a rank that the address it points at does not serve."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.messages import (
    AbortWrite,
    HandshakeResponse,
    RemoteBlocks,
    WriteAborted,
    WriteFailed,
)
from moriio_native.control.security import ControlSecurity
from moriio_native.pd.config import PdConfig
from moriio_native.pd.context import Context
from moriio_native.pd.peers import PeerDirectory, PeerKey
from moriio_native.pd.pusher import JobState, Pusher
from moriio_native.pd.tasks import SaveTask

DECODE = ZmqAddress("127.0.0.1", 8000, 8100)
DECODE_INCARNATION = "ab" * 16


class Engine:
    """Connects every peer it is given and records the writes."""

    def __init__(self) -> None:
        self.connected: list[str] = []
        self.calls: list[Any] = []

    def add_peer(
        self, metadata: bytes, *, replace: bool = False, expected_engine_id: str = ""
    ) -> str:
        self.connected.append(expected_engine_id)
        return expected_engine_id

    def peers(self) -> list[str]:
        return list(self.connected)

    def remove_idle_peer(self, peer: str) -> bool:
        return True

    def write_layer(self, *a: Any, **k: Any) -> bool:
        self.calls.append(("write_layer", a))
        return True

    def write_layers(self, *a: Any, **k: Any) -> bool:
        self.calls.append(("write_layers", a))
        return True

    def seal(self, *a: Any, **k: Any) -> None:
        self.calls.append(("seal", a))

    def abort(self, tid: str) -> None:
        self.calls.append(("abort", tid))

    def waits_for_device_events(self, peer: str) -> bool:
        return False


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Any]] = []

    def send(self, host: str, port: int, message: Any) -> None:
        self.sent.append((host, port, message))


class Stats:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _prefill(engine: Engine) -> tuple[Pusher, Context, PeerDirectory, Sender, list[PeerKey]]:
    """A WRITE-mode prefill rank whose peer directory's handshakes reach the genuine decode
    (TP 1, its only rank answering at handshake port 8000), its writer thread running; and
    the handshake addresses asked, in order."""
    directory = PeerDirectory(
        lambda: engine,  # type: ignore[arg-type,return-value]
        ControlSecurity.from_config({"allowed_peers": ["127.0.0.1/32"]}),
        "p:7000/dp0/tp0",
        timeout=1.0,
    )
    fetched: list[PeerKey] = []

    def fetch(key: PeerKey) -> HandshakeResponse:
        fetched.append(key)
        assert key == PeerKey("127.0.0.1", 8000)
        return HandshakeResponse(
            "d:8000/dp0/tp0", b"meta", 0, 0, 1, 1, "WRITE", incarnation=DECODE_INCARNATION
        )

    directory._fetch = fetch  # type: ignore[method-assign]
    cfg = PdConfig(
        engine_id="p:7000/dp0/tp0",
        mode="write",
        producer=True,
        consumer=False,
        host_ip="127.0.0.1",
        handshake_port=7000,
        notify_port=7100,
    )
    sender = Sender()
    ctx = Context(
        cfg=cfg,
        engine=lambda: engine,  # type: ignore[arg-type,return-value]
        sender=sender,  # type: ignore[arg-type]
        directory=directory,
        stats=Stats(),
        mark_terminal=lambda tid: None,
    )
    pusher = Pusher(ctx)
    threading.Thread(target=pusher.writer_loop, daemon=True).start()
    return pusher, ctx, directory, sender, fetched


def _abort(
    handshake_base: int,
    notify_base: int,
    rank: int,
    tp_size: int,
    *,
    transfer_id: str = "tx-forged",
    engine_id: str = "d:8000/dp0/tp0",
) -> AbortWrite:
    """An abort_write (by default of a transfer the prefill never had) naming rank ``rank`` of
    a decode of ``tp_size`` ranks at those base ports, as engine ``engine_id``."""
    return AbortWrite(
        transfer_id,
        engine_id,
        decode_host="127.0.0.1",
        decode_handshake_port=handshake_base,
        decode_notify_port=notify_base,
        decode_dp_rank=0,
        decode_tp_rank=rank,
        decode_tp_size=tp_size,
    )


def _start_genuine_write(pusher: Pusher) -> None:
    """The genuine request tx-1 to the decode (its notify port 8100), announced by its rank 0;
    returns once the job left CONNECTING."""
    pusher.begin_step([SaveTask("req-1", "tx-1", (1, 2, 3), 3, DECODE, 1)], [])
    pusher.on_remote_blocks(
        RemoteBlocks(
            "tx-1",
            ((11, 12, 13),),
            "d:8000/dp0/tp0",
            decode_tp_rank=0,
            decode_incarnation=DECODE_INCARNATION,
        )
    )
    _wait(lambda: pusher.job_states().get("tx-1") is not JobState.CONNECTING, "the job")


def test_a_forged_abort_write_does_not_fail_genuine_writes_to_the_decode_rank() -> None:
    """Before: acknowledging the abort handshook the address its fields name, and the real
    decode rank answering there as another rank than the abort claimed was remembered as that
    address's failure: every genuine WRITE to the rank failed at once (write_failed,
    recomputed) for the directory's backoff, 5 s and doubling, renewed by each retry of the
    acknowledgement or another such message. Now which rank answers is each caller's own
    expectation: the abort's acknowledgement fails alone, the genuine job writes."""
    pusher, ctx, directory, sender, fetched = _prefill(Engine())
    try:
        # Rank 1 of a TP-2 decode whose base port is 7999: by the port formula handshake port
        # 8000, where the genuine decode's rank 0 answers.
        pusher.on_abort_write(_abort(7999, 8099, 1, 2))
        _wait(lambda: fetched, "the acknowledgement's handshake")
        time.sleep(0.2)  # answered as rank 0 of TP 1: refused for the acknowledgement
        _start_genuine_write(pusher)
        failed = [m for _, _, m in sender.sent if isinstance(m, WriteFailed)]
        assert not failed, f"the genuine WRITE failed: {failed[0].reason}"
        assert pusher.job_states()["tx-1"] is JobState.WRITING
    finally:
        ctx.stop.set()
        directory.close()


def test_an_abort_write_naming_another_notify_port_cannot_redirect_a_genuine_job() -> None:
    """Found by a review: the rank's cached handshake kept the notify port its first caller
    named, so an abort_write with the rank's right handshake address and a wrong notify port,
    met before any genuine request handshook that rank, sent the genuine job's write_done and
    write_failed there (the decode waited out its timeout, then recomputed) for as long as the
    handshake stayed cached. Now each caller's messages go where its own request says."""
    pusher, ctx, directory, sender, fetched = _prefill(Engine())
    try:
        pusher.on_abort_write(_abort(8000, 9999, 0, 1))  # the rank's address, a wrong port
        _wait(lambda: sender.sent, "the acknowledgement")
        assert [(port, type(m)) for _, port, m in sender.sent] == [(9999, WriteAborted)]
        assert sender.sent[0][2].decode_engine_id == "d:8000/dp0/tp0"  # the rank it names
        _start_genuine_write(pusher)
        assert fetched == [PeerKey("127.0.0.1", 8000)]  # the job took the cached handshake
        pusher.on_event(SimpleNamespace(transfer_id="tx-1", state="failed", message="lost"), True)
        finals = [(port, m) for _, port, m in sender.sent if isinstance(m, WriteFailed)]
        assert [port for port, _ in finals] == [DECODE.notify_port], finals
    finally:
        ctx.stop.set()
        directory.close()


def test_the_acknowledgement_of_a_job_names_the_decode_rank_it_wrote_into() -> None:
    """write_aborted names the decode rank whose writes stopped, and a rank ignores one naming
    another: for a job, the rank it wrote into, whichever engine id the abort_write named (a
    message naming a wrong one still stops the job, as any abort_write does, and its
    acknowledgement still frees the rank the job wrote into)."""
    pusher, ctx, directory, sender, _ = _prefill(Engine())
    try:
        _start_genuine_write(pusher)
        pusher.on_abort_write(_abort(8000, 8100, 0, 1, transfer_id="tx-1", engine_id="x:1/dp0/tp0"))
        pusher.on_event(
            SimpleNamespace(transfer_id="tx-1", state="failed", message="aborted"), True
        )
        acks = [(port, m) for _, port, m in sender.sent if isinstance(m, WriteAborted)]
        assert [(port, m.decode_engine_id) for port, m in acks] == [(8100, "d:8000/dp0/tp0")]
    finally:
        ctx.stop.set()
        directory.close()
