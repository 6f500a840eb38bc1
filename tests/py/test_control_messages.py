"""Control-plane messages: round trips and strict rejection of anything else."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.messages import (
    MAX_NOTIFY_BYTES,
    NOTIFY_TYPES,
    AbortWrite,
    ChecksumRequest,
    HandshakeRejected,
    HandshakeRequest,
    HandshakeResponse,
    InvalidMessageError,
    Misaddressed,
    ProtocolVersionError,
    ProxyRegistration,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    decode,
    encode,
)
from moriio_native.errors import InvalidArgumentError

ALL_TYPES = (*NOTIFY_TYPES, HandshakeRequest, HandshakeResponse, HandshakeRejected)

SAMPLES = [
    RemoteBlocks("tx-1", ((3, 4, 5),), "10.0.0.2:7301", decode_dp_rank=1, req_id="req-a"),
    RemoteBlocks("tx-2", ((1, 2), (7,)), "d0", decode_dp_rank=0),
    RemoteBlocks("tx-3", ((),), "d0"),
    WriteDone("tx-1", writer_rank=3, num_writers=4),
    WriteFailed("tx-1", writer_rank=0, reason="RDMA transfer timed out"),
    Misaddressed("tx-1", "ab" * 16, "0123456789abcdef", writer_rank=1),
    Release("tx-1", consumer_tp_size=4, consumer_tp_rank=2),
    AbortWrite("tx-1", "d0/dp1/tp0", "10.0.0.2", 7301, 7401, decode_dp_rank=1),
    WriteAborted("tx-1", "d:8000/dp0/tp0", writer_rank=2),
    HandshakeRequest("decode-0"),
    HandshakeResponse("p0", b"\x00\x01native", 1, 2, 2, 4, "WRITE", nonce=b"n" * 16),
    HandshakeResponse("p0", b"meta", incarnation="0123456789abcdef0123456789abcdef"),
    HandshakeRejected("caches not registered", b"n" * 16),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message), ALL_TYPES, max_bytes=1 << 20) == message


def test_remote_blocks_wire_format_matches_vllm_field_names():
    wire = msgpack.unpackb(encode(SAMPLES[0]))
    assert wire["type"] == "remote_blocks"
    assert wire["block_notify_list"] == [3, 4, 5]  # one group -> flat list, as vLLM sends
    assert wire["decode_rank"] == 1
    assert wire["transfer_id"] == "tx-1"
    nested = msgpack.unpackb(encode(SAMPLES[1]))
    assert nested["block_notify_list"] == [[1, 2], [7]]


def test_release_without_optional_fields_gets_defaults():
    payload = msgpack.packb({"type": "release", "transfer_id": "tx-9"})
    assert decode(payload, NOTIFY_TYPES, max_bytes=1024) == Release("tx-9", 1, 0)


def test_proxy_registration_is_exactly_vllms_ping():
    reg = ProxyRegistration(
        "P", "10.1.2.3:8100", ZmqAddress("10.1.2.3", 6301, 61005), 2, 8, "WRITE"
    )
    assert msgpack.unpackb(encode(reg)) == {
        "type": "P",
        "http_address": "10.1.2.3:8100",
        "zmq_address": "host:10.1.2.3,handshake:6301,notify:61005",
        "dp_size": 2,
        "tp_size": 8,
        "transfer_mode": "WRITE",
    }
    assert decode(encode(reg), (ProxyRegistration,), max_bytes=4096) == reg


def _packed(d):
    return msgpack.packb(d, use_bin_type=True)


GOOD_RELEASE = {"type": "release", "transfer_id": "tx-1", "consumer_tp_size": 2}


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"", "not a msgpack"),
        (b"\xc1", "not a msgpack"),  # reserved byte
        (b"tx-123", "must be a map"),  # vLLM's legacy plain-string notify
        (_packed(GOOD_RELEASE) + b"\x00", "not a msgpack"),  # trailing bytes
        (_packed([1, 2, 3]), "must be a map"),
        (_packed({"transfer_id": "tx-1"}), "unknown message type"),
        (_packed({"type": "evil", "transfer_id": "tx"}), "unknown message type"),
        (_packed({"type": 7}), "unknown message type"),
        (_packed({"type": "release"}), "lacks transfer_id"),
        (_packed({**GOOD_RELEASE, "extra": 1}), "unknown keys"),
        (_packed({**GOOD_RELEASE, "transfer_id": 5}), "transfer_id"),
        (_packed({**GOOD_RELEASE, "transfer_id": ""}), "transfer_id"),
        (_packed({**GOOD_RELEASE, "transfer_id": "a\nb"}), "transfer_id"),
        (_packed({**GOOD_RELEASE, "transfer_id": "x" * 257}), "transfer_id"),
        (_packed({**GOOD_RELEASE, "consumer_tp_size": 0}), "consumer_tp_size"),
        (_packed({**GOOD_RELEASE, "consumer_tp_size": True}), "consumer_tp_size"),
        (_packed({**GOOD_RELEASE, "consumer_tp_size": "2"}), "consumer_tp_size"),
        (_packed({**GOOD_RELEASE, "consumer_tp_rank": 2}), "consumer_tp_rank"),
        (_packed({1: 2}), "map key is not a string"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension types are not allowed"),
        (_packed({**GOOD_RELEASE, "transfer_id": msgpack.ExtType(5, b"x")}), "extension types"),
        (
            _packed(
                {
                    "type": "remote_blocks",
                    "transfer_id": "t",
                    "decode_engine_id": "d",
                    "block_notify_list": [1, -2],
                }
            ),
            "block_notify_list",
        ),
        (
            _packed(
                {
                    "type": "remote_blocks",
                    "transfer_id": "t",
                    "decode_engine_id": "d",
                    "block_notify_list": [1, [2]],
                }
            ),
            "block_notify_list",
        ),
        (
            _packed(
                {
                    "type": "remote_blocks",
                    "transfer_id": "t",
                    "decode_engine_id": "d",
                    "block_notify_list": [1, 2**31],
                }
            ),
            "block_notify_list",
        ),
    ],
)
def test_decode_rejects_bad_notify_payloads(payload, needle):
    with pytest.raises(InvalidMessageError, match=needle):
        decode(payload, NOTIFY_TYPES, max_bytes=MAX_NOTIFY_BYTES)


def test_decode_rejects_oversized_before_parsing():
    payload = encode(RemoteBlocks("tx", (tuple(range(1000)),), "d"))
    with pytest.raises(InvalidMessageError, match="more than 100"):
        decode(payload, NOTIFY_TYPES, max_bytes=100)


def test_decode_rejects_types_not_accepted_on_this_channel():
    # A handshake request arriving on the notify channel is an unknown type there.
    with pytest.raises(InvalidMessageError, match="unknown message type 'handshake_request'"):
        decode(encode(HandshakeRequest("x")), NOTIFY_TYPES, max_bytes=4096)


def test_decode_rejects_deep_nesting():
    payload = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(InvalidMessageError):
        decode(payload, NOTIFY_TYPES, max_bytes=1 << 20)


# 1,000 nested one-element arrays under a key of a map (about 1 KB): deeper than msgspec can
# decode untyped, which it answers with RecursionError.
_DEEP = b"\x91" * 1000 + b"\xc0"


@pytest.mark.parametrize(
    "payload",
    [
        b"\x81\xa1x" + _DEEP,  # {"x": [[[...]]]}
        b"\x82\xa4type\xb1handshake_request\xa1x" + _DEEP,
        b"\x82\xa4type\xa1P\xachttp_address" + _DEEP,  # a registration ping's shape
    ],
    ids=["untyped", "handshake", "registration"],
)
@pytest.mark.parametrize(
    "accept",
    [NOTIFY_TYPES, (HandshakeRequest,), (ProxyRegistration,)],
    ids=["notify", "handshake", "registration"],
)
@pytest.mark.parametrize("explain", [True, False], ids=["explained", "terse"])
def test_decode_refuses_deep_nesting_inside_a_map_as_an_invalid_message(payload, accept, explain):
    """A listener catches InvalidMessageError only: anything else escaping decode() would end
    the proxy's discovery thread or cost a listener a traceback per message."""
    with pytest.raises(InvalidMessageError):
        decode(payload, accept, max_bytes=MAX_NOTIFY_BYTES, explain=explain)


def test_decode_names_deep_nesting_as_the_cause():
    with pytest.raises(InvalidMessageError, match="nested too deeply"):
        decode(b"\x81\xa1x" + _DEEP, NOTIFY_TYPES, max_bytes=MAX_NOTIFY_BYTES)


def test_handshake_response_checks_ranks_against_sizes():
    with pytest.raises(InvalidMessageError, match="tp_rank"):
        HandshakeResponse("p0", b"", dp_rank=0, tp_rank=4, dp_size=1, tp_size=4)
    with pytest.raises(InvalidMessageError, match="transfer_mode"):
        HandshakeResponse("p0", b"", transfer_mode="PUSH")
    with pytest.raises(InvalidMessageError, match="engine_metadata"):
        HandshakeResponse("p0", "not bytes")  # type: ignore[arg-type]


def test_handshake_response_incarnation_is_hex_and_optional_on_the_wire():
    """An older peer sends no ``incarnation`` (it decodes as "", unknown: a decode then reads
    nothing it computed); a present one is 16..64 lower-case hex, else the reply is refused."""
    fields = msgpack.unpackb(encode(HandshakeResponse("p0", b"m", incarnation="ab" * 16)))
    assert fields["incarnation"] == "ab" * 16
    del fields["incarnation"]
    old = decode(msgpack.packb(fields), (HandshakeResponse,), max_bytes=1 << 20)
    assert old.incarnation == ""
    for bad in ("AB" * 16, "ab" * 4, "ab" * 33, "zz" * 16, 7):
        fields["incarnation"] = bad
        with pytest.raises(InvalidMessageError, match="incarnation"):
            decode(msgpack.packb(fields), (HandshakeResponse,), max_bytes=1 << 20)
    fields["incarnation"] = "ab" * 16
    del fields["engine_metadata"]  # the keys of version 1 stay required
    with pytest.raises(InvalidMessageError, match="engine_metadata"):
        decode(msgpack.packb(fields), (HandshakeResponse,), max_bytes=1 << 20)


def test_constructors_refuse_invalid_messages():
    with pytest.raises(InvalidArgumentError, match="transfer_id"):
        Release("")
    with pytest.raises(InvalidArgumentError, match="num_writers"):
        WriteDone("tx", num_writers=0)
    with pytest.raises(InvalidArgumentError, match="nonce"):
        HandshakeRequest("d", nonce=b"short")
    with pytest.raises(InvalidArgumentError, match="http_address"):
        ProxyRegistration("P", "no-port", ZmqAddress("1.2.3.4", 1, 2), 1, 1, "READ")
    with pytest.raises(InvalidArgumentError, match="type"):
        ProxyRegistration("X", "1.2.3.4:80", ZmqAddress("1.2.3.4", 1, 2), 1, 1, "READ")


def test_misaddressed_names_two_different_incarnations():
    """A process answering misaddressed is not the one the announcement named: the same
    incarnation twice, or none, is refused when built and when decoded."""
    with pytest.raises(InvalidMessageError, match="addressed_incarnation"):
        Misaddressed("tx-1", "ab" * 16, "ab" * 16)
    with pytest.raises(InvalidMessageError, match="writer_incarnation"):
        Misaddressed("tx-1", "", "ab" * 16)
    body = msgpack.unpackb(encode(Misaddressed("tx-1", "ab" * 16, "cd" * 16)))
    body["addressed_incarnation"] = "ab" * 16
    with pytest.raises(InvalidMessageError, match="addressed_incarnation"):
        decode(_packed(body), NOTIFY_TYPES, max_bytes=1024)


def test_abort_write_checks_the_decode_address_and_ids():
    with pytest.raises(InvalidMessageError, match="decode_handshake_port"):
        AbortWrite("tx-1", "d0", "10.0.0.2", 0, 7401)
    with pytest.raises(InvalidMessageError, match="decode_notify_port"):
        AbortWrite("tx-1", "d0", "10.0.0.2", 7301, 70000)
    with pytest.raises(InvalidMessageError, match="abort_write"):
        AbortWrite("tx-1", "d0", "not a host!", 7301, 7401)
    with pytest.raises(InvalidMessageError, match="decode_engine_id"):
        AbortWrite("tx-1", "", "10.0.0.2", 7301, 7401)
    with pytest.raises(InvalidMessageError, match="writer_rank"):
        WriteAborted("tx-1", "d:8000/dp0/tp0", writer_rank=-1)
    wire = encode(AbortWrite("tx-1", "d0", "10.0.0.2", 7301, 7401))
    body = msgpack.unpackb(wire)
    body["decode_handshake_port"] = "7301"  # strings are not ports on the wire
    with pytest.raises(InvalidMessageError, match="decode_handshake_port"):
        decode(_packed(body), NOTIFY_TYPES, max_bytes=1024)
    message = decode(wire, NOTIFY_TYPES, max_bytes=1024)
    assert message.decode_address == ZmqAddress("10.0.0.2", 7301, 7401)


def test_proxy_registration_decode_checks_zmq_address():
    bad = {
        "type": "D",
        "http_address": "1.2.3.4:80",
        "zmq_address": "host:1.2.3.4,handshake:1",
        "dp_size": 1,
        "tp_size": 1,
        "transfer_mode": "READ",
    }
    with pytest.raises(InvalidMessageError, match="notify"):
        decode(_packed(bad), (ProxyRegistration,), max_bytes=4096)


def test_encode_refuses_non_messages():
    with pytest.raises(InvalidArgumentError):
        encode({"type": "release"})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_invalid_message(data):
    with contextlib.suppress(InvalidMessageError):
        decode(data, ALL_TYPES, max_bytes=1024)


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["remote_blocks", "write_done", "write_failed", "release"]),
    st.dictionaries(
        st.sampled_from(
            [
                "transfer_id",
                "block_notify_list",
                "decode_engine_id",
                "decode_rank",
                "req_id",
                "writer_rank",
                "num_writers",
                "reason",
                "consumer_tp_size",
                "consumer_tp_rank",
            ]
        ),
        json_like,
    ),
)
def test_random_structured_payloads_decode_or_raise_invalid_message(msg_type, fields):
    payload = msgpack.packb({"type": msg_type, **fields}, use_bin_type=True)
    try:
        message = decode(payload, NOTIFY_TYPES, max_bytes=1 << 16)
    except InvalidMessageError:
        return
    # Whatever passed the schema re-encodes to something that decodes to the same message.
    assert decode(encode(message), NOTIFY_TYPES, max_bytes=1 << 16) == message


def test_each_accepted_set_is_checked_on_its_own() -> None:
    """decode() keeps what it derives from ``accept`` (the union, the versioned types) per
    tuple: the same payloads, alternating between tuples, are judged by each tuple alone."""
    request = encode(HandshakeRequest("d"))
    checksums = encode(ChecksumRequest("d", "t1", (3, 1)))
    version_1 = msgpack.packb({**msgpack.unpackb(request), "protocol_version": 1})
    both = (HandshakeRequest, ChecksumRequest)
    for _ in range(2):
        assert isinstance(decode(request, both, max_bytes=4096), HandshakeRequest)
        assert isinstance(decode(checksums, both, max_bytes=4096), ChecksumRequest)
        with pytest.raises(InvalidMessageError, match="unknown message type") as caught:
            decode(request, (ChecksumRequest,), max_bytes=4096)
        assert not isinstance(caught.value, ProtocolVersionError)
        with pytest.raises(ProtocolVersionError):
            decode(version_1, both, max_bytes=4096)
        with pytest.raises(InvalidMessageError) as caught:
            decode(version_1, (ChecksumRequest,), max_bytes=4096)
        assert not isinstance(caught.value, ProtocolVersionError)
        with pytest.raises(InvalidMessageError, match="unknown message type"):
            decode(checksums, (HandshakeRequest,), max_bytes=4096)
