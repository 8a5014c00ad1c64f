"""Architectures this engine runs, by the name in ``config.json`` ``architectures``."""

from __future__ import annotations

from torch import nn

from sage_infer.models.arch_config import ArchConfig

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# mixture of experts (`sage_infer.models.moe`)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")
# Gemma 2 and text-only Gemma 3 (`sage_infer.models.gemma`; Gemma3ForConditionalGeneration is not built)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES + GEMMA_ARCHITECTURES


def build_model(cfg: ArchConfig) -> nn.Module:
    if cfg.architecture in MOE_ARCHITECTURES:
        from sage_infer.models.moe import MoeForCausalLM

        return MoeForCausalLM(cfg)
    if cfg.architecture in GEMMA_ARCHITECTURES:
        from sage_infer.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM(cfg)
    from sage_infer.models.llama import LlamaForCausalLM

    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}")
    return LlamaForCausalLM(cfg)
