"""One decoder for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral,
Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm). Parameter names match Hugging Face so a
checkpoint loads by name.

Shapes: T = tokens in this step (all sequences flattened), H = query heads,
KvH = KV heads, D = head_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sage_infer.layers.attention import AttentionMetadata, paged_attention
from sage_infer.layers.norm import RMSNorm
from sage_infer.layers.rotary import RotaryEmbedding
from sage_infer.models.arch_config import ArchConfig

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # which layer's K/V this module stores and reads in the pool
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, pool, self.layer, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, pool, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]; layer ``i`` stores and reads its K/V
        as layer ``i`` of `pool`."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.model.rotary_emb, pool, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()
