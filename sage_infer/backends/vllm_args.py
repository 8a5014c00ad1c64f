"""The resolved `ServeConfig` as vLLM engine arguments, in one visible function.

`vllm_engine_args` is pure data (it imports no vLLM), so what `--backend vllm` asks of
vLLM is unit-tested without vLLM installed. Each decision comes back as a
`ResolvedValue` line that `sage llm serve` prints at start-up; a setting vLLM cannot
honour is a `ConfigError` naming the field, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sage_infer.backends.native_only import refuse_native_only
from sage_infer.config.auto import (
    ModelFacts,
    ResolvedValue,
    resolve_max_model_len,
    resolve_model_dtype,
    resolve_num_blocks,
)
from sage_infer.config.serve import ServeConfig
from sage_infer.core.dtypes import HF_DTYPE_NAMES
from sage_infer.errors import ConfigError

VLLM_DTYPES = {sage: theirs for theirs, sage in HF_DTYPE_NAMES.items()}  # vLLM spells them as config.json
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# sage KV dtype -> vLLM cache_dtype, where vLLM stores the same thing
VLLM_KV_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
# vLLM 0.32's CPU attention (CPUAttentionBackend.supported_kv_cache_dtypes): auto (the model's dtype) or fp8
CPU_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")
CPU_DEFAULT_BLOCK_SIZE = 128  # vLLM's default on CPU (CpuPlatform.check_and_update_config)
CPU_BLOCK_MULTIPLE = 32  # CPUAttentionBackend kernel block sizes: multiples of 32
SCHEDULING_POLICIES = {"fifo": "fcfs", "priority": "priority"}


@dataclass(frozen=True, slots=True)
class VLLMModel:
    """What the translation needs to know of the model, read from config.json (no weights)."""

    path: str  # the local HF directory vLLM loads
    name: str  # the id the API serves it under
    facts: ModelFacts  # checkpoint dtype, max_position_embeddings, sliding window
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class VLLMEngineArgs:
    """Keyword arguments of `vllm.AsyncEngineArgs`, and why each value is what it is."""

    kwargs: dict[str, object]
    values: list[ResolvedValue] = field(default_factory=list)
    max_model_len: int = 0


def vllm_engine_args(config: ServeConfig, model: VLLMModel, platform: str,
                     host_available_bytes: int | None = None, pd_port: int | None = None) -> VLLMEngineArgs:
    """Translate `config` for vLLM running on `platform` (vLLM's device type: cpu, cuda, npu, ...).

    `host_available_bytes` (MemAvailable) caps the KV budget on CPU the way the native engine
    does. `pd_port`: where a prefill instance's KV connector answers pulls (``role: prefill``).
    Raises `ConfigError` for the first setting vLLM cannot honour.
    """
    refuse_native_only(config, "vllm", roles=True)
    values: list[ResolvedValue] = [_device(config, platform)]
    # generation_config stays vLLM's "auto": on the engine path it only adds generation_config.json's
    # EOS ids to each request's stop tokens (sage sends every sampling field itself)
    kwargs: dict[str, object] = {"model": model.path, "tokenizer": model.path, "served_model_name": model.name,
                                 "enable_log_requests": False}
    model_dtype = resolve_model_dtype(config, model.facts)
    max_len = resolve_max_model_len(config, model.facts)
    kv_dtype = _kv_dtype(config, model_dtype.value, platform)
    block = _block_size(config, platform)
    kwargs.update(dtype=VLLM_DTYPES[model_dtype.value], max_model_len=max_len.value, kv_cache_dtype=kv_dtype.value,
                  block_size=block.value, enable_prefix_caching=config.kv_pool.enable_prefix_caching)
    values += [model_dtype, max_len, kv_dtype, block]

    stored = model_dtype.value if kv_dtype.value == "auto" else next(
        sage for sage, theirs in VLLM_KV_DTYPES.items() if theirs == kv_dtype.value)
    block_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * block.value * DTYPE_BYTES[stored]
    values.append(_kv_pool_size(kwargs, config, platform, block_bytes, block.value, max_len.value,
                                host_available_bytes))
    values += _scheduler(kwargs, config, max_len.value)
    if config.model.revision != "local":
        values.append(ResolvedValue("model.revision", config.model.revision,
                                    "a prefix-cache key of sage's own index; vLLM loads the local directory as is"))
    if config.role != "both":
        kwargs["kv_transfer_config"], reason = _pd_connector(config, pd_port)
        values.append(ResolvedValue("role", config.role, reason))
    speculative = _speculative_config(config)
    if speculative is not None:
        kwargs["speculative_config"], value = speculative
        values.append(value)
    return VLLMEngineArgs(kwargs, values, max_len.value)


def _kv_pool_size(kwargs: dict[str, object], config: ServeConfig, platform: str, block_bytes: int, block_size: int,
                  max_model_len: int, host_available_bytes: int | None) -> ResolvedValue:
    """How much KV vLLM allocates: sized here by the native engine's rule on CPU or when set by hand (blocks or
    a budget), else vLLM's own share of device memory."""
    pool = config.kv_pool
    if platform == "cpu" or pool.num_blocks is not None or pool.memory_budget is not None:
        # the native engine's rule, so both backends size the same pool from the same config
        blocks = resolve_num_blocks(config.model_copy(update={"kv_pool": pool.model_copy(
            update={"block_size": block_size})}), bytes_per_block=block_bytes, max_model_len=max_model_len,
            free_device_bytes=None, host_available_bytes=host_available_bytes)
        kwargs["kv_cache_memory_bytes"] = blocks.value * block_bytes
        kwargs["num_gpu_blocks_override"] = blocks.value
        return ResolvedValue("kv_pool.num_blocks", blocks.value,
                             f"{blocks.reason}; vLLM kv_cache_memory_bytes = {blocks.value} x {block_bytes}")
    # vLLM measures the device after loading the model, as the native engine does
    kwargs["gpu_memory_utilization"] = pool.memory_utilization
    return ResolvedValue("kv_pool.memory_utilization", pool.memory_utilization,
                         "vLLM gpu_memory_utilization: share of device memory for weights and KV")


def _scheduler(kwargs: dict[str, object], config: ServeConfig, max_model_len: int) -> list[ResolvedValue]:
    """The scheduler's settings as vLLM's; one vLLM has no equivalent for is a `ConfigError`."""
    scheduler = config.scheduler
    if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < max_model_len:
        raise ConfigError(f"scheduler.max_num_batched_tokens: {scheduler.max_num_batched_tokens} is below "
                          f"model.max_model_len {max_model_len}, which vLLM requires without chunked prefill",
                          hint="enable scheduler.enable_chunked_prefill or raise max_num_batched_tokens")
    if scheduler.strategy not in SCHEDULING_POLICIES:
        raise ConfigError(f"scheduler.strategy: {scheduler.strategy}: vLLM admits requests fcfs or by priority only",
                          hint="use fifo or priority with --backend vllm")
    if scheduler.short_prefill_first:
        raise ConfigError("scheduler.short_prefill_first: vLLM has no option to hold long prompts back for short "
                          "ones", hint="set it to false with --backend vllm")
    kwargs.update(max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
                  enable_chunked_prefill=scheduler.enable_chunked_prefill,
                  long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
                  scheduling_policy=SCHEDULING_POLICIES[scheduler.strategy],
                  # vLLM counts waiting + running requests: the seats plus sage's waiting room
                  max_num_queued_reqs=scheduler.max_waiting + scheduler.max_num_seqs)
    return [ResolvedValue("scheduler.max_waiting", scheduler.max_waiting,
                          f"vLLM max_num_queued_reqs = {scheduler.max_waiting} + {scheduler.max_num_seqs} "
                          "running seats (it counts both)")]


# what vLLM's speculative_config takes from each method's settings (besides method and num_speculative_tokens),
# and the line `sage llm serve` prints for it
SPECULATIVE_FIELDS = {
    "ngram": (("prompt_lookup_min", "prompt_lookup_max"),
              "vLLM speculative_config: ngram with the same num_speculative_tokens, prompt_lookup_min/max and "
              "disable_by_batch_size"),
    "suffix": (("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
               "vLLM speculative_config: suffix (needs the arctic-inference package in vLLM's environment) with the "
               "same num_speculative_tokens and suffix_decoding_* fields"),
    "draft_model": (("model",), "vLLM speculative_config: draft_model with the same model and "
                    "num_speculative_tokens"),
}


def _speculative_config(config: ServeConfig) -> tuple[dict, ResolvedValue] | None:
    """vLLM's speculative_config for the configured method (None when off)."""
    speculative = config.speculative
    if speculative.method == "off":
        return None
    if speculative.method not in SPECULATIVE_FIELDS:
        raise ConfigError(f"speculative.method: {speculative.method} is not implemented yet (for either backend); "
                          "use ngram, suffix or draft_model (or off)")
    if speculative.adaptive:
        raise ConfigError(f"speculative.adaptive: vLLM's {speculative.method} proposer has no adaptive k; leave it "
                          "false for --backend vllm")
    names, reason = SPECULATIVE_FIELDS[speculative.method]
    settings = {"method": speculative.method, "num_speculative_tokens": speculative.num_speculative_tokens,
                **{name: getattr(speculative, name) for name in names}}
    if speculative.disable_by_batch_size is not None:
        settings["disable_by_batch_size"] = speculative.disable_by_batch_size
    return settings, ResolvedValue("speculative.method", speculative.method, reason)


def _pd_connector(config: ServeConfig, pd_port: int | None) -> tuple[dict, str]:
    """A prefill or decode role as vLLM's KV connector: SageKVConnector as kv_producer / kv_consumer, moving
    the prompt's blocks over sage's transport (docs/vllm_connector.md)."""
    from sage_infer.integrations.vllm import kv_transfer_config

    transport = config.kv_transport
    backend = "shm" if transport.backend == "auto" else transport.backend
    if backend not in ("shm", "tcp"):
        raise ConfigError(f"kv_transport.backend: {transport.backend}: vLLM's prefill/decode roles move KV through "
                          "SageKVConnector over shm or tcp", hint="set kv_transport.backend to shm or tcp")
    extra: dict = {"pd_backend": backend, "pd_timeout_s": transport.timeout_s}
    role = "kv_producer" if config.role == "prefill" else "kv_consumer"
    if role == "kv_producer":
        if pd_port is None:
            raise ValueError("a prefill role needs the port its KV connector answers pulls on")
        extra["pd_port"] = pd_port
    where = f", pulls on 127.0.0.1:{pd_port}" if pd_port is not None else ""
    return (kv_transfer_config(role=role, **extra),
            f"vLLM kv_transfer_config: SageKVConnector {role} over {backend}{where}")


def _device(config: ServeConfig, platform: str) -> ResolvedValue:
    hardware = config.hardware
    if hardware is None:
        return ResolvedValue("device", platform, "no hardware preset resolved: the platform vLLM was built for")
    wanted = hardware.device.torch_device_type
    if wanted != platform:
        raise ConfigError(f"preset: {hardware.name} runs on device {wanted}, but the installed vLLM runs on "
                          f"{platform}", hint=f"install the vLLM build for {wanted}, or pick a {platform} preset")
    return ResolvedValue("device", platform, f"hardware preset {hardware.name}: device.torch_device_type="
                         f"{wanted}, the platform of the installed vLLM")


def _kv_dtype(config: ServeConfig, model_dtype: str, platform: str) -> ResolvedValue:
    """vLLM cache_dtype: auto (the model's dtype) unless a different one was set."""
    wanted = config.kv_pool.kv_dtype
    if wanted == "auto":
        default = config.preset_kv_dtype()
        why = (f"; the preset's kv.default_dtype={default.value} is the native engine's choice"
               if default is not None and default.value != model_dtype else "")
        return ResolvedValue("kv_pool.kv_dtype", "auto", f"auto: vLLM keeps KV in the model's {model_dtype}{why}")
    wanted = getattr(wanted, "value", wanted)
    if wanted == model_dtype:
        return ResolvedValue("kv_pool.kv_dtype", "auto", f"set explicitly: {wanted}, the model's dtype (vLLM auto)")
    theirs = VLLM_KV_DTYPES.get(wanted)
    if theirs is None:
        raise ConfigError(f"kv_pool.kv_dtype: {wanted} has no vLLM equivalent (vLLM stores KV as the model's "
                          "dtype, fp16, bf16, fp8_e4m3 or fp8_e5m2)")
    if platform == "cpu" and wanted not in CPU_KV_DTYPES:
        raise ConfigError(f"kv_pool.kv_dtype: {wanted}: vLLM's CPU attention stores KV as the model's dtype or "
                          f"fp8 only ({', '.join(CPU_KV_DTYPES)})")
    return ResolvedValue("kv_pool.kv_dtype", theirs, f"set explicitly: vLLM cache_dtype {theirs}")


def _block_size(config: ServeConfig, platform: str) -> ResolvedValue:
    size = config.kv_pool.block_size
    explicit = "block_size" in config.kv_pool.model_fields_set
    if platform == "cpu":
        if not explicit:
            return ResolvedValue("kv_pool.block_size", CPU_DEFAULT_BLOCK_SIZE,
                                 "auto: vLLM's CPU default (sage's 16 is below its kernels' multiple of 32)")
        if size % CPU_BLOCK_MULTIPLE:
            raise ConfigError(f"kv_pool.block_size: {size}: vLLM's CPU attention needs a multiple of "
                              f"{CPU_BLOCK_MULTIPLE}", hint="leave block_size unset (vLLM uses 128) or set 32, 64, 128")
    return ResolvedValue("kv_pool.block_size", size, "set explicitly" if explicit else "sage's default")
