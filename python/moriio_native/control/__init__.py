"""The control plane between prefill (P) and decode (D): everything except KV bytes.

ZMQ + msgpack, compatible with the proxy/router protocol of vLLM's MoRIIO connector (peer
addresses embedded in request ids, ``kv_transfer_params`` keys, the proxy registration ping),
with its defects fixed: one port formula for every (dp, tp); every message schema-checked and
a bad one dropped while the listener keeps running; no connection to a host outside the
allowlist; an optional shared secret tagging every P<->D message; no pickle.

Modules (each docstring lists its classes and their thread-safety):

* :mod:`.messages`   -- typed messages, ``encode``/``decode`` with strict schema checks
* :mod:`.security`   -- ``MessageAuth`` (HMAC-SHA256), ``PeerAllowlist``, ``ControlSecurity``
* :mod:`.ports`      -- ``port_offset``/``rank_port``/``PortPlan``
* :mod:`.addressing` -- ``ZmqAddress``, request-id addresses, ``KvTransferParams``
* :mod:`.channel`    -- ``NotifyListener``, ``HandshakeServer``, ``fetch_metadata``,
  ``NotifySender``, ``ProxyPinger``

Usage, one worker of each side (READ mode: D pulls, then tells P to release)::

    from moriio_native import control as ctl

    extra = {"allowed_peers": ["10.0.0.0/16"], "auth_secret": "...32 random chars..."}
    sec = ctl.ControlSecurity.from_config(extra)          # or $MORIIO_NATIVE_AUTH_SECRET
    ports = ctl.PortPlan(handshake_base=6301, notify_base=61005, dp_size=1, tp_size=tp_size)

    # Prefill worker (dp_rank, tp_rank): serve metadata, listen for releases.
    server = ctl.HandshakeServer(
        ports.handshake_port(dp_rank, tp_rank),
        lambda req: ctl.HandshakeResponse(engine_id, native_metadata_bytes,
                                          dp_rank, tp_rank, 1, tp_size, "READ"),
        sec)
    listener = ctl.NotifyListener(ports.notify_port(dp_rank, tp_rank), sec)
    for msg in listener.drain():                          # once per scheduler step
        if isinstance(msg, ctl.Release):
            free_blocks(msg.transfer_id)
            listener.mark_terminal(msg.transfer_id)       # later copies are dropped

    # Decode worker: who is the peer, fetch its metadata, read, release.
    params = ctl.parse_kv_transfer_params(request.kv_transfer_params)  # InvalidArgumentError
    peer = params.peer_address(request.request_id, is_producer=False)  # embedded or explicit
    remote = ctl.PortPlan(peer.handshake_port, peer.notify_port,
                          params.remote_dp_size, params.remote_tp_size or tp_size)
    meta = ctl.fetch_metadata(peer.host, remote.handshake_port(params.remote_dp_rank, tp_rank),
                              timeout=5.0, security=sec, requester_engine_id=my_engine_id)
    ...  # add_peer(meta.engine_metadata), read the blocks
    sender = ctl.NotifySender(sec)
    sender.send(peer.host, remote.notify_port(params.remote_dp_rank, tp_rank),
                ctl.Release(params.transfer_id, consumer_tp_size=tp_size, consumer_tp_rank=tp_rank))

    # Rank 0 of each instance: register with the proxy until shutdown.
    pinger = ctl.ProxyPinger(proxy_ip, proxy_ping_port, ctl.ProxyRegistration(
        "P", f"{host_ip}:{http_port}", ctl.ZmqAddress(host_ip, 6301, 61005),
        dp_size=1, tp_size=tp_size, transfer_mode="READ")).start()

    pinger.stop(); sender.close(); listener.close(); server.close()

Errors: bad input raises :class:`~moriio_native.errors.InvalidArgumentError` (messages:
:class:`InvalidMessageError`); a refused peer :class:`PeerNotAllowedError`; a bad tag
:class:`AuthenticationError`; a handshake without reply
:class:`~moriio_native.errors.TransferTimeoutError`; a broken one
:class:`~moriio_native.errors.TransportError`.
"""

from __future__ import annotations

from .addressing import (
    KV_TRANSFER_PARAM_KEYS,
    KvTransferParams,
    RequestAddresses,
    ZmqAddress,
    format_request_id,
    parse_kv_transfer_params,
    parse_request_id,
    peer_address_from_request_id,
)
from .channel import (
    HandshakeServer,
    NotifyListener,
    NotifySender,
    ProxyPinger,
    fetch_metadata,
)
from .messages import (
    NOTIFY_TYPES,
    PROTOCOL_VERSION,
    AbortWrite,
    HandshakeRejected,
    HandshakeRequest,
    HandshakeResponse,
    InvalidMessageError,
    Misaddressed,
    NotifyMessage,
    ProxyRegistration,
    Release,
    RemoteBlocks,
    WriteAborted,
    WriteDone,
    WriteFailed,
    decode,
    encode,
)
from .ports import PortPlan, port_offset, rank_port
from .security import (
    AuthenticationError,
    ControlSecurity,
    MessageAuth,
    PeerAllowlist,
    PeerNotAllowedError,
)

__all__ = [
    "KV_TRANSFER_PARAM_KEYS",
    "NOTIFY_TYPES",
    "PROTOCOL_VERSION",
    "AbortWrite",
    "AuthenticationError",
    "ControlSecurity",
    "HandshakeRejected",
    "HandshakeRequest",
    "HandshakeResponse",
    "HandshakeServer",
    "InvalidMessageError",
    "KvTransferParams",
    "MessageAuth",
    "Misaddressed",
    "NotifyListener",
    "NotifyMessage",
    "NotifySender",
    "PeerAllowlist",
    "PeerNotAllowedError",
    "PortPlan",
    "ProxyPinger",
    "ProxyRegistration",
    "Release",
    "RemoteBlocks",
    "RequestAddresses",
    "WriteAborted",
    "WriteDone",
    "WriteFailed",
    "ZmqAddress",
    "decode",
    "encode",
    "fetch_metadata",
    "format_request_id",
    "parse_kv_transfer_params",
    "parse_request_id",
    "peer_address_from_request_id",
    "port_offset",
    "rank_port",
]
