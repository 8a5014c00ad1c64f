"""Gemma 2 and Gemma 3 (text only): `Gemma2ForCausalLM`, `Gemma3ForCausalLM`. Parameter names match Hugging Face
so a checkpoint loads by name.

What sets them apart from the Llama family (`sage_infer.models.llama`): sliding-window layers beside full ones
(`ArchConfig.layer_windows`), attention scaled by ``query_pre_attn_scalar`` instead of head_dim, RMSNorms that scale
by ``1 + weight``, a norm after attention and around the MLP (pre/post feed-forward), a GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden); Gemma 2 soft-caps attention scores and the logits; Gemma 3 normalizes q and k
per head and gives its sliding layers their own rope theta (``rope_local_base_freq``).

Every layer runs PyTorch elementwise ops (the fused ones are the Llama family's: `model.elementwise` resolves to torch
for Gemma, `fused_elementwise_unavailable`); attention
goes through the step's backend like every model (`paged_attention`), each layer with its `AttentionKind`.

Shapes: T = tokens in this step, H = query heads, KvH = KV heads, D = head_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sage_infer.layers.attention import AttentionMetadata, paged_attention
from sage_infer.layers.elementwise import TORCH_OPS, TorchOps
from sage_infer.layers.rotary import RotaryEmbedding, apply_rotary, attention_scaling, inv_frequencies
from sage_infer.models.arch_config import ArchConfig

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``, all in float32, cast back at the end (as Hugging Face's Gemma)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.kind = cfg.attention_kind(layer)
        self.local_rope = self.kind.window is not None and cfg.rope_local is not None
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], pool: KVPool,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden]; cos_sin: this layer's rotary tables ([T, 1, D] each) -> [T, hidden]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, pool, self.layer, meta, self.scale, self.kind)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer, qk_norm)
        self.mlp = GemmaMLP(cfg)
        norm = [GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[0], norm[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2], norm[3]

    def forward(self, x: torch.Tensor, cos_sin, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream [T, hidden] -> the layer's output."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, pool, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, qk_norm) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 (`qk_norm` False) and Gemma 3 text (`qk_norm` True)."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in GEMMA_ACTIVATIONS:
            raise ValueError(f"hidden_activation: {cfg.hidden_act!r} is not built for Gemma (built: "
                             f"{', '.join(GEMMA_ACTIVATIONS)})")
        self.config = cfg
        self.model = GemmaModel(cfg, qk_norm=cfg.architecture == "Gemma3ForCausalLM")
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._local_inv_freq: torch.Tensor | None = None  # Gemma 3's sliding layers' rope, made on first use

    def _rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, tuple]:
        """(full layers' cos/sin, sliding layers' cos/sin): the same tables unless the sliding layers have their
        own rope (`ArchConfig.rope_local`)."""
        rotary = self.model.rotary_emb
        full = rotary.cos_sin(positions, dtype)
        cfg = self.config
        if cfg.rope_local is None:
            return full, full
        if self._local_inv_freq is None or self._local_inv_freq.device != positions.device:
            self._local_inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_local,
                                                   cfg.max_position_embeddings).to(positions.device)
        global_inv_freq, global_scaling = rotary.inv_freq, rotary.attention_scaling
        rotary.inv_freq = self._local_inv_freq
        rotary.attention_scaling = attention_scaling(cfg.rope_local, cfg.max_position_embeddings)
        try:
            local = rotary.cos_sin(positions, dtype)
        finally:
            rotary.inv_freq, rotary.attention_scaling = global_inv_freq, global_scaling
        return full, local

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool, meta: AttentionMetadata,
                ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] after the final norm. `ops` is ignored: the
        elementwise parts are Gemma's own (PyTorch)."""
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        full, local = self._rotary_tables(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, local if layer.self_attn.local_rope else full, pool, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32, soft-capped when the config says so (Gemma 2)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fused_elementwise_unavailable(self) -> str:
        """Why `model.elementwise: fused` does not apply: the fused passes are the Llama family's norms and MLP."""
        return "Gemma's (1 + w) norms and GELU MLP run as PyTorch ops (the fused passes are the Llama family's)"

    def decode_step_unavailable(self, pool: KVPool, fused: bool) -> str | None:
        """The C++ decode step runs the Llama family's layers only."""
        return "it runs the Llama family's layers (Gemma has its own norms, MLP and attention kinds)"
