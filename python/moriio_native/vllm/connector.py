"""MoRIIONativeConnector: vLLM's KV connector interface on top of moriio-native.

One class serves both roles vLLM creates: in the scheduler process it delegates to
:class:`~moriio_native.vllm.scheduler.SchedulerSide` (what to move, when blocks may be freed),
in each worker to :class:`~moriio_native.vllm.worker.WorkerSide` (the engine, the control
plane, the transfers). Configuration: :mod:`moriio_native.vllm.config`.

It supports vLLM's hybrid KV-cache manager (``SupportsHMA``): full attention, sliding window
and Mamba state groups, each with its own block ids (:mod:`moriio_native.vllm.hybrid`,
:mod:`moriio_native.pd.groups`), and prefill/decode block sizes that divide one another.

Not supported (refused at start-up with a message): pipeline parallelism, sleep mode,
heterogeneous TP between prefill and decode, Mamba prefix caching (``mamba_cache_mode``
"align").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from moriio_native.errors import FailedPreconditionError
from moriio_native.vllm import use_vllm_logging
from moriio_native.vllm.config import ConnectorConfig
from moriio_native.vllm.hybrid import HybridLayout
from moriio_native.vllm.metadata import MoRIIONativeMetadata
from moriio_native.vllm.prom import MoRIIONativePromMetrics
from moriio_native.vllm.scheduler import SchedulerSide
from moriio_native.vllm.specs import layer_specs
from moriio_native.vllm.stats import MoRIIONativeStats
from moriio_native.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("moriio_native.vllm")
# Loaded through kv_connector_module_path, the entry point (register) may not have run.
use_vllm_logging()


def _ours(metadata: KVConnectorMetadata) -> MoRIIONativeMetadata:
    if not isinstance(metadata, MoRIIONativeMetadata):
        raise FailedPreconditionError(
            f"expected MoRIIONativeMetadata, got {type(metadata).__name__} "
            "(are the scheduler and the workers running the same connector?)"
        )
    return metadata


def _tp_rank(vllm_config: VllmConfig) -> int:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            model_parallel_is_initialized,
        )

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except ImportError:
        pass
    pc = vllm_config.parallel_config
    return int(pc.rank) % max(1, int(pc.tensor_parallel_size))


def _total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads over all TP ranks (0 when the model config cannot tell)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


class MoRIIONativeConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV transfer for ``vllm serve`` (READ or WRITE mode, UCX or MoRI-IO).

    Load with ``--kv-transfer-config '{"kv_connector": "MoRIIONativeConnector",
    "kv_connector_module_path": "moriio_native.vllm", "kv_role": ..., "kv_connector_extra_config":
    {...}}'`` (the module path may be left out once the package is installed: it registers the
    name through vLLM's plugin entry point).
    """

    _cache_hit_source = CacheHitSource.P2P

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        # The registered memory regions cannot follow a sleep-mode remap.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load (READ) and save_kv_layer (WRITE) must run between graph pieces.
        return True

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return MoRIIONativeStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        # The series are documented in moriio_native.vllm.prom and docs/vllm.md ("Metrics").
        return MoRIIONativePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise FailedPreconditionError(
                "MoRIIONativeConnector does not support pipeline parallelism "
                f"(pipeline_parallel_size={pc.pipeline_parallel_size})"
            )
        ktc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(
            ktc.kv_connector_extra_config,
            role=str(ktc.kv_role),
            dp_size=int(pc.data_parallel_size),
            tp_size=int(pc.tensor_parallel_size),
        )
        self.engine_id = self.config.engine_id
        dp_rank = int(pc.data_parallel_rank)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        # vLLM's KV-cache groups that transfer (several with the hybrid KV-cache manager on);
        # vLLM's own count includes those that do not (enable_kv_transfer off).
        hybrid = HybridLayout.from_kv_cache_config(
            kv_cache_config, str(vllm_config.cache_config.cache_dtype)
        )
        vllm_groups = len(kv_cache_config.kv_cache_groups)
        if vllm_groups > 1 and self.config.mode == "read" and self.config.read_loading == "sync":
            raise FailedPreconditionError(
                f"read_loading 'sync' with {vllm_groups} KV-cache groups ({len(hybrid.groups)} "
                "of them transferred): vLLM takes block-level load errors for one group only, "
                "so a failed synchronous READ could not be recomputed; use read_loading "
                "'async' (the default)"
            )
        if role == KVConnectorRole.SCHEDULER:
            groups = kv_cache_config.kv_cache_groups
            block_size = (
                groups[0].kv_cache_spec.block_size
                if groups
                else vllm_config.cache_config.block_size
            )
            self.scheduler = SchedulerSide(self.config, int(block_size), dp_rank, hybrid)
        else:
            self.worker = WorkerSide(
                self.config,
                layer_specs(kv_cache_config),
                groups=hybrid.groups,
                vllm_groups=vllm_groups,
                dp_rank=dp_rank,
                tp_rank=_tp_rank(vllm_config),
                total_kv_heads=_total_kv_heads(vllm_config),
                context_parallel=int(getattr(pc, "decode_context_parallel_size", 1)) > 1
                or int(getattr(pc, "prefill_context_parallel_size", 1)) > 1,
            )
        logger.info(
            "MoRIIONativeConnector %s: role %s, %s mode, engine %s, backend %s",
            role.name.lower(),
            self.config.role,
            self.config.mode,
            self.engine_id,
            self.config.backend,
        )

    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise FailedPreconditionError("scheduler-side hook called on a worker connector")
        return self.scheduler

    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise FailedPreconditionError("worker-side hook called on a scheduler connector")
        return self.worker

    # ---- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(
            connector_output.finished_sending, connector_output.invalid_block_ids
        )

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        # Every worker's incarnation by TP rank: the prefill's answers carry them.
        self._sched().set_incarnations(metadata)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A P/D transfer restores the request's own blocks in every transfer group.
        return self._kv_cache_config.transfer_group_ids

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work().handle_preemptions(_ours(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._work().bind_metadata(_ours(connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._work().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Failed loads are also reported block by block (get_block_ids_with_load_errors), so a
        # caller that only knows get_finished still makes vLLM recompute them.
        sending, recving, _failed = self._work().get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_finished()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        return self.worker.get_stats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


__all__ = ["MoRIIONativeConnector"]
