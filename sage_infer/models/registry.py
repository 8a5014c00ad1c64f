"""Architectures this engine runs, by the name in ``config.json`` ``architectures``."""

from __future__ import annotations

from torch import nn

from sage_infer.models.arch_config import ArchConfig

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# mixture of experts (`sage_infer.models.moe`)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")
# Gemma 2 and text-only Gemma 3 (`sage_infer.models.gemma`; Gemma3ForConditionalGeneration is not built)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# gpt-oss: attention sinks, sliding and full layers, clamped SwiGLU experts (`sage_infer.models.gpt_oss`)
GPT_OSS_ARCHITECTURES = ("GptOssForCausalLM",)
MXFP4_ARCHITECTURES = GPT_OSS_ARCHITECTURES  # MXFP4 experts (`sage_infer.quantization.mxfp4`)
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES + GEMMA_ARCHITECTURES + GPT_OSS_ARCHITECTURES
NOT_BUILT = {  # architectures asked for that are not built yet: what they miss
    "Gemma3ForConditionalGeneration": "multimodal Gemma 3 is not built (text-only Gemma 3 is Gemma3ForCausalLM)",
}


def unsupported_architecture(arch: str | None) -> str:
    """The one line that refuses `arch`: what it misses when known, and what runs."""
    why = f": {NOT_BUILT[arch]}" if arch in NOT_BUILT else ""
    return f"architecture {arch!r} is not supported{why} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"


def build_model(cfg: ArchConfig) -> nn.Module:
    if cfg.architecture in MOE_ARCHITECTURES:
        from sage_infer.models.moe import MoeForCausalLM

        return MoeForCausalLM(cfg)
    if cfg.architecture in GPT_OSS_ARCHITECTURES:
        from sage_infer.models.gpt_oss import GptOssForCausalLM

        return GptOssForCausalLM(cfg)
    if cfg.architecture in GEMMA_ARCHITECTURES:
        from sage_infer.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM(cfg)
    from sage_infer.models.llama import LlamaForCausalLM

    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}")
    return LlamaForCausalLM(cfg)
