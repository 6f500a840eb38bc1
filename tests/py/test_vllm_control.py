"""The connector's control plane under bad input: the listeners survive and nothing changes.

Messages are injected with a raw ZMQ DEALER into a prefill instance's notify and handshake
ports while one of its requests holds blocks, then the tests check that the blocks are still
held (vLLM frees nothing), that a genuine message afterwards still works, and that duplicates
and late copies free nothing twice (vLLM's scheduler asserts on a double free).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

pytest.importorskip("vllm")

from moriio_native.control.addressing import parse_kv_transfer_params
from moriio_native.control.messages import (
    MAX_NOTIFY_BYTES,
    Release,
    RemoteBlocks,
    WriteDone,
    encode,
)
from moriio_native.control.security import MessageAuth
from moriio_native.pd import pusher as pusher_module
from process_support import wait_for
from test_vllm_support import (
    Side,
    decode_params,
    load,
    pd_request_id,
    prefill_params,
    transfer_id,
    write_model_dir,
)

pytestmark = pytest.mark.vllm

SECRET = "correct horse battery staple 0123"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(Path(tmp_path_factory.mktemp("model")))


@pytest.fixture
def sides() -> Iterator[list[Side]]:
    made: list[Side] = []
    yield made
    for side in made:
        side.shutdown()


@pytest.fixture
def dealer() -> Iterator[Callable[..., None]]:
    """``send(port, frames, secret=None)``: over one connection per port and secret; with a
    secret, one that holds its CURVE keys (gets past the transport to the message checks)."""
    ctx = zmq.Context.instance()
    sockets: dict[tuple[int, str | None], zmq.Socket] = {}

    def send(port: int, frames: list[bytes], secret: str | None = None) -> None:
        if (port, secret) not in sockets:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            MessageAuth(secret).secure_dialer(sock)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sockets[port, secret] = sock
        sockets[port, secret].send_multipart(frames)

    yield send
    for sock in sockets.values():
        sock.close(linger=0)


def listener_stats(side: Side) -> dict[str, int]:
    return side.worker.worker._listener.stats()


def server_stats(side: Side) -> dict[str, int]:
    return side.worker.worker._server.stats()


def held_prefill(
    sides: list[Side], model_dir: str, mode: str = "read", **extra: object
) -> tuple[Side, Side, str, str, dict]:
    p = Side("prefill", "kv_producer", mode, model_dir, salt=1, extra=dict(extra))
    sides.append(p)
    d = Side("decode", "kv_consumer", mode, model_dir, salt=2, extra=dict(extra))
    sides.append(d)
    rid, tid = pd_request_id(p, d), transfer_id()
    p.add_request(rid, list(range(1, 41)), params=prefill_params(tid), max_tokens=1)
    result = p.step()
    returned = result.finished()[rid].kv_transfer_params
    assert p.free_blocks() == p.initial_free - 3
    return p, d, rid, tid, returned


def assert_still_held(p: Side, rid: str, steps: int = 3) -> None:
    for _ in range(steps):
        assert not p.step().transfer.finished_sending
    assert p.free_blocks() == p.initial_free - 3 and rid in p.scheduler.requests


def test_bad_notify_messages_are_dropped_and_the_listener_survives(
    sides: list[Side], model_dir: str, dealer: Callable[[int, list[bytes]], None]
) -> None:
    p, _, rid, tid, _ = held_prefill(sides, model_dir)
    port = p.notify_port
    bad = [
        [b"\xc1\xff not msgpack"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"type": "self_destruct", "transfer_id": tid})],
        [msgpack.packb({"type": "release", "transfer_id": tid, "consumer_tp_size": "many"})],
        [msgpack.packb({"type": "release", "transfer_id": tid, "extra": 1})],
        [msgpack.packb({"type": "release"})],
        [b"x" * (MAX_NOTIFY_BYTES + 1)],
        [encode(Release(tid)), b"a", b"b"],
        [encode(Release(tid)), b"\x00" * 32],  # a tag although no secret is configured
    ]
    for frames in bad:
        dealer(port, frames)
    wait_for(lambda: listener_stats(p)["received"] >= len(bad), "the bad messages")
    stats = listener_stats(p)
    assert stats["delivered"] == 0
    assert stats["dropped_malformed"] + stats["dropped_auth"] == len(bad)
    assert_still_held(p, rid)

    # A release for a transfer nobody knows changes nothing either.
    dealer(port, [encode(Release("tx-unknown"))])
    wait_for(lambda: listener_stats(p)["delivered"] == 1, "unknown release")
    assert_still_held(p, rid)

    # The listener is alive: a genuine release frees the blocks, exactly once.
    dealer(port, [encode(Release(tid))])
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")
    assert p.free_blocks() == p.initial_free
    dealer(port, [encode(Release(tid))])  # duplicate
    dealer(port, [encode(Release(tid, consumer_tp_size=2, consumer_tp_rank=1))])  # late
    wait_for(lambda: listener_stats(p)["received"] >= len(bad) + 4, "the late copies")
    for _ in range(3):
        assert not p.step().transfer.finished_sending  # a second report would crash vLLM
    assert p.free_blocks() == p.initial_free


def test_forged_or_missing_hmac_is_dropped(
    sides: list[Side], model_dir: str, dealer: Callable[..., None]
) -> None:
    """A stranger's messages are not even read (the listener is a CURVE server); a peer that
    holds the transport keys but sends an untagged, forged or truncated tag is dropped at
    authentication; neither changes the prefill's state."""
    p, d, rid, tid, returned = held_prefill(sides, model_dir, auth_secret=SECRET)
    payload = encode(Release(tid))
    forged = hmac.new(
        b"not the secret at all 0123456789",
        b"moriio-native/control/v1\x00" + payload,
        hashlib.sha256,
    ).digest()
    for secret in (None, SECRET):
        dealer(p.notify_port, [payload], secret)
        dealer(p.notify_port, [payload, forged], secret)
        dealer(p.notify_port, [payload, forged[:16]], secret)
    wait_for(lambda: listener_stats(p)["received"] >= 3, "forged messages")
    time.sleep(0.3)  # time for the stranger's messages to be read, were they let in
    assert listener_stats(p)["received"] == listener_stats(p)["dropped_auth"] == 3
    assert_still_held(p, rid)
    # The genuine decode (same secret) reads and releases.
    d.add_request(rid, list(range(1, 41)), params=decode_params(tid, returned), max_tokens=1)
    first = load(d, rid)
    assert first.invalid_blocks == set()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="authenticated release")


@pytest.mark.parametrize("answer", ["as the prefill tagged it", "tagged with the decode's secret"])
def test_handshake_with_the_wrong_secret_fails_closed(
    sides: list[Side], model_dir: str, answer: str
) -> None:
    """A decode with another secret than its prefill: it does not act on the prefill's answer
    (its tag is of another secret), so it never dials the prefill and computes the request
    locally. The same answer tagged with the decode's own secret (by a party that holds it)
    gets as far as the handshake, which ZMQ's CURVE refuses: nothing of it is read, and the
    load fails (vLLM recomputes)."""
    other_secret = "another secret of 32 bytes!!!!!"
    p = Side("prefill", "kv_producer", "read", model_dir, salt=1, extra={"auth_secret": SECRET})
    sides.append(p)
    d = Side(
        "decode",
        "kv_consumer",
        "read",
        model_dir,
        salt=2,
        extra={"auth_secret": other_secret, "transfer_timeout": 1},
    )
    sides.append(d)
    rid, tid = pd_request_id(p, d), transfer_id()
    prompt = list(range(3, 40))
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    returned = dict(p.step().finished()[rid].kv_transfer_params)
    retagged = answer != "as the prefill tagged it"
    if retagged:
        canonical = parse_kv_transfer_params(decode_params(tid, returned)).answer_bytes()
        returned["remote_answer_tag"] = MessageAuth(other_secret).tag_answer(canonical)
    d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=1)
    first = load(d, rid)
    # Retagged: nothing was loaded (vLLM recomputes); else nothing was tried.
    assert bool(first.invalid_blocks) is retagged
    # The decode's connection, if any, failed ZMQ's CURVE handshake: the server read nothing.
    assert server_stats(p)["received"] == 0 and server_stats(p)["answered"] == 0
    assert first.scheduled == {rid: len(prompt)}


def test_garbage_on_the_handshake_port_does_not_stop_the_server(
    sides: list[Side], model_dir: str, dealer: Callable[[int, list[bytes]], None]
) -> None:
    p, d, rid, tid, returned = held_prefill(sides, model_dir)
    for frames in (
        [b"get_meta_msg"],
        [msgpack.packb({"type": "handshake_request"})],
        [b"\x00" * 10000],
    ):
        dealer(p.handshake_port, frames)
    wait_for(lambda: server_stats(p)["received"] >= 3, "garbage handshakes")
    assert server_stats(p)["answered"] == 0
    d.add_request(rid, list(range(1, 41)), params=decode_params(tid, returned), max_tokens=1)
    assert load(d, rid).invalid_blocks == set()
    assert server_stats(p)["answered"] == 1
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release")


def test_forged_remote_blocks_cannot_redirect_writes(
    sides: list[Side],
    model_dir: str,
    dealer: Callable[[int, list[bytes]], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = Side("prefill", "kv_producer", "write", model_dir, salt=1)
    sides.append(p)
    d = Side("decode", "kv_consumer", "write", model_dir, salt=2)
    sides.append(d)
    rid, tid = pd_request_id(p, d), transfer_id()
    prompt = list(range(5, 50))
    # Someone else claims the transfer first, naming an engine that is not the request's decode.
    dealer(
        p.notify_port,
        [
            encode(
                RemoteBlocks(
                    tid, ((1, 2, 3),), decode_engine_id="127.0.0.1:1/dp0/tp0", num_tokens=44
                )
            )
        ],
    )
    wait_for(lambda: listener_stats(p)["delivered"] == 1, "forged remote_blocks")
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=1)
    d.step()
    with caplog.at_level(logging.WARNING, logger="moriio_native"):
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        p.step()
        p.run_until(lambda r: rid in r.transfer.finished_sending, what="refused job")
    assert "127.0.0.1:1/dp0/tp0" in caplog.text
    assert p.free_blocks() == p.initial_free
    res = d.run_until(lambda r: rid in r.transfer.failed_recving, what="write_failed")
    assert rid in res[-1].transfer.finished_recving
    # No byte of the prefill reached the decode's blocks; the decode computes the prompt itself.
    assert not any(d.slot_matches(rid, range(len(prompt)), p.salt, prompt))
    assert d.step().scheduled == {rid: len(prompt)}


def test_blocks_read_by_two_decode_ranks_wait_for_both_releases(
    sides: list[Side], model_dir: str, dealer: Callable[[int, list[bytes]], None]
) -> None:
    # A decode with TP 2 over this TP-1 prefill: both decode ranks read rank 0's blocks, so the
    # first release must not free them while the other rank may still be reading.
    p, _, rid, tid, _ = held_prefill(sides, model_dir, abort_timeout=600)
    port = p.notify_port
    dealer(port, [encode(Release(tid, consumer_tp_size=2, consumer_tp_rank=0))])
    wait_for(lambda: listener_stats(p)["delivered"] == 1, "the first release")
    assert_still_held(p, rid)
    dealer(port, [encode(Release(tid, consumer_tp_size=2, consumer_tp_rank=0))])  # duplicate
    wait_for(lambda: listener_stats(p)["received"] == 2, "the duplicate")
    assert_still_held(p, rid)
    dealer(port, [encode(Release(tid, consumer_tp_size=2, consumer_tp_rank=1))])
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="the second rank's release")
    assert p.free_blocks() == p.initial_free


def test_a_flood_on_every_listening_port_neither_stops_nor_grows_the_connector(
    sides: list[Side],
    model_dir: str,
    dealer: Callable[[int, list[bytes]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Garbage and schema-valid messages of transfers nobody knows, on the handshake and notify
    ports of both instances: every message is read and dropped or ignored, what the connector
    remembers of them stays within its bound, and a genuine transfer still goes through."""
    bound = 200
    monkeypatch.setattr(pusher_module, "MAX_EARLY_MESSAGES", bound)
    p, d, rid, tid, returned = held_prefill(sides, model_dir)
    flood = 1500
    garbage = [b"", b"\xc1", b"get_meta_msg", b"\x91" * 64, msgpack.packb({"type": "release"})]
    sent: dict[tuple[int, str], int] = {}
    ports = {
        "p-handshake": p.handshake_port,
        "p-notify": p.notify_port,
        "d-handshake": d.handshake_port,
        "d-notify": d.notify_port,
    }
    for i in range(flood):
        for name, port in ports.items():
            dealer(port, [garbage[i % len(garbage)]])
            sent[(port, name)] = sent.get((port, name), 0) + 1
        # Valid messages for transfers that do not exist: each is new to the dedup memory.
        dealer(p.notify_port, [encode(Release(f"flood-{i}"))])
        dealer(d.notify_port, [encode(WriteDone(f"flood-{i}"))])
    n = flood * 2  # garbage + valid per notify port
    wait_for(lambda: listener_stats(p)["received"] >= n, "the prefill's flood", limit=300)
    wait_for(lambda: listener_stats(d)["received"] >= n, "the decode's flood", limit=300)
    wait_for(lambda: server_stats(p)["received"] >= flood, "the prefill handshakes", limit=300)
    wait_for(lambda: server_stats(d)["received"] >= flood, "the decode handshakes", limit=300)
    for side in (p, d):
        assert listener_stats(side)["dropped_malformed"] == flood
        assert server_stats(side)["dropped_malformed"] == flood
        assert server_stats(side)["answered"] == 0
    # Releases of unknown transfers are remembered (they may come before their request), but
    # never more than the bound; the listener's queues are drained.
    wait_for(lambda: listener_stats(p)["queued"] == 0, "the prefill's queue drained")
    assert len(p.worker.worker._core.pusher._early_releases) == bound
    assert listener_stats(p)["remembered"] <= 65536
    # The genuine request still goes through: READ, release, blocks freed.
    d.add_request(rid, list(range(1, 41)), params=decode_params(tid, returned), max_tokens=1)
    assert d.step().invalid_blocks == set()
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="release after the flood")
