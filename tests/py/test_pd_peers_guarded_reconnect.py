"""PeerDirectory._admit_connection took the caller's ``replacing`` guard (the
connector's context lock, under which the WRITE writer runs check_current and posts) only when
the engine id is connected at that moment (``response.engine_id in before``). An engine peer
that was dropped from the engine while a handshake of it is still held -- by anything that
calls remove_peer -- is then connected to a NEW instance under the same engine id without the
guard: a poster that passed check_current with the old instance's handshake under the guard
(_connected_by still names it, or nothing) posts by engine id into the new process's blocks.

Reachability: in the connector's own flows today nothing drops an engine peer that a
WRITE job holds -- eviction skips in_use peers, and remove_peer is called only by the READ-mode
quarantine (Puller._quarantine_read), while the writer runs in WRITE mode only (the mode is
instance-wide, kv_both included). So this is a latent gap in the guard's contract, opened by
any future or embedding caller of remove_peer, not a failure seen in a vLLM deployment."""

from __future__ import annotations

import threading
from typing import Any

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.pd.peers import PeerDirectory, PeerKey
from net_support import free_port
from test_pd_peers_replaced_post import ENGINE_ID, LOCAL, _Prefill, _security


def test_a_new_instance_of_a_dropped_engine_peer_is_connected_under_the_guard() -> None:
    engine = mn.Engine("p:1/dp0/tp0", "loopback")
    engine.register_kv_caches(kc.build_caches(kc.mixed_model("p"), num_blocks=8).registrations())
    guard = threading.RLock()  # the connector's context lock
    hs = free_port()
    key = PeerKey(LOCAL, hs)
    directory = PeerDirectory(
        lambda: engine,  # type: ignore[arg-type,return-value]
        _security(),
        "p:1/dp0/tp0",
        timeout=5.0,
        replacing=lambda: guard,
    )
    old = _Prefill(hs, 1)
    new: _Prefill | None = None
    try:
        first = directory.connect(key, free_port(), lambda response: None).result(10)
        # A job holds ``first`` (its writes go on). The engine peer is dropped meanwhile (a
        # quarantine's remove_peer), and the instance restarts under the same engine id.
        engine.remove_peer(ENGINE_ID)
        old.close()
        new = _Prefill(hs, 2)
        with guard:  # the writer: check_current, then the post, under the context lock
            directory.check_current(first)  # passes: nothing else connected ENGINE_ID
            second = directory.connect(
                key, free_port(), lambda response: None, incarnation=new.incarnation
            )
            connected_meanwhile = second.exception(3) is None if _done_within(second, 3) else False
            # The writer would now post first's layers to ENGINE_ID: the new instance.
            posts_to_new = connected_meanwhile and ENGINE_ID in engine.peers()
        assert not posts_to_new, (
            "the new instance of a dropped engine peer was connected while a poster held the "
            "guard after check_current passed for the old instance's handshake: its post goes "
            "to the new process"
        )
        second.result(10)
    finally:
        directory.close()
        old.close()
        if new is not None:
            new.close()


def _done_within(future: Any, seconds: float) -> bool:
    try:
        future.result(seconds)
    except Exception:
        return future.done()
    return True
