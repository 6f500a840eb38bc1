"""Loading MoRIIONativeConnector through vLLM, its configuration, spec mapping and stats."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch

from moriio_native.control.security import ControlSecurity
from moriio_native.errors import InvalidArgumentError
from moriio_native.vllm import CONNECTOR_NAME, register
from moriio_native.vllm.config import (
    DEFAULT_ABORT_TIMEOUT,
    DEFAULT_HANDSHAKE_PORT,
    DEFAULT_NOTIFY_PORT,
    DEFAULT_TRANSFER_TIMEOUT,
    ConnectorConfig,
)
from test_vllm_support import dense_specs, make_kv_cache_config, make_vllm_config, write_model_dir

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(Path(tmp_path_factory.mktemp("model")))


def test_targets_vllm_0_33_0() -> None:
    import vllm

    assert vllm.__version__ == "0.33.0"


# ---- loading ----------------------------------------------------------------------------------


def test_factory_loads_connector_from_module_path(model_dir: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from moriio_native.vllm.connector import MoRIIONativeConnector

    config = make_vllm_config(
        model_dir, role="kv_consumer", extra={"backend": "loopback", "mode": "read"}
    )
    kv_cache_config = make_kv_cache_config(config, dense_specs(), 16, "LBNHC")
    assert (
        KVConnectorFactory.get_connector_class(config.kv_transfer_config) is MoRIIONativeConnector
    )
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    assert isinstance(connector, MoRIIONativeConnector)
    assert connector.config.mode == "read" and connector.config.role == "kv_consumer"
    # Not SupportsHMA: vLLM turns its hybrid allocator off for this connector.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_register_makes_the_name_loadable_without_module_path(model_dir: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from moriio_native.vllm.connector import MoRIIONativeConnector

    register()
    register()  # idempotent
    config = make_vllm_config(
        model_dir, role="kv_producer", extra={"backend": "loopback"}, module_path=None
    )
    assert config.kv_transfer_config.kv_connector_module_path is None
    assert (
        KVConnectorFactory.get_connector_class(config.kv_transfer_config) is MoRIIONativeConnector
    )


def test_plugin_entry_point_resolves_to_register() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["vllm.general_plugins"]["moriio_native"]
    module, _, attr = target.partition(":")
    hook = getattr(importlib.import_module(module), attr)
    assert (hook.__module__, hook.__name__) == ("moriio_native.vllm", "register")
    hook()  # callable the way vLLM's plugin loader calls it


def test_importing_the_package_does_not_import_vllm() -> None:
    code = (
        "import sys, moriio_native.vllm as m; assert callable(m.register); "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- configuration ----------------------------------------------------------------------------


def test_config_defaults() -> None:
    cfg = ConnectorConfig.from_extra_config({"host_ip": "10.1.2.3"}, role="kv_producer")
    assert cfg.mode == "write" and cfg.backend == "auto"
    assert (cfg.handshake_port, cfg.notify_port) == (DEFAULT_HANDSHAKE_PORT, DEFAULT_NOTIFY_PORT)
    assert (
        cfg.transfer_timeout == DEFAULT_TRANSFER_TIMEOUT
        and cfg.abort_timeout == DEFAULT_ABORT_TIMEOUT
    )
    assert cfg.proxy_ip is None and cfg.allowed_peers == () and cfg.auth_secret is None
    assert cfg.engine_id == "10.1.2.3:6301"
    assert cfg.bind_host == "10.1.2.3"  # the listeners bind only the address peers use
    assert cfg.max_peers == 1024
    assert (
        ConnectorConfig.from_extra_config({"max_peers": "64"}, role="kv_producer").max_peers == 64
    )


def test_config_bind_host_may_be_every_interface_or_another_address() -> None:
    every = ConnectorConfig.from_extra_config(
        {"host_ip": "10.1.2.3", "bind_host": "*"}, role="kv_producer"
    )
    assert every.bind_host == "*" and every.host_ip == "10.1.2.3"
    local = ConnectorConfig.from_extra_config(
        {"host_ip": "10.1.2.3", "bind_host": "127.0.0.1"}, role="kv_producer"
    )
    assert local.bind_host == "127.0.0.1"


def test_config_reads_strings_legacy_keys_and_backend_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MORIIO_NATIVE_AUTH_SECRET", raising=False)
    cfg = ConnectorConfig.from_extra_config(
        {
            "read_mode": "True",
            "handshake_port": "7301",
            "notify_port": "7501",
            "proxy_ip": "127.0.0.1",
            "proxy_ping_port": "36367",
            "http_port": "8200",
            "defer_timeout": "45",
            "allowed_peers": "10.0.0.0/8, 192.168.1.7",
            "ucx_tls": "tcp",
            "engine_options": {"progress_mode": "busy"},
            "qp_per_transfer": 2,
        },
        role="kv_consumer",
        tp_size=4,
    )
    assert cfg.mode == "read" and cfg.handshake_port == 7301 and cfg.notify_port == 7501
    assert cfg.abort_timeout == 45.0 and cfg.http_port == 8200
    assert cfg.allowed_peers == ("10.0.0.0/8", "192.168.1.7")
    # MoRI's unprefixed tuning keys reach the backend like ucx_*/mori_* keys do.
    assert dict(cfg.engine_options) == {
        "progress_mode": "busy",
        "ucx_tls": "tcp",
        "qp_per_transfer": "2",
    }
    assert cfg.ports.notify_port(0, 3) == 7504


def test_config_accept_only_allowed_peers_reaches_the_listeners_security() -> None:
    """The key (a string from vLLM's command line too) reaches the control plane's
    allowlist, whose accept filters every listener of the instance sets."""
    extra = {"allowed_peers": "10.0.0.0/8, 192.168.1.7", "accept_only_allowed_peers": "true"}
    cfg = ConnectorConfig.from_extra_config(extra, role="kv_consumer")
    assert cfg.accept_only_allowed_peers
    security = ControlSecurity.from_config(cfg.control_config())
    assert security.allowlist.accept_filters(ipv6=False) == ("10.0.0.0/8", "192.168.1.7/32")
    default = ConnectorConfig.from_extra_config({"allowed_peers": "10.0.0.0/8"}, role="kv_both")
    allowlist = ControlSecurity.from_config(default.control_config()).allowlist
    assert allowlist.accept_filters(ipv6=False) == ()


def test_config_listener_handshake_timeout_reaches_the_listeners_security() -> None:
    """The key (a string from vLLM's command line too) becomes every listener's ZMQ handshake
    limit; without it the limit is 2 s."""
    cfg = ConnectorConfig.from_extra_config(
        {"listener_handshake_timeout": "7.5"}, role="kv_consumer"
    )
    assert cfg.listener_handshake_timeout == 7.5
    assert ControlSecurity.from_config(cfg.control_config()).listener_handshake_ms == 7500
    default = ConnectorConfig.from_extra_config({}, role="kv_both")
    assert ControlSecurity.from_config(default.control_config()).listener_handshake_ms == 2000


def test_config_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORIIO_NATIVE_AUTH_SECRET", "s" * 32)
    assert ConnectorConfig.from_extra_config({}, role="kv_both").auth_secret == "s" * 32
    assert "s" * 32 not in repr(ConnectorConfig.from_extra_config({}, role="kv_both"))


def test_a_secret_turns_confirm_reads_on_unless_the_config_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signed answer proves its prefill, not its freshness: replayed after its decode
    released the blocks, only the hold check refuses it. So with a secret (from the config or
    the environment) confirm_reads is on by default; an explicit value stands."""
    monkeypatch.delenv("MORIIO_NATIVE_AUTH_SECRET", raising=False)

    def confirm(extra: dict) -> bool:
        return ConnectorConfig.from_extra_config(extra, role="kv_consumer").confirm_reads

    assert confirm({}) is False
    assert confirm({"auth_secret": "s" * 32}) is True
    assert confirm({"auth_secret": "s" * 32, "confirm_reads": "false"}) is False
    assert confirm({"auth_secret": "s" * 32, "confirm_reads": False}) is False
    monkeypatch.setenv("MORIIO_NATIVE_AUTH_SECRET", "s" * 32)
    assert confirm({}) is True


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"mode": "push"}, "mode"),
        ({"backend": "rdma"}, "backend"),
        ({"handshake_port": "70000"}, "handshake_port"),
        ({"notify_port": "abc"}, "notify_port"),
        ({"transfer_timeout": "-1"}, "transfer_timeout"),
        ({"abort_timeout": "soon"}, "abort_timeout"),
        ({"max_peers": 0}, "max_peers"),
        ({"max_peers": "many"}, "max_peers"),
        ({"proxy_ip": "127.0.0.1"}, "http_port"),
        ({"host_ip": "not a host"}, "host_ip"),
        ({"bind_host": "not a host"}, "bind_host"),
        ({"allowed_peers": ["10.0.0.0/33x"]}, "allowed_peers"),
        ({"auth_secret": "short"}, "auth_secret"),
        ({"accept_only_allowed_peers": "true"}, "accept_only_allowed_peers"),
        (
            {"allowed_peers": "prefill-node", "accept_only_allowed_peers": True},
            "accept_only_allowed_peers",
        ),
        ({"accept_only_allowed_peers": "sometimes"}, "accept_only_allowed_peers"),
        ({"listener_handshake_timeout": "0"}, "listener_handshake_timeout"),
        ({"listener_handshake_timeout": 31}, "listener_handshake_timeout"),
        ({"listener_handshake_timeout": "soon"}, "listener_handshake_timeout"),
        (
            {"allowed_peers": "2001:db8::/64", "accept_only_allowed_peers": True},
            "only IPv6",
        ),
        ({"handshake_port": 6301, "notify_port": 6302}, "overlap"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(extra: dict, needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        ConnectorConfig.from_extra_config(extra, role="kv_producer", tp_size=2)


def test_config_warns_about_unknown_keys_and_refuses_near_misses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="moriio_native.vllm.config"):
        ConnectorConfig.from_extra_config({"some_other_tools_key": 1}, role="kv_producer")
    assert "some_other_tools_key" in caplog.text
    # A typo of a known key would leave that key at its default without a word.
    with pytest.raises(InvalidArgumentError, match="did you mean 'handshake_port'"):
        ConnectorConfig.from_extra_config({"handshake_prot": 1}, role="kv_producer")
    # Keys of vLLM's other connectors near ours (a carried-over config) are only logged.
    foreign = {"proxy_port": "10001", "backends": ["UCX"], "local_ping_port": 7777}
    with caplog.at_level(logging.WARNING, logger="moriio_native.vllm.config"):
        ConnectorConfig.from_extra_config(foreign, role="kv_producer")
    assert "proxy_port" in caplog.text and "backends" in caplog.text


# ---- spec mapping -----------------------------------------------------------------------------


def test_spec_mapping_for_vllm_specs() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        SparseCacheRole,
    )

    from moriio_native.vllm.specs import to_cache_spec

    dense = to_cache_spec(
        "a", FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    )
    assert (
        dense.kind,
        dense.block_size,
        dense.num_kv_heads,
        dense.head_size,
        dense.head_size_v,
        dense.dtype_bytes,
    ) == ("kv", 16, 8, 128, 128, 2)
    swa = to_cache_spec(
        "b",
        SlidingWindowSpec(
            block_size=32,
            num_kv_heads=4,
            head_size=64,
            head_size_v=32,
            dtype=torch.float16,
            sliding_window=128,
        ),
    )
    assert (swa.kind, swa.head_size, swa.head_size_v) == ("kv", 64, 32)
    mla = to_cache_spec(
        "c", MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    )
    assert (mla.kind, mla.num_kv_heads, mla.head_size, mla.dtype_bytes) == ("mla", 1, 576, 2)
    indexer = to_cache_spec(
        "d",
        MLAAttentionSpec(
            block_size=64,
            num_kv_heads=1,
            head_size=132,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        ),
    )
    assert (indexer.kind, indexer.head_size, indexer.dtype_bytes) == ("mla", 132, 1)
    packed = to_cache_spec(
        "e",
        FullAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=128,
            dtype=torch.uint8,
            state_content_bytes=300,
            num_head_slots=2,
        ),
    )
    assert (packed.kind, packed.num_kv_heads, packed.head_size) == ("mla", 2, 300)


def test_mamba_state_maps_to_one_opaque_page_per_slot() -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    from moriio_native.vllm.specs import to_cache_spec

    spec = MambaSpec(
        block_size=1024,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.float16, torch.float32),
        page_size_padded=4096,
    )
    cache = to_cache_spec("model.layers.3.mixer", spec)
    # conv (3 x 8 fp16) then SSM (2 x 4 x 4 fp32) bytes; the padding only widens the stride.
    assert (cache.kind, cache.block_size, cache.num_kv_heads) == ("mla", 1, 1)
    assert (cache.head_size, cache.dtype_bytes) == (3 * 8 * 2 + 2 * 4 * 4 * 4, 1)


def test_spec_mapping_refuses_mamba_prefix_caching_naming_the_layer() -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    from moriio_native.vllm.specs import UnsupportedSpecError, to_cache_spec

    spec = MambaSpec(
        block_size=16, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )
    with pytest.raises(UnsupportedSpecError, match=r"model\.layers\.3\.mixer: mamba_cache_mode"):
        to_cache_spec("model.layers.3.mixer", spec)


def test_layer_specs_split_uniform_groups_and_skip_non_transfer_groups() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    from moriio_native.vllm.specs import layer_specs

    dense = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.float16)
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": dense, "b": mla})
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["a", "b"], uniform),
            KVCacheGroupSpec(["draft"], dense, enable_kv_transfer=False),
        ],
    )
    assert layer_specs(config) == {"a": dense, "b": mla}


# ---- stats ------------------------------------------------------------------------------------


def test_stats_aggregate_and_reduce() -> None:
    from moriio_native.vllm.connector import MoRIIONativeConnector

    a = MoRIIONativeConnector.build_kv_connector_stats()
    assert a is not None and a.is_empty()
    a.record(ok=True, nbytes=2_000_000, seconds=0.002, runs=10, batches=1)
    b = MoRIIONativeConnector.build_kv_connector_stats(dict(a.data))
    b.record(ok=False)
    merged = a.aggregate(b)
    summary = merged.reduce()
    assert summary["Num successful transfers"] == 2
    assert summary["Num failed transfers"] == 1
    assert summary["Avg throughput (GB/s)"] == pytest.approx(1.0)
    assert summary["Avg runs per transfer"] == 10.0


@pytest.mark.parametrize(
    ("how", "configure_first"),
    [("entry point", False), ("entry point", True), ("module path", False)],
)
def test_connector_logs_show_under_vllms_default_logging(how: str, configure_first: bool) -> None:
    # vLLM configures only its "vllm" logger, in each process it starts, before or after it
    # loads plugins; the connector's INFO lines must appear either way, once.
    import os

    load = (
        "import moriio_native.vllm as m; m.register()"
        if how == "entry point"
        else "import moriio_native.vllm.connector"
    )
    configure = "vllm.logger.configure_logging(LoggingConfig())"
    steps = [configure, load] if configure_first else [load, configure]
    code = (
        "import logging, vllm.logger; from vllm.config.logging import LoggingConfig; "
        f"{steps[0]}; {steps[1]}; "
        "logging.getLogger('moriio_native.vllm.worker').info('connector-info-marker'); "
        "logging.getLogger('moriio_native.vllm.worker').debug('connector-debug-marker')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    printed = out.stdout + out.stderr
    assert printed.count("connector-info-marker") == 1, printed
    assert "connector-debug-marker" not in printed  # vLLM's level (INFO) applies


def test_connector_name_constant() -> None:
    assert CONNECTOR_NAME == "MoRIIONativeConnector"


# ---- the launch recipe ------------------------------------------------------------------------


def test_launch_recipe_exports_no_deprecated_host_ip() -> None:
    # vLLM warns that HOST_IP is deprecated and ignores it; the recipe uses VLLM_HOST_IP.
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("HOST_IP", "VLLM_HOST_IP")}
    out = subprocess.run(
        ["bash", "-c", f"source {ROOT}/examples/launch/common.sh && env"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.split("=", 1)[0] for line in out.stdout.splitlines() if "=" in line}
    assert "HOST_IP" not in names
    assert "VLLM_HOST_IP" in names


@pytest.mark.parametrize(("role", "mode"), [("kv_producer", "read"), ("kv_consumer", "write")])
def test_launch_recipe_config_is_accepted_by_vllm_and_the_connector(
    model_dir: str, role: str, mode: str, tmp_path: Path
) -> None:
    import json
    import os

    from vllm.config import KVTransferConfig

    env = dict(os.environ, MODE=mode, VLLM_HOST_IP="10.0.0.5", ALLOWED_PEERS="10.0.0.0/24")
    script = (
        f"source {ROOT}/examples/launch/common.sh && kv_transfer_config {role} 20005 6301 61005"
    )
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    )
    raw = json.loads(out.stdout)
    ktc = KVTransferConfig(**raw)
    assert ktc.kv_connector == "MoRIIONativeConnector" and ktc.kv_load_failure_policy == "recompute"
    cfg = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config, role=role)
    assert (cfg.mode, cfg.host_ip, cfg.http_port, cfg.proxy_ip) == (
        mode,
        "10.0.0.5",
        20005,
        "127.0.0.1",
    )
    assert cfg.allowed_peers == ("10.0.0.0/24",)
    assert (
        f'--kv-transfer-config "$(kv_transfer_config {role}'
        in (
            ROOT / "examples/launch" / ("prefill.sh" if role == "kv_producer" else "decode.sh")
        ).read_text()
    )


def test_config_proxy_auth_is_off_unless_asked() -> None:
    assert not ConnectorConfig.from_extra_config({}, role="kv_producer").proxy_auth
    on = ConnectorConfig.from_extra_config(
        {"proxy_auth": "true", "auth_secret": "0123456789abcdef-shared"}, role="kv_producer"
    )
    assert on.proxy_auth
    with pytest.raises(InvalidArgumentError, match="proxy_auth"):
        ConnectorConfig.from_extra_config({"proxy_auth": "maybe"}, role="kv_producer")
