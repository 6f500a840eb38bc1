"""Registration of vLLM's KV caches by the worker-side connector (vllm/worker.py
register_kv_caches): caches missing a layer of a transfer group are refused naming it, and a
refused registration changes nothing. Each test failed before its fix (review of 2026-12-07)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from net_support import free_ports
from test_vllm_support import RankSpec, dense_specs, make_kv_cache_config, write_model_dir

pytestmark = pytest.mark.vllm


def _worker_connector(  # type: ignore[no-untyped-def]
    tmp_path: Path, handshake_port: int | None = None, notify_port: int | None = None
):
    """A decode worker-side connector over a dense two-layer model and its CPU caches, on the
    given ports (free ones by default), not registered yet."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker.utils import allocate_kv_cache

    extra = {
        "mode": "read",
        "backend": "loopback",
        "host_ip": "127.0.0.1",
        "handshake_port": free_ports(1) if handshake_port is None else handshake_port,
        "notify_port": free_ports(1) if notify_port is None else notify_port,
        "allowed_peers": ["127.0.0.1/32"],
    }
    model_dir = write_model_dir(tmp_path / "model")
    spec = RankSpec(
        "d",
        "kv_consumer",
        "read",
        model_dir,
        dense_specs(),
        64,
        "LBNHC",
        extra,
        "moriio_native.vllm",
        256,
        "recompute",
        1,
        1,
    )
    config = spec.vllm_config(0)
    kv_cache_config = make_kv_cache_config(config, spec.specs, 64, "LBNHC")
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout()
    )
    return connector, caches


def test_caches_missing_a_layer_of_a_transfer_group_are_refused_naming_it(
    tmp_path: Path,
) -> None:
    """vLLM's KV-cache config puts both layers in the transfer group (the handshake's groups
    list both, so a peer pairs with them), but the caches handed over lack one. It was
    registered silently without it: a transfer then moves that layer's KV for no one (the
    engine knows no such layer), and the decode computes on a layer never loaded. Expected:
    refused at start-up, naming the layer, as a layer outside every group is logged."""
    connector, caches = _worker_connector(tmp_path)
    try:
        names = list(caches)
        missing = names[-1]
        del caches[missing]
        with pytest.raises(Exception, match=missing.replace(".", r"\.")):
            connector.register_kv_caches(caches)
    finally:
        connector.shutdown()


def test_a_layer_left_out_of_registration_is_not_reported_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consequence of the above: both instances register their caches without their last
    layer (as a vLLM that hands the connector one layer fewer than its KV-cache config would).
    The READ then ends 'done' (no load error, vLLM takes the prompt as loaded) although that
    layer of the decode's blocks never received the prefill's KV: the decode computes on
    bytes nobody wrote. Expected: refused at registration (then no such load can happen)."""
    from moriio_native.vllm import worker as worker_module
    from test_vllm_support import (
        Side,
        decode_params,
        load,
        pd_request_id,
        prefill_params,
        transfer_id,
    )

    original = worker_module.WorkerSide.register_kv_caches

    def register_all_but_last(self, kv_caches):  # type: ignore[no-untyped-def]
        kept = dict(kv_caches)
        kept.pop(list(kept)[-1])
        return original(self, kept)

    monkeypatch.setattr(worker_module.WorkerSide, "register_kv_caches", register_all_but_last)
    model_dir = write_model_dir(tmp_path / "model2")
    sides: list[Side] = []
    try:
        try:
            p = Side("prefill", "kv_producer", "read", model_dir, salt=1)
            sides.append(p)
            d = Side("decode", "kv_consumer", "read", model_dir, salt=2)
            sides.append(d)
        except Exception:
            return  # refused at registration: the expected behaviour
        prompt = [(i * 13) % 251 + 1 for i in range(40)]
        rid, tid = pd_request_id(p, d), transfer_id()
        p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
        returned = p.step().finished()[rid].kv_transfer_params
        d.add_request(rid, prompt, params=decode_params(tid, returned), max_tokens=2)
        first = load(d, rid)
        assert first.invalid_blocks == set()  # vLLM was told the load succeeded
        last = d.layer_names[-1]
        all_layers = d.layer_names
        d.layer_names = all_layers[:1]  # the first layer alone: it was moved
        assert all(d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt))
        d.layer_names = all_layers
        matches = d.slot_matches(rid, range(len(prompt) - 1), p.salt, prompt)
        assert all(matches), (
            f"the load ended done, but layer {last} of the decode's blocks does not hold the "
            f"prefill's KV at {matches.count(False)} of {len(matches)} positions"
        )
    finally:
        for side in sides:
            side.shutdown()


def _listening(port: int):  # type: ignore[no-untyped-def]
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _bindable(port: int) -> bool:
    try:
        _listening(port).close()
        return True
    except OSError:
        return False


def test_a_registration_refused_for_a_busy_port_changes_nothing(tmp_path: Path) -> None:
    """The notify port is taken (another process, a previous instance still exiting):
    register_kv_caches is refused, naming the port (right). The refusal must change nothing:
    before, the handshake server it had bound kept its port, and the engine stayed registered,
    so the port stayed taken and a second call, once the port was free, was refused as
    'register_kv_caches was called twice'."""
    handshake_port, notify_port = free_ports(1), free_ports(1)
    busy = _listening(notify_port)
    connector, caches = _worker_connector(tmp_path, handshake_port, notify_port)
    try:
        with pytest.raises(Exception, match=str(notify_port)):
            connector.register_kv_caches(caches)
        busy.close()
        assert _bindable(handshake_port), (
            f"the refused registration still holds handshake port {handshake_port}"
        )
        connector.register_kv_caches(caches)  # the port is free now: registers
        assert connector.worker.layers == list(caches)
    finally:
        busy.close()
        connector.shutdown()
