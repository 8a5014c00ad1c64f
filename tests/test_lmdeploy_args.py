"""`lmdeploy_engine_config`: the ServeConfig as lmdeploy's documented TurboMind / PyTorch engine
config fields. Pure data (lmdeploy needs CUDA and is not installed here): these tests check the
translation, not lmdeploy."""

from __future__ import annotations

import pytest

from sage_infer.backends.lmdeploy import lmdeploy_engine_config
from sage_infer.config.auto import ModelFacts
from sage_infer.config.presets import load_hardware_preset
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError

BF16 = ModelFacts("bf16", 4096)


def translate(facts: ModelFacts = BF16, engine=None, preset: str | None = None, **fields):
    if preset is not None:
        fields["hardware"] = load_hardware_preset(preset).profile.model_dump()
    return lmdeploy_engine_config(ServeConfig.model_validate(fields), facts, engine)


def test_on_cuda_the_turbomind_engine_gets_the_scheduler_and_cache_fields():
    out = translate(preset="nvidia-h100", model={"max_model_len": 2048},
                    scheduler={"max_num_seqs": 32, "max_num_batched_tokens": 4096},
                    kv_pool={"memory_utilization": 0.6, "enable_prefix_caching": True})
    assert out.engine == "turbomind"
    assert out.kwargs == {"dtype": "bfloat16", "session_len": 2048, "quant_policy": 0, "cache_block_seq_len": 64,
                          "enable_prefix_caching": True, "cache_max_entry_count": 0.6, "max_batch_size": 32,
                          "max_prefill_token_num": 4096}


def test_on_ascend_the_pytorch_engine_runs_with_device_type_ascend():
    out = translate(preset="ascend-910b", kv_pool={"num_blocks": 500, "block_size": 128})
    assert out.engine == "pytorch"
    assert (out.kwargs["device_type"], out.kwargs["block_size"], out.kwargs["num_gpu_blocks"]) == ("ascend", 128, 500)


def test_on_cambricon_the_block_size_is_lmdeploys_16():
    assert translate(preset="cambricon-mlu590").kwargs["block_size"] == 16
    with pytest.raises(ConfigError, match="^kv_pool.block_size: 64: lmdeploy on Cambricon"):
        translate(preset="cambricon-mlu590", kv_pool={"block_size": 64})


def test_a_cpu_preset_is_refused():
    with pytest.raises(ConfigError, match="^preset: cpu runs on device cpu; lmdeploy runs on"):
        translate(preset="cpu")


@pytest.mark.parametrize("kv_dtype, policy", [("int8", 8), ("int4", 4), ("auto", 0), ("bf16", 0)])
def test_int8_and_int4_kv_become_quant_policy(kv_dtype, policy):
    assert translate(kv_pool={"kv_dtype": kv_dtype}).kwargs["quant_policy"] == policy


def test_a_long_prefill_cap_is_refused():
    with pytest.raises(ConfigError, match="^scheduler.long_prefill_token_threshold: 64: lmdeploy has no"):
        translate(scheduler={"long_prefill_token_threshold": 64})
    with pytest.raises(ConfigError, match="^scheduler.short_prefill_first: lmdeploy has no option"):
        translate(scheduler={"short_prefill_first": True})


def test_fp8_kv_is_refused():
    with pytest.raises(ConfigError, match="^kv_pool.kv_dtype: fp8_e4m3: lmdeploy stores KV"):
        translate(kv_pool={"kv_dtype": "fp8_e4m3"})


def test_an_fp32_checkpoint_runs_in_fp16_on_auto_and_is_refused_when_asked_for():
    assert translate(ModelFacts("fp32", 512)).kwargs["dtype"] == "float16"
    with pytest.raises(ConfigError, match="^model.dtype: fp32: lmdeploy computes in float16 or bfloat16"):
        translate(ModelFacts("fp32", 512), model={"dtype": "fp32"})


def test_turbomind_takes_no_byte_or_block_budget():
    with pytest.raises(ConfigError, match="^kv_pool.num_blocks: TurboMind sizes its KV cache"):
        translate(kv_pool={"num_blocks": 100})
    with pytest.raises(ConfigError, match="^kv_pool.memory_budget: TurboMind"):
        translate(kv_pool={"memory_budget": "1GiB"})


def test_priority_scheduling_is_refused():
    with pytest.raises(ConfigError, match="^scheduler.strategy: priority"):
        translate(scheduler={"strategy": "priority"})


@pytest.mark.parametrize("fields, field", [({"tiers": {"disk_path": "/tmp/kv"}}, "tiers.disk_path"),
                                           ({"policy": {"eviction": "arc"}}, "policy.eviction"),
                                           ({"role": "decode"}, "role")])
def test_native_only_settings_are_refused_naming_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        translate(**fields)


def test_backends_list_says_lmdeploy_is_translation_only_or_missing():
    from sage_infer.backends.registry import status

    lmdeploy = status("lmdeploy")
    assert lmdeploy.available is False
    assert "lmdeploy is not installed" in lmdeploy.reason or "only the config translation" in lmdeploy.reason
