"""Gemma 2 and Gemma 3 (text only): `Gemma2ForCausalLM`, `Gemma3ForCausalLM`. Parameter names match Hugging Face
so a checkpoint loads by name.

What sets them apart from the Llama family (`sage_infer.models.llama`): sliding-window layers beside full ones
(`ArchConfig.layer_windows`), attention scaled by ``query_pre_attn_scalar`` instead of head_dim, RMSNorms that scale
by ``1 + weight``, a norm after attention and around the MLP (pre/post feed-forward), a GELU-tanh gated MLP,
embeddings scaled by sqrt(hidden); Gemma 2 soft-caps attention scores and the logits; Gemma 3 normalizes q and k
per head and gives its sliding layers their own rope theta (``rope_local_base_freq``).

The elementwise parts run as the step executor's `ops` say (`sage_infer.layers.elementwise`): PyTorch ops (the
reference), or with `model.elementwise: fused` one C++ pass each (`cpu_kernels.gemma_rms_norm`, the residual add
with the norms around it, the q/k norms, rotary; GELU-tanh stays ATen's). Attention goes through the step's backend
like every model (`paged_attention`), each layer with its `AttentionKind`. A decode step can run every layer in
one C++ call (`prepare_decode_step`, csrc/decode_step.cpp).

Shapes: T = tokens in this step, H = query heads, KvH = KV heads, D = head_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sage_infer.layers import cpu_kernels as kernels
from sage_infer.layers.attention import AttentionMetadata, paged_attention
from sage_infer.layers.elementwise import TORCH_OPS, TorchOps, pass_rows
from sage_infer.layers.linear import PackedLinear
from sage_infer.layers.rotary import RotaryEmbedding, apply_rotary, attention_scaling, inv_frequencies
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.decode_step_args import layer_layout, pool_layer_map, step_linear
from sage_infer.models.llama import MLP, QKVProjections

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``, all in float32, cast back at the end (as Hugging Face's Gemma)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self._scale: tuple[tuple, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def scale(self) -> torch.Tensor:
        """The fp32 ``1 + weight`` [H] the C++ passes take, made again only when the weight changes."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.device)
        if self._scale is None or self._scale[0] != key:
            self._scale = key, (1.0 + weight.detach().float()).contiguous()
        return self._scale[1]

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` as one C++ pass (CPU)."""
        return kernels.gemma_rms_norm(x, self.scale(), self.eps)


def add_norms_(a: torch.Tensor, residual: torch.Tensor, post: GemmaRMSNorm, after: GemmaRMSNorm,
               fused: bool) -> torch.Tensor:
    """A sublayer's end: ``residual += post(a)`` in place, then ``after(residual)`` (the next sublayer's input);
    `fused`: one C++ pass."""
    if fused:
        return kernels.gemma_add_rms_norms_(a, residual, post.scale(), after.scale(), post.eps)
    residual.add_(post(a))
    return after(residual)


class GemmaAttention(QKVProjections, nn.Module):
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
        self.qkv_proj: nn.Module | None = None  # `fuse_projections`: q, k and v in one GEMM

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], pool: KVPool,
                meta: AttentionMetadata, fused: bool = False) -> torch.Tensor:
        """x: [T, hidden]; cos_sin: this layer's rotary tables ([T, 1, D] each; `fused`: [T, D], the C++ passes'
        shape) -> [T, hidden]."""
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v, qk = self.project(x)
        if fused:  # in place over the projections' output
            if self.qk_norm:
                kernels.gemma_norm_heads_(q, self.q_norm.scale(), self.q_norm.eps)
                kernels.gemma_norm_heads_(k, self.k_norm.scale(), self.k_norm.eps)
            for part in (qk,) if qk is not None else (q, k):
                kernels.rope_(part, *cos_sin)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, pool, self.layer, meta, self.scale, self.kind)
        return self.o_proj(out.reshape(t, heads * d))


class GemmaMLP(MLP):
    """Llama's MLP (and its `fuse_projections`) with GELU (tanh) in place of SiLU, run in passes of rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        rows = pass_rows(self.down_proj.in_features)  # each row's result is its own: passes bound the buffers
        if x.shape[0] <= rows:
            return self._stacked(x)
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for start in range(0, x.shape[0], rows):
            out[start : start + rows] = self._stacked(x[start : start + rows])
        return out

    def _stacked(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer, qk_norm)
        self.mlp = GemmaMLP(cfg)
        norm = [GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[0], norm[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2], norm[3]

    def forward(self, h: torch.Tensor, residual: torch.Tensor, after: GemmaRMSNorm, cos_sin, pool: KVPool,
                meta: AttentionMetadata, fused: bool = False) -> torch.Tensor:
        """h: this layer's normed input; `residual`: its input, the residual stream [T, hidden], updated in place to
        the layer's output; returns that normed by `after` (the next layer's input norm, or the final norm)."""
        attended = self.self_attn(h, cos_sin, pool, meta, fused)
        h = add_norms_(attended, residual, self.post_attention_layernorm, self.pre_feedforward_layernorm, fused)
        return add_norms_(self.mlp(h), residual, self.post_feedforward_layernorm, after, fused)


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
        """input_ids, positions: [T] -> hidden states [T, hidden] after the final norm. `ops`: PyTorch ops, or
        (``ops.name == "fused"``) Gemma's C++ passes."""
        fused = ops.name == "fused"
        x, h, (cos, sin, local_cos, local_sin) = self.embed(input_ids, positions, ops)
        layers = self.model.layers
        for i, layer in enumerate(layers):
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            local = layer.self_attn.local_rope and local_cos is not None
            h = layer(h, x, after, (local_cos, local_sin) if local else (cos, sin), pool, meta, fused)
        return h

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, ops: TorchOps = TORCH_OPS) -> tuple:
        """A step's start: the residual stream (the embeddings times sqrt(hidden), [T, hidden], which every layer
        updates in place), the first layer's normed input, and the rotary tables as `ops` takes them: (cos, sin,
        local cos, local sin), the local ones None unless the sliding layers have their own rope."""
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        full, local = self._rotary_tables(positions, x.dtype)
        tables = (*ops.rotary_tables(full), *(ops.rotary_tables(local) if local is not full else (None, None)))
        norm = self.model.layers[0].input_layernorm
        return x, norm.fused(x) if ops.name == "fused" else norm(x), tables

    def fuse_projections(self) -> int:
        """Stack each layer's q/k/v and gate/up weights into one linear each (fewer, wider GEMMs per step, the same
        products), before packing (`model.linear`); the reference path keeps the separate projections."""
        return sum(layer.self_attn.fuse_projections() + layer.mlp.fuse_projections() for layer in self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32, soft-capped when the config says so (Gemma 2)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decode_step_unavailable(self, pool: KVPool, fused: bool) -> str | None:
        """Why the C++ decode step (`prepare_decode_step`) cannot run this model over `pool`; None when it can."""
        dtype = self.model.norm.weight.dtype
        if not fused:
            return "it chains the fused elementwise ops (model.elementwise is torch or cannot run)"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"it runs fp32 and bf16 models (the model is {dtype})"
        if not pool.supports_int8_block_views and (not pool.supports_block_views or pool.dtype != dtype):
            return (f"it needs a KV pool in the model's dtype, or an int8 one (kv_dtype is {pool.schema.dtype.value}, "
                    f"the model {dtype})")
        for layer in self.model.layers:
            linears = _decode_linears(layer)
            if not all(isinstance(m, PackedLinear) for m in linears):
                return "it needs every projection packed (model.linear), q/k/v and gate/up stacked"
            if any(m.weight_bf16 is not None and not m.rows_kernel for m in linears):
                return "its bf16 layers on fp32 copies need the bf16 rows kernel, which was not loaded for them"
        if len({n.eps for n in self.modules() if isinstance(n, GemmaRMSNorm)}) > 1:
            return "it takes one RMSNorm epsilon for all the layers' norms"
        return None

    def prepare_decode_step(self, pool: KVPool) -> object:
        """Hand every layer's packed weights, (1 + w) norms, attention kind, KV group and `pool` rows to the C++
        decode step (csrc/decode_step.cpp; what goes in the lists: `LlamaForCausalLM.prepare_decode_step`, with
        Gemma's feed-forward norms in `ff_norms`). The caller checked `decode_step_unavailable`."""
        cfg, layers = self.config, self.model.layers
        layer_map = pool_layer_map(cfg, pool)
        args: dict[str, list] = {name: [] for name in ("shapes", "packed", "biases", "bf16", "tensors", "qk_norms",
                                                       "kv_scales", "ff_norms", "layout", "softcaps")}
        for i, layer in enumerate(layers):
            attn, (group, slot) = layer.self_attn, layer_map[i]
            for linear in _decode_linears(layer):
                shape, weight, biases, bf16 = step_linear(linear)
                args["shapes"] += shape
                args["packed"].append(weight)
                args["biases"] += biases
                args["bf16"] += bf16
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            norms = [layer.post_attention_layernorm.scale(), after.scale()]
            if pool.supports_int8_block_views:
                k_codes, v_codes, k_scales, v_scales = pool.int8_block_views(slot)
                rows = [codes.view(-1, *codes.shape[2:]) for codes in (k_codes, v_codes)]
                args["tensors"] += [*norms, *rows, k_codes, v_codes]
                args["kv_scales"] += [k_scales, v_scales]
            else:
                args["tensors"] += [*norms, *pool.token_rows(slot), *pool.block_views(slot)]
            if attn.qk_norm:
                args["qk_norms"] += [attn.q_norm.scale(), attn.k_norm.scale()]
            args["ff_norms"] += [layer.pre_feedforward_layernorm.scale(), layer.post_feedforward_layernorm.scale()]
            args["layout"] += layer_layout(group, attn.kind, attn.local_rope)
            args["softcaps"].append(attn.kind.softcap or 0.0)
        attn = layers[0].self_attn
        return kernels.decode_layers(args["shapes"], args["packed"], args["biases"], args["bf16"], args["tensors"],
                                     args["qk_norms"], args["kv_scales"], attn.num_heads, attn.num_kv_heads,
                                     attn.head_dim, cfg.rms_norm_eps, cfg.rms_norm_eps, attn.scale,
                                     ff_norms=args["ff_norms"], layout=args["layout"], softcaps=args["softcaps"])


def _decode_linears(layer: GemmaDecoderLayer) -> tuple[nn.Module | None, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
