"""gpt-oss (`GptOssForCausalLM`) against transformers, fp32 greedy tokens on random weights: attention sinks (random, so
they matter), alternating sliding-window (8 keys) and full layers with prompts longer than the window, q/k/v/o biases,
yarn rope, a biased router over 4 experts (top 2) and clamped SwiGLU experts with biases (a limit low enough that the
clamp bites); a batch of several prompts through the reference path and, at each ISA level this CPU runs, the paths
the engine picks (the paged decode and flash prefill kernels taking the window and sinks), with prefix cache hits and
with chunked prefill; MXFP4 experts kept MXFP4 on the grouped kernel, dequantized per expert or at load. Config
fields sage does not build are refused naming the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from sage_infer.layers.cpu_kernels import flash_unavailable, kernel_unavailable
from sage_infer.layers.rotary import attention_scaling, inv_frequencies, rope_parameters
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.loader import ModelLoadError
from tests.test_engine_vs_transformers import random_prompts
from tests.test_sliding_window import PATHS, engine, hf_greedy, sage_greedy
from tests.tiny_models import save_tokenizer

WINDOW = 8
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 256}
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=1024, swiglu_limit=0.6, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              rope_parameters=ROPE)


def shared_prefix_prompts() -> list[list[int]]:
    """Four prompts longer than the window; three share a 32-token (two-block) prefix."""
    system = random_prompts([32], seed=11)[0]
    return [system + tail for tail in random_prompts([5, 14, 1], seed=12)] + random_prompts([27], seed=13)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():  # sinks, router and expert biases start near zero: random ones decide tokens
        for name, param in hf.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0, 1.5)
            elif ".mlp." in name:
                param.normal_(0, 0.3)
    directory = tmp_path_factory.mktemp("gpt-oss") / "model"
    hf.save_pretrained(directory)
    save_tokenizer(directory, CONFIG["vocab_size"])
    hf = hf_reference(directory)
    prompts = shared_prefix_prompts()
    return directory, prompts, hf_greedy(hf, prompts)


def hf_reference(directory, **kwargs) -> transformers.PreTrainedModel:
    """transformers' gpt-oss from `directory` (fp32, eager attention and experts), its experts' clamp the config's
    ``swiglu_limit``: transformers 5.17 (a GPU machine's image) fixes it at 7.0 whatever the config says, a different
    model with the limit of 0.6 here; 5.25, vLLM and sage read the config's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                           experts_implementation="eager", **kwargs).eval()
    for layer in hf.model.layers:
        layer.mlp.experts.limit = hf.config.swiglu_limit
    return hf


def check_gpt_oss(directory, prompts, want, path: str):
    llm = engine(directory, **PATHS[path])
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.kind.window for layer in layers] == [WINDOW, None, WINDOW, None]
    decided = {d.field: d for d in llm.engine.decisions}
    assert decided["model.layer_attention"].value == "2 x sliding window 8, attention sinks; 2 x full, attention sinks"
    reason = decided["model.layer_attention"].reason
    if path == "reference":
        assert reason == ("config.json; decode rows through PyTorch (the gathered decode part is the PyTorch oracle); "
                          "prefill spans through PyTorch (the torch prefill part is the PyTorch oracle)")
    else:
        assert ("decode rows through the paged kernel" in reason) == (kernel_unavailable() is None)
        assert ("prefill spans through the flash kernel" in reason) == (flash_unavailable(32, torch.float32) is None)
    # the engine's own paths: decode steps in the C++ step (sinks, windows, biases and the experts' kernel call)
    want_step = "sage" if path == "auto" and kernel_unavailable() is None else "python"
    assert decided["model.decode_step"].value == want_step, decided["model.decode_step"].reason
    assert decided["model.experts"].value == "4 x 32, top 2"
    first = sage_greedy(llm, prompts[:1])
    rest = sage_greedy(llm, prompts[1:])  # a batch of three; two share the first prompt's 32 tokens, from the cache
    assert first + rest == want
    assert llm.engine.kv.index.metrics.hit_blocks >= 4
    assert sum(sum(counts) for _, counts in llm.engine.runner.model.expert_tokens()) > 0


def test_gpt_oss_matches_transformers_with_prefix_hits(gpt_oss):
    check_gpt_oss(*gpt_oss, "reference")


def test_gpt_oss_kernels_match_transformers_at_each_isa(gpt_oss, cpu_isa):
    """The engine's own paths (auto) at each ISA level: sinks and windows through the paged and flash kernels."""
    check_gpt_oss(*gpt_oss, "auto")


@pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_cpp_decode_step_gives_the_layer_loops_tokens_and_expert_counts(gpt_oss, dtype):
    """Decode steps of up to `decode_step_rows` rows in the C++ step (each layer's sinks and window, its biased
    projections, and its router and experts in one `moe_block` call) give the layer loop's tokens and per-expert counts
    exactly, bf16 too."""
    directory, prompts, _ = gpt_oss
    got = {}
    for choice in ("sage", "python"):
        llm = engine(directory, dtype=dtype, decode_step=choice)
        assert llm.engine.runner.step.name == ("cpp-decode" if choice == "sage" else "fused")
        got[choice] = (sage_greedy(llm, prompts), llm.engine.runner.model.expert_tokens())
    assert got["sage"] == got["python"]


def test_gpt_oss_with_chunked_prefill_matches_transformers(gpt_oss):
    directory, prompts, want = gpt_oss
    assert sage_greedy(engine(directory, max_num_batched_tokens=16), prompts) == want


def test_the_sinks_decide_tokens(gpt_oss):
    """Parity above would hold with the sinks ignored unless they change the tokens: zeroed in sage alone, it breaks."""
    directory, prompts, want = gpt_oss
    llm = engine(directory)
    with torch.no_grad():
        for layer in llm.engine.runner.model.model.layers:
            layer.self_attn.sinks.zero_()
    assert sage_greedy(llm, prompts) != want


def test_deterministic_steps_are_refused_for_sinks_layers(gpt_oss):
    from sage_infer.errors import ConfigError

    with pytest.raises(ConfigError, match="not built for models with sliding-window, soft-capped or sinks layers"):
        engine(gpt_oss[0], deterministic=True)


def test_yarn_rope_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in (ROPE, {**ROPE, "truncate": True, "mscale": 0.8, "mscale_all_dim": 1.0},
                   {**ROPE, "attention_factor": 1.25, "beta_fast": 16.0}):
        config = transformers.GptOssConfig(**{**CONFIG, "rope_parameters": dict(params)})
        want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
        ours = rope_parameters({"rope_parameters": dict(params)})
        assert torch.equal(inv_frequencies(CONFIG["head_dim"], ours, 1024), want_freq)
        assert attention_scaling(ours, 1024) == want_scale


def test_config_without_layer_types_takes_transformers_defaults():
    cfg = ArchConfig.from_hf({"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 8, "intermediate_size": 8,
                              "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
                             "GptOssForCausalLM")
    assert cfg.layer_windows == (128, None, 128, None) and cfg.qkv_bias and cfg.o_bias and cfg.head_dim == 64
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["rope_theta"] == 150000.0 and cfg.rope["factor"] == 32.0
    assert (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 7.0)


def mxfp4_checkpoint(source, directory, **quantization) -> None:
    """`source` with its experts replaced by random MXFP4 blocks and scales, as OpenAI's checkpoints store them."""
    shutil.copytree(source, directory)
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor
            continue
        experts, cols, rows = tensor.shape  # [E, in, out]: MXFP4 blocks run along `in`
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                                                  generator=generator)
        tensors[f"{name}_scales"] = torch.randint(121, 127, (experts, rows, cols // 32), dtype=torch.uint8,
                                                  generator=generator)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], **quantization}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The gpt-oss checkpoint with MXFP4 experts, and transformers' greedy tokens on it (``Mxfp4Config(dequantize=
    True)``: transformers runs MXFP4 only on a GPU, dequantized elsewhere)."""
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model"
    mxfp4_checkpoint(gpt_oss[0], directory)
    hf = hf_reference(directory, quantization_config=transformers.Mxfp4Config(dequantize=True))
    prompts = gpt_oss[1][1:3]
    want = hf_greedy(hf, prompts)
    assert want != gpt_oss[2][1:3]  # the experts are the MXFP4 ones, not the float checkpoint's
    return directory, prompts, want


def expert_tensors(llm) -> dict[str, torch.dtype]:
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    return {name: param.dtype for name, param in experts.named_parameters()}


def test_mxfp4_experts_stay_mxfp4_on_the_grouped_kernel_and_match_transformers(gpt_oss_mxfp4, cpu_isa):
    """OpenAI's gpt-oss checkpoints store their experts as MXFP4: on a CPU with the kernels they stay MXFP4 in
    memory (a quarter of bf16's bytes), read in place by the grouped-experts kernel at each ISA level; the tokens
    are transformers' on the dequantized experts."""
    directory, prompts, want = gpt_oss_mxfp4
    llm = engine(directory)
    reason = {d.field: d for d in llm.engine.decisions}["model.experts"].reason
    assert ("MXFP4 experts kept as they are" in reason) == (kernel_unavailable() is None)
    if kernel_unavailable() is None:
        assert expert_tensors(llm) == {"gate_up_proj_bias": torch.float32, "down_proj_bias": torch.float32,
                                       **{f"{w}_{part}": torch.uint8 for w in ("gate_up_proj", "down_proj")
                                          for part in ("blocks", "scales")}}
    assert sage_greedy(llm, prompts) == want


def test_mxfp4_experts_on_the_per_expert_products_and_dequantized_at_load_match_transformers(gpt_oss_mxfp4,
                                                                                           tmp_path):
    """The PyTorch path (``model.elementwise: torch``) dequantizes each MXFP4 expert it runs; a config with
    ``dequantize: true`` gets float experts at load, as transformers' ``Mxfp4Config(dequantize=True)`` does."""
    directory, prompts, want = gpt_oss_mxfp4
    assert sage_greedy(engine(directory, **PATHS["reference"]), prompts) == want
    dequantized = tmp_path / "model"
    shutil.copytree(directory, dequantized)
    config = json.loads((dequantized / "config.json").read_text())
    config["quantization_config"]["dequantize"] = True
    (dequantized / "config.json").write_text(json.dumps(config))
    llm = engine(dequantized)
    assert set(expert_tensors(llm).values()) == {torch.float32}
    assert sage_greedy(llm, prompts) == want


def test_mxfp4_config_sage_does_not_run_is_refused_naming_the_field(tmp_path):
    from sage_infer.models.loader import quantization_of

    qc = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    for arch, extra, field in (("Qwen3MoeForCausalLM", {}, "quant_method: 'mxfp4' is built for GptOssForCausalLM"),
                               ("GptOssForCausalLM", {"group_size": 16}, "quantization_config.group_size: not")):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "quantization_config": {
            **qc, **extra}}))
        with pytest.raises(ModelLoadError, match=field):
            quantization_of(tmp_path)


def test_a_rope_sage_does_not_build_is_refused_at_start_up_naming_the_field(gpt_oss, tmp_path):
    from sage_infer.models.loader import arch_config

    directory = tmp_path / "model"
    directory.mkdir()
    config = json.loads((gpt_oss[0] / "config.json").read_text())
    config["rope_parameters"] = {**ROPE, "partial_rotary_factor": 0.5}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json: .*partial_rotary_factor 0.5 is not built"):
        arch_config(directory)
    config["rope_parameters"] = {**ROPE, "rope_type": "longrope"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json: .*rope_type 'longrope' is not built"):
        arch_config(directory)
