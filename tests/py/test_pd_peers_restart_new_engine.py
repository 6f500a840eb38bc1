"""The decode's READ against a prefill restarted under the same
address as a NEW engine id (vLLM's default: a random engine id per start), through the real
PeerDirectory and real handshake servers on 127.0.0.1 (the engine that posts the READs is
scripted)."""

from __future__ import annotations

import moriio_native as mn
from moriio_native import kvcache as kc
from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.channel import HandshakeServer
from moriio_native.control.messages import HandshakeResponse
from moriio_native.pd.tasks import RecvTask
from net_support import free_port
from test_pd_decode_robustness import wait_for
from test_pd_peers_replaced_post import LOCAL, _security, decode_with_a_directory
from test_pd_tp_fanout import Engine as ScriptedEngine


class _Prefill:
    """One prefill process: a loopback engine named ``engine_id`` behind a handshake server
    (no incarnation stated: an older prefill, the reason to run require_incarnation off)."""

    def __init__(self, engine_id: str, port: int, salt: int) -> None:
        caches = kc.build_caches(kc.mixed_model("prefill"), num_blocks=8)
        kc.fill_random(caches, seed=salt)
        self.engine = mn.Engine(engine_id, "loopback")
        self.engine.register_kv_caches(caches.registrations())
        self.caches = caches
        self.engine_id = engine_id
        self.server = HandshakeServer(
            port, self._answer, _security(), bind_host=LOCAL, own_thread=True
        )

    def _answer(self, request: object) -> HandshakeResponse:
        return HandshakeResponse(self.engine_id, self.engine.local_metadata(), 0, 0, 1, 1, "READ")

    def close(self) -> None:
        self.server.close()


def _task(req: str, prefill: ZmqAddress, engine: str) -> RecvTask:
    # What vLLM's proxy hands the decode for a request the prefill computed: no incarnation,
    # no hold (an older prefill; require_incarnation / require_hold off on this decode).
    return RecvTask(req, f"tx-{req}", prefill, engine, 0, 1, (1, 2), (3, 4), report_done=True)


def test_a_prefill_restarted_as_a_new_engine_is_reached_by_the_next_request() -> None:
    """Request 1 reads from engine p:A at 127.0.0.1:H (handshake cached). The prefill
    restarts there as engine p:B. Request 2 names p:B: the cached handshake still names p:A,
    check_engine refuses it (recomputed: fair, the cache was stale). But _post_read's failure
    path forgets ``part.peer``, which is set only AFTER the checks pass -- None here -- so the
    stale handshake stays cached and request 3, 4, ... naming p:B are refused the same way
    for HANDSHAKE_MAX_AGE_S (10 minutes): every request to the restarted prefill recomputed."""
    hs, notify = free_port(), free_port()
    address = ZmqAddress(LOCAL, hs, notify)
    scripted = ScriptedEngine()
    _, _, ctx, puller = decode_with_a_directory(
        scripted, require_incarnation=False, require_hold=False
    )
    directory = ctx.directory
    first = _Prefill("p:A/dp0/tp0", hs, 1)
    second = None
    try:
        puller.start(_task("req-1", address, "p:A"))
        assert wait_for(lambda: ("read", "tx-req-1", "p:A/dp0/tp0") in scripted.calls, 10.0), (
            ctx.reports
        )
        first.close()
        second = _Prefill("p:B/dp0/tp0", hs, 2)  # restarted under the same address
        puller.start(_task("req-2", address, "p:B"))
        assert wait_for(lambda: "req-2" in ctx.reports.done_recving, 10.0)
        assert "req-2" in ctx.reports.failed_recving  # the stale cache: recomputed once
        puller.start(_task("req-3", address, "p:B"))
        wait_for(
            lambda: (
                "req-3" in ctx.reports.done_recving
                or any(c[:2] == ("read", "tx-req-3") for c in scripted.calls)
            ),
            5.0,
        )
        assert ("read", "tx-req-3", "p:B/dp0/tp0") in scripted.calls, (
            f"request 3 names the restarted prefill p:B and was refused again: "
            f"{ctx.reports.failures.get('req-3')!r}; the directory still caches "
            f"{directory.cached(next(iter(directory._peers))).response.engine_id!r}"
        )
    finally:
        directory.close()
        first.close()
        if second is not None:
            second.close()
