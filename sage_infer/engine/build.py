"""Assemble an `LLMEngine` from a resolved `ServeConfig`: model, tokenizer, KV pool,
block manager with its prefix index and policy, scheduler."""

from __future__ import annotations

from pathlib import Path

import torch

from sage_infer.config.serve import ServeConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.engine.llm_engine import EngineParts, LLMEngine
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.errors import ConfigError
from sage_infer.kv_policy import make_policy
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.models.loader import ModelLoadError, load_model
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from sage_infer.scheduler.scheduler import Scheduler

DEMO_MODEL_NAME = "sage-demo"
MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPE_OF = {torch.float32: KVDtype.FP32, torch.bfloat16: KVDtype.BF16, torch.float16: KVDtype.FP16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _available_kv_bytes(device: torch.device, schema: KVCacheSchema, config: ServeConfig, max_len: int) -> int:
    """Bytes the pool may use when neither num_blocks nor memory_budget is set.

    CUDA: free device memory after the model loaded. CPU: enough blocks for every
    seat at full context, never more than the memory the OS reports available.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    wanted = config.scheduler.max_num_seqs * (max_len + schema.block_size) // schema.block_size
    wanted_bytes = int(wanted * schema.bytes_per_block / config.kv_pool.memory_utilization)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(wanted_bytes, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return wanted_bytes


def build_engine(config: ServeConfig, device: str | torch.device | None = None) -> LLMEngine:
    device = torch.device(device) if device is not None else default_device()
    dtype = None if config.model.dtype == "auto" else MODEL_DTYPES[config.model.dtype]
    model, arch, directory = load_model(config.model.path, dtype, device)
    model_dtype = next(model.parameters()).dtype
    try:
        tokenizer = Tokenizer.from_dir(directory)
    except (FileNotFoundError, ValueError) as err:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {err}") from None

    max_len = arch.max_position_embeddings
    if arch.sliding_window:  # attention within the window equals full attention up to it
        max_len = min(max_len, arch.sliding_window)
    if config.model.max_model_len:
        if config.model.max_model_len > max_len:
            raise ConfigError(f"model.max_model_len: {config.model.max_model_len} exceeds what the model "
                              f"supports ({max_len})")
        max_len = config.model.max_model_len

    kv_dtype = KV_DTYPE_OF[model_dtype] if config.kv_pool.kv_dtype == "auto" else KVDtype(config.kv_pool.kv_dtype)
    if kv_dtype.is_quantized:
        raise ConfigError(f"kv_pool.kv_dtype: {kv_dtype.value} KV cache is not implemented yet (use auto, fp16, "
                          "bf16 or fp32)")
    schema = KVCacheSchema(arch.num_layers, arch.num_kv_heads, arch.head_dim, config.kv_pool.block_size, kv_dtype)
    available = None
    if config.kv_pool.num_blocks is None and config.kv_pool.memory_budget is None:
        available = _available_kv_bytes(device, schema, config, max_len)
    try:
        pool = KVPool.from_config(schema, config.kv_pool, device, available_bytes=available)
    except ValueError as err:
        raise ConfigError(f"kv_pool: {err}") from None

    index = None
    if config.kv_pool.enable_prefix_caching:
        try:
            policy = make_policy(config.policy.eviction, capacity=pool.num_blocks)
        except ValueError as err:
            raise ConfigError(f"policy.eviction: {err}") from None
        index = PrefixReuseIndex(schema.block_size, policy)
    block_manager = BlockManager(pool.num_blocks, schema.block_size, index)
    scheduler = Scheduler(config.scheduler, KVCacheManager(block_manager), max_len, tokenizer.eos_token_ids)
    parts = EngineParts(
        tokenizer=tokenizer,
        runner=ModelRunner(model, pool, device),
        scheduler=scheduler,
        model_id=config.model.served_name or (DEMO_MODEL_NAME if config.model.path is None else directory.name),
        revision=config.model.revision,
        kv_dtype=kv_dtype.value,
        max_model_len=max_len,
        device=device,
    )
    return LLMEngine(parts)
