"""Fuzzing every decoder of untrusted input: control-plane messages, addresses,
``kv_transfer_params``, the connector configuration, signed registrations and the peer
metadata (the C++ decoder through ``Engine.add_peer``).

Inputs are random bytes and values, and structure-aware mutations of valid input (bytes
flipped, inserted, cut; one field replaced by an arbitrary value). What must hold for every
input: the decoder returns a value or raises its own error (an InvalidArgumentError subclass;
for peer metadata also IncompatiblePeerError, or TransportError when the backend cannot connect
the address it names) -- never anything else, never a crash; a decoded message re-encodes to
bytes that decode to the same message; a refused peer leaves the engine without a peer.

The default run is short (``MORIIO_NATIVE_FUZZ_EXAMPLES`` inputs per target, 200 by default). The
long run (docs/reliability.md, "Fuzzing")::

    MORIIO_NATIVE_FUZZ_EXAMPLES=10000 MORIIO_NATIVE_FUZZ_REPORT=fuzz.json \\
        python -m pytest tests/py/test_fuzz.py -q

writes how many inputs each target tried, and how many were accepted, to the report file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.control.addressing import (
    KV_TRANSFER_PARAM_KEYS,
    ZmqAddress,
    format_request_id,
    parse_kv_transfer_params,
    parse_request_id,
)
from moriio_native.control.messages import (
    MAX_CHECKSUM_REQUEST_BYTES,
    MAX_HANDSHAKE_REQUEST_BYTES,
    MAX_HANDSHAKE_RESPONSE_BYTES,
    MAX_NOTIFY_BYTES,
    MAX_PING_BYTES,
    NOTIFY_TYPES,
    AbortWrite,
    ChecksumRequest,
    ChecksumResponse,
    HandshakeRejected,
    HandshakeRequest,
    HandshakeResponse,
    InvalidMessageError,
    Misaddressed,
    ProxyRegistration,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    decode,
    encode,
)
from moriio_native.control.security import (
    AuthenticationError,
    MessageAuth,
    RegistrationVerifier,
)
from moriio_native.errors import IncompatiblePeerError, InvalidArgumentError, TransportError

EXAMPLES = int(os.environ.get("MORIIO_NATIVE_FUZZ_EXAMPLES", "200"))
REPORT = os.environ.get("MORIIO_NATIVE_FUZZ_REPORT")
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_tried: Counter[str] = Counter()
_accepted: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    if REPORT:
        rows = {name: {"inputs": _tried[name], "accepted": _accepted[name]} for name in _tried}
        rows["total"] = {"inputs": sum(_tried.values()), "accepted": sum(_accepted.values())}
        Path(REPORT).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


def _count(target: str, accepted: bool) -> None:
    _tried[target] += 1
    _accepted[target] += accepted


# ---- strategies ------------------------------------------------------------------------------

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)
ids = st.text(min_size=1, max_size=40).filter(str.isprintable)
transfer_ids = ids.filter(lambda i: "#" not in i)  # '#' is reserved for the engine's part ids
texts = st.text(max_size=40).filter(str.isprintable)
ranks = st.integers(0, 7)
ports = st.integers(1, 65535)
hosts = st.sampled_from(["10.0.0.2", "::1", "prefill-0.svc", "127.0.0.1"])
block_lists = st.lists(st.integers(0, 2**31 - 1), max_size=20)

# A stated incarnation (valid) or "" (a peer that predates them).
STATED_INCARNATIONS = st.just("") | st.binary(min_size=8, max_size=32).map(bytes.hex)
NOTIFY_SAMPLES = st.one_of(
    st.builds(
        RemoteBlocks,
        transfer_ids,
        st.lists(block_lists, min_size=1, max_size=3).map(lambda g: tuple(map(tuple, g))),
        ids,
        decode_dp_rank=ranks,
        req_id=texts,
        decode_incarnation=STATED_INCARNATIONS,
    ),
    st.builds(
        WriteDone,
        transfer_ids,
        writer_rank=ranks,
        num_writers=st.integers(8, 16),
        checksums=st.none() | st.dictionaries(ids, st.binary(max_size=16), max_size=2),
    ),
    st.builds(WriteFailed, transfer_ids, writer_rank=ranks, reason=texts),
    st.builds(
        Misaddressed,
        transfer_ids,
        STATED_INCARNATIONS.filter(bool),
        st.binary(min_size=8, max_size=31).map(lambda b: "f" + b.hex()),
        writer_rank=ranks,
    ),
    st.builds(Release, transfer_ids, consumer_tp_size=st.just(8), consumer_tp_rank=ranks),
    st.builds(AbortWrite, transfer_ids, ids, hosts, ports, ports, decode_dp_rank=ranks),
    st.builds(WriteAborted, transfer_ids, ids, writer_rank=ranks),
)
# Incarnations: valid ones (16..64 lower-case hex) and near misses (upper case, short, other text).
INCARNATIONS = st.one_of(
    st.binary(min_size=8, max_size=32).map(bytes.hex),
    st.text("0123456789abcdefABCDEF", max_size=70),
    st.text(max_size=40),
)
HANDSHAKE_REPLIES = st.one_of(
    st.builds(
        HandshakeResponse,
        ids,
        st.binary(max_size=64),
        dp_rank=st.just(0),
        tp_rank=ranks,
        dp_size=st.just(1),
        tp_size=st.just(8),
        transfer_mode=st.sampled_from(["READ", "WRITE"]),
        nonce=st.binary(min_size=16, max_size=16),
        incarnation=STATED_INCARNATIONS,
    ),
    st.builds(HandshakeRejected, ids, st.binary(min_size=16, max_size=16)),
)
REGISTRATIONS = st.builds(
    ProxyRegistration,
    st.sampled_from(["P", "D"]),
    st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["10.0.0.1", "node-1"]), ports),
    st.builds(ZmqAddress, hosts, ports, ports),
    st.integers(1, 8),
    st.integers(1, 8),
    st.sampled_from(["READ", "WRITE"]),
)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with a few byte-level edits: flip, overwrite, insert, erase, truncate."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "erase", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "erase" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@st.composite
def wire_inputs(draw: st.DrawFn, samples: st.SearchStrategy[Any]) -> bytes:
    """Random bytes, a mutated valid message, or a valid message with one field replaced."""
    kind = draw(st.sampled_from(["random", "mutated", "field"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    valid = encode(draw(samples))
    if kind == "mutated":
        return draw(mutated(valid))
    body = msgpack.unpackb(valid)
    key = draw(st.sampled_from(sorted(body)) | st.text(max_size=12))
    if draw(st.booleans()) and key in body:
        del body[key]
    else:
        body[key] = draw(anything)
    return msgpack.packb(body, use_bin_type=True)


def _check_decoder(target: str, payload: bytes, accept: tuple[type, ...], max_bytes: int) -> None:
    try:
        message = decode(payload, accept, max_bytes=max_bytes)
    except InvalidMessageError:
        _count(target, False)
        return
    _count(target, True)
    assert decode(encode(message), accept, max_bytes=max_bytes) == message


# ---- control-plane messages --------------------------------------------------------------------


@FUZZ
@given(wire_inputs(NOTIFY_SAMPLES))
def test_fuzz_notify_decoder(payload: bytes) -> None:
    _check_decoder("notify", payload, NOTIFY_TYPES, MAX_NOTIFY_BYTES)


@FUZZ
@given(wire_inputs(st.builds(HandshakeRequest, ids)))
def test_fuzz_handshake_request_decoder(payload: bytes) -> None:
    _check_decoder("handshake_request", payload, (HandshakeRequest,), MAX_HANDSHAKE_REQUEST_BYTES)


@FUZZ
@given(wire_inputs(HANDSHAKE_REPLIES))
def test_fuzz_handshake_reply_decoder(payload: bytes) -> None:
    _check_decoder(
        "handshake_reply",
        payload,
        (HandshakeResponse, HandshakeRejected),
        MAX_HANDSHAKE_RESPONSE_BYTES,
    )


CHECKSUM_REQUESTS = st.builds(
    ChecksumRequest,
    requester_engine_id=ids,
    transfer_id=transfer_ids,
    block_ids=st.lists(st.integers(0, 2**31 - 1), max_size=8).map(tuple),
    head_begin=st.integers(0, 64),
    heads=st.integers(0, 64),
)
CHECKSUM_REPLIES = st.builds(
    ChecksumResponse,
    transfer_id=transfer_ids,
    checksums=st.dictionaries(ids, st.binary(max_size=32), max_size=3),
) | st.builds(HandshakeRejected, st.text(min_size=1, max_size=20).filter(str.isprintable))


@FUZZ
@given(wire_inputs(CHECKSUM_REQUESTS | st.builds(HandshakeRequest, ids)))
def test_fuzz_checksum_request_decoder(payload: bytes) -> None:
    # What a handshake server that verifies reads off its socket.
    _check_decoder(
        "checksum_request",
        payload,
        (HandshakeRequest, ChecksumRequest),
        MAX_CHECKSUM_REQUEST_BYTES,
    )


@FUZZ
@given(wire_inputs(CHECKSUM_REPLIES))
def test_fuzz_checksum_reply_decoder(payload: bytes) -> None:
    _check_decoder(
        "checksum_reply",
        payload,
        (ChecksumResponse, HandshakeRejected),
        MAX_HANDSHAKE_RESPONSE_BYTES,
    )


@FUZZ
@given(wire_inputs(REGISTRATIONS))
def test_fuzz_proxy_registration_decoder(payload: bytes) -> None:
    _check_decoder("proxy_registration", payload, (ProxyRegistration,), MAX_PING_BYTES)


SECRET = "fuzzing-secret-0123456789abcdef!"


@st.composite
def registration_frames(draw: st.DrawFn) -> list[bytes]:
    auth = MessageAuth(SECRET)
    frames = auth.seal_registration(encode(draw(REGISTRATIONS)))
    index = draw(st.integers(0, len(frames)))
    if index < len(frames):
        frames[index] = draw(mutated(frames[index]))
    else:
        frames = draw(st.lists(st.binary(max_size=40), max_size=4))
    return frames


@FUZZ
@given(registration_frames())
def test_fuzz_signed_registration_verifier(frames: list[bytes]) -> None:
    verifier = RegistrationVerifier(MessageAuth(SECRET))
    try:
        payload = verifier.open(frames)
    except AuthenticationError:
        _count("registration_envelope", False)
        return
    _count("registration_envelope", True)
    # The tag covers the payload and the stamp: only an unmodified ping gets through.
    decode(payload, (ProxyRegistration,), max_bytes=MAX_PING_BYTES)


# ---- addresses, kv_transfer_params, configuration ---------------------------------------------

P, D = ZmqAddress("10.0.0.1", 6301, 61005), ZmqAddress("10.0.0.2", 7301, 7501)
VALID_ID = format_request_id(P, D, "0123456789abcdef0123456789abcdef")


@st.composite
def request_ids(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(st.text(max_size=200))
    text = list(draw(st.sampled_from([VALID_ID, "cmpl-" + VALID_ID + "-0-1a2b3c4d"])))
    for _ in range(draw(st.integers(1, 3))):
        pos = draw(st.integers(0, len(text) - 1))
        text[pos : pos + draw(st.integers(0, 3))] = draw(st.text(max_size=4))
    return "".join(text)


@FUZZ
@given(request_ids())
def test_fuzz_request_id_parser(request_id: str) -> None:
    try:
        parsed = parse_request_id(request_id)
    except InvalidArgumentError:
        _count("request_id", False)
        return
    _count("request_id", parsed is not None)
    if parsed is not None:
        assert parse_request_id(format_request_id(parsed.prefill, parsed.decode, parsed.uid))


KV_KEYS = [*KV_TRANSFER_PARAM_KEYS, "tp_size"]


@FUZZ
@given(
    st.dictionaries(st.sampled_from(KV_KEYS) | st.text(max_size=8), anything, max_size=8),
    st.booleans(),
    st.none() | st.lists(INCARNATIONS, max_size=4) | INCARNATIONS,
)
def test_fuzz_kv_transfer_params(params: dict[str, Any], with_id: bool, incarnations: Any) -> None:
    if with_id:
        params.setdefault("transfer_id", "tx-1")
    if incarnations is not None:  # mostly well-typed: random values would never reach the check
        params.setdefault("remote_incarnations", incarnations)
    before = json.dumps(params, default=repr, sort_keys=True)
    try:
        kv = parse_kv_transfer_params(params)
    except InvalidArgumentError:
        _count("kv_transfer_params", False)
    else:
        _count("kv_transfer_params", True)
        assert parse_kv_transfer_params(kv.to_dict()) == kv
    assert json.dumps(params, default=repr, sort_keys=True) == before  # never mutated


CONFIG_KEYS = [
    "backend",
    "mode",
    "read_mode",
    "handshake_port",
    "notify_port",
    "host_ip",
    "bind_host",
    "proxy_ip",
    "proxy_ping_port",
    "http_port",
    "ping_interval",
    "proxy_auth",
    "transfer_timeout",
    "abort_timeout",
    "quarantine_timeout",
    "allowed_peers",
    "auth_secret",
    "engine_options",
]


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(CONFIG_KEYS),
        anything | st.sampled_from(["10.0.0.1", "read", "write", "ucx", "30", "true", "*"]),
        max_size=6,
    )
)
def test_fuzz_connector_config(extra: dict[str, Any]) -> None:
    config = pytest.importorskip("moriio_native.vllm.config")
    extra.setdefault("host_ip", "127.0.0.1")
    try:
        config.ConnectorConfig.from_extra_config(extra, role="kv_producer")
    except InvalidArgumentError:
        _count("connector_config", False)
        return
    _count("connector_config", True)


# ---- the peer metadata (C++ decoder) -----------------------------------------------------------


def _metadata() -> tuple[Callable[[], mn.Engine], bytes]:
    shapes = [kc.LayerShape("dense.0", "separated_nhd", block_size=4, head_size=8, num_heads=2)]
    prefill = mn.Engine("prefill-0")
    meta = prefill.register_kv_caches(kc.build_caches(shapes, 8).registrations())

    def make_decode() -> mn.Engine:
        engine = mn.Engine("decode-0")
        engine.register_kv_caches(kc.build_caches(shapes, 8).registrations())
        engine._keep = prefill  # type: ignore[attr-defined]  # its memory outlives the test
        return engine

    return make_decode, meta


MAKE_DECODE, METADATA = _metadata()
DECODE_ENGINE = MAKE_DECODE()


@st.composite
def metadata_inputs(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "mutated", "leaf"]))
    if kind == "random":
        return draw(st.binary(max_size=400))
    if kind == "mutated":
        return draw(mutated(METADATA))
    # Structure-aware: one leaf of the decoded metadata replaced by an arbitrary value.
    tree = msgpack.unpackb(METADATA, raw=True, strict_map_key=False)
    node: Any = tree
    while isinstance(node, (dict, list)) and node:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
            node[key] = draw(anything)
            break
        node = child
    return msgpack.packb(tree, use_bin_type=True)


@FUZZ
@given(metadata_inputs())
def test_fuzz_peer_metadata_decoder(data: bytes) -> None:
    engine = DECODE_ENGINE
    try:
        peer = engine.add_peer(data)
    except (InvalidArgumentError, IncompatiblePeerError, TransportError) as exc:
        # A clean error with a message. TransportError: well-formed metadata naming a transport
        # address the backend cannot connect (a loopback peer in another process).
        assert str(exc)
        assert engine.peers() == []
        _count("peer_metadata", False)
        return
    _count("peer_metadata", True)
    assert engine.peers() == [peer]
    engine.remove_peer(peer)
    assert engine.peers() == []
