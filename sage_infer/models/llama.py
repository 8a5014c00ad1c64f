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

from sage_infer.layers import cpu_kernels as kernels
from sage_infer.layers.attention import AttentionMetadata, paged_attention
from sage_infer.layers.linear import PackedLinear
from sage_infer.layers.norm import RMSNorm
from sage_infer.layers.rotary import RotaryEmbedding, apply_rotary
from sage_infer.models.arch_config import ArchConfig

# `MLP.forward_fused` runs a prefill step's rows through the MLP in passes whose stacked gate/up product (fp32, the
# largest activation of a layer) stays within this many bytes: a buffer above glibc's largest mmap threshold (32 MiB)
# is mapped and page-faulted afresh on every call (sage_infer/hal/malloc.py), which cost 10-20 % of a 2,000-row
# prefill of the 0.5B shape on a 2-core AVX2 CPU (docs/benchmarks.md "Allocator and fused elementwise ops")
MLP_PASS_BYTES = 16 << 20
MLP_PASS_MIN_ROWS = 128

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


def _stacked_linear(linears: list[nn.Module]) -> nn.Linear | None:
    """One `nn.Linear` whose output is the given linears' outputs side by side, or None unless they
    are all plain `nn.Linear` (a quantized one is left alone) of one input size, dtype and device."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    first = linears[0].weight
    if any(m.in_features != linears[0].in_features or m.weight.dtype != first.dtype or m.weight.device != first.device
           or (m.bias is None) != (linears[0].bias is None) for m in linears):
        return None
    out_features = sum(m.out_features for m in linears)
    fused = nn.Linear(linears[0].in_features, out_features, bias=linears[0].bias is not None,
                      dtype=first.dtype, device=first.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    fused.requires_grad_(False)
    return fused


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
        self.qkv_proj: nn.Module | None = None  # `fuse_projections`: q, k and v in one GEMM

    def fuse_projections(self) -> bool:
        """Replace q/k/v_proj by one `qkv_proj` (their weights stacked: the same products, one GEMM
        call instead of three); False, and nothing changed, unless all three are plain `nn.Linear`."""
        fused = _stacked_linear([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return False
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos_sin: this step's rotary tables (`RotaryEmbedding.cos_sin`) -> [T, hidden]."""
        t, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None and not self.qk_norm:  # q and k side by side: one rotary for both
            qkv = self.qkv_proj(x).view(t, heads + 2 * kv_heads, self.head_dim)
            q, k = apply_rotary(qkv[:, : heads + kv_heads], *cos_sin).split([heads, kv_heads], dim=1)
            v = qkv[:, heads + kv_heads :]
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split([heads * self.head_dim, kv_heads * self.head_dim,
                                                  kv_heads * self.head_dim], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k = q.view(t, heads, self.head_dim), k.view(t, kv_heads, self.head_dim)
            v = v.view(t, kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, pool, self.layer, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def forward_fused(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], pool: KVPool,
                      meta: AttentionMetadata) -> torch.Tensor:
        """`forward` with the q/k norms and rotary as in-place C++ passes over the projection's output
        (`kernels.rope_`); cos_sin: `forward`'s tables without their head axis, [T, head_dim] each."""
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(t, heads + 2 * kv_heads, d)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        else:
            q, k = self.q_proj(x).view(t, heads, d), self.k_proj(x).view(t, kv_heads, d)
            v = self.v_proj(x).view(t, kv_heads, d)
        cos, sin = cos_sin
        if self.qk_norm:
            kernels.rope_(q, cos, sin, self.q_norm.weight, self.q_norm.eps)
            kernels.rope_(k, cos, sin, self.k_norm.weight, self.k_norm.eps)
        elif self.qkv_proj is not None:  # q and k side by side: one pass
            kernels.rope_(qkv[:, : heads + kv_heads], cos, sin)
        else:
            kernels.rope_(q, cos, sin)
            kernels.rope_(k, cos, sin)
        out = paged_attention(q, k, v, pool, self.layer, meta, self.scale)
        return self.o_proj(out.reshape(t, heads * d))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # `fuse_projections`: gate and up in one GEMM

    def fuse_projections(self) -> bool:
        """Replace gate/up_proj by one `gate_up_proj`; False, and nothing changed, unless both are plain `nn.Linear`."""
        fused = _stacked_linear([self.gate_proj, self.up_proj])
        if fused is None:
            return False
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with silu(gate) * up as one C++ pass (`kernels.silu_mul`) over the stacked projection; rows in
        passes of `pass_rows` (each row's result is its own: a pass only bounds the intermediate buffers)."""
        if self.gate_up_proj is None:
            return self.forward(x)
        rows = self.pass_rows()
        if x.shape[0] <= rows:
            return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for start in range(0, x.shape[0], rows):
            out[start:start + rows] = self.down_proj(kernels.silu_mul(self.gate_up_proj(x[start:start + rows])))
        return out

    def pass_rows(self) -> int:
        """Rows per pass of `forward_fused`: the stacked gate/up product of that many rows fits `MLP_PASS_BYTES` in
        fp32 (at least `MLP_PASS_MIN_ROWS`)."""
        return max(MLP_PASS_MIN_ROWS, MLP_PASS_BYTES // (4 * self.down_proj.in_features * 2))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, pool, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h, residual, next_norm: RMSNorm, cos_sin, pool, meta) -> torch.Tensor:
        """`forward` as C++ passes: h is this layer's normed input, `residual` its input (updated in
        place to the output); returns the output normed by `next_norm` (the next layer's input norm, or
        the model's final norm): each residual add runs in the same pass as the norm after it."""
        post = self.post_attention_layernorm
        h = kernels.add_rms_norm_(self.self_attn.forward_fused(h, cos_sin, pool, meta), residual, post.weight, post.eps)
        return kernels.add_rms_norm_(self.mlp.forward_fused(h), residual, next_norm.weight, next_norm.eps)


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
        fused: bool = False,
        decode_step: object | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]; layer ``i`` stores and reads its K/V
        as layer ``i`` of `pool`. The step executor (`sage_infer.engine.step`) says how: `fused`, the layers'
        norms, rotary and silu*mul as C++ passes (`forward_fused`); `decode_step` (from `prepare_decode_step`
        over this `pool`), a decode step's layers in one C++ call."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary_emb.cos_sin(positions, x.dtype)  # once per step, not per layer
        layers = self.model.layers
        if fused:  # x is the embedding's fresh output: the residual stream, updated in place
            cos_sin = tuple(table[:, 0] for table in cos_sin)  # [T, D], the shape the C++ rotary takes
            first = layers[0].input_layernorm
            h = kernels.rms_norm(x, first.weight, first.eps)
            if decode_step is not None:  # a decode step: every layer in one C++ call
                if (group := meta.pure_decode_group()) is not None:
                    return decode_step.run(h, x, *cos_sin, meta.slot_mapping, group.block_tables,
                                           group.context_lens, None, False)
                # an int8 pool's shared prefix is attended in Python (its keys dequantized, `gather_blocks`)
                if pool.supports_block_views and (group := meta.cascade_decode_group(x.shape[0])) is not None:
                    return decode_step.run(h, x, *cos_sin, meta.slot_mapping, group.block_tables,
                                           group.context_lens, meta.shared.block_ids, meta.backend.prefill.flash)
            for i, layer in enumerate(layers):
                after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                h = layer.forward_fused(h, x, after, cos_sin, pool, meta)
            return h
        for layer in layers:
            x = layer(x, cos_sin, pool, meta)
        return self.model.norm(x)

    def fuse_projections(self) -> int:
        """Stack each layer's q/k/v and gate/up weights into one linear each (`Attention.fuse_projections`,
        `MLP.fuse_projections`): fewer, wider GEMMs per step, the same products. How many were fused.
        Done before packing (`model.linear`); the reference path keeps the separate projections."""
        return sum(layer.self_attn.fuse_projections() + layer.mlp.fuse_projections() for layer in self.model.layers)

    def decode_step_unavailable(self, pool: KVPool, fused: bool) -> str | None:
        """Why the C++ decode step (`prepare_decode_step`) cannot run this model over `pool` (`fused`: the
        elementwise ops run fused); None when it can."""
        dtype = self.model.norm.weight.dtype
        if not fused:
            return "it chains the fused elementwise ops (model.elementwise is torch or cannot run)"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"it runs fp32 and bf16 models (the model is {dtype})"
        if not pool.supports_int8_block_views and (not pool.supports_block_views or pool.dtype != dtype):
            return (f"it needs a KV pool in the model's dtype, or an int8 one (kv_dtype is {pool.schema.dtype.value}, "
                    f"the model {dtype})")
        for layer in self.model.layers:
            if not all(isinstance(m, PackedLinear) for m in self._decode_linears(layer)):
                return "it needs every projection packed (model.linear), q/k/v and gate/up stacked"
            if any(m.weight_bf16 is not None and not m.rows_kernel for m in self._decode_linears(layer)):
                return "its bf16 layers on fp32 copies need the bf16 rows kernel, which was not loaded for them"
        eps, qk_eps = self._norm_eps()
        if len(eps) > 1 or len(qk_eps) > 1:
            return "it takes one RMSNorm epsilon for the layers' norms and one for the q/k norms"
        return None

    def _norm_eps(self) -> tuple[set[float], set[float]]:
        """The epsilons of the layers' (and the final) RMSNorms, and of the q/k norms (none without them)."""
        layers = self.model.layers
        eps = {self.model.norm.eps} | {n.eps for layer in layers
                                       for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        return eps, {n.eps for layer in layers if layer.self_attn.qk_norm
                     for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)}

    @staticmethod
    def _decode_linears(layer: DecoderLayer) -> tuple[nn.Module | None, ...]:
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj

    def prepare_decode_step(self, pool: KVPool) -> object:
        """Hand every layer's packed weights, norms and `pool` rows to the C++ decode step
        (csrc/decode_step.cpp): the handle `forward(..., fused=True, decode_step=handle)` runs a decode step over
        `pool` (a pure one, or one whose rows all attend a shared prefix; over an int8 pool a pure one: its codes
        quantized and read in place) in one call. The caller checked `decode_step_unavailable`."""
        layers = self.model.layers
        shapes: list[int] = []
        packed: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        bf16: list[torch.Tensor | None] = []
        tensors: list[torch.Tensor] = []
        qk_norms: list[torch.Tensor] = []
        kv_scales: list[torch.Tensor] = []  # an int8 pool's: its codes stand in for the K/V rows and blocks
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            for linear in self._decode_linears(layer):
                small = linear.small_rows > 0
                shapes += [linear._address if small else 0, linear._nbytes if small else 0, linear.out_features,
                           linear.small_rows, linear.bf16_rows]
                packed.append(linear.packed)
                biases += [linear._bias32 if small else None, linear.bias]
                bf16 += [linear.weight_bf16, linear.bias_bf16]
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            if pool.supports_int8_block_views:
                k_codes, v_codes, k_scales, v_scales = pool.int8_block_views(attn.layer)
                rows = [codes.view(-1, *codes.shape[2:]) for codes in (k_codes, v_codes)]
                tensors += [layer.post_attention_layernorm.weight, after.weight, *rows, k_codes, v_codes]
                kv_scales += [k_scales, v_scales]
            else:
                tensors += [layer.post_attention_layernorm.weight, after.weight, *pool.token_rows(attn.layer),
                            *pool.block_views(attn.layer)]
            if attn.qk_norm:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        eps, qk_eps = self._norm_eps()
        attn = layers[0].self_attn
        step = kernels.decode_layers(shapes, packed, biases, bf16, tensors, qk_norms, kv_scales, attn.num_heads,
                                     attn.num_kv_heads, attn.head_dim, eps.pop(), (qk_eps or {1e-6}).pop(), attn.scale)
        return step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()
