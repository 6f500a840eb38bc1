"""The worker-side half of MoRIIONativeConnector (one per vLLM worker process / GPU).

A thin adapter over the protocol core (:class:`moriio_native.pd.PdCore`): it registers vLLM's
KV cache tensors with the native :class:`~moriio_native.Engine`, starts the core on this
rank's ports (plus, on rank 0, the proxy registration pinger), and translates vLLM's hooks
into core calls and the core's reports back:

=============================== ===============================================================
vLLM hook                       core
=============================== ===============================================================
``bind_connector_metadata``     ``begin_step`` (prefill saves and finished requests)
``start_load_kv``               ``start_loads`` (READ pulls / WRITE announcements; never waits)
``wait_for_layer_load``         ``wait_sync_reads`` (only with ``read_loading: sync``)
``save_kv_layer``               ``layer_saved`` with the layer's CUDA event
``wait_for_save``               ``forward_done`` (queues unsaved layers, seals)
``get_finished``                ``take_reports`` (sending / receiving / failed receiving)
``get_block_ids_with_load_errors`` ``take_load_errors``
``get_kv_connector_stats``      the stats the core counted
=============================== ===============================================================

READ loads are asynchronous by default: the scheduler parks the request in
WAITING_FOR_REMOTE_KVS, the core handshakes and reads in the background, and the end is
reported as finished (and failed) receiving; the decode batch keeps running meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.channel import HandshakeServer, NotifyListener, ProxyPinger
from moriio_native.control.messages import KvGroup, ProxyRegistration
from moriio_native.control.security import ControlSecurity
from moriio_native.engine import Engine, LayerRegistration, choose_backend
from moriio_native.errors import FailedPreconditionError, InvalidArgumentError
from moriio_native.pd import PdConfig, PdCore
from moriio_native.pd.pusher import WRITER_QUEUE
from moriio_native.verify import LayerChecksums
from moriio_native.vllm.config import ConnectorConfig
from moriio_native.vllm.metadata import MoRIIONativeMetadata, RankIncarnation, RecvTask
from moriio_native.vllm.specs import cache_specs, checked_total_kv_heads, split_across_tp
from moriio_native.vllm.stats import MoRIIONativeStats

logger = logging.getLogger("moriio_native.vllm.worker")

# The writer queue's bound (a test shrinks it to prove backpressure cannot deadlock).
_WRITER_QUEUE = WRITER_QUEUE


def _memory_kind(tensor: Any) -> tuple[str, int]:
    device = tensor.device
    if device.type == "cpu":
        return "host", -1
    import torch

    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return kind, device.index if device.index is not None else torch.cuda.current_device()


class WorkerSide:
    """Transfers of one vLLM worker. vLLM calls the hooks from its model-runner thread; the
    core's threads do the rest."""

    def __init__(
        self,
        config: ConnectorConfig,
        specs: Mapping[str, Any],
        *,
        dp_rank: int = 0,
        tp_rank: int = 0,
        total_kv_heads: int = 0,
        context_parallel: bool = False,
        groups: tuple[KvGroup, ...] = (),
        vllm_groups: int = 1,
    ) -> None:
        self.cfg = config
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank
        self.engine_id = f"{config.engine_id}/dp{dp_rank}/tp{tp_rank}"
        self._groups = groups
        # vLLM takes block-level load errors only with one KV-cache group in all, transfer or
        # not (it raises otherwise): with more, failed loads are reported per request alone.
        self._block_errors = vllm_groups <= 1
        self._specs = dict(specs)
        self._stats = MoRIIONativeStats()
        self._open_reported = 0  # the open-transfers gauge as last sent to vLLM
        self._engine: Engine | None = None
        self._checksums: LayerChecksums | None = None
        self._layers: list[str] = []
        self._gpu = False
        self._pending_recv: list[RecvTask] = []
        self._pinger: ProxyPinger | None = None
        split, whole = split_across_tp(self._specs)
        total_kv_heads = checked_total_kv_heads(self._specs, split, total_kv_heads, config.tp_size)
        # One security context for every channel of this rank: the core's and the pinger's.
        self._security = ControlSecurity.from_config(config.control_config())
        if config.proxy_ip is not None:
            # The registration pings dial the proxy as any peer is dialled: refused here,
            # before anything started, when allowed_peers does not cover it.
            self._security.allowlist.require(
                config.proxy_ip,
                purpose=f"proxy registration to {config.proxy_ip}:{config.proxy_ping_port}",
            )
        self._core = PdCore(
            PdConfig(
                engine_id=self.engine_id,
                mode=config.mode,
                producer=config.is_producer,
                consumer=config.is_consumer,
                host_ip=config.host_ip,
                handshake_port=config.handshake_port,
                notify_port=config.notify_port,
                dp_rank=dp_rank,
                tp_rank=tp_rank,
                dp_size=config.dp_size,
                tp_size=config.tp_size,
                transfer_timeout=config.transfer_timeout,
                abort_timeout=config.abort_timeout,
                quarantine_timeout=config.quarantine_timeout,
                sync_read=config.read_loading == "sync",
                # Context parallelism splits every cache by token across ranks: no rank holds a
                # layer whole, so only equal TP sizes pair.
                context_parallel=context_parallel,
                split_layers=split,
                whole_layers=whole,
                total_kv_heads=total_kv_heads,
                verify=config.verify,
                confirm_reads=config.confirm_reads,
                groups=groups,
                require_incarnation=config.require_incarnation,
                require_hold=config.require_hold,
                max_peers=config.max_peers,
            ),
            self._security,
            self._stats,
            engine=lambda: self.engine,
            bind_host=config.bind_host,
            writer_queue=_WRITER_QUEUE,
            checksums=lambda: self.checksums,
        )

    # ---- setup --------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise FailedPreconditionError("KV caches are not registered yet")
        return self._engine

    @property
    def checksums(self) -> LayerChecksums:
        """This rank's block checksums (``verify`` on, caches registered)."""
        if self._checksums is None:
            raise FailedPreconditionError("verify is off, or the KV caches are not registered")
        return self._checksums

    @property
    def core(self) -> PdCore:
        return self._core

    def handshake_metadata(self) -> RankIncarnation:
        """This rank's incarnation, for the scheduler (vLLM's ``get_handshake_metadata``)."""
        return RankIncarnation(self.engine_id, self.tp_rank, self._core.incarnation)

    @property
    def layers(self) -> list[str]:
        return list(self._layers)

    @property
    def _server(self) -> HandshakeServer | None:
        return self._core.server

    @property
    def _listener(self) -> NotifyListener | None:
        return self._core.listener

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Register every transferable layer with the engine (layers viewing one backing share
        one memory region) and start the protocol core. Raises on any bad layer before
        anything is registered."""
        if self._engine is not None:
            raise FailedPreconditionError("register_kv_caches was called twice")
        names = [n for n in kv_caches if n in self._specs]
        absent = [n for n in self._specs if n not in kv_caches]
        if absent:
            raise InvalidArgumentError(
                f"register_kv_caches: no cache for layer(s) {', '.join(absent[:4])} of the "
                "KV-transfer groups (vLLM's KV-cache config names them); a transfer would "
                "end done without moving them"
            )
        skipped = [n for n in kv_caches if n not in self._specs]
        if skipped:
            logger.info(
                "not transferring %d layer(s) outside transfer groups: %s",
                len(skipped),
                skipped[:4],
            )
        if not names:
            raise InvalidArgumentError(
                "register_kv_caches: no layer belongs to a KV-transfer group"
            )
        specs = cache_specs(self._specs, names, {name: kv_caches[name].dim() for name in names})
        regs = []
        for name in names:
            tensor = kv_caches[name]
            storage = tensor.untyped_storage()
            memory, device = _memory_kind(tensor)
            regs.append(
                LayerRegistration(
                    name=name,
                    tensor=tensor,
                    spec=specs[name],
                    allocation=(storage.data_ptr(), storage.nbytes()),
                    memory=memory,  # type: ignore[arg-type]
                    device=device,
                )
            )
        if self.cfg.verify:
            # Refused here, at start-up, when a layer's memory can be checked by neither path.
            self._checksums = LayerChecksums.for_registrations(regs)
        backend = choose_backend(self.cfg.backend, self.cfg.engine_options, role="serve")
        engine = Engine(
            self.engine_id,
            backend,
            options=self.cfg.engine_options,
            transfer_timeout=self.cfg.transfer_timeout,
        )
        engine.register_kv_caches(regs)
        self._engine = engine
        self._layers = names
        self._gpu = any(r.memory != "host" for r in regs)
        ports = self.cfg.ports
        try:
            self._core.start(
                ports.handshake_port(self.dp_rank, self.tp_rank),
                ports.notify_port(self.dp_rank, self.tp_rank),
            )
        except BaseException:
            # Refused: nothing changed (a later call may register again).
            self._engine, self._layers, self._gpu, self._checksums = None, [], False, None
            raise
        if self.cfg.proxy_ip is not None and self.dp_rank == 0 and self.tp_rank == 0:
            self._start_pinger()
        assert self._server is not None and self._listener is not None
        logger.info(
            "engine %s (%s, %s mode%s) registered %d layers; handshake port %d, notify port %d",
            self.engine_id,
            backend,
            self.cfg.mode,
            ", verified transfers" if self.cfg.verify else "",
            len(names),
            self._server.port,
            self._listener.port,
        )

    def _start_pinger(self) -> None:
        cfg = self.cfg
        assert cfg.proxy_ip is not None and cfg.http_port is not None
        registration = ProxyRegistration(
            role="D" if cfg.role == "kv_consumer" else "P",
            http_address=f"{cfg.host_ip}:{cfg.http_port}",
            zmq_address=ZmqAddress(cfg.host_ip, cfg.handshake_port, cfg.notify_port),
            dp_size=cfg.dp_size,
            tp_size=cfg.tp_size,
            transfer_mode=cfg.transfer_mode,
        )
        self._pinger = ProxyPinger(
            cfg.proxy_ip,
            cfg.proxy_ping_port,
            registration,
            interval=cfg.ping_interval,
            auth=self._security.auth if cfg.proxy_auth else None,
            allowlist=self._security.allowlist,
        ).start()

    # ---- per-step hooks -----------------------------------------------------------------------

    def handle_preemptions(self, meta: MoRIIONativeMetadata) -> None:
        """vLLM calls this before the step's GPU work (which may zero or copy into blocks it
        freed); bind_metadata comes after it. WRITE requests it preempted after their save stop
        writing here."""
        self._core.drop_preempted(meta.send)

    def bind_metadata(self, meta: MoRIIONativeMetadata) -> None:
        """Take in one step's metadata (once per step). Prefill tasks take effect at once
        (saves happen during the forward); decode loads start in :meth:`start_load_kv`."""
        self._core.begin_step(meta.save, meta.send)
        self._pending_recv.extend(meta.recv)

    def start_load_kv(self) -> None:
        tasks, self._pending_recv = self._pending_recv, []
        self._core.start_loads(tasks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._core.wait_sync_reads()

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        if layer_name not in self._specs or not self._core.has_step_jobs():
            return
        self._core.layer_saved(layer_name, self._record_event(kv_layer))

    def wait_for_save(self) -> None:
        """Queue every layer whose save hook did not run (after the whole forward) and seal."""
        if not self._core.has_step_jobs():
            return
        event = self._record_event(None) if self._engine is not None and self._layers else None
        self._core.forward_done(self._layers, event)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call. The
        failed loads' blocks stay for get_block_ids_with_load_errors."""
        self._core.wait_sync_reads()
        reports = self._core.take_reports()
        with self._core.lock:
            self._core.ctx.reports.invalid_blocks |= reports.invalid_blocks
        return reports.done_sending, reports.done_recving, reports.failed_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._core.take_load_errors()
        return errors if self._block_errors else set()

    def get_stats(self) -> MoRIIONativeStats | None:
        """This interval's counters, plus the open-transfers gauge when it changed; None when
        there is nothing to send."""
        with self._core.lock:
            if self._engine is not None:
                open_now = self._engine.pending_transfers + self._engine.quarantined_transfers
                # Sent while any is open too, not only on a change: vLLM's log line sums the
                # ranks of one interval's payloads, and a rank left out would count 0.
                if open_now != self._open_reported or open_now:
                    self._stats.record_open_transfers(self.tp_rank, open_now)
                    self._open_reported = open_now
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()

    def _record_event(self, tensor: Any) -> Any:
        """A CUDA event after the work queued so far on the current stream, when the caches are
        on a GPU; None on CPU (the forward already ran synchronously)."""
        on_gpu = self._gpu if tensor is None else bool(getattr(tensor, "is_cuda", False))
        if not on_gpu:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    # ---- teardown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the threads and close every socket. Idempotent."""
        if self._pinger is not None:
            try:
                self._pinger.stop()
            except Exception:
                logger.exception("error stopping the proxy pinger")
            self._pinger = None
        self._core.shutdown()
        logger.info("engine %s shut down", self.engine_id)


__all__ = ["WorkerSide", "choose_backend"]
