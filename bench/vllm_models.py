"""The models bench/engine_vs_vllm.py compares on: the bundled demo model, and random-weight
Qwen shapes built with `transformers` that carry the demo tokenizer (vocab 4096), among them a
mixture-of-experts one (Qwen3-30B-A3B's layer with 2 layers) and two with sliding-window layers (Gemma-3- and
gpt-oss-shaped).

A built model is saved once under the cache directory (fp32 safetensors, tied embeddings unless its shape
says otherwise) and reused; each engine casts it to the dtype of the run.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "sage_infer" / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BUILD_VERSION = 1  # bump when the build changes, so every cached copy is rebuilt


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    description: str
    dtype: str  # the default dtype of a run (the anchor's)
    arch: str | None = None  # None: the bundled demo model, as shipped
    shape: dict = field(default_factory=dict)
    revision: int = 0  # bump when this shape changes, so its cached copy is rebuilt


MODELS = {
    "demo": ModelSpec("demo", "bundled demo model (4M Llama, trained weights)", "bf16"),
    "qwen3-11m": ModelSpec(
        "qwen3-11m", "random Qwen3 shape, 11M: hidden 384, 6 layers, 6/2 heads, head_dim 64, inter 1024", "fp32",
        arch="qwen3", shape=dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                                 head_dim=64, intermediate_size=1024)),
    "qwen2.5-0.5b-shape": ModelSpec(
        "qwen2.5-0.5b-shape", "random Qwen2.5-0.5B shape, 362M: hidden 896, 24 layers, 14/2 heads, inter 4864",
        "bf16", arch="qwen2", shape=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                         num_key_value_heads=2, intermediate_size=4864)),
    "qwen3-30b-a3b-2l": ModelSpec(
        "qwen3-30b-a3b-2l", "random Qwen3-30B-A3B shape with 2 layers, 1.2B (0.1B active): hidden 2048, 32/4 heads, "
        "head_dim 128, 128 experts x 768, top 8, norm_topk_prob", "bf16",
        arch="qwen3_moe", shape=dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                                     num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                     norm_topk_prob=True)),
    "qwen1.5-moe-a2.7b-2l": ModelSpec(
        "qwen1.5-moe-a2.7b-2l", "random Qwen1.5-MoE-A2.7B shape (Qwen2-MoE) with 2 layers, 0.8B: hidden 2048, 16/16 "
        "heads, 60 experts x 1408, top 4, a shared expert of 5632 with its sigmoid gate", "bf16",
        arch="qwen2_moe", shape=dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                                     num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                                     shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                                     norm_topk_prob=False)),
    "olmoe-1b-7b-2l": ModelSpec(
        "olmoe-1b-7b-2l", "random OLMoE-1B-7B shape with 2 layers, 0.9B: hidden 2048, 16/16 heads, head_dim 128, "
        "64 experts x 1024, top 8, q/k norms over all heads", "bf16",
        arch="olmoe", shape=dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                                 num_key_value_heads=16, intermediate_size=1024, num_experts=64,
                                 num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5)),
    # sliding-window shapes: max_position_embeddings is 4 windows + 32, so W4's prompts are 4 windows long
    "gemma3-shape-small": ModelSpec(
        "gemma3-shape-small", "random Gemma-3-270m shape with 6 layers (5 sliding-window 512 : 1 full), 36M: "
        "hidden 640, 4/1 heads, head_dim 256, inter 2048, 2,080 positions", "fp32",
        arch="gemma3", shape=dict(hidden_size=640, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=256, intermediate_size=2048, query_pre_attn_scalar=256,
                                  sliding_window=512, max_position_embeddings=2080,
                                  layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    "gpt-oss-shape-small": ModelSpec(
        "gpt-oss-shape-small", "random gpt-oss shape with 4 layers (sliding-window 128 / full, alternating), "
        "30M: hidden 512, 8/2 heads, head_dim 64, 8 experts x 512, top 4, attention sinks, 544 positions, "
        "untied lm_head", "fp32",
        # untied as gpt-oss itself is: vLLM's GptOssForCausalLM ignores tie_word_embeddings and would run a
        # zero lm_head (every greedy token 0) on a tied checkpoint
        arch="gpt_oss", shape=dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=64, intermediate_size=512, num_local_experts=8,
                                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=544,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   tie_word_embeddings=False), revision=1),
}


def prepare_model(spec: ModelSpec, cache_dir: Path, seed: int = 0) -> Path:
    """The model's directory: the demo model in place, or a random model built (once) under cache_dir."""
    if spec.arch is None:
        return DEMO_DIR
    revision = f"r{spec.revision}" if spec.revision else ""
    directory = cache_dir / f"{spec.name}-seed{seed}-v{BUILD_VERSION}{revision}"
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers

    classes = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
               "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
               "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
               "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}
    config_cls, model_cls = classes[spec.arch]
    demo = json.loads((DEMO_DIR / "config.json").read_text())
    settings = dict(vocab_size=demo["vocab_size"], bos_token_id=demo["bos_token_id"],
                    eos_token_id=demo["eos_token_id"], pad_token_id=demo["pad_token_id"],
                    max_position_embeddings=4096, tie_word_embeddings=True)
    config = config_cls(**{**settings, **spec.shape})  # a shape may set its own vocab_size
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # build next to the target and rename, so an interrupted build never looks finished
    partial = cache_dir / f".{directory.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_DIR / name, partial / name)
    partial.rename(directory)
    return directory


def model_facts(model_dir: Path) -> dict:
    """vocab, context length and parameter count read from the saved model; `read_params`: those one token's
    forward reads (a mixture of experts reads its top-k of each layer's experts, counted as k / E of them)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    params = experts = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():
            n = math.prod(f.get_slice(key).get_shape())
            params += n
            experts += n if ".experts." in key else 0
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    active = config["num_experts_per_tok"] / num_experts if num_experts else 1.0
    return {"vocab_size": config["vocab_size"], "max_position_embeddings": config["max_position_embeddings"],
            "params": params, "read_params": round(params - experts * (1 - active)),
            "architecture": config["architectures"][0]}
