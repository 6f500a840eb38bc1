"""A READ posted with a handshake of the prefill instance that was
just REPLACED in the engine (a restart under the same address and the same engine id, which
the peer directory swaps in with ``add_peer(..., replace=True)``). The native engine knows the
peer by its engine id alone, so a part that took the old instance's cached handshake -- and
passed check_incarnation against it: that handshake does name the incarnation the request
was computed by -- posts its READ to whatever instance the engine id names at the post: the
NEW process, whose blocks under those ids hold other bytes. Real loopback engines, real
handshake servers and the real PeerDirectory on 127.0.0.1; the replacement (another
request's handshake on the directory's pool) is injected in the window between the part's
checks and its post."""

from __future__ import annotations

from typing import Any

import pytest

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.channel import HandshakeServer
from moriio_native.control.messages import HandshakeResponse
from moriio_native.control.schema import new_incarnation
from moriio_native.control.security import ControlSecurity
from moriio_native.pd import puller as puller_module
from moriio_native.pd.context import Context
from moriio_native.pd.peers import PeerDirectory, PeerKey
from moriio_native.pd.puller import Puller
from moriio_native.pd.tasks import RecvTask
from net_support import free_port
from test_pd_decode_robustness import wait_for
from test_pd_protocol import context as protocol_context

LOCAL = "127.0.0.1"
ENGINE_ID = "p:fixed/dp0/tp0"  # an operator-set engine id: the same after a restart


def _security() -> ControlSecurity:
    return ControlSecurity.from_config({"allowed_peers": [f"{LOCAL}/32"]})


class _Prefill:
    def __init__(self, port: int, salt: int) -> None:
        self.caches = kc.build_caches(kc.mixed_model("prefill"), num_blocks=8)
        kc.fill_random(self.caches, seed=salt)
        self.engine = mn.Engine(ENGINE_ID, "loopback")
        self.engine.register_kv_caches(self.caches.registrations())
        self.incarnation = new_incarnation()
        self.server = HandshakeServer(
            port, self._answer, _security(), bind_host=LOCAL, own_thread=True
        )

    def _answer(self, request: object) -> HandshakeResponse:
        return HandshakeResponse(
            ENGINE_ID,
            self.engine.local_metadata(),
            0,
            0,
            1,
            1,
            "READ",
            incarnation=self.incarnation,
        )

    def close(self) -> None:
        self.server.close()


def decode_with_a_directory(
    puller_engine: Any = None, **settings: Any
) -> tuple[mn.Engine, kc.KvCacheSet, Context, Puller]:
    """A decode rank's loopback engine and caches, its protocol context with a real
    PeerDirectory connecting that engine, and a Puller; the puller posts to ``puller_engine``
    (default: the same engine)."""
    caches = kc.build_caches(kc.mixed_model("decode"), num_blocks=8)
    kc.fill_random(caches, seed=9)
    engine = mn.Engine("d:1/dp0/tp0", "loopback")
    engine.register_kv_caches(caches.registrations())
    posts_to = engine if puller_engine is None else puller_engine
    ctx, _, _ = protocol_context("read", producer=False, engine=posts_to, **settings)
    ctx.directory = PeerDirectory(
        lambda: engine,  # type: ignore[arg-type,return-value]
        _security(),
        "d:1/dp0/tp0",
        timeout=5.0,
    )
    return engine, caches, ctx, Puller(ctx)


def test_a_read_posted_after_its_prefill_was_replaced_does_not_load_the_new_instances_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hs, notify = free_port(), free_port()
    address = ZmqAddress(LOCAL, hs, notify)
    key = PeerKey(LOCAL, hs)
    decode_engine, decode_caches, ctx, puller = decode_with_a_directory(require_hold=False)
    directory = ctx.directory
    old = _Prefill(hs, 1)
    new: _Prefill | None = None
    try:
        # The old instance is handshaken (an earlier request) and cached.
        first = directory.connect(key, notify, ctx.peer_check(key), incarnation=old.incarnation)
        assert first.result(10).response.incarnation == old.incarnation
        # It restarts under the same address and engine id; the request it computed before
        # comes now. Its part takes the cached handshake (of the incarnation that computed
        # it: the checks pass) -- and just then another request, computed by the new
        # process, has the directory handshake it and replace the engine's connection.
        old.close()
        new = _Prefill(hs, 2)
        real_check_hold = puller_module.check_hold
        replaced: list[str] = []

        def replaced_meanwhile(*args: Any, **kwargs: Any) -> None:
            if not replaced:
                assert new is not None
                fresh = directory.connect(
                    key, notify, ctx.peer_check(key), incarnation=new.incarnation
                )
                replaced.append(fresh.result(10).response.incarnation)
            real_check_hold(*args, **kwargs)

        monkeypatch.setattr(puller_module, "check_hold", replaced_meanwhile)
        local, remote = [1, 2], [3, 4]
        task = RecvTask(
            "req-old",
            "tx-old",
            address,
            "p:fixed",
            0,
            1,
            tuple(local),
            tuple(remote),
            report_done=True,
            remote_incarnations=(old.incarnation,),
        )
        puller.start(task)
        assert replaced == [new.incarnation]
        events: list[Any] = []

        def ended() -> bool:
            for e in decode_engine.poll_events(timeout=0.05):
                events.append(e)
                puller.on_event(e)
            return "req-old" in ctx.reports.done_recving

        wait_for(ended, 10.0)
        assert "req-old" in ctx.reports.done_recving, (events, puller.read_states())
        loaded = "req-old" not in ctx.reports.failed_recving
        from_new = kc.blocks_match(decode_caches, new.caches, local, remote)
        from_old = kc.blocks_match(decode_caches, old.caches, local, remote)
        assert not loaded or from_old, (
            f"the READ of a request computed by incarnation {old.incarnation} ended done with "
            f"the bytes of the instance that replaced it ({new.incarnation}): blocks from the "
            f"new process {from_new}, from the old {from_old}; event {events}"
        )
    finally:
        directory.close()
        old.close()
        if new is not None:
            new.close()
