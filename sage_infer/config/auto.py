"""Every ``auto`` in a `ServeConfig`, decided in one place, each with its reason.

`build_engine` asks this module for the device, the model dtype, the KV dtype, the
context length and the pool size, and only applies the answers; `sage llm serve` and
`sage llm generate` print them, one line each, so nothing is chosen silently.

The hardware preset proposes (device type, KV dtype); the model and the device can
veto with a reason: a quantized preset KV dtype the pool cannot store yet, bf16 on a
device without native bf16, a 16-bit KV format other than the one the model computes in.

The ``model.*`` fast paths (`model.attention`, `model.prefill_attention`, `model.elementwise`,
`model.decode_step`, `model.cuda_graphs`, `model.linear`, `model.decode_linear`, `model.host_malloc`)
are decided here too, by `resolve_fast_path`: `engine/build.py` probes what this machine can run
(a kernel build, a device, a pool layout: the layers this package may not import) and passes the
reason a path cannot run, or None; this module turns the choice and that reason into the value,
its reason, or the one-line error of an explicit choice that cannot run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sage_infer.config.serve import ServeConfig
from sage_infer.core.kv_schema import KVDtype
from sage_infer.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from sage_infer.hal.device import DeviceFacts

log = logging.getLogger("sage_infer.auto")

MODEL_DTYPES = ("fp32", "bf16", "fp16")  # what a model can compute in (KVDtype values)


@dataclass(frozen=True, slots=True)
class ResolvedValue:
    """One decided value: the dotted field, what it became, and why."""

    field: str
    value: object
    reason: str

    def line(self) -> str:
        return f"{self.field} = {self.value} ({self.reason})"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What config.json says, read before any weight is loaded."""

    checkpoint_dtype: str  # fp32 | bf16 | fp16
    max_position_embeddings: int
    sliding_window: int | None = None


@dataclass(slots=True)
class AutoResolution:
    device: torch.device
    model_dtype: str  # fp32 | bf16 | fp16
    kv_dtype: KVDtype
    max_model_len: int
    values: list[ResolvedValue] = field(default_factory=list)

    def log(self) -> None:
        for value in self.values:
            log.info("%s", value.line())


def resolve_fast_path(field: str, choice: str, why: str | None, fast: str, detail: str,
                      reference: str = "torch") -> ResolvedValue:
    """An ``auto | <fast> | <reference>`` field once `choice` is not the reference: `fast` (with `detail`, what it
    runs) where it can run here (`why` None). Where it cannot, an explicit `choice` is a `ConfigError` naming the
    field and the reason; auto falls back to `reference` and says why."""
    if why is None:
        return ResolvedValue(field, fast, detail)
    if choice != "auto":
        raise ConfigError(f"{field}: {choice}: {why}", hint=f"set {field}: {reference}")
    return ResolvedValue(field, reference, f"auto: {why}")


def resolve_device(config: ServeConfig, explicit: str | torch.device | None = None) -> ResolvedValue:
    """The torch device: an explicit argument wins, else the hardware preset's device
    type (through `hal.device.select_device`, which raises one line when it is missing)."""
    import torch

    from sage_infer.hal.device import select_device

    if explicit is not None:
        return ResolvedValue("device", torch.device(explicit), "given explicitly (device argument)")
    hardware = config.hardware
    if hardware is None:  # a ServeConfig built in code, not by resolve_config
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return ResolvedValue("device", device, "no hardware preset resolved: torch's default device")
    detected = " (auto-detected)" if config.preset == "auto" else ""
    device = select_device(hardware.device.torch_device_type, hardware.device.python_module,
                           requested_by=f"preset {hardware.name}", vendor=hardware.vendor.value)
    return ResolvedValue("device", device, f"hardware preset {hardware.name}{detected}: "
                                           f"device.torch_device_type={hardware.device.torch_device_type}")


def resolve_auto(config: ServeConfig, model: ModelFacts, device: ResolvedValue, facts: DeviceFacts) -> AutoResolution:
    """Model dtype, KV dtype and context length for `config` on `device` (see module doc)."""
    values = [device]
    model_dtype = resolve_model_dtype(config, model)
    values.append(model_dtype)
    kv = _kv_dtype(config, model_dtype.value, facts)
    values.append(kv)
    max_len = resolve_max_model_len(config, model)
    values.append(max_len)
    return AutoResolution(device.value, model_dtype.value, KVDtype(kv.value), max_len.value, values)


def resolve_model_dtype(config: ServeConfig, model: ModelFacts) -> ResolvedValue:
    if config.model.dtype != "auto":
        return ResolvedValue("model.dtype", config.model.dtype, "set explicitly")
    return ResolvedValue("model.dtype", model.checkpoint_dtype, "auto: the checkpoint's dtype in config.json")


def _kv_dtype(config: ServeConfig, model_dtype: str, facts: DeviceFacts) -> ResolvedValue:
    hardware = config.hardware
    wanted = config.kv_pool.kv_dtype
    if wanted != "auto":
        wanted = KVDtype(wanted)
        if hardware is not None and wanted not in hardware.kv.dtypes:
            raise ConfigError(f"kv_pool.kv_dtype: {wanted.value} is not supported by preset {hardware.name} "
                              f"(kv.dtypes: {', '.join(d.value for d in hardware.kv.dtypes)})")
        return ResolvedValue("kv_pool.kv_dtype", wanted.value, "set explicitly")

    def model(reason: str) -> ResolvedValue:
        return ResolvedValue("kv_pool.kv_dtype", model_dtype, f"auto: the model's dtype; {reason}")

    if hardware is None:
        return model("no hardware preset resolved")
    default = hardware.kv.default_dtype
    source = f"preset {hardware.name} kv.default_dtype={default.value}"
    if default.is_quantized:  # fp8/int8/int4 KV: a preset only defaults to it when its accuracy was judged
        return ResolvedValue("kv_pool.kv_dtype", default.value, f"auto: {source}")
    if default == KVDtype.BF16 and not facts.native_bf16:
        return model(f"{source}, but {facts.bf16_note}")
    if default.value != model_dtype and {default.value, model_dtype} == {"bf16", "fp16"}:
        loss = "precision" if model_dtype == "fp16" else "range (fp16 overflows above 65504)"
        return model(f"{source}, but the model computes in {model_dtype} and {default.value} KV would lose {loss}")
    if default == KVDtype.FP32 and model_dtype != "fp32":
        return model(f"{source}, but fp32 KV holds nothing more than the model's {model_dtype}")
    return ResolvedValue("kv_pool.kv_dtype", default.value, f"auto: {source}")


def resolve_max_model_len(config: ServeConfig, model: ModelFacts) -> ResolvedValue:
    # a sliding window bounds what a layer attends, not the positions the model takes: the context is
    # max_position_embeddings whatever the window
    supported, why = model.max_position_embeddings, "max_position_embeddings"
    wanted = config.model.max_model_len
    if wanted is None:
        return ResolvedValue("model.max_model_len", supported, f"auto: the model's {why}")
    if wanted > supported:
        raise ConfigError(f"model.max_model_len: {wanted} exceeds what the model supports ({supported})")
    return ResolvedValue("model.max_model_len", wanted, "set explicitly")


@dataclass(frozen=True, slots=True)
class DraftKV:
    """What a draft model (``speculative.method: draft_model``) takes from the KV budget, known from its config.json
    and the headers of its weight files before any of its weights load."""

    bytes_per_block: int  # its pool's blocks hold the target's block_size tokens, in its compute dtype
    weight_bytes: int  # its weights, loaded after the pools are sized: not free memory for KV


def resolve_num_blocks(
    config: ServeConfig,
    *,
    bytes_per_block: int,
    max_model_len: int,
    free_device_bytes: int | None,
    host_available_bytes: int | None,
    draft: DraftKV | None = None,
) -> ResolvedValue:
    """Blocks of the target's KV pool (and of the draft's, which holds as many: every token the target keeps, the
    draft may have computed).

    kv_pool.num_blocks: as set (a draft's pool is on top of it). kv_pool.memory_budget: the bytes target and draft
    KV take together per block divide it. Else, with a device memory reading (GPU/NPU after the model loaded):
    memory_utilization of it, less the draft's weights. Host memory (CPU): enough blocks for every seat at full
    context, never more than memory_utilization of what the OS reports available, less the draft's weights.
    """
    pool = config.kv_pool
    draft_block = draft.bytes_per_block if draft is not None else 0
    per_block = bytes_per_block + draft_block
    sizes = f" (target {bytes_per_block} + draft {draft_block})" if draft is not None else ""
    if pool.num_blocks is not None:
        _fits("kv_pool.num_blocks", pool.num_blocks * per_block, free_device_bytes,
              f"{pool.num_blocks} blocks of {per_block} bytes")
        if draft is None:
            return ResolvedValue("kv_pool.num_blocks", pool.num_blocks, "set explicitly")
        return ResolvedValue("kv_pool.num_blocks", pool.num_blocks, (
            f"set explicitly: the target's pool, {_mib(pool.num_blocks, bytes_per_block)}; the draft's pool holds as "
            f"many blocks, another {_mib(pool.num_blocks, draft_block)}"))
    by_bytes = True  # the count comes from a byte budget (else from the tokens every seat may hold)
    if pool.memory_budget is not None:
        blocks = int(pool.memory_budget) // per_block
        reason = f"kv_pool.memory_budget={pool.memory_budget.human_readable()} / {per_block} bytes per block{sizes}"
    elif free_device_bytes is not None:
        free, free_note = _less_draft_weights(free_device_bytes, "free device memory after loading the model", draft)
        blocks = int(free * pool.memory_utilization) // per_block
        reason = f"auto: {pool.memory_utilization} x {free_note} / {per_block} bytes per block{sizes}"
    else:
        seats = config.scheduler.max_num_seqs
        blocks = seats * (max_model_len + pool.block_size) // pool.block_size
        by_bytes = False
        reason = f"auto: {seats} seats (scheduler.max_num_seqs) x {max_model_len} tokens at full context"
        if host_available_bytes is not None:
            available, available_note = _less_draft_weights(host_available_bytes, "available host memory", draft)
            cap = int(available * pool.memory_utilization) // per_block
            if cap < blocks:
                blocks, by_bytes = cap, True
                reason = (f"auto: {pool.memory_utilization} x {available_note} (less than every seat at full "
                          f"context) / {per_block} bytes per block{sizes}")
    if blocks < 1:
        raise ConfigError(f"kv_pool: the KV budget holds no block of {per_block} bytes{sizes} ({reason})",
                          hint="set kv_pool.num_blocks or a larger kv_pool.memory_budget")
    if draft is not None:
        pools = "share the budget" if by_bytes else "hold as many"
        reason += (f"; the target's and the draft's pools {pools}, {blocks} blocks each: target "
                   f"{_mib(blocks, bytes_per_block)}, draft {_mib(blocks, draft_block)}")
    return ResolvedValue("kv_pool.num_blocks", blocks, reason)


def _less_draft_weights(memory: int, what: str, draft: DraftKV | None) -> tuple[int, str]:
    """`memory` less the draft's weights (they load after the pools are sized), and how the reason says it."""
    if draft is None:
        return memory, f"{memory / 2**30:.1f} GiB {what}"
    return memory - draft.weight_bytes, (f"({memory / 2**30:.1f} GiB {what} - "
                                         f"{draft.weight_bytes / 2**20:.1f} MiB of draft weights)")


def _fits(field: str, nbytes: int, free_device_bytes: int | None, what: str) -> None:
    """A size set by hand that this machine cannot hold is a config error before anything is allocated: more than
    the accelerator's free memory (`free_device_bytes`), or, in host memory, more than all of it (the OS may
    overcommit what is merely available; it cannot give more than it has)."""
    if free_device_bytes is not None:
        limit, where = free_device_bytes, "free device memory"
    else:
        from sage_infer.hal.cpu import read_meminfo_total

        limit, where = read_meminfo_total(), "host memory"
    if limit is not None and nbytes > limit:
        raise ConfigError(f"{field}: {nbytes / 2**30:,.1f} GiB ({what}), more than the {limit / 2**30:,.1f} GiB of "
                          f"{where} this machine has")


def _mib(blocks: int, bytes_per_block: int) -> str:
    return f"{blocks * bytes_per_block / 2**20:.1f} MiB"


HOST_TIER_DDR_SHARE = 0.5  # of the host DDR per device, for the host KV tier by default
HOST_TIER_AVAILABLE_SHARE = 0.5  # never more than this of what the OS reports available now


def resolve_host_bytes(config: ServeConfig, device_type: str, host_available_bytes: int | None) -> ResolvedValue:
    """Bytes of the host KV tier: as set, or (``auto``) from the preset's host DDR per device.

    The host tier's slab is allocated and touched at start-up, so the default is capped by
    what the OS has available. On a CPU the device pool is host DRAM already: no host tier
    by default (a larger pool does the same job without a copy).
    """
    value = config.tiers.host_bytes
    if value != "auto":
        _fits("tiers.host_bytes", int(value), None, "the host tier")
        return ResolvedValue("tiers.host_bytes", int(value), "set explicitly" if value else "set explicitly: off")
    if device_type == "cpu":
        return ResolvedValue("tiers.host_bytes", 0, "auto: the KV pool is in host memory already (device cpu)")
    hw = config.hardware
    if hw is None or hw.memory.host_ddr_gb is None:
        return ResolvedValue("tiers.host_bytes", 0, "auto: the hardware preset states no host DDR "
                             "(memory.host_ddr_gb): set tiers.host_bytes to use a host tier")
    per_device = hw.memory.host_ddr_gb * 1e9 / hw.device.devices_per_node
    wanted = int(per_device * HOST_TIER_DDR_SHARE)
    reason = (f"auto: {HOST_TIER_DDR_SHARE} x {hw.memory.host_ddr_gb:g} GB host DDR / "
              f"{hw.device.devices_per_node} devices (preset {hw.name})")
    if host_available_bytes is not None and wanted > host_available_bytes * HOST_TIER_AVAILABLE_SHARE:
        wanted = int(host_available_bytes * HOST_TIER_AVAILABLE_SHARE)
        reason = (f"auto: {HOST_TIER_AVAILABLE_SHARE} x {host_available_bytes / 2**30:.1f} GiB available host "
                  f"memory (less than {HOST_TIER_DDR_SHARE} x the preset's {per_device / 1e9:.0f} GB DDR per device)")
    return ResolvedValue("tiers.host_bytes", wanted, reason)
