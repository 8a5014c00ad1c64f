"""Assemble an `LLMEngine` from a resolved `ServeConfig`: model, tokenizer, KV pool,
block manager with its prefix index and policy, scheduler."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

import torch

from sage_infer.config.auto import (
    DraftKV,
    ModelFacts,
    ResolvedValue,
    resolve_auto,
    resolve_device,
    resolve_fast_path,
    resolve_host_bytes,
    resolve_num_blocks,
)
from sage_infer.config.serve import ServeConfig
from sage_infer.core.dtypes import DTYPE_NAMES, FLOAT_DTYPES, dtype_name
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.engine.draft import DraftModelProposer
from sage_infer.engine.kv_transfer_role import KVTransferRole
from sage_infer.engine.llm_engine import EngineParts, LLMEngine, kv_schema_digest
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.engine.prefill_probe import describe as describe_probe
from sage_infer.engine.prefill_probe import probe_prefill
from sage_infer.engine.steps import step_executor
from sage_infer.errors import ConfigError
from sage_infer.hal.cpu import read_mem_available
from sage_infer.hal.device import device_facts, free_memory_bytes
from sage_infer.hal.huge_pages import collapse_to_huge_pages
from sage_infer.hal.malloc import keep_freed_buffers
from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.cost_benefit import CostBenefitModel, ModelShape
from sage_infer.kv_policy.load_or_compute import LoadOrCompute
from sage_infer.kv_policy.quota import DEVICE, QuotaManager, build_quota
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.group_tiers import GroupTierSource
from sage_infer.kv_runtime.group_transfers import GroupKVTransfers, GroupTransferSource
from sage_infer.kv_runtime.hierarchy import ROLE, HierarchyManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.kv_runtime.kv_groups import KVGroups, kv_groups
from sage_infer.kv_runtime.kv_pipe import KVPipe
from sage_infer.kv_runtime.pool import KVPool, bytes_per_block, make_kv_pool
from sage_infer.kv_runtime.read_probe import probe_reads
from sage_infer.kv_runtime.sources import KVSource
from sage_infer.kv_runtime.tier_source import TierSource
from sage_infer.kv_runtime.tiers import DiskTier, HostTier, MooncakeTier, RedisTier, TierError
from sage_infer.kv_runtime.transfer_source import TransferSource
from sage_infer.kv_runtime.transfers import KVTransfers
from sage_infer.layers.attention_backends import (
    AttentionBackend,
    attention_backend,
)
from sage_infer.layers.attention_kinds import AttentionKind
from sage_infer.layers.batch_invariant import DETERMINISTIC_ROWS, describe_tiling, tile_linears
from sage_infer.layers.cpu_kernels import (
    amx_flash_attention,
    check_forced_level,
    flash_kernel,
    flash_unavailable,
    kernel_level,
    kernel_unavailable,
    small_linear_unavailable,
)
from sage_infer.layers.linear import (
    SMALL_LINEAR_ROWS,
    SMALL_LINEAR_ROWS_AMX,
    PackedLinear,
    pack_linears,
    packing_available,
    tied_linear_bytes,
)
from sage_infer.layers.quant_linear import use_quant_kernels
from sage_infer.layers.triton_paged import triton_unavailable
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.loader import (
    ModelLoadError,
    arch_config,
    load_model,
    resolve_model_dir,
    weight_elements,
    weight_files,
)
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.prefix_reuse.hashing import ExtraKeys
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from sage_infer.scheduler.scheduler import Scheduler
from sage_infer.spec_decode import build_proposer
from sage_infer.transport.process_group import join_process_group

DEMO_MODEL_NAME = "sage-demo"
auto_log = logging.getLogger("sage_infer.auto")  # the start-up lines `sage llm serve` prints
# the decisions of the `EngineBuilder` building now (`_report` adds to it); None outside a build
_DECISIONS: ContextVar[list[ResolvedValue] | None] = ContextVar("engine_build_decisions", default=None)


def build_engine(config: ServeConfig, device: str | torch.device | None = None) -> LLMEngine:
    """The engine for `config`. Every ``auto`` (device, dtypes, context, pool size) comes
    from `sage_infer.config.auto`, which logs each value with its reason; an explicit
    `device` wins over the hardware preset's. The steps are `EngineBuilder`'s."""
    return EngineBuilder(config).build(device)


class EngineBuilder:
    """`build_engine` as named steps, run in this order by `build`: `resolve` (device, dtypes, the speculative
    method), `load_model` (weights, tokenizer, and the ``use_*`` probes that change the model or the process),
    `make_pool`, `make_kv_cache` (prefix index, quotas, KV sources), `choose_attention`, `make_scheduler`,
    `choose_step` (the step executor), `engine`. Each step sets what the later ones read.

    Every decided value (``field = value (reason)``, the lines `sage llm serve` prints at start-up) is kept in
    `decisions`, in the order it was decided, and the engine carries them (`LLMEngine.decisions`).
    """

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.decisions: list[ResolvedValue] = []

    def build(self, device: str | torch.device | None = None) -> LLMEngine:
        recording = _DECISIONS.set(self.decisions)
        try:
            self.resolve(device)
            self.load_model()
            self.make_pool()
            self.make_kv_cache()
            self.choose_attention()
            self.make_scheduler()
            self.choose_step()
            return self.engine()
        finally:
            _DECISIONS.reset(recording)

    def resolve(self, device: str | torch.device | None) -> None:
        """Every ``auto`` from config.json and the device, before any weight loads; what cannot run here (a
        forced CPU ISA, a speculative method not built, a draft that cannot be read) fails now, in one line."""
        config = self.config
        self.directory = resolve_model_dir(config.model.path)
        arch = arch_config(self.directory)  # config.json only: the dtypes are decided before the weights load
        facts = ModelFacts(DTYPE_NAMES.get(arch.torch_dtype, "fp32"), arch.max_position_embeddings,
                           arch.sliding_window)
        chosen = resolve_device(config, device)
        self.auto = resolve_auto(config, facts, chosen, device_facts(chosen.value))
        self.device = self.auto.device
        if self.device.type == "cpu":
            check_forced_level()
        self.proposer = build_proposer(config.speculative)
        self.draft = draft_kv(config, self.auto.model_dtype)

    def load_model(self) -> None:
        """The weights in the resolved dtype, then the ``use_*`` probes that change the model or the process
        (packed linears, batch-invariant tiling, huge pages, the host allocator, CPU kernels, fused elementwise
        ops), and the tokenizer."""
        config, device = self.config, self.device
        self.model, self.arch, self.directory = load_model(self.directory, FLOAT_DTYPES[self.auto.model_dtype],
                                                           device)
        model = self.model
        use_packed_linears(model, config.model.linear, device, config.model.decode_linear)
        self.deterministic = use_deterministic(config.model, model, device)
        if getattr(model, "is_moe", False):
            _report(ResolvedValue("model.experts", *model.describe_experts()))
        if config.model.huge_pages:
            use_huge_pages(model)
        use_host_malloc(config.model.host_malloc, device)
        if device.type == "cpu":
            use_cpu_kernels()
        self.fused = use_fused_elementwise(config.model.elementwise, device, model)
        try:
            self.tokenizer = Tokenizer.from_dir(self.directory)
        except (FileNotFoundError, ValueError) as err:
            raise ModelLoadError(f"{self.directory}: cannot load the tokenizer: {err}") from None

    def make_pool(self) -> None:
        """The KV layout and the pool's size in blocks (with the host tier's bytes, the last ``auto`` values:
        every one is logged here), then the pool."""
        config, arch, auto, device = self.config, self.arch, self.auto, self.device
        self.kv_groups = use_kv_groups(arch, config.kv_pool.block_size)
        try:  # fp8/int8/int4 KV carries one scale (and min) per token and head
            self.schema = KVCacheSchema(self.kv_groups.layers_per_block if self.kv_groups else arch.num_layers,
                                        arch.num_kv_heads, arch.head_dim,
                                        config.kv_pool.block_size).with_dtype(auto.kv_dtype)
        except ValueError as err:
            raise ConfigError(f"kv_pool.kv_dtype: {auto.kv_dtype.value}: {err}") from None
        seat_tokens = auto.max_model_len if self.kv_groups is None else \
            seat_tokens_of_groups(self.kv_groups, auto.max_model_len, config)
        blocks = resolve_num_blocks(config, bytes_per_block=bytes_per_block(self.schema),
                                    max_model_len=seat_tokens, free_device_bytes=free_memory_bytes(device),
                                    host_available_bytes=read_mem_available(), draft=self.draft)
        if self.kv_groups is not None:  # what "tokens" counted for a seat
            blocks = ResolvedValue(blocks.field, blocks.value, f"{blocks.reason}; blocks of {self.schema.num_layers} "
                                   f"layers, a seat's tokens counted over its {len(self.kv_groups.groups)} KV groups")
        auto.values.append(blocks)
        host_bytes = resolve_host_bytes(config, device.type, read_mem_available())
        auto.values.append(host_bytes)
        auto.log()
        self.decisions.extend(auto.values)
        self.host_bytes = host_bytes.value
        self.pool = make_kv_pool(self.schema, blocks.value, device=device, huge_pages=config.model.huge_pages)
        if resolve_layer_loads(config.kv_pool.layer_loads, self.pool, self.kv_groups is not None):
            self.pool.enable_layer_loads()

    def make_kv_cache(self) -> None:
        """The prefix index under the eviction policy, tenant quotas, the lower tiers and prefill/decode
        transfers, and the `KVCacheManager` over them (`kv_sources`)."""
        config, pool, schema, arch = self.config, self.pool, self.schema, self.arch
        index = None
        if config.kv_pool.enable_prefix_caching:
            try:
                policy = make_policy(config.policy.eviction, capacity=pool.num_blocks)
            except ValueError as err:
                raise ConfigError(f"policy.eviction: {err}") from None
            index = PrefixReuseIndex(schema.block_size, policy)
        block_manager = BlockManager(pool.num_blocks, schema.block_size, index)
        self.model_id = config.model.served_name or (DEMO_MODEL_NAME if config.model.path is None
                                                     else self.directory.name)
        self.extra_key = ExtraKeys(self.model_id, config.model.revision, self.auto.kv_dtype.value,
                                   schema.layout.value)
        quota = build_quota(config.quota, self.extra_key)
        if quota is not None:
            if index is None:
                raise ConfigError("quota: tenant quotas need kv_pool.enable_prefix_caching (they share cached "
                                  "blocks)")
            index.quota = quota
            quota.add_tier(DEVICE, pool.num_blocks)
        shape = ModelShape(num_layers=arch.num_layers, hidden=arch.hidden_size, num_kv_heads=arch.num_kv_heads,
                           head_dim=arch.head_dim,
                           dtype_bytes=schema.bytes_per_block / schema.num_layers / schema.elements_per_block_per_layer,
                           num_params=float(sum(p.numel() for p in self.model.parameters())))
        hierarchy = build_hierarchy(config, pool, shape, quota, host_bytes=self.host_bytes)
        self.load_rates = hierarchy.rates if hierarchy is not None else None
        # with KV groups: a block table per group; the tiers and transfers move each group's blocks a hit needs
        self.transfers = build_transfers(config, pool, self.device, self.extra_key, index, self.kv_groups)
        grouped = self.kv_groups is not None
        publish_kv_events(config, index, hierarchy, grouped=grouped)
        sources = kv_sources(config, hierarchy, self.transfers, grouped)
        self.kv = GroupKVCacheManager(block_manager, self.kv_groups, sources=sources) if grouped else \
            KVCacheManager(block_manager, sources=sources)

    def choose_attention(self) -> None:
        """The step's attention backend; with ``speculative.method: draft_model``, the draft's runner, which
        decodes the way the target's does."""
        config, model, arch, device, pool = self.config, self.model, self.arch, self.device, self.pool
        tokenizer, auto, fused, proposer = self.tokenizer, self.auto, self.fused, self.proposer
        deterministic = self.deterministic
        attention = build_attention(config, model, arch.head_dim, device, pool, deterministic)
        self.kinds = report_attention_kinds(model, attention, device, pool.block_size)
        if self.kinds and deterministic:
            raise ConfigError("model.deterministic is not built for models with sliding-window, soft-capped or sinks "
                              "layers", hint="set model.deterministic: false")
        if config.speculative.method == "draft_model":
            proposer = build_draft_proposer(config, arch, tokenizer, device, auto.model_dtype, pool.num_blocks,
                                            attention.decode_in_place, fused)
        self.attention, self.proposer = attention, proposer

    def make_scheduler(self) -> None:
        """Continuous batching over the KV cache, with the speculative proposer if one is configured."""
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.auto.max_model_len,
                                   self.tokenizer.eos_token_ids, proposer=self.proposer)
        if self.kv_groups is not None:  # a sliding group holds only its window: the pool bounds a sequence less
            alone = self.kv.max_tokens_alone(self.config.scheduler.max_num_batched_tokens)
            self.scheduler.max_total_tokens = self.auto.max_model_len if alone is None else \
                min(self.auto.max_model_len, alone)

    def choose_step(self) -> None:
        """The step executor (Python layers, fused elementwise ops, the C++ decode step, CUDA graphs), and
        cascade attention where the backend and `model.deterministic` allow it."""
        config, model, pool, device, attention = self.config, self.model, self.pool, self.device, self.attention
        fused, deterministic, proposer, schema = self.fused, self.deterministic, self.proposer, self.schema
        max_len = self.auto.max_model_len
        if not attention.supports_cascade and config.model.cascade_attention:
            _report(ResolvedValue("model.cascade_attention", "off", "the Triton kernels read each row's shared prefix "
                                                                    "in place"))
        step = step_executor("fused" if fused else "python")
        if use_decode_step(config.model.decode_step, model, pool, device, attention.decode_in_place, fused,
                           deterministic):
            rows = model.decode_step_rows() if hasattr(model, "decode_step_rows") else None
            step = step_executor("cpp-decode", model.prepare_decode_step(pool), rows)
        if self.kinds and config.model.cascade_attention:
            _report(ResolvedValue("model.cascade_attention", "off", "its kernels attend every shared key: no sliding "
                                                                    "window, soft-cap or sinks"))
        if use_cuda_graphs(config.model.cuda_graphs, device, attention.decode_in_place, self.kinds,
                           getattr(model, "is_moe", False)):
            step = step_executor("cuda-graphs", model, pool, device, config.scheduler.max_num_seqs,
                                 -(-max_len // schema.block_size), True, attention)
            if proposer is not None:
                auto_log.warning("speculative.method = %s: a step with verify rows runs without CUDA graphs (only pure "
                                 "decode steps replay one), so on a GPU speculation has measured slower than none "
                                 "(docs/spec_decode.md)", config.speculative.method)
        if deterministic and config.model.cascade_attention:
            _report(ResolvedValue("model.cascade_attention", "off", "model.deterministic: rows that share a prefix "
                                                                    "would reduce it apart from their own context"))
        self.step = step

    def engine(self) -> LLMEngine:
        """The runner over the model, the pool, the attention backend and the step executor; the engine."""
        config, model, pool, device = self.config, self.model, self.pool, self.device
        attention, step = self.attention, self.step
        runner = ModelRunner(model, pool, device, cascade_attention=config.model.cascade_attention and not self.kinds,
                             attention=attention, step=step, kv_groups=self.kv if self.kv_groups else None)
        kv_dtype = self.auto.kv_dtype.value
        pd = None
        if self.transfers is not None:
            pd = KVTransferRole(self.transfers, kv_schema_digest(self.schema, self.kv_groups), kv_dtype)
        parts = EngineParts(
            tokenizer=self.tokenizer,
            runner=runner,
            scheduler=self.scheduler,
            model_id=self.model_id,
            revision=config.model.revision,
            kv_dtype=kv_dtype,
            max_model_len=self.auto.max_model_len,
            device=device,
            extra_key=self.extra_key,
            pd=pd,
            decisions=tuple(self.decisions),
            load_rates=self.load_rates,
        )
        if self.load_rates is not None and not self.kv_groups:
            # load-or-compute prices a prompt's blocks from the first request on (not from an average rate)
            probe_prefill(runner, self.kv.block_manager, self.load_rates,
                          min(config.scheduler.max_num_batched_tokens, self.auto.max_model_len - 1),
                          model.config.vocab_size)
            auto_log.info("%s", describe_probe(self.load_rates))
        return LLMEngine(parts)


DRAFT_PROBE = "ROMEO: What light through yonder window breaks? 1,234.5 -- ¿qué? 日本語 \n\t<|end|>"


def draft_kv(config: ServeConfig, dtype: str) -> DraftKV | None:
    """What the draft model of ``speculative.method: draft_model`` takes from the KV budget (`resolve_num_blocks`),
    from its config.json and the headers of its weight files; None without a draft."""
    if config.speculative.method != "draft_model":
        return None
    try:
        directory = resolve_model_dir(config.speculative.model)
        schema = draft_kv_schema(arch_config(directory), config.kv_pool.block_size, dtype)
        elements = weight_elements(weight_files(directory))
    except (ModelLoadError, FileNotFoundError, ValueError) as err:
        raise ConfigError(f"speculative.model: {err}") from None
    return DraftKV(schema.bytes_per_block, elements * FLOAT_DTYPES[dtype].itemsize)


def draft_kv_schema(draft: ArchConfig, block_size: int, dtype: str) -> KVCacheSchema:
    """The draft pool's layout: the target's block size, the draft's KV in its compute dtype `dtype`."""
    return KVCacheSchema(draft.num_layers, draft.num_kv_heads, draft.head_dim, block_size).with_dtype(KVDtype(dtype))


def build_draft_proposer(config: ServeConfig, target: ArchConfig, tokenizer: Tokenizer, device: torch.device,
                         dtype: str, blocks: int, decode_in_place: bool, fused: bool) -> DraftModelProposer:
    """`speculative.method: draft_model`: the draft model (`speculative.model`) with a KV pool of its own of
    `blocks` blocks (the target pool's count, sized together with it by `resolve_num_blocks`), its KV in its compute
    dtype, decoding through the paged kernel where the target's does. A draft whose vocabulary or tokenizer is not
    the target's is refused with the reason."""
    spec = config.speculative
    try:
        directory = resolve_model_dir(spec.model)
        draft = arch_config(directory)
        draft_tokenizer = Tokenizer.from_dir(directory)
    except (ModelLoadError, FileNotFoundError, ValueError) as err:
        raise ConfigError(f"speculative.model: {err}") from None
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative.model: the draft's vocabulary has {draft.vocab_size} tokens, the target's "
                          f"{target.vocab_size}: a draft model must share the target's tokenizer")
    if (draft_tokenizer.encode(DRAFT_PROBE) != tokenizer.encode(DRAFT_PROBE)
            or set(draft_tokenizer.eos_token_ids) != set(tokenizer.eos_token_ids)):
        raise ConfigError(f"speculative.model: {directory.name} tokenizes text differently from the target (or ends "
                          "on other tokens): a draft model must share the target's tokenizer")
    model, draft, _ = load_model(directory, FLOAT_DTYPES[dtype], device)
    if device.type == "cpu" and config.model.linear != "torch" and packing_available():
        try:
            pack_linears(model)
        except RuntimeError:  # oneDNN cannot pack this dtype here: the draft's products stay on nn.Linear
            pass
    block_size = config.kv_pool.block_size
    pool = make_kv_pool(draft_kv_schema(draft, block_size, dtype), blocks, device=device)
    attention = attention_backend(decode="paged" if decode_in_place else "torch")
    runner = ModelRunner(model, pool, device, cascade_attention=False, attention=attention,
                         step=step_executor("fused" if fused else "python"))
    params = sum(p.numel() for p in model.parameters())
    _report(ResolvedValue("speculative.model", directory.name, f"draft model, {params / 1e6:.1f}M parameters, "
                          f"{spec.num_speculative_tokens} greedy tokens per step from its own KV pool of {blocks} "
                          f"blocks ({pool.nbytes / 2**20:.1f} MiB, as many as the target's: kv_pool.num_blocks)"))
    return DraftModelProposer(runner, BlockManager(blocks, block_size, None), spec.num_speculative_tokens,
                              spec.disable_by_batch_size, spec.adaptive)


def resolve_layer_loads(choice: str, pool: KVPool, grouped: bool) -> bool:
    """`kv_pool.layer_loads`: whether admission's loads reach `pool` layer by layer (`KVPool.enable_layer_loads`);
    reported like the other decided values. ConfigError where `on` cannot be honoured."""
    field = "kv_pool.layer_loads"
    why = None
    if pool.schema.dtype.is_quantized:
        why = f"a {pool.schema.dtype.value} pool's codes and scales load whole"
    elif grouped:
        why = "a model with KV groups loads its groups' blocks whole"
    elif pool.device.type == "cuda":
        why = triton_unavailable(pool.device)
    elif pool.device.type != "cpu":
        why = f"layer-wise loads are built for CUDA and CPU pools (device is {pool.device.type})"
    if choice == "on" and why is not None:
        raise ConfigError(f"{field}: on: {why}", hint="leave kv_pool.layer_loads at auto")
    if choice == "off":
        _report(ResolvedValue(field, "off", "set: loads are written whole before the step"))
        return False
    if why is not None:
        _report(ResolvedValue(field, "off", why))
        return False
    if choice == "auto" and pool.device.type == "cpu":
        _report(ResolvedValue(field, "off", "auto on a CPU pool: the engine thread makes the copies either way"))
        return False
    where = "on a copy stream beside the compute" if pool.device.type == "cuda" else "before each layer's attention"
    _report(ResolvedValue(field, "on", f"{choice}: loads are written layer by layer, {where}"))
    return True


def use_cpu_kernels() -> str | None:
    """Load the C++ CPU kernels of the level this CPU (or ``SAGE_CPU_ISA``) allows, and log which; None (and
    why, logged) when none can be used. ConfigError for a ``SAGE_CPU_ISA`` this CPU cannot run."""
    check_forced_level()
    level = kernel_level()
    if level is None:
        _report(ResolvedValue("cpu_kernels", "none", f"{kernel_unavailable()}: the model.* fast paths take the "
                                                     "PyTorch path"))
    else:
        _report(ResolvedValue("cpu_kernels", level.split(" (")[0], level.partition(" (")[2].removesuffix(")")))
    return level


def use_fused_elementwise(choice: str, device: torch.device, model: torch.nn.Module | None = None) -> bool:
    """`model.elementwise`: whether the model runs its norms, rotary and silu·mul as the C++ passes of
    `sage_infer.layers.elementwise.FusedOps` (a model whose `fused_elementwise_unavailable` says why not runs its own
    PyTorch ops)."""
    if choice == "torch":
        return False
    why = f"the fused ops are CPU-only (device is {device.type})" if device.type != "cpu" else kernel_unavailable()
    if why is None and hasattr(model, "fused_elementwise_unavailable"):
        why = model.fused_elementwise_unavailable()
    return _fast_path("model.elementwise", choice, why, "fused", "norms, rotary and silu*mul as one C++ pass each")


def build_attention(config: ServeConfig, model: torch.nn.Module, head_dim: int, device: torch.device,
                    pool: KVPool, deterministic: bool = False) -> AttentionBackend:
    """The step's attention backend (`sage_infer.layers.attention_backends`): the decode part `model.attention`
    asks for and the prefill part `model.prefill_attention` asks for, each where it can run here; with
    `deterministic`, every query row a decode row of the paged kernel (`AttentionBackend.row_invariant`)."""
    decode = "paged" if use_paged_attention(config.model.attention, pool, device) else "torch"
    prefill = "torch"
    if use_flash_attention(config.model.prefill_attention, model, head_dim, device, pool):
        prefill = "triton" if device.type == "cuda" else "flash_amx" if amx_flash_attention(model_dtype(model)) \
            else "flash"
    if deterministic and decode != "paged":
        raise ConfigError("model.deterministic: every query row goes through the paged decode kernel, which cannot "
                          "run here (model.attention is torch or the kernel is unavailable: see the line above)",
                          hint="set model.attention: auto, or model.deterministic: false")
    return attention_backend(decode, prefill, row_invariant=deterministic)


def report_attention_kinds(model: torch.nn.Module, attention: AttentionBackend, device: torch.device,
                           block_size: int) -> bool:
    """Whether `model` has layers other than plain causal attention (a sliding window, soft-capped scores, attention
    sinks); if so, a decided line says which, and how `attention` runs them (`AttentionBackend.kind_routes`: each
    part's kernel, or PyTorch and why)."""
    kinds = [m.kind for m in model.modules() if isinstance(getattr(m, "kind", None), AttentionKind)]
    special: dict[str, int] = {}
    for kind in kinds:
        if not kind.plain:
            special[kind.describe()] = special.get(kind.describe(), 0) + 1
    if not special:
        return False
    full = len(kinds) - sum(special.values())
    layers = "; ".join(f"{count} x {what}" for what, count in special.items()) + (f"; {full} x full" if full else "")
    how = attention.kind_routes([kind for kind in kinds if not kind.plain], device, block_size)
    if full:
        how.append("full layers run the parts the backend chose")
    _report(ResolvedValue("model.layer_attention", layers, "; ".join(["config.json", *how])))
    return True


def use_paged_attention(choice: str, pool: KVPool, device: torch.device) -> bool:
    """`model.attention`: whether decode rows read K/V in place through the paged kernel."""
    if choice == "torch":
        return False
    if not pool.supports_block_views and not (pool.supports_int8_block_views and device.type == "cpu"):
        why = (f"kv_dtype {pool.schema.dtype.value} is quantized (the kernels read float blocks, and int8 ones "
               f"on a CPU)")
    elif device.type == "cuda":
        why = triton_unavailable(device)
    elif device.type != "cpu":
        why = f"the kernel runs on CPUs (C++) and NVIDIA GPUs (Triton); device is {device.type}"
    else:
        why = kernel_unavailable()
    kernel = "Triton" if device.type == "cuda" else "C++"
    return _fast_path("model.attention", choice, why, "paged", f"decode reads KV blocks in place: {kernel} kernel")


def use_decode_step(choice: str, model: torch.nn.Module, pool: KVPool, device: torch.device,
                    decode_in_place: bool, fused: bool, deterministic: bool = False) -> bool:
    """`model.decode_step`: whether decode steps (every row one new token, with or without a prefix all rows
    share) run every decoder layer in one C++ call (`LlamaForCausalLM.prepare_decode_step`)."""
    if choice == "python":
        return False
    if deterministic:
        why = "model.deterministic: a pure decode step must run the kernels a mixed step runs"
    elif device.type != "cpu":
        why = f"the C++ decode step is CPU-only (device is {device.type})"
    elif not decode_in_place:
        why = "it chains the paged decode kernel (model.attention is torch or cannot run)"
    else:
        why = model.decode_step_unavailable(pool, fused)
    rows = model.decode_step_rows() if why is None and hasattr(model, "decode_step_rows") else None
    detail = "a decode step's layers in one C++ call" + (
        f" (steps of up to {rows} rows: the experts' kernel call; larger ones layer by layer)" if rows else "")
    return _fast_path("model.decode_step", choice, why, "sage", detail, reference="python")


def use_cuda_graphs(choice: str, device: torch.device, decode_in_place: bool, kinds: bool = False,
                    moe: bool = False) -> bool:
    """`model.cuda_graphs`: whether pure decode steps replay CUDA graphs (`sage_infer.engine.steps.cuda_graphs`)."""
    if choice == "off":
        return False
    if kinds:
        why = ("capturing the kernels of sliding-window, soft-capped or sinks layers in a graph is not built yet "
               "(they run without graphs)")
    elif moe:
        why = "a mixture-of-experts layer sizes its expert products from the step's routing (shapes a graph cannot fix)"
    elif device.type != "cuda" or torch.version.cuda is None:
        why = f"CUDA graphs need an NVIDIA CUDA device (device is {device.type})"
    elif not decode_in_place:
        why = "CUDA graphs need model.attention paged (the Triton kernel: the torch path's shapes change every step)"
    else:
        why = None
    return _fast_path("model.cuda_graphs", choice, why, "on", "pure decode steps replay a CUDA graph per batch bucket",
                      reference="off")


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter."""
    return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)


def use_flash_attention(choice: str, model: torch.nn.Module, head_dim: int, device: torch.device,
                        pool: KVPool) -> bool:
    """`model.prefill_attention`: whether prefill chunks run sage's kernel: on a CPU the flash kernel (bf16 or
    fp32 models; shared prefixes too), on an NVIDIA GPU the Triton prefill kernel over the pool's blocks."""
    if choice == "torch":
        return False
    if device.type == "cuda":
        why = triton_unavailable(device)
        if why is None and not pool.supports_block_views:
            why = f"kv_dtype {pool.schema.dtype.value} is quantized (the kernel reads float blocks)"
        return _fast_path("model.prefill_attention", choice, why, "sage",
                          "Triton kernel: every prefill span in one launch per layer, K/V read in place")
    dtype = model_dtype(model)
    if device.type != "cpu":
        why = f"the kernels run on CPUs (C++) and NVIDIA GPUs (Triton); device is {device.type}"
    elif dtype not in (torch.bfloat16, torch.float32):
        why = f"the kernel is bf16 or fp32 only (the model is {dtype_name(dtype)})"
    else:
        why = flash_unavailable(head_dim, dtype)
    kind = flash_kernel(dtype) if why is None else "the CPU flash kernel"
    if why is None and amx_flash_attention(dtype):
        kind = ("PyTorch's CPU flash kernel on AMX tiles for plain layers (3-5x sage's bf16 kernel on such a CPU), "
                f"sage's {kind} for windowed, soft-capped and sink layers")
    return _fast_path("model.prefill_attention", choice, why, "sage", kind)


def _fast_path(field: str, choice: str, why: str | None, fast: str, detail: str, reference: str = "torch") -> bool:
    """Decide an ``auto | <fast> | <reference>`` field (`config.auto.resolve_fast_path`), log it, and say whether
    the fast path runs."""
    return _report(resolve_fast_path(field, choice, why, fast, detail, reference)).value == fast


def _report(value: ResolvedValue) -> ResolvedValue:
    """Log a decided value as `sage llm serve` prints them: ``field = value (reason)``; while an `EngineBuilder`
    builds, it keeps the value too."""
    auto_log.info("%s", value.line())
    decisions = _DECISIONS.get()
    if decisions is not None:
        decisions.append(value)
    return value


def use_deterministic(model_config, model: torch.nn.Module, device: torch.device) -> bool:
    """`model.deterministic`: wrap every linear layer in `RowTiledLinear` (fixed-row products); the runner then
    sends every query row through the paged decode kernel (`build_engine`). CPU only."""
    if not model_config.deterministic:
        return False
    if device.type != "cpu":
        raise ConfigError(f"model.deterministic: batch-invariant steps are built for CPU devices (device is "
                          f"{device.type})", hint="leave model.deterministic at false")
    for module in model.modules():  # MoE experts: one linear pair each, so that each is row-tiled too
        if hasattr(module, "split_linears"):
            module.split_linears()
    tile_linears(model, DETERMINISTIC_ROWS)
    _report(ResolvedValue("model.deterministic", "on", f"{describe_tiling(model)}; every query row on the paged "
                                                       "decode kernel"))
    return True


def use_huge_pages(model: torch.nn.Module) -> int:
    """`model.huge_pages`: collapse the packed weights of `model` into 2 MiB pages; the bytes collapsed
    (logged with the time it took, or why it could not)."""
    ranges = [(torch.ops.mkldnn.data_ptr(m.packed), torch.ops.mkldnn._nbytes(m.packed)) for m in model.modules()
              if isinstance(m, PackedLinear)]
    if not ranges:
        return 0
    start = time.perf_counter()
    done, why = collapse_to_huge_pages(ranges)
    total = sum(n for _, n in ranges)
    if done:
        auto_log.info("model.huge_pages = on (%.0f MB of packed weights, %.0f MB of 2 MiB pages, %.1f s%s)",
                      total / 1e6, done / 1e6, time.perf_counter() - start, f"; some failed: {why}" if why else "")
    else:
        auto_log.info("model.huge_pages: no effect here: %s", why or "no packed weight of 1 MiB or more")
    return done


def use_host_malloc(choice: str, device: torch.device) -> bool:
    """`model.host_malloc`: on a CPU device, keep freed activation buffers in glibc's heap for the next
    step (`sage_infer.hal.malloc`). Whether the thresholds were raised; logged either way."""
    if choice == "system" or device.type != "cpu":
        return False
    why = keep_freed_buffers()
    _report(ResolvedValue("model.host_malloc", "keep", "glibc reuses freed buffers up to 32 MiB") if why is None
            else ResolvedValue("model.host_malloc", "system", f"keep has no effect here: {why}"))
    return why is None


def use_packed_linears(model: torch.nn.Module, choice: str, device: torch.device, decode: str = "auto") -> None:
    """`model.linear`: swap nn.Linear for oneDNN-packed ones, and the quantized linears of a quantized
    checkpoint for the CPU int8 / int4 kernels, where asked for (or auto and possible). `model.decode_linear`
    (`decode`): whether the packed bf16 layers run their products of a few rows through sage's kernel.

    torch keeps both on their reference paths (nn.Linear; QuantLinear: dequantize, then F.linear).
    Quantized layers are never repacked as bf16: only the unquantized ones (lm_head, say) are.
    """
    if choice == "torch":
        if decode == "sage":
            raise ConfigError("model.decode_linear: sage runs on packed weights; model.linear is torch",
                              hint="set model.linear: auto or packed, or leave model.decode_linear at auto")
        return
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        dtype = model_dtype(model)
        swapped, kept = use_quant_kernels(model, dtype)
        if swapped or kept:
            auto_log.info("model.linear: %d quantized linear layers on CPU int8/int4 kernels%s", swapped,
                          f", {kept} on the reference path (no faster kernel for their scheme with "
                          f"{dtype_name(dtype)} activations)" if kept else "")
    possible = on_cpu and packing_available()
    if not possible:
        if decode == "sage":
            raise ConfigError(f"model.decode_linear: sage runs on oneDNN-packed weights, which need a CPU device "
                              f"and a torch with oneDNN (device is {device})", hint="leave model.decode_linear at auto")
        if choice == "packed":
            raise ConfigError(f"model.linear: packed needs a CPU device and a torch with oneDNN (device is "
                              f"{device}, oneDNN {'present' if packing_available() else 'missing'}); use auto or torch")
        return
    # q/k/v and gate/up stacked first, so each pair or triple is packed as one wider GEMM
    fused = model.fuse_projections() if hasattr(model, "fuse_projections") else 0
    small_why = small_linear_why(decode, dtype)
    if decode == "sage" and small_why is not None:
        _fast_path("model.decode_linear", decode, small_why, "sage", "", "onednn")  # raises, before packing
    small_rows = SMALL_LINEAR_ROWS if decode != "onednn" and small_why is None else 0
    tied = tied_linear_bytes(model)
    try:
        count = pack_linears(model, small_rows)
    except RuntimeError as err:  # oneDNN cannot pack this dtype here (fp16 without AVX512-FP16, say)
        if decode == "sage":
            raise ConfigError(f"model.decode_linear: sage: oneDNN cannot pack these weights here: {err}") from None
        if choice == "packed":
            raise ConfigError(f"model.linear: packed: oneDNN cannot pack these weights here: {err}") from None
        _report(ResolvedValue("model.linear", "torch", f"auto: oneDNN cannot pack these weights here: {err}"))
        return
    why = "set explicitly" if choice == "packed" else "auto: a CPU with oneDNN"
    tied_note = f"; the lm_head tied to the embedding as a copy, +{tied / 1e6:.0f} MB" if tied else ""
    _report(ResolvedValue("model.linear", "packed", f"{why}; {count} linear layers prepacked, {fused} of them q/k/v "
                                                    f"or gate/up stacked{tied_note}"))
    if decode == "onednn":
        return
    on_kernel = [m for m in model.modules() if isinstance(m, PackedLinear) and m.small_rows > 0]
    if small_why is None and not on_kernel:  # oneDNN packed them in another layout: never on this CPU so far
        small_why = "oneDNN packed no layer in the kernel's layout here"
    amx = any(m._block_rows == 32 for m in on_kernel)
    note = " (oneDNN packs for AMX tiles here, and its own products win from 4 rows)" if amx else ""
    _fast_path("model.decode_linear", decode, small_why, "sage", f"bf16 products of up to "
               f"{SMALL_LINEAR_ROWS_AMX if amx else SMALL_LINEAR_ROWS} rows on sage's kernel{note}: "
               f"{len(on_kernel)} of {count} packed layers", "onednn")


def small_linear_why(choice: str, dtype: torch.dtype) -> str | None:
    """Why sage's small-row kernel (`model.decode_linear`) cannot run the packed layers of `dtype` here; None
    when it can (or is not wanted: onednn)."""
    if choice == "onednn":
        return None
    if dtype != torch.bfloat16:
        return f"the kernel is bf16-only (the model is {dtype_name(dtype)})"
    return small_linear_unavailable()


def use_kv_groups(arch: ArchConfig, block_size: int) -> KVGroups | None:
    """The model's KV groups when some layer has a sliding window (a block table per group; the window's blocks
    only), with a decided line saying which; None for a model whose every layer attends fully (one table)."""
    groups = kv_groups(arch.layer_windows or (None,) * arch.num_layers)
    if not groups.per_group:
        return None
    kinds = "; ".join(f"{group.kind}: layers {','.join(map(str, group.layers))}" for group in groups.groups)
    _report(ResolvedValue("kv_pool.kv_groups", len(groups.groups),
                          f"a block table per group, {groups.layers_per_block} layers a block ({kinds}); a sliding "
                          f"group keeps only the blocks its window reaches"))
    return groups


def seat_tokens_of_groups(groups: KVGroups, max_model_len: int, config: ServeConfig) -> int:
    """Tokens of blocks one sequence at full context holds over all groups (what sizes a seat of the pool): every
    token in a full group, the window and a chunk in a sliding one."""
    chunk = config.scheduler.max_num_batched_tokens
    bs = config.kv_pool.block_size
    return sum(max_model_len if group.window is None else
               min(max_model_len, (-(-group.window // bs) + 1) * bs + chunk) for group in groups.groups)


PD_BACKENDS = ("shm", "tcp", "torchdist")  # what the KV pipe can run on today


def build_transfers(config: ServeConfig, pool: KVPool, device: torch.device, extra_key,
                    index: PrefixReuseIndex | None, groups: KVGroups | None = None) -> KVTransfers | None:
    """A prefill or decode instance's KV pipe and transfers, from `config.kv_transport` (joining the process
    group first for torchdist); None for an engine that does both. `groups`: the model's KV groups (each group's
    blocks a hit needs travel, `GroupKVTransfers`). A prefill instance logs its prefix cache's events: the router
    follows what it holds."""
    if config.role == "both":
        return None
    transport = config.kv_transport
    backend = "shm" if transport.backend == "auto" else transport.backend
    if backend not in PD_BACKENDS:
        raise ConfigError(f"kv_transport.backend: {backend} does not carry prefill/decode KV yet; use shm (one "
                          f"host), tcp or torchdist")
    if index is None:
        raise ConfigError("prefill/decode separation needs kv_pool.enable_prefix_caching (received KV is "
                          "registered under its block hashes)")
    group = ""
    if backend == "torchdist":
        joined = join_process_group(transport.process_group, device)
        group = (f", rank {joined.rank} of {joined.world_size} in a {joined.backend} process group"
                 + (f" at {joined.init_method}" if joined.init_method else ""))
    # target_dtype: blocks cross in that KV dtype (the pool's codec) and the decode side converts them back
    wire = KVDtype(transport.target_dtype) if transport.target_dtype is not None else None
    schema = pool.schema.with_dtype(wire) if wire is not None else pool.schema
    pipe = KVPipe(schema, transport, backend=backend, listen=config.role == "decode")
    if groups is None:
        transfers = KVTransfers(pipe, pool, pool.block_size, transport.timeout_s, extra_key=extra_key, wire_dtype=wire)
    else:
        transfers = GroupKVTransfers(pipe, pool, pool.block_size, transport.timeout_s, extra_key=extra_key,
                                     wire_dtype=wire, groups=groups)
    where = f", receiving at {pipe.address}" if pipe.address else ""
    auto_log.info("role = %s (KV over %s%s as %s, %d KiB chunks, %s s deadline%s)", config.role, backend, group,
                  schema.dtype.value, int(transport.chunk_size) // 1024, f"{transport.timeout_s:g}", where)
    return transfers


def publish_kv_events(config: ServeConfig, index: PrefixReuseIndex | None,
                      hierarchy: HierarchyManager | None, grouped: bool = False) -> None:
    """Log which blocks this engine holds, in which tier, for KV-aware routers (`prefix_reuse.events`): on every
    instance that computes prompts (role both or prefill) with prefix caching on; a decode worker's cache is
    not routed on. `grouped`: the engine keeps KV groups, and every event names its group."""
    if index is None or config.role == "decode":
        return
    events = index.enable_events()
    events.grouped = grouped
    for tier in hierarchy.migration.tiers if hierarchy is not None else ():
        events.add_medium(tier.name, tier.blocks.keys)
        tier.listener = lambda op, key, medium=tier.name: (events.stored if op == "stored" else events.removed)(
            key, medium)
    if hierarchy is not None and hierarchy.shared_level is not None:
        shared = hierarchy.migration.tiers[hierarchy.shared_level - 1].name
        hierarchy.on_shared_copy = lambda key: events.stored(key, shared)


def kv_sources(config: ServeConfig, hierarchy: HierarchyManager | None, transfers: KVTransfers | None,
               grouped: bool = False) -> list[KVSource]:
    """What `KVCacheManager` takes prompt blocks from past the device, in the order it asks them: received
    transfers first (a request they claim is never served from the tiers), then the lower tiers, which claim
    every other request. `grouped`: the sources of a block table per KV group."""
    sources: list[KVSource] = []
    if transfers is not None:
        sources.append(GroupTransferSource(transfers) if grouped else TransferSource(transfers))
    if hierarchy is not None:
        tiers = GroupTierSource if grouped else TierSource
        sources.append(tiers(hierarchy, config.tiers.load_timeout_s, config.tiers.flush_on_shutdown_s))
    return sources


def build_hierarchy(config: ServeConfig, pool: KVPool, shape: ModelShape | None = None,
                    quota: QuotaManager | None = None, host_bytes: int | None = None) -> HierarchyManager | None:
    """The lower KV tiers `config.tiers` asks for, fastest first (host, disk, remote); None without any.

    Each tier is placed by the same `MigrationPolicy` the replay simulator uses, ordered by the
    device's eviction policy. With a hardware preset, its `CostBenefitModel` (the preset's link
    bandwidths and FLOPs, this model's shape) decides whether an evicted block is worth keeping
    in a tier at all; without one every evicted block is kept. A remote tier that cannot be
    reached now is a start-up error.
    """
    tiers = config.tiers
    if host_bytes is None:  # resolved by the caller; here: as set, and auto means none
        host_bytes = 0 if tiers.host_bytes == "auto" else int(tiers.host_bytes)
    stores = []
    try:
        if host_bytes:
            stores.append(HostTier(pool.schema, host_bytes))
        if tiers.disk_path is not None:
            if not tiers.disk_bytes:
                raise ConfigError("tiers.disk_bytes: set a size cap for the disk tier at tiers.disk_path")
            stores.append(DiskTier(pool.schema, tiers.disk_path, int(tiers.disk_bytes)))
        if tiers.remote_url is not None:
            remote_tier = MooncakeTier if tiers.remote_url.startswith("mooncake://") else RedisTier
            remote = remote_tier(pool.schema, tiers.remote_url, int(tiers.remote_bytes))
            stores.append(remote)
            remote.contains([bytes(32)])  # reach it now: a wrong URL fails at start, not on the first eviction
    except (TierError, OSError) as err:
        for store in stores:
            store.close()
        raise ConfigError(f"tiers: {err}") from None
    if not stores:
        return None
    if not config.kv_pool.enable_prefix_caching:
        raise ConfigError("tiers: KV tiers need kv_pool.enable_prefix_caching (blocks are found by their hash)")
    cost = CostBenefitModel(config.hardware, shape) if config.hardware is not None and shape is not None else None
    hierarchy = HierarchyManager.build(pool, stores, lambda capacity: make_policy(config.policy.eviction,
                                                                                  capacity=capacity), cost, quota)
    if quota is not None and isinstance(remote := stores[-1], (RedisTier, MooncakeTier)):  # shared: fleet-wide
        quota.share_fleet_wide(ROLE["redis"], remote.tenant_shares(lambda: quota.local_blocks(ROLE["redis"])))
    hierarchy.migrator.hot_after = tiers.hot_promote_after
    hierarchy.write_policy = tiers.write_policy
    hierarchy.remote_write_through = tiers.remote_write_policy == "write_through"
    # a tier hit is loaded where that is faster; each tier's read speed measured now, before a request needs it
    scheduler = config.scheduler  # a prompt computed in chunks of this many tokens: a load spares steps
    hierarchy.rates = LoadOrCompute(pool.block_size, pool.block_nbytes, shape,
                                    scheduler.max_num_batched_tokens if scheduler.enable_chunked_prefill else None)
    reads = probe_reads(hierarchy)
    if reads:
        auto_log.info("tier reads measured at start: %s", ", ".join(f"{name} {rate / 1e9:.2f} GB/s"
                                                                    for name, rate in reads.items()))
    auto_log.info("%s", hierarchy.describe())
    return hierarchy
