"""The engine reconnects a peer whose connection the backend reported failed
when the same metadata is handed to it again (Engine::ConnectPeer, Backend::PeerFailed). A READ
decode reaches that path: a failed part forgets its prefill's cached handshake, the next load
handshakes again and calls add_peer. The WRITE prefill did not: Pusher.on_event ended a job
whose engine transfer failed without forgetting the decode's cached handshake, so every later
job to that decode reused the cached handshake, never called add_peer, and posted to the broken
connection -- each WRITE failed (recomputed on the decode) until the cache entry aged out
(HANDSHAKE_MAX_AGE_S, 600 s)."""

from __future__ import annotations

from typing import Any

from moriio_native.pd.pusher import JobState
from test_pd_tp_fanout import event, sealed_write


def test_a_write_whose_engine_transfer_failed_forgets_the_decodes_handshake() -> None:
    ctx, _sender, _engine, pusher = sealed_write("tx-f")
    forgotten: list[Any] = []
    ctx.directory.forget = forgotten.append  # type: ignore[method-assign]
    job = pusher._jobs["tx-f"]
    peer = job.peer
    assert peer is not None
    # UCX: the endpoint reported an error (connection reset); every op drained.
    pusher.on_event(event("tx-f", "failed"), True)
    assert pusher.job_states().get("tx-f", JobState.FAILED) is JobState.FAILED
    assert any((p is peer or getattr(p, "handshake", None) is peer.handshake) for p in forgotten), (
        "the decode's handshake stays cached after its WRITE failed in the engine: the next "
        f"job reuses it and never reconnects the broken connection (forgotten: {forgotten})"
    )


def test_a_write_the_engine_refused_for_a_failed_connection_forgets_the_decodes_handshake() -> None:
    """The same when the engine refuses the post itself (a transport error raised into the
    writer): the job fails, and the handshake must not be reused for the next job."""
    from moriio_native.control.messages import RemoteBlocks
    from moriio_native.errors import TransportError
    from moriio_native.pd.pusher import Pusher
    from moriio_native.pd.tasks import SaveTask
    from test_pd_tp_fanout import DECODE, DENSE, WHOLE, answer_handshakes, context, run_writer

    ctx, directory, _, engine = context("write", producer=True, tp_rank=0, tp_size=1)
    forgotten: list[Any] = []
    directory.forget = forgotten.append  # type: ignore[method-assign]

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise TransportError("UCX connection to peer 1 failed: Connection reset by remote peer")

    engine.write_layer = broken  # type: ignore[method-assign]
    engine.write_layers = broken  # type: ignore[method-assign]
    pusher = Pusher(ctx)
    pusher.begin_step([SaveTask("req-1", "tx-s", (1, 2, 3), 3, DECODE, remote_tp_size=1)], [])
    pusher.on_remote_blocks(RemoteBlocks("tx-s", ((20, 21, 22),), "d:8000/dp0/tp0"))
    answer_handshakes(directory, DECODE, 1, "WRITE")
    peer = pusher._jobs["tx-s"].peer
    assert peer is not None
    for layer in DENSE + WHOLE:
        pusher.layer_saved(layer, None)
    run_writer(ctx, pusher)
    assert pusher.job_states().get("tx-s", JobState.FAILED) is JobState.FAILED, pusher.job_states()
    assert any((p is peer or getattr(p, "handshake", None) is peer.handshake) for p in forgotten), (
        "the decode's handshake stays cached after the engine refused its WRITE on a failed "
        f"connection (forgotten: {forgotten})"
    )
