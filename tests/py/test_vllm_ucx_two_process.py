"""Prefill and decode in two processes over the UCX backend, through the connector's API.

Each process runs vLLM's real Scheduler and a worker connector whose KV caches come from
vLLM's ``allocate_kv_cache`` for a mixed model -- dense K|V layers, an MLA latent layer and a
uint8 indexer layer, all views into ONE shared backing -- with a different physical layout on
each side (LBNHC on the prefill, block-interleaved BLNHC on the decode). The test plays the
proxy. After READ and after WRITE, every byte of the decode's backing is compared with what
torch indexing says it must be: the prefill's content in exactly the transferred blocks of
every layer, the decode's previous bytes everywhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from moriio_native.control.addressing import ZmqAddress, format_request_id
from test_vllm_support import (
    BLOCK_SIZE,
    RemoteSides,
    decode_params,
    prefill_params,
    transfer_id,
    write_model_dir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteSides, RemoteSides]]:
    model_dir = write_model_dir(Path(tmp_path_factory.mktemp("model")))
    prefill, decode = RemoteSides(model_dir), RemoteSides(model_dir)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def _make(proc: RemoteSides, name: str, role: str, mode: str, layout: str, salt: int) -> ZmqAddress:
    hs, notify, _ = proc.call(
        "make",
        name,
        {
            "role": role,
            "mode": mode,
            "layout": layout,
            "salt": salt,
            "num_blocks": 40,
            # abort_timeout above transfer_timeout + 1 s: a decode READs only while the
            # prefill holds the blocks for all of a READ.
            "extra": {"backend": "ucx", "transfer_timeout": 30, "abort_timeout": 120},
        },
    )
    return ZmqAddress("127.0.0.1", hs, notify)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 17 + i * 29) % 241 + 3 for i in range(n)]


def test_read_over_ucx_every_byte(procs: tuple[RemoteSides, RemoteSides]) -> None:
    p, d = procs
    p_addr = _make(p, "p-read", "kv_producer", "read", "LBNHC", salt=1)
    d_addr = _make(d, "d-read", "kv_consumer", "read", "BLNHC", salt=2)
    for seed, length in ((1, 70), (2, 37)):  # the second request reuses the handshake
        rid, tid = format_request_id(p_addr, d_addr), transfer_id()
        prompt = _prompt(length, seed)
        returned, content = p.call("prefill", "p-read", (rid, prompt, prefill_params(tid)))
        n_loaded = -(-(length - 1) // BLOCK_SIZE)
        loaded_content = {k: v[:n_loaded] for k, v in content.items()}
        out = d.call(
            "decode_read", "d-read", (rid, prompt, decode_params(tid, returned), loaded_content)
        )
        assert out["scheduled"][rid] == 1  # only the last prompt token is computed
        assert out["invalid"] == []
        assert out["differing_bytes"] == 0
        assert out["stats"]["transfers"] == 1 and out["stats"]["failures"] == 0
        free = p.call("until_sent", "p-read", (rid,))
        assert free == 40 - 1  # every block back in the pool (one is vLLM's null block)


def test_write_over_ucx_every_byte(procs: tuple[RemoteSides, RemoteSides]) -> None:
    p, d = procs
    p_addr = _make(p, "p-write", "kv_producer", "write", "LBNHC", salt=3)
    d_addr = _make(d, "d-write", "kv_consumer", "write", "BLNHC", salt=4)
    for seed, length in ((3, 53), (4, 16)):
        rid, tid = format_request_id(p_addr, d_addr), transfer_id()
        prompt = _prompt(length, seed)
        started = d.call("decode_write_start", "d-write", (rid, prompt, decode_params(tid)))
        assert rid not in started["scheduled"]  # waiting for the prefill's writes
        _, content = p.call("prefill", "p-write", (rid, prompt, prefill_params(tid)))
        free = p.call("until_sent", "p-write", (rid,))
        assert free == 40 - 1
        out = d.call("decode_write_finish", "d-write", (rid, content))
        assert out["failed"] is False
        assert out["differing_bytes"] == 0
