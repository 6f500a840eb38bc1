"""Harness for the vLLM connector tests (no tests here).

A :class:`Side` is one vLLM instance reduced to what the connector touches: vLLM's real
``Scheduler`` (which creates the scheduler-side connector through vLLM's connector factory),
a worker-side connector made by the same factory, and KV caches allocated by vLLM's own
``allocate_kv_cache`` on CPU. :meth:`Side.step` runs one engine step the way vLLM's model
runner drives a connector (bind metadata, start_load_kv, per layer wait_for_layer_load /
"attention" / save_kv_layer, wait_for_save, get_transfer_results, load errors, stats) and
feeds the result back through ``Scheduler.update_from_output``.

The fake attention writes a pattern into each computed token's slot that depends on the
token, its position, the layer and a per-instance ``salt``: after a transfer, the decode's
slots must hold the prefill's pattern exactly where the KV was loaded and its own pattern
where it computed (or had cached) the tokens itself.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from net_support import free_ports

LAYERS_DENSE = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
}
BLOCK_SIZE = 16


def write_model_dir(path: Path, **overrides: Any) -> str:
    """A model directory with LLAMA_CONFIG (``overrides`` replace some of its keys)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **overrides}))
    return str(path)


def dense_specs(num_kv_heads: int = 2) -> dict[str, Any]:
    """Dense K|V layers holding ``num_kv_heads`` KV heads (one TP rank's share)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {
        name: FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=16, dtype=torch.float16
        )
        for name in LAYERS_DENSE
    }


def mixed_specs(num_kv_heads: int = 2) -> dict[str, Any]:
    """Dense K|V layers (``num_kv_heads`` each) plus an MLA latent layer and an fp8-style
    indexer (uint8) layer."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs = dense_specs(num_kv_heads)
    specs["model.layers.2.self_attn.mla"] = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=48, dtype=torch.float16
    )
    specs["model.layers.2.self_attn.indexer"] = MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )
    return specs


def mla_specs() -> dict[str, Any]:
    """Only caches every TP rank holds whole (an MLA latent and an indexer layer): what
    transfers between different TP sizes need."""
    return {k: v for k, v in mixed_specs().items() if k not in LAYERS_DENSE}


def make_vllm_config(
    model_dir: str,
    *,
    role: str,
    extra: Mapping[str, Any],
    module_path: str | None = "moriio_native.vllm",
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    failure_policy: str = "recompute",
    enable_prefix_caching: bool = True,
    tp_size: int = 1,
    tp_rank: int = 0,
    block_size: int = BLOCK_SIZE,
    hybrid_kv_cache_manager: bool = False,
) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float16"
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    kv_transfer_config = KVTransferConfig(
        kv_connector="MoRIIONativeConnector",
        kv_connector_module_path=module_path,
        kv_role=role,
        kv_connector_extra_config=dict(extra),
        kv_load_failure_policy=failure_policy,
    )
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, rank=tp_rank),
    )
    if hybrid_kv_cache_manager:
        # vLLM turns the hybrid KV-cache manager off on platforms without GPU kernels (this
        # CPU); the scheduler and the connector run with it on as on a GPU host.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def make_kv_cache_config(
    vllm_config: Any, specs: Mapping[str, Any], num_blocks: int, layout: str
) -> Any:
    """vLLM's own grouping and tensor planning for ``specs``, with ``num_blocks`` blocks."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups

    resolve_kv_cache_layout(vllm_config, [[layout]], specs.values())
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    per_block = sum(spec.page_size_bytes for spec in specs.values())
    config = get_kv_cache_config_from_groups(vllm_config, groups, per_block * num_blocks)
    if config.num_blocks != num_blocks:
        # Hybrid groups share tensors (one layer of each group per tensor): fewer bytes a block.
        per_block = per_block * num_blocks // config.num_blocks
        config = get_kv_cache_config_from_groups(vllm_config, groups, per_block * num_blocks)
    assert config.num_blocks == num_blocks, (config.num_blocks, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return config


def pattern(
    token: torch.Tensor,
    pos: torch.Tensor,
    layer: int,
    salt: int,
    cell: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """[len(pos), *cell] values for the given tokens/positions; exact in fp16 and uint8."""
    base = (token.long() * 7 + pos.long() * 3 + layer * 11 + salt * 101) % 997
    offsets = torch.arange(int(torch.tensor(cell).prod())).reshape(cell) % 5
    values = base.reshape(-1, *([1] * len(cell))) + offsets
    if dtype == torch.uint8:
        values = values % 251
    return values.to(dtype)


def rank_salt(salt: int, rank: int) -> int:
    """The pattern salt of TP rank ``rank`` of an instance with ``salt``: every rank holds other
    bytes, so a rank that read another rank's shard is caught."""
    return salt + 1000 * rank


@dataclass
class Transfers:
    """What the scheduler hears of the workers' transfers this step (aggregated over ranks)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


@dataclass
class StepResult:
    output: Any  # SchedulerOutput
    engine_outputs: dict[int, Any]
    transfer: Transfers
    invalid_blocks: set[int]
    stats: Any

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.output.num_scheduled_tokens)

    def finished(self) -> dict[str, Any]:
        """request id -> its EngineCoreOutput, for requests that finished this step."""
        out = {}
        for outputs in self.engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    out[o.request_id] = o
        return out


@dataclass
class StepWork:
    """What one TP rank's worker needs of one scheduler step (picklable, as vLLM hands the
    metadata to worker processes): the connector metadata, and for every scheduled request
    the tokens computed this step and where their slots are."""

    metadata: Any
    has_sync_kv_loads: bool
    finished_req_ids: set[str]
    # (request id, first position, token ids, each KV-cache group's block ids, sampled a token)
    computed: list[tuple[str, int, list[int], list[list[int]], bool]]


@dataclass
class RankSpec:
    """Everything one TP rank's worker is built from (picklable: a worker in another process
    is built from it the same way)."""

    name: str
    role: str
    mode: str
    model_dir: str
    specs: dict[str, Any]
    num_blocks: int
    layout: str
    extra: dict[str, Any]  # the connector's extra config, complete
    module_path: str | None
    max_num_batched_tokens: int
    failure_policy: str
    tp_size: int
    salt: int
    max_num_seqs: int = 16
    block_size: int = BLOCK_SIZE  # tokens per block of the attention groups
    prefix_caching: bool = True
    hybrid_kv_cache_manager: bool = False

    def vllm_config(self, rank: int) -> Any:
        return make_vllm_config(
            self.model_dir,
            role=self.role,
            extra=self.extra,
            module_path=self.module_path,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            failure_policy=self.failure_policy,
            tp_size=self.tp_size,
            tp_rank=rank,
            block_size=self.block_size,
            enable_prefix_caching=self.prefix_caching,
            hybrid_kv_cache_manager=self.hybrid_kv_cache_manager,
        )


class RankWorker:
    """One TP rank of an instance: a worker-side connector made by vLLM's factory, its KV
    caches from vLLM's ``allocate_kv_cache``, and the fake forward that writes the pattern."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        self.rank = rank
        self.salt = rank_salt(spec.salt, rank)
        self.layer_names = list(spec.specs)
        self.specs = spec.specs
        config = spec.vllm_config(rank)
        kv_cache_config = make_kv_cache_config(config, spec.specs, spec.num_blocks, spec.layout)
        self.group_of = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        self.caches = allocate_kv_cache(
            kv_cache_config,
            torch.device("cpu"),
            config.cache_config.get_resolved_kv_cache_layout(),
        )
        self.connector.register_kv_caches(self.caches)

    def _attention(self, work: StepWork, layer_index: int, layer: str) -> None:
        """Write the pattern of every token computed this step into its slot of ``layer`` (a
        Mamba layer: its state block gets the pattern of the last token computed, over the
        whole state page)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        cache = self.caches[layer]
        gid, spec = self.group_of[layer], self.specs[layer]
        for _, start, token_ids, group_ids, _ in work.computed:
            ids = group_ids[gid]
            end = start + len(token_ids)
            if isinstance(spec, MambaSpec):
                page = _bits(cache)[ids[-1 - spec.num_speculative_blocks]]
                token = torch.tensor([token_ids[-1]])
                state = pattern(
                    token, torch.tensor([end]), layer_index, self.salt, page.shape, page.dtype
                )
                page.copy_(state[0])
                continue
            pos = torch.arange(start, end)
            tokens = torch.tensor(token_ids)
            blocks = torch.tensor(ids)[pos // spec.block_size]
            cell = (cache.shape[1], cache.shape[3])
            values = pattern(tokens, pos, layer_index, self.salt, cell, cache.dtype)
            # A block stores cache.shape[2] states: one per token, or one per several tokens
            # (compressed states; the fake forward keeps the last token's of each).
            cache[blocks, :, (pos % spec.block_size) * cache.shape[2] // spec.block_size, :] = (
                values
            )

    def run(
        self,
        work: StepWork,
        before_forward: Callable[[], None] | None = None,
        after_start_load: Callable[[], None] | None = None,
    ) -> Any:
        """This rank's part of the step: the connector calls of vLLM's model runner around a
        forward pass that writes the pattern. Returns this rank's ModelRunnerOutput."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        w = self.connector
        # vLLM's executors hand the metadata to worker processes pickled: so do we, so every
        # connector test proves it survives the trip. Its model runner calls
        # handle_preemptions first, before the step's GPU work, then binds it.
        metadata = pickle.loads(pickle.dumps(work.metadata))
        w.handle_preemptions(metadata)
        w.bind_connector_metadata(metadata)
        sync = work.has_sync_kv_loads
        if sync:
            w.start_load_kv(None)
            if after_start_load is not None:
                after_start_load()
        if before_forward is not None:
            before_forward()
        if work.computed:
            for i, layer in enumerate(self.layer_names):
                w.wait_for_layer_load(layer)
                self._attention(work, i, layer)
                w.save_kv_layer(layer, self.caches[layer], None)
        if not sync:
            w.start_load_kv(None)
            if after_start_load is not None:
                after_start_load()
        w.wait_for_save()
        transfer = w.get_transfer_results(work.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        # Worker processes send their stats back pickled, too.
        stats = pickle.loads(pickle.dumps(w.get_kv_connector_stats()))
        w.clear_connector_metadata()
        req_ids = [c[0] for c in work.computed]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[SAMPLED_TOKEN] if c[4] else [] for c in work.computed],
            kv_connector_output=KVConnectorOutput(
                finished_sending=transfer.finished_sending or None,
                finished_recving=transfer.finished_recving or None,
                failed_recving=set(transfer.failed_recving),
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
            ),
        )

    def shutdown(self) -> None:
        self.connector.shutdown()


SAMPLED_TOKEN = 7


@dataclass
class Side:
    """One vLLM instance's scheduler + one worker per TP rank, connected through
    MoRIIONativeConnector."""

    name: str
    role: str
    mode: str
    model_dir: str
    num_blocks: int = 64
    salt: int = 1
    specs: dict[str, Any] = field(default_factory=dense_specs)
    layout: str = "LBNHC"
    extra: dict[str, Any] = field(default_factory=dict)
    module_path: str | None = "moriio_native.vllm"
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    failure_policy: str = "recompute"
    tp_size: int = 1  # workers of this instance, one per TP rank (each with its own caches)
    block_size: int = BLOCK_SIZE  # tokens per block of the attention groups
    prefix_caching: bool = True
    hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        init_none_hash(sha256)
        self.hash_fn = sha256
        # Ports given in ``extra`` are kept (an instance restarted under the same address). Each
        # rank listens at base + rank: a block per kind, so that the two never overlap (single
        # ports picked apart once gave 29953..29954 and 29952..29953 to a TP-2 instance).
        self.handshake_port = int(self.extra.get("handshake_port") or free_ports(self.tp_size))
        self.notify_port = int(self.extra.get("notify_port") or free_ports(self.tp_size))
        extra = {
            "mode": self.mode,
            "backend": "loopback",
            "host_ip": "127.0.0.1",
            "handshake_port": self.handshake_port,
            "notify_port": self.notify_port,
            "allowed_peers": ["127.0.0.1/32"],
            "transfer_timeout": 10,
            "abort_timeout": 30,
        }
        extra.update(self.extra)
        self.rank_spec = RankSpec(
            self.name,
            self.role,
            self.mode,
            self.model_dir,
            self.specs,
            self.num_blocks,
            self.layout,
            extra,
            self.module_path,
            self.max_num_batched_tokens,
            self.failure_policy,
            self.tp_size,
            self.salt,
            self.max_num_seqs,
            block_size=self.block_size,
            prefix_caching=self.prefix_caching,
            hybrid_kv_cache_manager=self.hybrid_kv_cache_manager,
        )
        self.vllm_config = self.rank_spec.vllm_config(0)
        self.kv_cache_config = make_kv_cache_config(
            self.vllm_config, self.specs, self.num_blocks, self.layout
        )
        # As vLLM's engine core does: the scheduler sees one spec per group, and schedules in
        # the block sizes vLLM resolves for the groups.
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config([self.kv_cache_config])
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            scheduler_kv_cache_config, self.vllm_config
        )
        self.hash_block_size = hash_block_size
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=scheduler_kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        # One worker per TP rank, as vLLM runs them, and the aggregator that merges their
        # transfer reports for the scheduler (a request is finished once every rank says so).
        self._make_ranks()
        # As vLLM's engine core does once the workers registered their caches: each rank's
        # handshake metadata (its incarnation) goes to the scheduler-side connector.
        self.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, rank): meta for rank, meta in enumerate(self._handshake_metadata())}
        )
        self.aggregator = KVOutputAggregator(self.tp_size)
        self.layer_names = list(self.specs)
        self.initial_free = self.free_blocks()
        # How often each request was reported in each of the scheduler's transfer sets, over
        # every step: each must be reported exactly once (a second report double-frees).
        self.reports: dict[str, Counter[str]] = {
            "finished_sending": Counter(),
            "finished_recving": Counter(),
            "failed_recving": Counter(),
        }
        self.rank_reports: list[dict[str, Counter[str]]] = [
            {"finished_sending": Counter(), "finished_recving": Counter()}
            for _ in range(self.tp_size)
        ]

    def _make_ranks(self) -> None:
        """The TP ranks' workers, in this process."""
        self.ranks = [RankWorker(self.rank_spec, rank) for rank in range(self.tp_size)]
        self.workers = [r.connector for r in self.ranks]
        self.rank_caches = [r.caches for r in self.ranks]
        self.worker, self.caches = self.workers[0], self.rank_caches[0]

    def _handshake_metadata(self) -> list[Any]:
        """Every rank's ``get_handshake_metadata()``, by rank."""
        return [w.get_handshake_metadata() for w in self.workers]

    def _run_ranks(
        self,
        work: StepWork,
        before_forward: Callable[[], None] | None,
        after_start_load: Callable[[], None] | None,
    ) -> list[Any]:
        """Every rank's ModelRunnerOutput for one step."""
        return [r.run(work, before_forward, after_start_load) for r in self.ranks]

    # ---- addresses ----------------------------------------------------------------------------

    def zmq_address(self) -> Any:
        from moriio_native.control.addressing import ZmqAddress

        return ZmqAddress("127.0.0.1", self.handshake_port, self.notify_port)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt: list[int],
        *,
        params: dict[str, Any] | None = None,
        max_tokens: int = 4,
    ) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sampling = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.hash_block_size, self.hash_fn),
        )
        self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # ---- one engine step ----------------------------------------------------------------------

    def group_of(self, layer: str) -> tuple[int, Any]:
        """(index among vLLM's KV-cache groups, the layer's spec) of ``layer``."""
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if layer in group.layer_names:
                return gid, self.specs[layer]
        raise KeyError(layer)

    def _work(self, output: Any) -> StepWork:
        """What the ranks need of scheduler output ``output``."""
        computed = []
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # already advanced by the scheduler
            start = end - n
            computed.append(
                (
                    req_id,
                    start,
                    list(request.all_token_ids[start:end]),
                    [list(ids) for ids in self.scheduler.kv_cache_manager.get_block_ids(req_id)],
                    request.num_computed_tokens >= request.num_tokens,
                )
            )
        return StepWork(
            output.kv_connector_metadata,
            bool(output.has_sync_kv_loads),
            set(output.finished_req_ids),
            computed,
        )

    def step(
        self,
        before_forward: Callable[[], None] | None = None,
        after_start_load: Callable[[], None] | None = None,
    ) -> StepResult:
        """One engine step; ``after_start_load`` runs right after ``start_load_kv`` (loads
        posted), wherever vLLM calls it in the step."""
        output = self.scheduler.schedule()
        per_rank = self._run_ranks(self._work(output), before_forward, after_start_load)
        self.on_rank_outputs(per_rank)
        runner_output = self.aggregator.aggregate(per_rank)
        kv = runner_output.kv_connector_output
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        transfers = Transfers(
            set(kv.finished_sending or ()), set(kv.finished_recving or ()), set(kv.failed_recving)
        )
        for key, ids in (
            ("finished_sending", transfers.finished_sending),
            ("finished_recving", transfers.finished_recving),
            ("failed_recving", transfers.failed_recving),
        ):
            self.reports[key].update(ids)
        return StepResult(
            output, engine_outputs, transfers, set(kv.invalid_block_ids), kv.kv_connector_stats
        )

    def on_rank_outputs(self, outputs: list[Any]) -> None:
        """Counts each rank's own transfer reports, before the aggregator merges them."""
        for rank, out in enumerate(outputs):
            kv = out.kv_connector_output
            for rid in kv.finished_sending or ():
                self.rank_reports[rank]["finished_sending"][rid] += 1
            for rid in kv.finished_recving or ():
                self.rank_reports[rank]["finished_recving"][rid] += 1

    def run_until(
        self, cond: Callable[[StepResult], bool], *, max_wait: float = 30.0, what: str = ""
    ) -> list[StepResult]:
        """Step until ``cond(last step)`` holds; fails (no hang) after ``max_wait`` seconds."""
        results = []
        deadline = time.monotonic() + max_wait
        while True:
            result = self.step()
            results.append(result)
            if cond(result):
                return results
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: gave up waiting for {what or cond}")
            time.sleep(0.005)

    # ---- checks -------------------------------------------------------------------------------

    def slot_matches(
        self,
        req_id: str,
        positions: range,
        salt: int,
        tokens: list[int],
        rank: int = 0,
        writer_rank: int | None = None,
    ) -> list[bool]:
        """For each position: do all layers of TP rank ``rank`` hold the pattern that rank
        ``writer_rank`` (default: ``rank``) of an instance with ``salt`` writes there?"""
        writer = rank if writer_rank is None else writer_rank
        blocks = self.block_ids(req_id)
        out = []
        for p in positions:
            ok = True
            for i, layer in enumerate(self.layer_names):
                cache = self.rank_caches[rank][layer]
                cell = (cache.shape[1], cache.shape[3])
                want = pattern(
                    torch.tensor([tokens[p]]),
                    torch.tensor([p]),
                    i,
                    rank_salt(salt, writer),
                    cell,
                    cache.dtype,
                )[0]
                got = cache[blocks[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :]
                ok = ok and torch.equal(got, want)
            out.append(ok)
        return out

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()


@dataclass
class Loaded:
    """The decode steps of one READ load, merged (see :func:`load`)."""

    scheduled: dict[str, int]  # of the step that scheduled the request
    invalid_blocks: set[int]
    stats: Any  # counters summed over the steps (``.data``), None when none were counted
    blocks: list[int]  # the request's blocks while it loaded
    steps: int


def load(
    d: Side,
    rid: str,
    *,
    before_forward: Callable[[], None] | None = None,
    max_steps: int = 100000,
) -> Loaded:
    """Step the decode until ``rid`` is scheduled after its load ended: with asynchronous READ
    it first waits (WAITING_FOR_REMOTE_KVS, nothing scheduled for it); with synchronous READ
    the first step loads it. After a load error vLLM recomputes it in a later step: that step
    is the one returned, with the load error's blocks."""
    invalid: set[int] = set()
    data: dict[str, Any] = {}
    blocks: list[int] = []
    deadline = time.monotonic() + 60
    for step in range(1, max_steps + 1):
        result = d.step(before_forward)
        if not blocks and rid in d.scheduler.requests:
            blocks = d.block_ids(rid)
        invalid |= result.invalid_blocks
        if result.stats is not None:
            for key, value in result.stats.data.items():
                if key == "samples":
                    data[key] = [*data.get(key, []), *value]
                elif key == "open_transfers":  # a gauge per rank: the latest value counts
                    data[key] = {**data.get(key, {}), **value}
                else:
                    data[key] = data.get(key, 0) + value
        if rid in result.scheduled and not result.invalid_blocks:
            stats = SimpleNamespace(data=data) if data else None
            return Loaded(result.scheduled, invalid, stats, blocks, step)
        assert time.monotonic() < deadline, f"{rid} was never scheduled"
        time.sleep(0.002)
    raise AssertionError(f"{rid} not scheduled within {max_steps} steps")


def transfer_id() -> str:
    return f"tx-{uuid.uuid4()}"


def pd_request_id(prefill: Side, decode: Side) -> str:
    from moriio_native.control.addressing import format_request_id

    return format_request_id(prefill.zmq_address(), decode.zmq_address())


def prefill_params(tid: str, remote_tp_size: int = 1) -> dict[str, Any]:
    """What vLLM's MoRIIO proxy sends the prefill instance (with the decode's TP size)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_dp_size": 1,
        "remote_tp_size": remote_tp_size,
        "transfer_id": tid,
    }


# The keys of the prefill's answer a proxy passes on to the decode (examples/launch/proxy.py).
PROXY_FORWARDS = (
    "remote_engine_id",
    "remote_block_ids",
    "transfer_id",
    "remote_incarnations",
    "remote_hold_until_ms",
    "remote_num_tokens",
    "remote_prompt_digest",
    "remote_answer_tag",
)


def decode_params(
    tid: str, prefill_result: Mapping[str, Any] | None = None, remote_tp_size: int = 1
) -> dict[str, Any]:
    """What the proxy sends the decode instance (with the prefill's TP size): in READ mode with
    the prefill's answer."""
    params: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": tid,
        "remote_dp_size": 1,
        "remote_tp_size": remote_tp_size,
        "remote_dp_rank": 0,
    }
    if prefill_result is not None:
        for key in PROXY_FORWARDS:  # as examples/launch/proxy.py: a missing key goes as None
            params[key] = prefill_result.get(key)
    return params


# ---- a Side in another process (for the two-process UCX test) ---------------------------------


def backing_of(side: Side) -> torch.Tensor:
    """The one shared KV backing every layer of ``side`` views, as flat bytes."""
    storage = next(iter(side.caches.values())).untyped_storage()
    return torch.tensor([], dtype=torch.uint8).set_(storage)


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def logical_blocks(side: Side, blocks: list[int]) -> dict[str, torch.Tensor]:
    """Each layer's [len(blocks), H, N, C] content (as integers), independent of the physical
    layout, copied out of the backing."""
    index = torch.tensor(blocks, dtype=torch.long)
    return {name: _bits(cache)[index].clone() for name, cache in side.caches.items()}


def expected_backing(
    side: Side, before: torch.Tensor, blocks: list[int], content: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``before`` with ``content`` written into ``blocks`` of every layer, using torch views of
    the same strides -- nothing else may differ after a transfer."""
    expected = before.clone()
    base = backing_of(side).data_ptr()
    index = torch.tensor(blocks, dtype=torch.long)
    for name, cache in side.caches.items():
        es = cache.element_size()
        sizes = (*cache.shape[:-1], cache.shape[-1] * es)
        strides = (*(s * es for s in cache.stride()[:-1]), 1)
        view = torch.as_strided(expected, sizes, strides, cache.data_ptr() - base)
        _bits(view.view(cache.dtype))[index] = content[name]
    return expected


def fill_random(side: Side, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    backing = backing_of(side)
    backing.copy_(torch.randint(0, 256, backing.shape, dtype=torch.uint8, generator=gen))


def _cmd_prefill(side: Side, rid: str, prompt: list[int], params: dict[str, Any]) -> Any:
    side.add_request(rid, prompt, params=params, max_tokens=1)
    out = side.step().finished()[rid].kv_transfer_params
    n = -(-len(prompt) // BLOCK_SIZE)
    return out, logical_blocks(side, side.block_ids(rid)[:n])


def _cmd_until_sent(side: Side, rid: str) -> int:
    side.run_until(lambda r: rid in r.transfer.finished_sending, what="sent")
    return side.free_blocks()


def _cmd_decode_read(
    side: Side, rid: str, prompt: list[int], params: dict[str, Any], content: Any
) -> dict[str, Any]:
    """READ leg: snapshot the backing right after the load (before the forward writes the
    last prompt token) and count bytes that differ from the expected backing."""
    fill_random(side, 7)
    before = backing_of(side).clone()
    # One token: the request ends in the step that computes it, so no earlier request's decode
    # steps write the backing while a later READ waits (asynchronous loading steps meanwhile).
    side.add_request(rid, prompt, params=params, max_tokens=1)
    loaded: dict[str, Any] = {}

    def snapshot() -> None:
        side.worker.wait_for_layer_load(side.layer_names[0])
        loaded["backing"] = backing_of(side).clone()

    result = load(side, rid, before_forward=snapshot)  # the forward that computes rid
    blocks = result.blocks[: -(-(len(prompt) - 1) // BLOCK_SIZE)]
    want = expected_backing(side, before, blocks, content)
    return {
        "scheduled": result.scheduled,
        "differing_bytes": int((want != loaded["backing"]).sum()),
        "invalid": sorted(result.invalid_blocks),
        "blocks": blocks,
        "stats": dict(result.stats.data) if result.stats else None,
    }


def _cmd_decode_write_start(
    side: Side, snapshots: dict[str, torch.Tensor], rid: str, prompt: list[int], params: Any
) -> dict[str, Any]:
    while side.scheduler.get_num_unfinished_requests():  # quiesce older requests
        side.step()
    fill_random(side, 9)
    snapshots[rid] = backing_of(side).clone()
    side.add_request(rid, prompt, params=params, max_tokens=2)
    result = side.step()
    return {"scheduled": result.scheduled, "blocks": side.block_ids(rid)}


def _cmd_decode_write_finish(
    side: Side, snapshots: dict[str, torch.Tensor], rid: str, content: Any
) -> dict[str, Any]:
    results = side.run_until(lambda r: rid in r.transfer.finished_recving, what="write_done")
    want = expected_backing(side, snapshots[rid], side.block_ids(rid), content)
    return {
        "differing_bytes": int((want != backing_of(side)).sum()),
        "failed": rid in results[-1].transfer.failed_recving,
    }


@dataclass
class ChildContext:
    """What a ``run`` command's function gets in the child: the child's Sides, and
    ``progress(value)``, which the test receives with :meth:`RemoteSides.progress` while the
    command is still running (say, once a transfer was posted)."""

    sides: dict[str, Side]
    model_dir: str
    progress: Callable[[Any], None]


def _serve(conn: Any, model_dir: str, env: Mapping[str, str] | None = None) -> None:
    """Child process: build Sides on request and run scripted legs of a P/D exchange.

    ``("run", "module:function", args)`` calls ``function(ChildContext, *args)`` from an
    importable module (the fault tests' legs live with those tests). ``env`` is set before
    any engine exists (UCX reads its transports from it)."""
    import logging
    import traceback

    os.environ.update(env or {})
    conn.send(("progress", "started"))
    logging.basicConfig(level=logging.WARNING)
    sides: dict[str, Side] = {}
    context = ChildContext(sides, model_dir, lambda value: conn.send(("progress", value)))
    snapshots: dict[str, torch.Tensor] = {}
    try:
        while True:
            cmd, name, args = conn.recv()
            try:
                if cmd == "make":
                    side = Side(name, model_dir=model_dir, specs=mixed_specs(), **args)
                    sides[name] = side
                    conn.send(("ok", (side.handshake_port, side.notify_port, side.initial_free)))
                elif cmd == "quit":
                    for each in sides.values():
                        each.shutdown()
                    conn.send(("ok", None))
                    return
                elif cmd == "prefill":
                    conn.send(("ok", _cmd_prefill(sides[name], *args)))
                elif cmd == "until_sent":
                    conn.send(("ok", _cmd_until_sent(sides[name], *args)))
                elif cmd == "decode_read":
                    conn.send(("ok", _cmd_decode_read(sides[name], *args)))
                elif cmd == "decode_write_start":
                    conn.send(("ok", _cmd_decode_write_start(sides[name], snapshots, *args)))
                elif cmd == "decode_write_finish":
                    conn.send(("ok", _cmd_decode_write_finish(sides[name], snapshots, *args)))
                elif cmd == "run":
                    module, function = name.split(":")
                    leg = getattr(importlib.import_module(module), function)
                    conn.send(("ok", leg(context, *args)))
                else:
                    conn.send(("error", f"unknown command {cmd}"))
            except Exception as exc:  # report to the test, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


class RemoteSides:
    """A child process serving :func:`_serve`; ``call`` raises what the child raised.

    ``submit`` + ``result`` split a call, so the test can act (signal the other process) while
    this one runs a leg; ``progress`` waits for what the leg reports on the way."""

    def __init__(
        self,
        model_dir: str,
        timeout: float = 180.0,
        env: Mapping[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model_dir, env), daemon=True)
        if netns:
            # Started through ``ip netns exec``, which also remounts /sys for the namespace
            # (UCX finds its network devices there; setns alone would leave the host's).
            with tempfile.TemporaryDirectory(prefix="netns-python-") as tmp:
                wrapper = Path(tmp) / "python"
                wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {netns} {sys.executable} "$@"\n')
                wrapper.chmod(0o755)
                ctx.set_executable(str(wrapper))
                try:
                    self._proc.start()
                    # The wrapper has exec'd once the child talks: then it may go.
                    if not self._conn.poll(timeout):
                        raise AssertionError(f"child in netns {netns} did not start")
                    assert self._conn.recv() == ("progress", "started")
                finally:
                    ctx.set_executable(sys.executable)
        else:
            self._proc.start()
        child.close()
        self._timeout = timeout

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.is_alive()

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def submit(self, cmd: str, name: str, args: Any = None) -> None:
        self._conn.send((cmd, name, args))

    def _receive(self, cmd: str, name: str, timeout: float) -> tuple[str, Any]:
        if not self._conn.poll(timeout):
            raise AssertionError(f"child did not answer {cmd} for {name} within {timeout}s")
        status, value = self._conn.recv()
        return status, value

    def progress(self, what: str, timeout: float | None = None) -> Any:
        """The next value the running leg reports through ``ChildContext.progress``."""
        status, value = self._receive("progress", what, timeout or self._timeout)
        if status != "progress":
            raise AssertionError(f"child ended before reporting {what}: {status} {value}")
        return value

    def result(self, cmd: str, name: str, timeout: float | None = None) -> Any:
        while True:
            status, value = self._receive(cmd, name, timeout or self._timeout)
            if status == "progress":
                continue  # reports nobody waited for
            if status != "ok":
                raise AssertionError(f"child failed {cmd} for {name}: {value}")
            return value

    def call(self, cmd: str, name: str, args: Any = None) -> Any:
        self.submit(cmd, name, args)
        return self.result(cmd, name)

    def run(self, leg: str, *args: Any, timeout: float | None = None) -> Any:
        """Run ``leg`` (``module:function``) in the child; see :class:`ChildContext`."""
        self.submit("run", leg, args)
        return self.result("run", leg, timeout)

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10)

    def close(self) -> None:
        try:
            if self._proc.is_alive():
                self.call("quit", "")
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10)
