"""Bad or ambiguous input from an operator or a caller (connector config, engine API, CLI): an
error naming what was wrong, no state changed; ambiguous input refused, never guessed. Each
case was found by a review (2026-12-07) and seen failing before its fix: accepted silently,
read as something else, or refused with an error that named the wrong thing."""

from __future__ import annotations

import numpy as np
import pytest

import moriio_native as mn
from moriio_native.errors import InvalidArgumentError
from moriio_native.vllm.config import ConnectorConfig


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORIIO_NATIVE_AUTH_SECRET", raising=False)


def _cfg(extra: dict, role: str = "kv_consumer", **kw) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config(extra, role=role, **kw)


# ---- connector configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_unspecified_host_ip_is_refused(host: str) -> None:
    """host_ip is what peers and the proxy dial (engine id, proxy registration, the prefill's
    answer). 0.0.0.0 / :: is a bind-all idiom, not an address anyone can reach: a peer dialling
    it reaches its OWN host. The docs say to use bind_host "*" for that."""
    with pytest.raises(InvalidArgumentError, match="host_ip"):
        _cfg({"host_ip": host})


def test_unspecified_proxy_ip_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="proxy_ip"):
        _cfg({"proxy_ip": "0.0.0.0", "http_port": 8000})


@pytest.mark.parametrize(
    "extra",
    [
        {"mode": "write", "read_mode": True},  # which one is meant?
        {"mode": "read", "read_mode": False},
        {"mode": 1, "read_mode": False},  # an invalid mode must not be dropped unnoticed
    ],
)
def test_mode_and_legacy_read_mode_that_disagree_are_refused(extra: dict) -> None:
    with pytest.raises(InvalidArgumentError, match="mode"):
        _cfg(extra)


def test_abort_timeout_and_legacy_defer_timeout_that_disagree_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="defer_timeout"):
        _cfg({"abort_timeout": 10, "defer_timeout": 500})


def test_backend_key_given_twice_with_two_values_is_refused() -> None:
    """ucx_tls at top level and in engine_options: today the top-level one wins silently."""
    with pytest.raises(InvalidArgumentError, match="ucx_tls"):
        _cfg({"engine_options": {"ucx_tls": "tcp"}, "ucx_tls": "sm,self"})


@pytest.mark.parametrize(
    "extra",
    [
        {"ucx_tls": None},  # plain keys treat null as "unset"; this becomes the string "None"
        {"ucx_tls": ["sm", "self"]},  # becomes "['sm', 'self']"
        {"engine_options": {"ucx_tls": None}},
        {"engine_options": {"ucx_net_devices": {"a": 1}}},
    ],
)
def test_backend_option_values_that_are_not_scalars_are_refused_not_stringified(
    extra: dict,
) -> None:
    with pytest.raises(InvalidArgumentError, match="ucx_"):
        _cfg(extra)


def test_proxy_auth_without_a_secret_is_refused() -> None:
    """proxy_auth asks for signed registration pings; with no auth_secret (none in the
    environment either) the pinger sends unsigned ones and a proxy that requires signatures
    never registers the instance."""
    with pytest.raises(InvalidArgumentError, match="proxy_auth"):
        _cfg({"proxy_auth": True, "proxy_ip": "10.0.0.5", "http_port": 8000}, role="kv_producer")


@pytest.mark.parametrize(
    ("extra", "typo"),
    [
        ({"auth_secert": "0123456789abcdef0123"}, "auth_secert"),  # runs unauthenticated
        ({"verfy": True}, "verfy"),  # integrity check silently off
        (
            {"allowed_peers": "10.0.0.0/8", "accept_only_allowed_peer": True},
            "accept_only_allowed_peer",
        ),  # listeners silently accept everyone
    ],
)
def test_misspelt_key_is_refused_naming_it(extra: dict, typo: str) -> None:
    with pytest.raises(InvalidArgumentError, match=typo):
        _cfg(extra)


def test_transfer_timeout_the_engine_refuses_is_refused_by_the_config() -> None:
    """The config takes up to 1e9 s; the Engine the worker builds from it refuses more than a
    year -- at register_kv_caches, after the model loaded, without naming the config key."""
    with pytest.raises(InvalidArgumentError, match="transfer_timeout"):
        _cfg({"transfer_timeout": 4e7})  # ~1.3 years
    year = _cfg({"transfer_timeout": 365 * 86400}).transfer_timeout
    mn.Engine("x", "loopback", transfer_timeout=year)  # the most the config takes, the engine too


def test_allowlist_cidr_with_host_bits_is_refused_not_widened() -> None:
    """'10.1.2.3/8' is read as all of 10.0.0.0/8 without a word: did the operator mean the
    host or the network?"""
    with pytest.raises(InvalidArgumentError, match=r"10\.1\.2\.3/8"):
        _cfg({"allowed_peers": "10.1.2.3/8"})


def test_a_bad_auth_secret_is_not_echoed_in_the_error() -> None:
    secret = 918273645546372819
    with pytest.raises(InvalidArgumentError) as info:
        _cfg({"auth_secret": secret})
    assert "auth_secret" in str(info.value)
    assert str(secret) not in str(info.value)


# ---- engine API ----------------------------------------------------------------------------------


def test_read_with_an_empty_layer_list_does_not_move_every_layer(pair) -> None:
    """layers=None means every layer; layers=[] (a caller's filter that matched nothing) is
    turned into the same thing by `list(layers or [])`, so every layer is overwritten."""
    _, decode, _, ed = pair
    before = decode.backing.copy()
    with pytest.raises(InvalidArgumentError, match="layers is empty"):
        ed.read("req-empty-layers", "prefill-0", [1], [1], layers=[])
    assert ed.pending_transfers == 0
    assert np.array_equal(decode.backing, before)


def test_segment_with_an_empty_layer_list_does_not_move_every_layer(pair) -> None:
    _, decode, _, ed = pair
    before = decode.backing.copy()
    with pytest.raises(InvalidArgumentError, match="layers is empty"):
        ed.read_segments("req-seg", "prefill-0", [mn.BlockSegment([3], [3], layers=[])])
    assert ed.pending_transfers == 0
    assert np.array_equal(decode.backing, before)


def test_wait_given_one_id_as_a_string_is_refused_or_waits_for_that_id(pair) -> None:
    """wait("tx1", ...) waits for transfers 't', 'x' and '1': the full timeout every time
    (for ever with math.inf) though tx1 ended at once."""
    _, _, _, ed = pair
    ed.read("tx1", "prefill-0", [4], [4])
    with pytest.raises(InvalidArgumentError, match="transfer_ids"):
        ed.wait("tx1", timeout=3.0)  # type: ignore[arg-type]
    assert ed.wait(["tx1"], timeout=5.0)["tx1"].state == "done"


@pytest.mark.parametrize("count", [1.9, True])
def test_seal_refuses_a_non_integer_count_instead_of_truncating(pair, count) -> None:
    _, _, ep, _ = pair
    with pytest.raises(InvalidArgumentError, match="expected_writes"):
        ep.seal("w-trunc", "decode-0", expected_writes=count)
    assert ep.pending_transfers == 0


@pytest.mark.parametrize("layers", ["mla.0"])
def test_a_string_for_layers_is_refused_naming_it_and_fails_nothing(pair, layers) -> None:
    """write_layers(..., "mla.0", ...) iterates the characters: 'unknown layer 'm'' and the
    transfer is failed; read() likewise names layer 'm'. (That a refused layer fails the WRITE
    is the documented design; the defect is that the error names 'm', not the bad argument.)"""
    _, _, ep, ed = pair
    with pytest.raises(InvalidArgumentError, match=r"mla\.0"):
        ed.read("r-str", "prefill-0", [2], [2], layers=layers)
    with pytest.raises(InvalidArgumentError, match=r"mla\.0"):
        ep.write_layers("w-str", layers, "decode-0", [0], [0])
    with pytest.raises(InvalidArgumentError, match=r"mla\.0"):
        mn.BlockSegment([0], [0], layers=layers)._native()


@pytest.mark.parametrize("engine_id", ["a\nb", "a\x1b[31mred", "a\u202eb"])
def test_engine_ids_with_control_characters_are_refused(engine_id: str) -> None:
    """The control plane refuses such ids (they forge log lines); the engine takes them, and
    add_peer takes them from a peer's metadata."""
    with pytest.raises(InvalidArgumentError, match="engine_id holds a control"):
        mn.Engine(engine_id, "loopback")


def test_negative_counts_get_an_error_naming_the_argument(pair) -> None:
    _, _, _, ed = pair
    with pytest.raises(InvalidArgumentError, match="max_events"):
        ed.poll_events(max_events=-1)
    with pytest.raises(InvalidArgumentError, match="terminal_history"):
        mn.Engine("x", "loopback", terminal_history=-1)


def test_a_read_only_numpy_array_is_not_registered_as_writable_memory(pair) -> None:
    """numpy says the array must not be written (here: it is an immutable bytes object); the
    engine registers it anyway and a READ writes into it."""
    spec = mn.CacheSpec(
        kind="kv", block_size=16, num_kv_heads=2, head_size=8, dtype_bytes=2, axis_order="nhd"
    )
    blk = 2 * 16 * 2 * 8
    frozen = bytes(blk * 4 * 2)
    ro = np.frombuffer(frozen, dtype=np.int16)
    assert not ro.flags.writeable
    engine = mn.Engine("ro", "loopback")
    with pytest.raises(InvalidArgumentError, match="L"):
        engine.register_kv_caches(
            [
                mn.LayerRegistration(
                    "L", ro.reshape(4, 2, 16, 2, 8), spec, allocation=(ro.ctypes.data, ro.nbytes)
                )
            ]
        )


# ---- CLI -----------------------------------------------------------------------------------------


def test_demo_with_a_negative_seed_exits_3_with_a_message(capsys) -> None:
    """Exit 1 means "mismatch / failed transfer / block left held"; a bad --seed is a setup
    error (exit 3 with a message, or argparse's exit 2), not a numpy traceback and exit 1."""
    from moriio_native.cli import main

    code = main(
        [
            "demo",
            "--backend",
            "loopback",
            "--preset",
            "llama3-8b",
            "--layers",
            "1",
            "--requests",
            "1",
            "--seed",
            "-1",
        ]
    )
    assert code == 3
    captured = capsys.readouterr()
    assert "seed" in captured.out + captured.err


# ---- protocol core settings (pd/config.py) -------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("handshake_port", 70000),
        ("notify_port", -1),
        ("host_ip", "not a host!"),
        ("engine_id", ""),
        ("split_layers", ("a",)),  # with whole_layers ("a",): a layer both split and whole
    ],
)
def test_pd_config_refuses_what_the_connector_config_refuses(field: str, value) -> None:
    """PdConfig is the framework-free entry to the protocol core; it checks mode, ranks,
    max_peers and timeouts but takes any port, host, engine id, and a layer listed as both
    split by heads and held whole."""
    from moriio_native.pd.config import PdConfig

    base = dict(
        engine_id="e/dp0/tp0",
        mode="read",
        producer=True,
        consumer=False,
        host_ip="10.0.0.1",
        handshake_port=6301,
        notify_port=61005,
        whole_layers=("a",),
    )
    with pytest.raises(InvalidArgumentError, match=field):
        PdConfig(**{**base, field: value})


def test_bench_plot_to_an_unwritable_path_is_a_setup_error_not_exit_1(capsys) -> None:
    """`bench` exit 1 means "a transfer's bytes or the planners' runs disagree". A --plot path
    whose directory does not exist raises FileNotFoundError out of write_plot after the whole
    benchmark ran (the JSON document is never printed) and the process exits 1."""
    pytest.importorskip("matplotlib")
    from moriio_native.cli import main

    code = main(
        [
            "bench",
            "--planning",
            "--quick",
            "--presets",
            "llama3-8b",
            "--contexts",
            "1024",
            "--json",
            "--plot",
            "/nonexistent-dir-review-f/x.png",
        ]
    )
    assert code == 3
    captured = capsys.readouterr()
    assert "nonexistent-dir-review-f" in captured.out + captured.err


@pytest.mark.parametrize("field", ["block_size", "num_kv_heads", "head_size", "dtype_bytes"])
@pytest.mark.parametrize("value", [True, 16.0])
def test_a_cache_spec_count_that_is_no_integer_is_refused_by_name(
    field: str, value: object
) -> None:
    """Seen failing (a review of the layout mapping, 2026-12-07): pybind11 took True as 1 where
    block ids and windows refuse bools."""
    kwargs: dict[str, object] = {
        "kind": "kv",
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 4,
        "dtype_bytes": 2,
        field: value,
    }
    with pytest.raises(mn.InvalidArgumentError, match=f"CacheSpec.{field} must be an integer"):
        mn.CacheSpec(**kwargs)  # type: ignore[arg-type]
    assert mn.CacheSpec(**{**kwargs, field: np.int64(2)}).block_size in (2, 16)
