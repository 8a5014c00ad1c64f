"""`config.auto`: every auto value with its reason; the preset proposes, model and device veto."""

from __future__ import annotations

import pytest
import torch

from sage_infer.config.auto import (
    DraftKV,
    ModelFacts,
    ResolvedValue,
    resolve_auto,
    resolve_device,
    resolve_host_bytes,
    resolve_num_blocks,
)
from sage_infer.config.resolve import resolve_config
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError
from sage_infer.hal.device import DeviceFacts

CPU = ResolvedValue("device", torch.device("cpu"), "test")
NATIVE_BF16 = DeviceFacts("cpu", True, "CPU has amx_bf16")
NO_BF16 = DeviceFacts("cpu", False, "CPU has no AVX512-BF16/AMX-BF16 (bf16 would be emulated)")


def config(preset: str | None = "cpu", **cli) -> ServeConfig:
    if preset is None:
        return ServeConfig.model_validate(cli)
    return resolve_config(preset=preset, cli=cli, env={}).config


def kv(cfg: ServeConfig, model_dtype: str = "fp32", facts: DeviceFacts = NATIVE_BF16) -> ResolvedValue:
    auto = resolve_auto(cfg, ModelFacts(model_dtype, 2048), CPU, facts)
    return next(v for v in auto.values if v.field == "kv_pool.kv_dtype")


def test_kv_auto_follows_the_preset_default():
    assert kv(config()) == ResolvedValue("kv_pool.kv_dtype", "bf16", "auto: preset cpu kv.default_dtype=bf16")


def test_kv_auto_without_native_bf16_keeps_the_model_dtype():
    value = kv(config(), facts=NO_BF16)
    assert value.value == "fp32"
    assert value.reason == ("auto: the model's dtype; preset cpu kv.default_dtype=bf16, but CPU has no "
                            "AVX512-BF16/AMX-BF16 (bf16 would be emulated)")


def test_kv_auto_takes_a_quantized_preset_default():
    value = kv(config("nvidia-h100", hardware={"kv": {"default_dtype": "fp8_e4m3"}}), model_dtype="bf16")
    assert value == ResolvedValue("kv_pool.kv_dtype", "fp8_e4m3", "auto: preset nvidia-h100 kv.default_dtype=fp8_e4m3")


def test_kv_auto_does_not_store_a_fp16_model_in_bf16():
    value = kv(config(), model_dtype="fp16")
    assert value.value == "fp16" and "would lose precision" in value.reason


def test_kv_auto_without_a_preset_uses_the_model_dtype():
    value = kv(config(None), model_dtype="fp32")
    assert value == ResolvedValue("kv_pool.kv_dtype", "fp32", "auto: the model's dtype; no hardware preset resolved")


def test_explicit_values_say_so():
    auto = resolve_auto(config(kv_pool={"kv_dtype": "fp16"}, model={"dtype": "bf16", "max_model_len": 128}),
                        ModelFacts("fp32", 2048), CPU, NO_BF16)
    reasons = {v.field: (v.value, v.reason) for v in auto.values}
    assert reasons["kv_pool.kv_dtype"] == ("fp16", "set explicitly")
    assert reasons["model.dtype"] == ("bf16", "set explicitly")
    assert reasons["model.max_model_len"] == (128, "set explicitly")


def test_explicit_quantized_kv_is_taken():
    assert kv(config(kv_pool={"kv_dtype": "int8"})) == ResolvedValue("kv_pool.kv_dtype", "int8", "set explicitly")


def test_a_quantized_kv_dtype_the_preset_does_not_list_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_pool.kv_dtype: int4 is not supported by preset ascend-910b"):
        kv(config("ascend-910b", kv_pool={"kv_dtype": "int4"}))


def test_context_auto_is_max_position_embeddings_whatever_the_sliding_window():
    auto = resolve_auto(config(), ModelFacts("bf16", 32768, sliding_window=4096), CPU, NATIVE_BF16)
    assert auto.max_model_len == 32768
    assert auto.values[-1].reason == "auto: the model's max_position_embeddings"


def test_device_explicit_wins_and_cpu_preset_gives_cpu():
    assert resolve_device(config("ascend-910b"), "cpu").value == torch.device("cpu")
    device = resolve_device(config())
    assert device.value == torch.device("cpu") and device.reason.startswith("hardware preset cpu")


def test_auto_detected_preset_on_this_machine_gives_cpu():
    cfg = resolve_config(env={}).config
    assert cfg.preset == "auto" and cfg.hardware.name == "cpu"
    assert resolve_device(cfg).reason == "hardware preset cpu (auto-detected): device.torch_device_type=cpu"


def test_pool_size_on_host_memory_is_capped_by_what_is_available():
    cfg = config(scheduler={"max_num_seqs": 4})
    full = resolve_num_blocks(cfg, bytes_per_block=1000, max_model_len=112, free_device_bytes=None,
                              host_available_bytes=10**9)
    assert full.value == 4 * (112 + 16) // 16 and "4 seats" in full.reason
    capped = resolve_num_blocks(cfg, bytes_per_block=1000, max_model_len=112, free_device_bytes=None,
                                host_available_bytes=10_000)
    assert capped.value == 9 and "available host memory" in capped.reason  # 0.9 x 10000 // 1000


def test_pool_size_on_a_device_is_a_share_of_free_memory():
    cfg = config(kv_pool={"memory_utilization": 0.5})
    value = resolve_num_blocks(cfg, bytes_per_block=1 << 20, max_model_len=512, free_device_bytes=8 << 30,
                               host_available_bytes=None)
    assert value.value == 4096 and "free device memory" in value.reason


def test_with_a_draft_the_bytes_of_both_pools_divide_the_device_share_less_the_draft_weights():
    cfg = config(kv_pool={"memory_utilization": 0.5})
    value = resolve_num_blocks(cfg, bytes_per_block=3 << 20, max_model_len=512, free_device_bytes=9 << 30,
                               host_available_bytes=None, draft=DraftKV(bytes_per_block=1 << 20,
                                                                        weight_bytes=1 << 30))
    assert value.value == 1024  # 0.5 x (9 GiB - 1 GiB) / (3 + 1) MiB
    assert "1024.0 MiB of draft weights" in value.reason
    assert "share the budget, 1024 blocks each: target 3072.0 MiB, draft 1024.0 MiB" in value.reason


def test_with_a_draft_every_seat_at_full_context_is_capped_by_host_memory_for_both_pools():
    cfg = config(scheduler={"max_num_seqs": 4})
    draft = DraftKV(bytes_per_block=500, weight_bytes=1000)
    full = resolve_num_blocks(cfg, bytes_per_block=1000, max_model_len=112, free_device_bytes=None,
                              host_available_bytes=10**9, draft=draft)
    assert full.value == 4 * (112 + 16) // 16 and "hold as many, 32 blocks each" in full.reason
    capped = resolve_num_blocks(cfg, bytes_per_block=1000, max_model_len=112, free_device_bytes=None,
                                host_available_bytes=16_000, draft=draft)
    assert capped.value == 9 and "share the budget" in capped.reason  # 0.9 x (16000 - 1000) // 1500


def test_pool_budget_below_one_block_is_a_config_error():
    with pytest.raises(ConfigError, match="holds no block of 4096 bytes"):
        resolve_num_blocks(config(kv_pool={"memory_budget": 1000}), bytes_per_block=4096, max_model_len=64,
                           free_device_bytes=None, host_available_bytes=None)


# -- tiers.host_bytes: auto from the preset's host DDR ---------------------------------------------

GiB = 1 << 30


def test_host_tier_auto_is_a_share_of_the_presets_ddr_per_device():
    # DGX H100: 2048 GB of DDR for 8 GPUs -> 0.5 x 256 GB for one device's host tier
    value = resolve_host_bytes(config("nvidia-h100"), "cuda", host_available_bytes=1024 * GiB)
    assert value.value == 128 * 10**9
    assert value.reason == "auto: 0.5 x 2048 GB host DDR / 8 devices (preset nvidia-h100)"


def test_host_tier_auto_never_takes_more_than_half_of_what_is_available():
    value = resolve_host_bytes(config("nvidia-h100"), "cuda", host_available_bytes=20 * GiB)
    assert value.value == 10 * GiB
    assert value.reason.startswith("auto: 0.5 x 20.0 GiB available host memory")


def test_host_tier_auto_is_off_on_a_cpu_and_without_a_ddr_figure():
    assert resolve_host_bytes(config("cpu"), "cpu", 64 * GiB).value == 0
    no_ddr = config("nvidia-h100", hardware={"memory": {"host_ddr_gb": None}})
    value = resolve_host_bytes(no_ddr, "cuda", 64 * GiB)
    assert value.value == 0 and "memory.host_ddr_gb" in value.reason


def test_host_tier_set_explicitly_wins_over_the_preset():
    value = resolve_host_bytes(config("nvidia-h100", tiers={"host_bytes": "2GiB"}), "cuda", 64 * GiB)
    assert value == ResolvedValue("tiers.host_bytes", 2 * GiB, "set explicitly")
    assert resolve_host_bytes(config("nvidia-h100", tiers={"host_bytes": 0}), "cuda", 64 * GiB).value == 0
