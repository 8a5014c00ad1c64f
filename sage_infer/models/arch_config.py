"""The few numbers a decoder needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sage_infer.core.dtypes import parse_dtype_name
from sage_infer.layers.rotary import rope_parameters


@dataclass(slots=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None
    torch_dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, config: dict, architecture: str) -> ArchConfig:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // heads
        family = architecture.removesuffix("ForCausalLM")
        qkv_bias = bool(config.get("attention_bias", family == "Qwen2"))
        sliding = config.get("sliding_window")
        if family == "Qwen2" and not config.get("use_sliding_window", False):
            sliding = None
        eos = config.get("eos_token_id")
        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope=rope_parameters(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family == "Qwen3",
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=parse_dtype_name(dtype_name, torch.float32),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
