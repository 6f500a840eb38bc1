"""A handshake whose answer the engine refuses (its metadata names
another engine than it answered as) must change nothing (pd/peers.py's docstring: "checked by
the engine before anything is connected or replaced"). At max_peers, _admit_connection makes
room FIRST (_make_room evicts the least recently used idle peer) and only then asks the engine,
so every refused answer evicts a healthy idle peer: anyone who can point this rank at an
address (an abort_write naming it, a request's remote_host) and answer there with another
engine's metadata empties the cache, one healthy peer per refusal."""

from __future__ import annotations

import pytest

from moriio_native.errors import IncompatiblePeerError
from moriio_native.pd.peers import PeerKey
from net_support import free_port
from test_pd_peers import LOCAL, Prefill, accept, directory, engine, made  # noqa: F401


def test_a_refused_answer_evicts_no_healthy_peer(made: list) -> None:  # noqa: F811
    decode, _ = engine("decode", 1)
    genuine_port, stranger_port = free_port(), free_port()
    made.append(Prefill("prefill", genuine_port, 2))
    # Answers as "prefill-stranger" with metadata naming engine "prefill-x": refused.
    made.append(Prefill("prefill-x", stranger_port, 3, claims="prefill-stranger"))
    bound: list[bool] = []
    peers = directory(decode, made, max_peers=1, on_bound=bound.append)
    peers.connect(PeerKey(LOCAL, genuine_port), 1, accept).result(timeout=30)
    assert decode.peers() == ["prefill"]
    with pytest.raises(IncompatiblePeerError, match="not the expected 'prefill-stranger'"):
        peers.connect(PeerKey(LOCAL, stranger_port), 1, accept).result(timeout=30)
    assert decode.peers() == ["prefill"] and peers.cached(PeerKey(LOCAL, genuine_port)), (
        f"a refused answer evicted the healthy idle peer: engine peers {decode.peers()}, "
        f"cached {len(peers)}, stats {peers.stats()}, on_bound {bound}"
    )
