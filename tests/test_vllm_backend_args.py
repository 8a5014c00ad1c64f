"""`vllm_engine_args`: the resolved ServeConfig as vLLM engine arguments. Pure data: runs
without vLLM installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from sage_infer.backends.vllm_args import VLLMModel, vllm_engine_args
from sage_infer.config.auto import ModelFacts
from sage_infer.config.presets import load_hardware_preset
from sage_infer.config.serve import ServeConfig
from sage_infer.errors import ConfigError

# 2 layers x 2 KV heads x head_dim 16: one token's K and V in fp32 are 2*2*2*16*4 = 512 bytes
MODEL = VLLMModel("/models/tiny", "tiny", ModelFacts("fp32", 256), num_layers=2, num_kv_heads=2, head_dim=16)
GIB = 1 << 30


def translate(platform: str = "cpu", served: VLLMModel = MODEL, available: int | None = 8 * GIB,
              pd_port: int | None = None, **fields):
    """`fields`: ServeConfig fields (``model={"dtype": "fp16"}``); `served`: what config.json says."""
    return vllm_engine_args(ServeConfig.model_validate(fields), served, platform, available, pd_port)


def test_the_model_is_served_from_its_directory_under_its_name():
    kwargs = translate().kwargs
    assert (kwargs["model"], kwargs["tokenizer"], kwargs["served_model_name"]) == ("/models/tiny", "/models/tiny",
                                                                                   "tiny")


def test_model_dtype_auto_is_the_checkpoint_dtype_not_vllms_auto():
    bf16 = VLLMModel("/m", "m", ModelFacts("bf16", 256), 2, 2, 16)
    assert translate().kwargs["dtype"] == "float32"
    assert translate(served=bf16).kwargs["dtype"] == "bfloat16"


def test_an_explicit_model_dtype_is_passed_in_vllm_spelling():
    assert translate(model={"dtype": "fp16"}).kwargs["dtype"] == "float16"


def test_max_model_len_defaults_to_the_models_and_is_checked_against_it():
    assert translate().kwargs["max_model_len"] == 256
    assert translate(model={"max_model_len": 128}).kwargs["max_model_len"] == 128
    with pytest.raises(ConfigError, match="^model.max_model_len: 512 exceeds"):
        translate(model={"max_model_len": 512})


def test_on_cpu_an_unset_block_size_is_vllms_128():
    assert translate().kwargs["block_size"] == 128


def test_on_cpu_a_block_size_vllms_kernels_cannot_take_is_refused():
    with pytest.raises(ConfigError, match="^kv_pool.block_size: 16: vLLM's CPU attention needs a multiple of 32"):
        translate(kv_pool={"block_size": 16})
    assert translate(kv_pool={"block_size": 64}).kwargs["block_size"] == 64


def test_on_cuda_the_block_size_is_passed_through():
    assert translate("cuda").kwargs["block_size"] == 16
    assert translate("cuda", kv_pool={"block_size": 32}).kwargs["block_size"] == 32


def test_a_kv_memory_budget_becomes_whole_blocks_of_kv_cache_memory():
    block_bytes = 512 * 128
    kwargs = translate(kv_pool={"memory_budget": "1MiB"}).kwargs
    assert kwargs["num_gpu_blocks_override"] == (1 << 20) // block_bytes == 16
    assert kwargs["kv_cache_memory_bytes"] == 16 * block_bytes


def test_num_blocks_becomes_exactly_that_many_blocks():
    kwargs = translate(kv_pool={"num_blocks": 40, "block_size": 32}).kwargs
    assert kwargs["num_gpu_blocks_override"] == 40
    assert kwargs["kv_cache_memory_bytes"] == 40 * 512 * 32


def test_fp8_kv_halves_a_block_of_a_16_bit_model_and_quarters_fp32():
    kwargs = translate(kv_pool={"num_blocks": 10, "kv_dtype": "fp8_e4m3"}).kwargs
    assert kwargs["kv_cache_dtype"] == "fp8_e4m3"
    assert kwargs["kv_cache_memory_bytes"] == 10 * 128 * 512 // 4


def test_on_cpu_without_a_budget_the_pool_is_sized_like_the_native_engines():
    # every seat at full context: 64 seats x (256 + 128) // 128 blocks, well under 8 GiB available
    kwargs = translate().kwargs
    assert kwargs["num_gpu_blocks_override"] == 64 * (256 + 128) // 128
    assert "gpu_memory_utilization" not in kwargs


def test_on_cpu_without_a_budget_the_pool_is_capped_by_available_memory():
    kwargs = translate(available=10 * 128 * 512).kwargs
    assert kwargs["num_gpu_blocks_override"] == 9  # 0.9 of 10 blocks' worth


def test_on_a_gpu_without_a_budget_vllm_takes_its_share_of_device_memory():
    kwargs = translate("cuda", kv_pool={"memory_utilization": 0.5}).kwargs
    assert kwargs["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in kwargs


def test_scheduler_limits_and_policy_are_passed_on():
    kwargs = translate(scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 512, "strategy": "priority",
                                  "max_waiting": 20, "enable_chunked_prefill": True,
                                  "long_prefill_token_threshold": 64}).kwargs
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"], kwargs["scheduling_policy"]) == (8, 512,
                                                                                                        "priority")
    assert kwargs["long_prefill_token_threshold"] == 64 and translate().kwargs["long_prefill_token_threshold"] == 0
    assert kwargs["max_num_queued_reqs"] == 28 and kwargs["enable_chunked_prefill"] is True
    assert translate().kwargs["scheduling_policy"] == "fcfs"
    with pytest.raises(ConfigError, match="^scheduler.short_prefill_first: vLLM has no option"):
        translate(scheduler={"short_prefill_first": True, "long_prefill_token_threshold": 64})
    with pytest.raises(ConfigError, match="^scheduler.strategy: lpm: vLLM admits requests fcfs or by priority only"):
        translate(scheduler={"strategy": "lpm"})


def test_without_chunked_prefill_the_step_budget_must_hold_a_whole_prompt():
    with pytest.raises(ConfigError, match="^scheduler.max_num_batched_tokens: 128 is below model.max_model_len 256"):
        translate(scheduler={"enable_chunked_prefill": False, "max_num_batched_tokens": 128})


def test_prefix_caching_switch_is_passed_on():
    assert translate(kv_pool={"enable_prefix_caching": False}).kwargs["enable_prefix_caching"] is False


@pytest.mark.parametrize("kv_dtype, platform, expected", [
    ("auto", "cpu", "auto"), ("fp32", "cpu", "auto"), ("fp8_e5m2", "cpu", "fp8_e5m2"), ("fp16", "cuda", "float16"),
    ("bf16", "cuda", "bfloat16")])
def test_kv_dtypes_vllm_stores_are_translated(kv_dtype, platform, expected):
    assert translate(platform, kv_pool={"kv_dtype": kv_dtype}).kwargs["kv_cache_dtype"] == expected


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3fnuz"])
def test_kv_dtypes_without_a_vllm_equivalent_are_refused(kv_dtype):
    with pytest.raises(ConfigError, match=f"^kv_pool.kv_dtype: {kv_dtype} has no vLLM equivalent"):
        translate("cuda", kv_pool={"kv_dtype": kv_dtype})


def test_16_bit_kv_for_an_fp32_model_is_refused_on_cpu():
    with pytest.raises(ConfigError, match="^kv_pool.kv_dtype: bf16: vLLM's CPU attention"):
        translate(kv_pool={"kv_dtype": "bf16"})


@pytest.mark.parametrize("fields, field", [
    ({"tiers": {"host_bytes": "1GiB"}}, "tiers.host_bytes"),
    ({"tiers": {"disk_path": "/tmp/kv", "disk_bytes": "1GiB"}}, "tiers.disk_path"),
    ({"tiers": {"remote_url": "redis://127.0.0.1:6379/0"}}, "tiers.remote_url"),
    ({"quota": {"tenants": [{"name": "a", "cache_salt": "s", "max_share": 0.5}]}}, "quota"),
    ({"policy": {"eviction": "s3fifo"}}, "policy.eviction"),
    ({"model": {"linear": "packed"}}, "model.linear"),
    ({"model": {"cascade_attention": False}}, "model.cascade_attention"),
    ({"model": {"attention": "paged"}}, "model.attention"),
    ({"model": {"elementwise": "torch"}}, "model.elementwise"),
    ({"model": {"host_malloc": "system"}}, "model.host_malloc"),
    ({"model": {"decode_linear": "onednn"}}, "model.decode_linear"),
    ({"model": {"prefill_attention": "torch"}}, "model.prefill_attention"),
    ({"model": {"huge_pages": False}}, "model.huge_pages"),
    ({"model": {"deterministic": True}}, "model.deterministic"),
    ({"model": {"decode_step": "python"}}, "model.decode_step"),
])
def test_what_vllm_cannot_honour_is_one_config_error_naming_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        translate(**fields)


def test_a_prefill_or_decode_role_is_sages_connector_as_producer_or_consumer():
    prefill = translate(role="prefill", pd_port=7500)
    transfer = prefill.kwargs["kv_transfer_config"]
    assert (transfer["kv_connector"], transfer["kv_role"]) == ("SageKVConnector", "kv_producer")
    assert transfer["kv_connector_extra_config"]["pd_port"] == 7500
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert prefill.values[-1].field == "role" and "kv_producer over shm" in prefill.values[-1].reason
    decode = translate(role="decode", kv_transport={"backend": "tcp"})
    assert decode.kwargs["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert decode.kwargs["kv_transfer_config"]["kv_connector_extra_config"]["pd_backend"] == "tcp"
    assert "kv_transfer_config" not in translate().kwargs
    with pytest.raises(ConfigError, match="^kv_transport.backend: torchdist: vLLM's prefill/decode roles"):
        translate(role="decode", kv_transport={"backend": "torchdist"})


def test_a_preset_for_another_device_than_vllms_platform_is_refused():
    h100 = load_hardware_preset("nvidia-h100").profile
    with pytest.raises(ConfigError, match="^preset: nvidia-h100 runs on device cuda, but the installed vLLM runs on "
                                          "cpu"):
        translate(hardware=h100.model_dump())
    assert translate("cuda", hardware=h100.model_dump()).values[0].value == "cuda"


def test_every_decision_comes_with_a_reason_line():
    lines = [v.line() for v in translate(model={"revision": "abc123"}).values]
    fields = [line.split(" = ")[0] for line in lines]
    assert fields == ["device", "model.dtype", "model.max_model_len", "kv_pool.kv_dtype", "kv_pool.block_size",
                      "kv_pool.num_blocks", "scheduler.max_waiting", "model.revision"]
    assert all("(" in line and line.endswith(")") for line in lines)


def test_the_translation_and_the_registry_import_no_vllm():
    code = ("import sys, sage_infer, sage_infer.backends.vllm_args, sage_infer.backends.offline\n"
            "from sage_infer.backends.registry import list_backends\n"
            "list_backends()\n"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                             reason="vllm is installed here: tests/test_vllm_backend.py runs it")


@NO_VLLM
def test_llm_with_backend_vllm_says_why_it_cannot_run_here():
    from sage_infer import LLM

    with pytest.raises(ConfigError, match="^backend vllm is not available: vllm is not installed"):
        LLM(backend="vllm")


@NO_VLLM
def test_generate_with_backend_vllm_exits_2_with_one_line(sage):
    result = sage("llm", "generate", "--backend", "vllm", "--prompt", "ROMEO:")
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sage: error: backend vllm is not available: vllm is not installed")


def test_ngram_and_draft_model_speculation_become_vllms_speculative_config():
    assert "speculative_config" not in translate().kwargs
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert translate(speculative=speculative).kwargs["speculative_config"] == speculative
    speculative["disable_by_batch_size"] = 8
    assert translate(speculative=speculative).kwargs["speculative_config"] == speculative
    draft = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 5}
    assert translate(speculative=draft).kwargs["speculative_config"] == draft


def test_suffix_speculation_keeps_vllms_field_names():
    speculative = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 32,
                   "suffix_decoding_max_cached_requests": 50, "suffix_decoding_max_spec_factor": 2.0,
                   "suffix_decoding_min_token_prob": 0.2}
    assert translate(speculative=speculative).kwargs["speculative_config"] == speculative


def test_adaptive_speculation_is_refused_for_vllm():
    for method in ("ngram", "suffix"):
        with pytest.raises(ConfigError, match=f"^speculative.adaptive: vLLM's {method} proposer has no adaptive k"):
            translate(speculative={"method": method, "adaptive": True})
