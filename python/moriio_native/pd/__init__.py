"""The prefill/decode protocol core, free of any serving framework.

Layering: :mod:`moriio_native.control` (ZMQ control plane) and :mod:`moriio_native.engine`
below; :mod:`moriio_native.vllm` (the vLLM connector) and :mod:`moriio_native.demo` above.
Nothing here imports vLLM, torch or the demo.

* :class:`~moriio_native.pd.core.PdCore` -- one rank's protocol (threads, endpoints, reports);
* :class:`~moriio_native.pd.peers.PeerDirectory` -- background handshakes, cached per peer;
* :class:`~moriio_native.pd.puller.Puller` -- decode side: READ pulls, WRITE awaits;
* :class:`~moriio_native.pd.pusher.Pusher` -- prefill side: held READs, WRITE pushes;
* :mod:`~moriio_native.pd.fsm` -- the state machine shape they share.
"""

from moriio_native.pd.config import PdConfig
from moriio_native.pd.context import Reports, StatsSink
from moriio_native.pd.core import PdCore
from moriio_native.pd.fsm import IllegalTransitionError, Machine
from moriio_native.pd.peers import Peer, PeerDirectory, PeerKey
from moriio_native.pd.tasks import RecvTask, SaveTask, SendTask

__all__ = [
    "IllegalTransitionError",
    "Machine",
    "PdConfig",
    "PdCore",
    "Peer",
    "PeerDirectory",
    "PeerKey",
    "RecvTask",
    "Reports",
    "SaveTask",
    "SendTask",
    "StatsSink",
]
