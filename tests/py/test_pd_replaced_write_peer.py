"""A WRITE job posts to its decode by engine id, layer by layer, long after its handshake. A
decode restarted under a fixed engine id and handshaken by another request replaces the
engine's connection (``add_peer(..., replace=True)``): the engine fails the transfers that
exist, but a job that posts after that wrote into the new process's blocks of those ids (its
other requests' KV). The peer directory now swaps a connection under the caller's
``replacing`` guard (the context lock) and the writer posts under that lock after
``check_current``: a replaced instance's job fails instead of writing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.control.messages import RemoteBlocks
from moriio_native.errors import FailedPreconditionError
from moriio_native.pd.peers import PeerDirectory, PeerKey
from moriio_native.pd.pusher import JobState, Pusher
from moriio_native.pd.tasks import SaveTask
from net_support import free_port
from test_pd_peers_replaced_post import ENGINE_ID, LOCAL, _Prefill, _security
from test_pd_tp_fanout import DECODE, DENSE, WHOLE, PortSender, context, peer_at, run_writer


class ReplacedDirectory:
    """The decode rank handshaken already; its connection replaced once ``replaced`` is set."""

    def __init__(self) -> None:
        self.replaced = False

    def connect(self, key: Any, notify_port: int, validate: Any, **kw: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(peer_at(key, DECODE, 0, 1, "WRITE"))
        return future

    def find_engine(self, engine_id: str) -> None:
        return None

    def check_current(self, peer: Any) -> None:
        if self.replaced:
            raise FailedPreconditionError(f"peer {peer.engine_peer} was replaced")


def test_a_job_whose_decode_was_replaced_writes_nothing_and_fails() -> None:
    ctx, _, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    directory = ReplacedDirectory()
    ctx.directory = directory  # type: ignore[assignment]
    ctx.sender = PortSender()  # type: ignore[assignment]
    pusher = Pusher(ctx)
    pusher.on_remote_blocks(RemoteBlocks("tx", ((20, 21, 22),), "d:8000/dp0/tp0"))
    pusher.begin_step([SaveTask("req-1", "tx", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    assert pusher.job_states()["tx"] is JobState.WRITING, pusher.job_states()
    directory.replaced = True  # the decode restarted; another request's handshake swapped it
    for layer in DENSE + WHOLE:
        pusher.layer_saved(layer, None)
    pusher.forward_done(list(DENSE + WHOLE), None)
    run_writer(ctx, pusher)
    posted = [c for c in engine.calls if c[0] in ("write_layer", "write_layers", "seal")]
    assert posted == [], f"posted to a replaced decode: {posted}"
    assert pusher.job_states()["tx"] is JobState.FAILED, pusher.job_states()


def test_a_replacement_is_made_under_the_guard_and_the_old_handshake_is_no_longer_current() -> None:
    engine = mn.Engine("p:1/dp0/tp0", "loopback")
    engine.register_kv_caches(kc.build_caches(kc.mixed_model("p"), num_blocks=8).registrations())
    guarded: list[bool] = []
    held = [False]

    @contextlib.contextmanager
    def replacing() -> Iterator[None]:
        held[0] = True
        try:
            yield
        finally:
            held[0] = False

    real_add_peer = engine.add_peer

    def add_peer(*args: Any, **kwargs: Any) -> Any:
        guarded.append(held[0])
        return real_add_peer(*args, **kwargs)

    engine.add_peer = add_peer  # type: ignore[method-assign]
    hs = free_port()
    key = PeerKey(LOCAL, hs)
    directory = PeerDirectory(
        lambda: engine,  # type: ignore[arg-type,return-value]
        _security(),
        "p:1/dp0/tp0",
        timeout=5.0,
        replacing=replacing,
    )
    old = _Prefill(hs, 1)
    new: _Prefill | None = None
    try:
        first = directory.connect(key, free_port(), lambda response: None).result(10)
        directory.check_current(first)
        old.close()
        new = _Prefill(hs, 2)
        second = directory.connect(
            key, free_port(), lambda response: None, incarnation=new.incarnation
        ).result(10)
        assert second.response.incarnation == new.incarnation
        # Every connection: an engine id dropped and connected anew is a replacement too.
        assert guarded == [True, True], guarded
        directory.check_current(second)
        with pytest.raises(FailedPreconditionError, match=f"peer {ENGINE_ID} .* was replaced"):
            directory.check_current(first)
    finally:
        directory.close()
        old.close()
        if new is not None:
            new.close()
