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

With ``kv_role`` ``kv_producer`` / ``kv_consumer`` the same connector carries a prompt's KV from a
prefill instance to a decode instance over sage's transport (`pd_transfer.py`); the stores are optional then.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, astuple, dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sage_infer.config.presets import load_hardware_preset
from sage_infer.config.transport import KVTransportConfig
from sage_infer.errors import NotAvailableError
from sage_infer.integrations.vllm.blocks import PagedBlocks, block_schema
from sage_infer.integrations.vllm.config import SageConnectorConfig
from sage_infer.integrations.vllm.keys import KeySpace, vllm_layout
from sage_infer.integrations.vllm.pd_transfer import (
    TOKEN_ENV,
    HeldBlocks,
    HeldTransfer,
    PDPlanner,
    PullClient,
    PullIO,
    PullServer,
)
from sage_infer.integrations.vllm.plan import (
    BlockIO,
    ConnectorPlanner,
    ScheduledRequest,
    StepPlan,
    admit,
    model_shape,
)
from sage_infer.integrations.vllm.store import BlockSaver, open_lookup, open_store
from sage_infer.kv_policy.cost_benefit import CostBenefitModel
from sage_infer.kv_policy.quota import build_quota
from sage_infer.kv_runtime.kv_pipe import KVPipe

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
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
    # prefill/decode: producer
    held_blocks: int = 0
    sends: int = 0
    send_failures: int = 0
    # prefill/decode: consumer
    pulls: int = 0
    pull_blocks: int = 0
    pull_bytes: int = 0
    pull_s: float = 0.0  # from asking the producer until the rows were in vLLM's cache
    pull_failures: int = 0


class SageKVConnector(KVConnectorBase_V1):
    """sage's KV store for vLLM: prefix blocks found by chained hash in disk / Redis tiers."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache, and a failed pull is a recompute: nothing is lost when a transfer is

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = SageConnectorConfig.parse(transfer.kv_connector_extra_config, transfer.kv_role)
        self.producer = self.config.role == "kv_producer"
        self.consumer = self.config.role == "kv_consumer"
        token = os.environ.get(TOKEN_ENV)
        self._token = token.encode() if token else None
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
            quota = build_quota(self.config.quota, self.key_space.extra_key)
            self.store, self.disk_index = open_lookup(self.config, self.schema, quota)
            self.cost = self._cost_model(vllm_config) if self.config.hardware_preset else None
            self.planner = ConnectorPlanner(self.block_size, self.key_space, self.config.save_decode)
            self._requests: dict[str, Request] = {}
            self.pd = PDPlanner(self.block_size, self.key_space, f"{self.config.pd_host}:{self.config.pd_port}")
        else:
            self.store = open_store(self.config, self.schema)
            self.paged: PagedBlocks | None = None
            self.saver = BlockSaver(self.store, self.config.save_pending_bytes)
            self.worker_stats = WorkerStats()
            self._failed_blocks: set[int] = set()
            self._finished_saves: set[str] = set()
            self._stats_written: tuple | None = None
            self._open_pd_worker()

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
            return 0, False  # their KV depends on more than token ids: not keyed, not stored
        req_id = request.request_id
        self._requests[req_id] = request
        params = request.kv_transfer_params
        if self.producer and params and params.get("do_remote_decode"):
            self.pd.hold(req_id, request.prompt_token_ids or (), request.cache_salt)
        held = HeldTransfer.of(params) if self.consumer else None
        if held is not None:
            pulled = self.pd.match(req_id, held, request.all_token_ids, request.cache_salt, num_computed_tokens)
            if pulled:
                self.planner.forget(req_id)  # the pull fills these blocks, not the store
                return pulled, True  # asynchronous: the request waits for the pull, other requests run
        if not self.config.has_store:
            return 0, False
        matched = self.planner.match(req_id, request.all_token_ids, request.cache_salt,
                                     num_computed_tokens, self.store.lookup)
        return matched, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.consumer and self.pd.pulling(request.request_id):
            self.pd.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)
            request.kv_transfer_params["do_remote_prefill"] = False  # one pull: after a failure it computes
        elif num_external_tokens > 0:
            load = self.planner.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)
            if load is not None and self.disk_index is not None:
                self.disk_index.hit(load.keys)

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
        plan = self.planner.plan_step(scheduled) if self.config.has_store else StepPlan()
        if self.cost is not None:
            plan.saves = [io for io in map(self._admitted, plan.saves) if io.keys]
        if self.disk_index is not None:
            for io in plan.saves:
                plan.drops.extend(self.disk_index.add(io.keys, io.first, io.parent, io.tenant))
        if self.producer:
            holds = (self.pd.plan_holds(r.req_id, r.token_ids, r.num_computed_tokens, r.block_ids) for r in scheduled)
            plan.holds = [io for io in holds if io is not None]
        if self.consumer:
            plan.pulls = self.pd.take_pulls()
        return SageConnectorMetadata(plan)

    def _admitted(self, io: BlockIO) -> BlockIO:
        """Admission (`hardware_preset`): the native tiers' `CostBenefitModel` decides which blocks are worth a save."""
        tier = "disk" if self.config.disk_path else "remote"
        return admit(io, lambda depth: self.cost.worth_loading(tier, self.block_size, depth))

    def _cost_model(self, vllm_config: VllmConfig) -> CostBenefitModel:
        """The preset's links and FLOPs and this model's shape (parameters estimated from its config)."""
        shape = model_shape(vllm_config.model_config.hf_config, self.schema)
        return CostBenefitModel(load_hardware_preset(self.config.hardware_preset).profile, shape)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.consumer:
            self.pd.received(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) while a pull fills them, or when the last full block still has to be saved; the
        worker says when either is done. A producer answers where its held prompt blocks are."""
        req_id = request.request_id
        if self._requests.pop(req_id, None) is None:
            return False, None
        if self.consumer and self.pd.finished_pull(req_id):
            self.planner.forget(req_id)
            return True, None  # its blocks are being written: freed when the worker reports the pull ended
        params = self.pd.finished_hold(req_id) if self.producer else None
        keep = self.config.has_store and self.planner.finished(req_id, request.all_token_ids,
                                                               request.num_computed_tokens, block_ids)
        return keep, params

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """`kv_caches`: layer name -> ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM CPU)."""
        self.paged = PagedBlocks(list(kv_caches.values()), self.block_size)
        if self.paged.bytes_per_block != self.schema.bytes_per_block:
            raise NotAvailableError(f"SageKVConnector: vLLM's blocks are {self.paged.bytes_per_block} bytes "
                                    f"({len(kv_caches)} layers), the KV cache spec says {self.schema.bytes_per_block}")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan: StepPlan = self._get_connector_metadata().plan
        for io in plan.pulls:
            wire_id = uuid.uuid4().hex
            self.transport.expect(wire_id, len(io.block_ids), self.config.pd_timeout_s)
            self._pulling[wire_id] = (io, time.perf_counter())
            self.pull_client.pull(io.held.address, io.held.transfer, io.first, len(io.block_ids),
                                  self.transport.address, wire_id)
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
        if plan.drops:
            self.saver.drop(plan.drops)
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
        for io in plan.holds:
            assert self.paged is not None, "vLLM registers its caches before the first step"
            self.held.add(io.transfer, self.paged.gather(io.block_ids), io.keys)
            self.worker_stats.held_blocks += len(io.keys)
        if self.config.stats_path:
            self._stats_changed()

    def _stats_changed(self) -> None:
        """Rewrite the stats file when a counter moved since the last write: the file is current after every
        step, not only when vLLM's shutdown reaches the worker (it may not, when the engine process is stopped)."""
        snapshot = (astuple(self.store.stats), astuple(self.worker_stats))
        if snapshot != self._stats_written:
            self._stats_written = snapshot
            self._write_stats(self.config.stats_path)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose last blocks were copied out this step: vLLM may free their blocks now."""
        done, self._finished_saves = self._finished_saves, set()
        return done or None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves copied out (`get_finished`), and pulls that ended: landed in vLLM's blocks, or failed (then
        also in ``failed_recving``: vLLM recomputes the prompt)."""
        saved, _ = self.get_finished(finished_req_ids)
        results = KVConnectorTransferResults(finished_sending=set(saved or ()))
        if self.producer:
            for sent in self.transport.poll_sent():
                self.worker_stats.sends += sent.ok
                self.worker_stats.send_failures += not sent.ok
                if not sent.ok:
                    log.warning("SageKVConnector: sending held KV %s failed: %s", sent.transfer_id, sent.error)
        if self.consumer:
            for req_id, ok in self._pulls_ended():
                results.finished_recving.add(req_id)
                if not ok:
                    results.failed_recving.add(req_id)
        return results

    def _pulls_ended(self) -> list[tuple[str, bool]]:
        """(request id, landed) of every pull that ended since the last step."""
        ended = []
        stats = self.worker_stats

        def failed(req_id: str, why: str) -> None:
            log.warning("SageKVConnector: request %s computes its prompt: %s", req_id, why)
            stats.pull_failures += 1
            ended.append((req_id, False))

        while self._pull_failures:
            wire_id, why = self._pull_failures.popleft()
            entry = self._pulling.pop(wire_id, None)
            if entry is not None:
                self.transport.cancel(wire_id)
                failed(entry[0].req_id, why)
        for result in self.transport.poll_received():
            entry = self._pulling.pop(result.transfer_id, None)
            if entry is None:
                continue
            io, started = entry
            why = result.error
            if why is None and list(result.block_hashes) != io.keys:
                why = ("the producer's block hashes differ from this prompt's (another model, dtype, block size or "
                       "cache_salt)")
            if why is not None:
                failed(io.req_id, why)
                continue
            assert self.paged is not None, "vLLM registers its caches before the first step"
            self.paged.scatter(io.block_ids, result.rows)
            stats.pulls += 1
            stats.pull_blocks += len(io.block_ids)
            stats.pull_bytes += result.rows.numel()
            stats.pull_s += time.perf_counter() - started
            ended.append((io.req_id, True))
        return ended

    def _open_pd_worker(self) -> None:
        """The producer's held blocks, pull server and sender; the consumer's receiver and pull client."""
        if not (self.producer or self.consumer):
            return
        config = self.config
        transport = KVTransportConfig(timeout_s=config.pd_timeout_s, auth_token=self._token.decode() if self._token
                                      else None)
        if self.producer:
            self.transport = KVPipe(self.schema, transport, backend=config.pd_backend)
            self.held = HeldBlocks(config.pd_hold_bytes, config.pd_timeout_s)
            self.pull_server = PullServer(config.pd_host, config.pd_port, self.held, self.transport.start_send,
                                          self._token)
        else:
            listen = f"tcp://{config.pd_host}:0" if config.pd_backend == "tcp" else None
            self.transport = KVPipe(self.schema, transport, backend=config.pd_backend, listen=True,
                                         listen_address=listen)
            self._pulling: dict[str, tuple[PullIO, float]] = {}
            self._pull_failures: collections.deque[tuple[str, str]] = collections.deque()
            self.pull_client = PullClient(lambda wire_id, why: self._pull_failures.append((wire_id, why)), self._token)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            if self.producer:
                self.pull_server.close()
            if self.consumer:
                self.pull_client.close()
            if self.producer or self.consumer:
                self.transport.close()
            self.saver.close()
            if self.config.stats_path:
                self._write_stats(self.config.stats_path)
            self.store.release()
        else:
            self.store.close()

    def _write_stats(self, path: str) -> None:
        data = {"store": asdict(self.store.stats), "worker": asdict(self.worker_stats),
                "pd": ({"held_dropped": self.held.dropped, "pulls_served": self.pull_server.pulls,
                        "pulls_refused": self.pull_server.refused} if self.producer else {}),
                "tiers": {tier.name: asdict(tier.stats()) for tier in self.store.tiers if not self.store.closed}}
        partial = f"{path}.{os.getpid()}.tmp"
        try:
            with open(partial, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(partial, path)  # a reader never sees half a file
        except OSError as err:
            log.warning("SageKVConnector: cannot write stats to %s: %s", path, err)
