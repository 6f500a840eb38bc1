"""Peer addresses in request ids and kv_transfer_params validation."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moriio_native.control.addressing import (
    KV_TRANSFER_PARAM_KEYS,
    BlockIdGroups,
    KvTransferParams,
    ZmqAddress,
    answer_bytes,
    block_ids_to_wire,
    format_request_id,
    parse_kv_transfer_params,
    parse_request_id,
    peer_address_from_request_id,
)
from moriio_native.errors import InvalidArgumentError

P = ZmqAddress("10.0.0.1", 6301, 61005)
D = ZmqAddress("10.0.0.2", 7301, 7501)
UID = "0123456789abcdef0123456789abcdef"


def test_zmq_address_round_trip():
    for addr in (P, ZmqAddress("::1", 1, 65535), ZmqAddress("prefill-0.svc", 6301, 61005)):
        assert ZmqAddress.parse(addr.format()) == addr
    assert ZmqAddress.parse("host:::1,handshake:1,notify:2").host == "::1"
    assert ZmqAddress.parse(" host: 10.0.0.1 , handshake: 6301 ,notify:61005") == P


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("host:10.0.0.1,handshake:6301", "missing notify"),
        ("host:10.0.0.1,handshake:6301,notify:61005,host:6.6.6.6", "twice"),
        ("host:10.0.0.1,handshake:6301,notify:61005,extra:1", "unexpected segment"),
        ("host:10.0.0.1,handshake:0,notify:61005", "handshake port = 0: expected `int` >= 1"),
        ("host:10.0.0.1,handshake:65536,notify:61005", "handshake port = 65536: .* <= 65535"),
        ("host:10.0.0.1,handshake:-1,notify:61005", "decimal"),
        ("host:10.0.0.1,handshake:0x10,notify:61005", "decimal"),
        ("host:,handshake:1,notify:2", "empty"),
        ("host:evil_host,handshake:1,notify:2", "host name"),
        ("host:a b,handshake:1,notify:2", "host name"),
        ("host:1.2.3.4.5,handshake:1,notify:2", "host name"),
        ("host:fe80::1%eth0,handshake:1,notify:2", "zone ids"),
    ],
)
def test_zmq_address_parse_rejects(text, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        ZmqAddress.parse(text)


def test_request_id_round_trip_and_peer_selection():
    rid = format_request_id(P, D, UID)
    assert rid == (
        "___prefill_addr_host:10.0.0.1,handshake:6301,notify:61005"
        "___decode_addr_host:10.0.0.2,handshake:7301,notify:7501_" + UID
    )
    parsed = parse_request_id(rid)
    assert parsed is not None and (parsed.prefill, parsed.decode, parsed.uid) == (P, D, UID)
    assert peer_address_from_request_id(rid, is_producer=True) == D
    assert peer_address_from_request_id(rid, is_producer=False) == P


def test_request_id_tolerates_vllm_wrapping():
    rid = "cmpl-" + format_request_id(P, D, UID) + "-0-1a2b3c4d"
    parsed = parse_request_id(rid)
    assert parsed is not None and parsed.decode == D and parsed.uid == UID


def test_request_id_without_addresses_is_none():
    assert parse_request_id("cmpl-1234-0-abcd") is None
    assert peer_address_from_request_id("chatcmpl-xyz", is_producer=True) is None


def test_fresh_uid_is_random_hex():
    a, b = format_request_id(P, D), format_request_id(P, D)
    assert a != b and parse_request_id(a) is not None


GOOD = format_request_id(P, D, UID)


@pytest.mark.parametrize(
    "crafted",
    [
        # A second decode marker trying to make a greedy parser pick the attacker's address.
        GOOD + "___decode_addr_host:6.6.6.6,handshake:1,notify:2_" + UID,
        GOOD.replace("___prefill_addr_", "___prefill_addr____prefill_addr_"),
        # Decode before prefill.
        f"___decode_addr_{D.format()}___prefill_addr_{P.format()}_{UID}",
        # Only one marker.
        f"___prefill_addr_{P.format()}_{UID}",
        f"___decode_addr_{D.format()}_{UID}",
        # No / short / upper-case uuid.
        f"___prefill_addr_{P.format()}___decode_addr_{D.format()}",
        f"___prefill_addr_{P.format()}___decode_addr_{D.format()}_{UID[:31]}",
        f"___prefill_addr_{P.format()}___decode_addr_{D.format()}_{UID.upper()}",
        # Suffix without a dash, odd characters around the addresses.
        GOOD + "x",
        "a b" + GOOD,
        GOOD + "-0 ; rm",
        # Bad embedded addresses: extra key, duplicate key, bad port, missing port.
        GOOD.replace("notify:7501", "notify:7501,host:6.6.6.6"),
        GOOD.replace("handshake:6301", "handshake:99999"),
        GOOD.replace(",notify:61005", ""),
        # Too long.
        "x" * 3000 + GOOD,
    ],
)
def test_crafted_request_ids_are_rejected(crafted):
    with pytest.raises(InvalidArgumentError):
        parse_request_id(crafted)


@pytest.mark.vllm
def test_agrees_with_vllms_parser_on_valid_ids():
    common = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common"
    )
    for rid in (
        GOOD,
        "cmpl-" + GOOD + "-0-1a2b3c4d",
        format_request_id(ZmqAddress("::1", 5, 6), D),
    ):
        for is_producer in (True, False):
            theirs = common.parse_moriio_zmq_address(
                common.get_peer_zmq_from_request_id(rid, is_producer)
            )
            ours = peer_address_from_request_id(rid, is_producer=is_producer)
            assert ours is not None
            assert (ours.host, ours.handshake_port, ours.notify_port) == theirs


def test_kv_transfer_params_key_names():
    assert KV_TRANSFER_PARAM_KEYS == (
        "transfer_id",
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_host",
        "remote_handshake_port",
        "remote_notify_port",
        "remote_dp_rank",
        "remote_tp_size",
        "remote_dp_size",
        "remote_incarnations",
        "remote_hold_until_ms",
        "remote_num_tokens",
        "remote_prompt_digest",
        "remote_answer_tag",
    )


def test_an_answers_tagged_bytes_do_not_depend_on_how_a_proxy_serialised_it():
    """remote_answer_tag covers the validated values: one group flat or nested, ids as ints,
    other keys (the address, which the proxy fills in from its registry) left out; any
    covered field changed changes the bytes."""
    base = {"transfer_id": "tx-1", "remote_engine_id": "10.0.0.1:6301", "remote_hold_until_ms": 7}
    flat = parse_kv_transfer_params({**base, "remote_block_ids": [4, 5, 6]})
    nested = parse_kv_transfer_params(
        {**base, "remote_block_ids": [[4, 5, 6]], "remote_host": "10.0.0.2", "tp_size": "2"}
    )
    assert flat.answer_bytes() == nested.answer_bytes()
    for changed in (
        {"remote_block_ids": [4, 5, 7]},
        {"transfer_id": "tx-2"},
        {"remote_engine_id": "10.0.0.1:6302"},
        {"remote_hold_until_ms": 8},
        {"remote_incarnations": ["0123456789abcdef"]},
        {"remote_num_tokens": 40},
        {"remote_prompt_digest": "ab" * 32},
    ):
        other = parse_kv_transfer_params({**base, "remote_block_ids": [4, 5, 6], **changed})
        assert other.answer_bytes() != flat.answer_bytes(), changed


_GROUPS = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=4)
_INCARNATIONS = st.none() | st.lists(
    st.text("0123456789abcdef", min_size=16, max_size=16), min_size=1, max_size=3
)


@given(
    groups=_GROUPS,
    incarnations=_INCARNATIONS,
    hold=st.none() | st.integers(0, 2**62),
    num_tokens=st.none() | st.integers(0, 2**31 - 1),
    digest=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
)
def test_the_prefills_answer_bytes_are_the_ones_a_decode_parses(
    groups: list[list[int]],
    incarnations: list[str] | None,
    hold: int | None,
    num_tokens: int | None,
    digest: str | None,
) -> None:
    """The prefill encodes what it tags from its own values (no re-parse of its answer); a
    decode encodes what it parsed from the JSON a proxy forwarded: the same bytes for any
    groups (none, one flat, several, empty ones), incarnations, hold, token count and
    digest."""
    selected = tuple(tuple(g) for g in groups)
    wire: dict[str, object] = {
        "transfer_id": "tx-1",
        "remote_engine_id": "10.0.0.1:6301",
        "remote_block_ids": block_ids_to_wire(selected),
    }
    if incarnations is not None:
        wire["remote_incarnations"] = incarnations
    if hold is not None:
        wire["remote_hold_until_ms"] = hold
    if num_tokens is not None:
        wire["remote_num_tokens"] = num_tokens
    if digest is not None:
        wire["remote_prompt_digest"] = digest
    parsed = parse_kv_transfer_params(json.loads(json.dumps(wire)))
    sent = answer_bytes("tx-1", selected, "10.0.0.1:6301", incarnations, hold, num_tokens, digest)
    assert parsed.answer_bytes() == sent


def test_prefill_response_params_parse():
    # What a prefill instance returns in request_finished (ports as strings, legacy tp_size).
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [4, 5, 6],
        "remote_engine_id": "10.0.0.1:6301",
        "remote_host": "10.0.0.1",
        "remote_handshake_port": "6301",
        "remote_notify_port": "61005",
        "remote_dp_size": 1,
        "tp_size": 4,
        "transfer_id": "tx-42",
        "remote_incarnations": ["0123456789abcdef" * 2, "fedcba9876543210" * 2],
        "remote_hold_until_ms": 1_764_900_000_000,
        "_p_side_truncated": True,  # vLLM-internal keys are ignored
    }
    kv = parse_kv_transfer_params(params)
    assert kv.remote_incarnations == ("0123456789abcdef" * 2, "fedcba9876543210" * 2)
    assert kv.remote_hold_until_ms == 1_764_900_000_000
    assert kv.remote_block_ids == ((4, 5, 6),)
    assert kv.remote_tp_size == 4 and kv.remote_handshake_port == 6301
    assert kv.peer_address("cmpl-plain-id", is_producer=False) == P
    assert parse_kv_transfer_params(kv.to_dict()) == kv


def test_proxy_to_decode_params_with_nones():
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": "tx-1",
        "remote_dp_size": 2,
        "remote_tp_size": 8,
        "remote_dp_rank": 1,
    }
    kv = parse_kv_transfer_params(params)
    assert kv.remote_block_ids is None and kv.remote_engine_id is None
    # WRITE mode: the address comes from the request id.
    assert kv.peer_address(GOOD, is_producer=False) == P
    with pytest.raises(InvalidArgumentError, match="embeds no peer address"):
        kv.peer_address("cmpl-plain", is_producer=False)


def test_request_id_address_wins_over_explicit_keys():
    kv = parse_kv_transfer_params(
        {
            "transfer_id": "t",
            "remote_host": "10.9.9.9",
            "remote_handshake_port": 1,
            "remote_notify_port": 2,
        }
    )
    assert kv.peer_address(GOOD, is_producer=True) == D


@pytest.mark.parametrize(
    ("update", "needle"),
    [
        ({"transfer_id": None}, "transfer_id"),
        ({"transfer_id": 12}, "transfer_id"),
        ({"transfer_id": "a\x00b"}, "transfer_id"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "cannot both be true"),
        ({"remote_block_ids": [1, -1]}, "remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_block_ids": [1, 2.0]}, "remote_block_ids"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_host": "evil host"}, "remote_host"),
        ({"remote_handshake_port": 0}, "remote_handshake_port"),
        ({"remote_notify_port": "80x"}, "remote_notify_port"),
        ({"remote_notify_port": True}, "remote_notify_port"),
        ({"remote_dp_rank": 2, "remote_dp_size": 2}, "remote_dp_rank"),
        ({"remote_dp_size": 0}, "remote_dp_size"),
        ({"remote_tp_size": -1}, "remote_tp_size"),
        ({"remote_incarnations": "ab" * 16}, "remote_incarnations"),
        ({"remote_incarnations": []}, "remote_incarnations"),
        ({"remote_incarnations": ["AB" * 16]}, "remote_incarnations"),
        ({"remote_incarnations": ["ab" * 16, "ab"]}, "remote_incarnations"),
        ({"remote_hold_until_ms": -1}, "remote_hold_until_ms"),
        ({"remote_hold_until_ms": "soon"}, "remote_hold_until_ms"),
        ({"remote_hold_until_ms": 1.5}, "remote_hold_until_ms"),
    ],
)
def test_bad_kv_transfer_params_name_the_key(update, needle):
    params = {"transfer_id": "tx-1", **update}
    before = dict(params)
    with pytest.raises(InvalidArgumentError, match=needle):
        parse_kv_transfer_params(params)
    assert params == before


def test_partial_explicit_address_names_missing_keys():
    kv = parse_kv_transfer_params({"transfer_id": "t", "remote_host": "10.0.0.1"})
    with pytest.raises(InvalidArgumentError, match="remote_handshake_port, remote_notify_port"):
        kv.peer_address("plain", is_producer=True)


def test_non_mapping_params_are_rejected():
    with pytest.raises(InvalidArgumentError, match="mapping"):
        parse_kv_transfer_params([("transfer_id", "t")])
    with pytest.raises(InvalidArgumentError, match="transfer_id"):
        KvTransferParams(transfer_id="")


def test_addresses_and_block_ids_survive_pickling() -> None:
    """vLLM pickles the connector metadata that carries them to its worker processes."""
    address = ZmqAddress("127.0.0.1", 6301, 61005)
    groups = BlockIdGroups([[1, 2], [3]])
    again = pickle.loads(pickle.dumps((address, groups)))
    assert again == (address, groups)
    assert again[0].format() == address.format()
