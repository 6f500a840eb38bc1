"""A peer whose UCX connection failed is reached again after a new handshake.

Two live engines over TCP with peer-failure detection (``ucx_tls=tcp``, ``ucx_direct_copy=off``,
PEER mode: what ``auto`` picks between two hosts). The TCP connections between them are reset
once (``ss -K``: a transient network fault). The transfer in flight may fail; then the decode's
peer directory does what it does after a failed transfer: handshakes the prefill again (the
same metadata: it never restarted) and calls ``add_peer(metadata, replace=True, ...)``. The
engine took the same metadata for the same handshake even when the backend had marked the
connection failed (every later batch then failed with the old failure); it now reconnects such
a peer (Backend::PeerFailed; the deterministic test is engine_test's
EnginePeers.TheSameMetadataAgainReconnectsAPeerWhoseConnectionFailed). On this machine the
READs after the reset also succeeded without that fix, so this test covers the UCX path of the
recovery; its failure before the fix was seen on another run only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import numpy as np
import pytest

import moriio_native as mn

pytestmark = pytest.mark.ucx

PAGE = 4096
BLOCK = 16 * 64
BLOCKS = 64
OPTIONS = {"ucx_tls": "tcp", "ucx_direct_copy": "off", "ucx_error_handling": "peer"}


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % PAGE
    return raw[offset : offset + nbytes]


def _layers(buf: np.ndarray) -> list[mn.LayerRegistration]:
    spec = mn.CacheSpec(kind="mla", block_size=16, head_size=64, dtype_bytes=1)
    view = buf.reshape(BLOCKS, 16, 64)
    return [mn.LayerRegistration("L", view, spec, allocation=(buf.ctypes.data, buf.nbytes))]


def _my_tcp_ports() -> list[str]:
    out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True).stdout
    mine = [line for line in out.splitlines() if f"pid={os.getpid()}," in line]
    return [line.split()[3].rsplit(":", 1)[1] for line in mine]


def _reset_my_tcp_connections(spared: set[str]) -> None:
    """Resets this process's TCP connections but those from ports in ``spared``."""
    for port in set(_my_tcp_ports()) - spared:
        subprocess.run(["ss", "-K", "sport", f"= :{port}"], capture_output=True, check=False)
    if set(_my_tcp_ports()) - spared:
        pytest.skip("ss -K cannot destroy sockets here (no CAP_NET_ADMIN or INET_DIAG_DESTROY)")


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")
def test_a_peer_whose_connection_was_reset_is_reachable_again_after_a_new_handshake() -> None:
    spared = set(_my_tcp_ports())  # connections of anything else in this process
    decode = mn.Engine("decode", "ucx", OPTIONS, transfer_timeout=2.0)
    prefill = mn.Engine("prefill", "ucx", OPTIONS, transfer_timeout=2.0)
    dbuf = _aligned(BLOCKS * BLOCK)
    pbuf = _aligned(BLOCKS * BLOCK)
    pbuf[:] = 9
    decode.register_kv_caches(_layers(dbuf))
    metadata = prefill.register_kv_caches(_layers(pbuf))
    assert decode.add_peer(metadata) == "prefill"

    def read(tid: str):
        dbuf[:] = 0
        decode.read(tid, "prefill", [0], [1])
        event = decode.wait([tid], timeout=10).get(tid)
        return event, bool((dbuf[:BLOCK] == 9).all())

    event, landed = read("r-before")
    assert event is not None and event.state == "done" and landed, event
    _reset_my_tcp_connections(spared)
    time.sleep(1.0)
    event, _ = read("r-reset")  # may fail: the connection it used was reset
    # The peer directory after a failed part: forget, handshake again, connect what it answered.
    assert decode.add_peer(metadata, replace=True, expected_engine_id="prefill") == "prefill"
    time.sleep(0.5)
    events = [read(f"r-after-{i}") for i in range(3)]
    assert all(e is not None and e.state == "done" and ok for e, ok in events), (
        f"READs from the live prefill after a connection reset and a new handshake: "
        f"{[e for e, _ in events]}"
    )
