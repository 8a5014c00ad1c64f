"""lmdeploy: the resolved `ServeConfig` as a TurboMind or PyTorch engine config.

UNTESTED against lmdeploy itself: its wheels need CUDA, which this project's machines do
not have, so only the translation is built (and unit-tested as data); the engine adapter
(`create`) is not, and `sage infer backends:list` says so. The fields are lmdeploy's
documented `TurbomindEngineConfig` and `PytorchEngineConfig` (lmdeploy/messages.py):
``dtype`` (auto | float16 | bfloat16), ``session_len``, ``max_batch_size``,
``cache_max_entry_count`` (share of FREE device memory for KV, in (0, 1)),
``cache_block_seq_len`` (TurboMind) / ``block_size`` and ``num_gpu_blocks`` (PyTorch),
``max_prefill_token_num``, ``enable_prefix_caching``, ``quant_policy`` (0, or 4 / 8 for
int4 / int8 KV) and, for PyTorch, ``device_type`` (cuda | ascend | maca | camb).
Nothing here imports lmdeploy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sage_infer.backends.native_only import refuse_native_only
from sage_infer.config.auto import ModelFacts, ResolvedValue, resolve_max_model_len, resolve_model_dtype
from sage_infer.config.serve import ServeConfig
from sage_infer.core.dtypes import HF_DTYPE_NAMES
from sage_infer.errors import ConfigError

Engine = Literal["turbomind", "pytorch"]
# lmdeploy computes in 16 bits only, and spells them as config.json does
LMDEPLOY_DTYPES = {sage: theirs for theirs, sage in HF_DTYPE_NAMES.items() if sage != "fp32"}
QUANT_POLICY = {"int8": 8, "int4": 4}  # lmdeploy's online KV quantization (per token and head)
# torch device type (hardware preset) -> PytorchEngineConfig.device_type
PYTORCH_DEVICE_TYPES = {"cuda": "cuda", "npu": "ascend", "mlu": "camb"}
DEFAULT_BLOCK_SIZE = 64  # both engines' default (cache_block_seq_len, block_size)
CAMB_BLOCK_SIZE = 16  # lmdeploy forces 16 on Cambricon


@dataclass(frozen=True, slots=True)
class LMDeployEngineConfig:
    """Which lmdeploy engine, its config's keyword arguments, and why each value is what it is."""

    engine: Engine
    kwargs: dict[str, object]
    values: list[ResolvedValue] = field(default_factory=list)


def lmdeploy_engine_config(config: ServeConfig, facts: ModelFacts,
                           engine: Engine | None = None) -> LMDeployEngineConfig:
    """Translate `config` (see the module doc). `engine` None: TurboMind on CUDA, the PyTorch
    engine elsewhere (Ascend, Cambricon). Raises `ConfigError` for the first setting lmdeploy
    cannot honour."""
    refuse_native_only(config, "lmdeploy")
    device = _device(config)
    engine = engine or ("turbomind" if device.value == "cuda" else "pytorch")
    if engine == "turbomind" and device.value != "cuda":
        raise ConfigError(f"preset: lmdeploy's TurboMind engine runs on CUDA only, not {device.value}")
    values = [device, ResolvedValue("backend.engine", engine, "TurboMind on CUDA, the PyTorch engine elsewhere")]
    kwargs: dict[str, object] = {}
    if engine == "pytorch":
        kwargs["device_type"] = PYTORCH_DEVICE_TYPES[device.value]

    dtype = _dtype(config, facts)
    kwargs["dtype"] = LMDEPLOY_DTYPES[dtype.value]
    values.append(dtype)
    max_len = resolve_max_model_len(config, facts)
    kwargs["session_len"] = max_len.value
    values.append(max_len)

    wanted = config.kv_pool.kv_dtype
    wanted = getattr(wanted, "value", wanted)
    if wanted in ("auto", dtype.value):
        kwargs["quant_policy"] = 0
    elif wanted in QUANT_POLICY:
        kwargs["quant_policy"] = QUANT_POLICY[wanted]
        values.append(ResolvedValue("kv_pool.kv_dtype", wanted, f"set explicitly: quant_policy={QUANT_POLICY[wanted]}"))
    else:
        raise ConfigError(f"kv_pool.kv_dtype: {wanted}: lmdeploy stores KV in the model's dtype or as int8 / int4 "
                          "(quant_policy 8 / 4)")

    block = _block_size(config, kwargs.get("device_type"))
    kwargs["cache_block_seq_len" if engine == "turbomind" else "block_size"] = block.value
    values.append(block)
    kwargs["enable_prefix_caching"] = config.kv_pool.enable_prefix_caching

    pool = config.kv_pool
    if pool.num_blocks is not None or pool.memory_budget is not None:
        if engine == "turbomind":
            field_name = "kv_pool.num_blocks" if pool.num_blocks is not None else "kv_pool.memory_budget"
            raise ConfigError(f"{field_name}: TurboMind sizes its KV cache as a share of free device memory only",
                              hint="set kv_pool.memory_utilization instead")
        if pool.num_blocks is None:
            raise ConfigError("kv_pool.memory_budget: lmdeploy takes a block count (num_gpu_blocks) or a share of "
                              "free memory, not bytes", hint="set kv_pool.num_blocks or kv_pool.memory_utilization")
        kwargs["num_gpu_blocks"] = pool.num_blocks
    if not 0 < pool.memory_utilization < 1:
        raise ConfigError(f"kv_pool.memory_utilization: lmdeploy's cache_max_entry_count must be below 1, got "
                          f"{pool.memory_utilization}")
    kwargs["cache_max_entry_count"] = pool.memory_utilization

    scheduler = config.scheduler
    if scheduler.strategy != "fifo":
        raise ConfigError(f"scheduler.strategy: {scheduler.strategy}: lmdeploy schedules in arrival order only")
    if not scheduler.enable_chunked_prefill:
        raise ConfigError("scheduler.enable_chunked_prefill: lmdeploy always splits prefills by "
                          "max_prefill_token_num (scheduler.max_num_batched_tokens)")
    if scheduler.long_prefill_token_threshold:
        raise ConfigError(f"scheduler.long_prefill_token_threshold: {scheduler.long_prefill_token_threshold}: "
                          "lmdeploy has no per-request cap on prefill tokens per step", hint="set it to 0")
    if scheduler.short_prefill_first:
        raise ConfigError("scheduler.short_prefill_first: lmdeploy has no option to hold long prompts back for "
                          "short ones", hint="set it to false")
    kwargs["max_batch_size"] = scheduler.max_num_seqs
    kwargs["max_prefill_token_num"] = scheduler.max_num_batched_tokens
    return LMDeployEngineConfig(engine, kwargs, values)


def _device(config: ServeConfig) -> ResolvedValue:
    hardware = config.hardware
    if hardware is None:
        return ResolvedValue("device", "cuda", "no hardware preset resolved: lmdeploy's default, CUDA")
    wanted = hardware.device.torch_device_type
    if wanted not in PYTORCH_DEVICE_TYPES:
        raise ConfigError(f"preset: {hardware.name} runs on device {wanted}; lmdeploy runs on "
                          f"{', '.join(PYTORCH_DEVICE_TYPES)} only")
    return ResolvedValue("device", wanted, f"hardware preset {hardware.name}: device.torch_device_type={wanted}")


def _dtype(config: ServeConfig, facts: ModelFacts) -> ResolvedValue:
    chosen = resolve_model_dtype(config, facts)
    if chosen.value in LMDEPLOY_DTYPES:
        return chosen
    if config.model.dtype != "auto":
        raise ConfigError(f"model.dtype: {chosen.value}: lmdeploy computes in float16 or bfloat16 only")
    return ResolvedValue("model.dtype", "fp16", "auto: the checkpoint is fp32, which lmdeploy does not run; fp16, "
                         "lmdeploy's own choice for fp32 checkpoints")


def _block_size(config: ServeConfig, device_type: object) -> ResolvedValue:
    explicit = "block_size" in config.kv_pool.model_fields_set
    size = config.kv_pool.block_size
    if device_type == "camb":
        if explicit and size != CAMB_BLOCK_SIZE:
            raise ConfigError(f"kv_pool.block_size: {size}: lmdeploy on Cambricon runs {CAMB_BLOCK_SIZE} only")
        return ResolvedValue("kv_pool.block_size", CAMB_BLOCK_SIZE, "lmdeploy's only size on Cambricon")
    if not explicit:
        return ResolvedValue("kv_pool.block_size", DEFAULT_BLOCK_SIZE, "auto: lmdeploy's default")
    return ResolvedValue("kv_pool.block_size", size, "set explicitly")
