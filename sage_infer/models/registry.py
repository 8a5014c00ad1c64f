"""Architectures this engine runs, by the name in ``config.json`` ``architectures``."""

from __future__ import annotations

from torch import nn

from sage_infer.models.arch_config import ArchConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def build_model(cfg: ArchConfig) -> nn.Module:
    from sage_infer.models.llama import LlamaForCausalLM

    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}")
    return LlamaForCausalLM(cfg)
