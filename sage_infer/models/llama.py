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
from sage_infer.layers.attention_kinds import kernel_kind_args
from sage_infer.layers.elementwise import TORCH_OPS, TorchOps
from sage_infer.layers.linear import PackedLinear
from sage_infer.layers.norm import RMSNorm
from sage_infer.layers.rotary import RotaryEmbedding
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.decode_step_args import layer_layout, pool_layer_map, step_linear

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


class QKVProjections:
    """q/k/v_proj of an attention module (Llama's, Gemma's), stacked into one `qkv_proj` by `fuse_projections`."""

    def fuse_projections(self) -> bool:
        """Replace q/k/v_proj by one `qkv_proj` (their weights stacked: the same products, one GEMM
        call instead of three); False, and nothing changed, unless all three are plain `nn.Linear`."""
        fused = _stacked_linear([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return False
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KvH, D], and q and k as one view ([T, H + KvH, D]) where they
        come from one stacked GEMM (the C++ rotary pass takes both at once), else None."""
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(t, heads + 2 * kv_heads, d)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            return q, k, v, qkv[:, : heads + kv_heads]
        q, k = self.q_proj(x).view(t, heads, d), self.k_proj(x).view(t, kv_heads, d)
        return q, k, self.v_proj(x).view(t, kv_heads, d), None

    def norm_and_clip(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """OLMoE's q and k RMSNorms over all heads (`qk_norm_full`: before the head split), then q, k and v clamped
        to +-`clip_qkv`, in place (q, k, v: `project`'s views)."""
        t = q.shape[0]
        if self.qk_norm_full:
            for x, norm in ((q, self.q_norm), (k, self.k_norm)):
                flat = x.view(t, -1)
                flat.copy_(norm(flat))
        if self.clip_qkv is not None:
            for x in (q, k, v):
                x.clamp_(-self.clip_qkv, self.clip_qkv)


class Attention(QKVProjections, nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # which layer's K/V this module stores and reads in the pool
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.kind = cfg.attention_kind(layer)  # its sliding window (Mistral, Qwen2 with use_sliding_window)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        # OLMoE (`cfg.moe`): q/k norms over all heads, and q, k and v clamped (`norm_and_clip`)
        self.qk_norm_full = cfg.moe is not None and cfg.moe.qk_norm_full
        self.clip_qkv = cfg.moe.clip_qkv if cfg.moe is not None else None
        if self.qk_norm_full:
            self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None  # `fuse_projections`: q, k and v in one GEMM

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], pool: KVPool,
                meta: AttentionMetadata, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """x: [T, hidden]; cos_sin: this step's rotary tables (`ops.rotary_tables`) -> [T, hidden]."""
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v, qk = self.project(x)
        if self.qk_norm_full or self.clip_qkv is not None:
            self.norm_and_clip(q, k, v)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        q, k = ops.rotary(q, k, qk, cos_sin, *norms)
        out = paged_attention(q, k, v, pool, self.layer, meta, self.scale, self.kind)
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

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return ops.gated_mlp(self.gate_up_proj, self.down_proj, x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm, cos_sin, pool: KVPool,
                meta: AttentionMetadata, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """h is this layer's normed input, `residual` its input (updated in place to the output); returns the
        output normed by `next_norm` (the next layer's input norm, or the model's final norm): each residual add
        is the norm after it's first step (`ops.add_rms_norm_`)."""
        h = ops.add_rms_norm_(self.self_attn(h, cos_sin, pool, meta, ops), residual, self.post_attention_layernorm)
        return ops.add_rms_norm_(self.mlp(h, ops), residual, next_norm)


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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool, meta: AttentionMetadata,
                ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden], normed by the final norm; layer ``i`` stores and
        reads its K/V as layer ``i`` of `pool`. `ops` runs the elementwise parts (`sage_infer.layers.elementwise`:
        the step executor's choice)."""
        x, h, cos_sin = self.embed(input_ids, positions, ops)
        layers = self.model.layers
        for i, layer in enumerate(layers):
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h = layer(h, x, after, cos_sin, pool, meta, ops)
        return h

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              ops: TorchOps = TORCH_OPS) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A step's start: the residual stream (the embeddings, [T, hidden], which every layer updates in place),
        the first layer's normed input, and the step's rotary tables as `ops` takes them (once per step)."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = ops.rotary_tables(self.model.rotary_emb.cos_sin(positions, x.dtype))
        return x, ops.rms_norm(x, self.model.layers[0].input_layernorm), cos_sin

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
        if any(layer.self_attn.kind.softcap is not None for layer in self.model.layers):
            return "it takes the Llama family's sliding windows and sinks, not soft-capped layers"
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
        for layer in self.model.layers:  # mixture-of-experts MLPs (`ExpertsInDecodeStep`)
            if hasattr(layer.mlp, "decode_step_unavailable") and (why := layer.mlp.decode_step_unavailable(dtype)):
                return why
        return None

    def _norm_eps(self) -> tuple[set[float], set[float]]:
        """The epsilons of the layers' (and the final) RMSNorms, and of the q/k norms (none without them)."""
        layers = self.model.layers
        eps = {self.model.norm.eps} | {n.eps for layer in layers
                                       for n in (layer.input_layernorm, layer.post_attention_layernorm)} | {
            n.eps for layer in layers if layer.self_attn.qk_norm_full  # (the C++ step norms OLMoE's with the layers')
            for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)}
        return eps, {n.eps for layer in layers if layer.self_attn.qk_norm
                     for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)}

    @staticmethod
    def _decode_linears(layer: DecoderLayer) -> tuple[nn.Module | None, ...]:
        """The layer's linears the C++ step multiplies by: q/k/v, o, and a dense MLP's gate/up and down (a mixture
        of experts, `decode_step_args`, runs its own kernel; a shared expert's gate/up, down and sigmoid gate)."""
        attn = layer.self_attn
        if hasattr(layer.mlp, "decode_step_args"):
            return attn.qkv_proj, attn.o_proj, *(layer.mlp.decode_step_shared() or ())
        return attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj

    def decode_step_rows(self) -> int | None:
        """The most rows a decode step may have to run in the C++ step (None: any); more run layer by layer."""
        limits = [layer.mlp.decode_step_rows() for layer in self.model.layers if hasattr(layer.mlp, "decode_step_rows")]
        limits = [limit for limit in limits if limit is not None]
        return min(limits) if limits else None

    def prepare_decode_step(self, pool: KVPool) -> object:
        """Hand every layer's packed weights, norms and `pool` rows to the C++ decode step
        (csrc/decode_step.cpp): the handle runs a decode step over `pool` (a pure one, or one whose rows all attend
        a shared prefix; over an int8 pool a pure one: its codes quantized and read in place) in one call, from the
        embedding and the first layer's normed input to the final norm (`sage_infer.engine.steps.cpp_decode`). The
        caller checked `decode_step_unavailable`."""
        layers = self.model.layers
        shapes: list[int] = []
        packed: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        bf16: list[torch.Tensor | None] = []
        tensors: list[torch.Tensor] = []
        qk_norms: list[torch.Tensor] = []
        kv_scales: list[torch.Tensor] = []  # an int8 pool's: its codes stand in for the K/V rows and blocks
        layout: list[int] = []  # each layer's KV group and window
        layer_map = pool_layer_map(self.config, pool)
        for i, layer in enumerate(layers):
            attn, (group, slot) = layer.self_attn, layer_map[i]
            layout += layer_layout(group, attn.kind)
            linears = self._decode_linears(layer)[:4]  # a shared expert's gate goes to `set_shared_expert` below
            for linear in linears:
                shape, weight, biases_of, bf16_of = step_linear(linear)
                shapes += shape
                packed.append(weight)
                biases += biases_of
                bf16 += bf16_of
            for _ in range(4 - len(linears)):  # a mixture of experts: no dense gate/up and down (`set_moe` below)
                shapes += [0] * 6
                packed.append(torch.empty(0))
                biases += [None, None]
                bf16 += [None, None]
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            if pool.supports_int8_block_views:
                k_codes, v_codes, k_scales, v_scales = pool.int8_block_views(slot)
                rows = [codes.view(-1, *codes.shape[2:]) for codes in (k_codes, v_codes)]
                tensors += [layer.post_attention_layernorm.weight, after.weight, *rows, k_codes, v_codes]
                kv_scales += [k_scales, v_scales]
            else:
                tensors += [layer.post_attention_layernorm.weight, after.weight, *pool.token_rows(slot),
                            *pool.block_views(slot)]
            if attn.qk_norm:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        eps, qk_eps = self._norm_eps()
        attn = layers[0].self_attn
        sinks = [kernel_kind_args(layer.self_attn.kind)[2] for layer in layers]  # gpt-oss's, as the kernel reads them
        step = kernels.decode_layers(shapes, packed, biases, bf16, tensors, qk_norms, kv_scales, attn.num_heads,
                                     attn.num_kv_heads, attn.head_dim, eps.pop(), (qk_eps or {1e-6}).pop(), attn.scale,
                                     layout=layout, sinks=sinks if any(t is not None for t in sinks) else ())
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if attn.qk_norm_full or attn.clip_qkv is not None:  # OLMoE
                norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm_full else (None, None)
                step.set_qk_full(i, *norms, attn.clip_qkv or 0.0)
            if hasattr(layer.mlp, "decode_step_args"):
                step.set_moe(i, *layer.mlp.decode_step_args())
                if (rows := layer.mlp.decode_step_rows_args()) is not None:  # steps of any rows
                    router, *rest = rows
                    shape, weight, biases_of, bf16_of = step_linear(router)
                    step.set_moe_rows(i, shape, weight, *biases_of, *bf16_of, *rest)
                if (shared := layer.mlp.decode_step_shared()) is not None:  # its gate/up and down went in above
                    shape, weight, biases_of, bf16_of = step_linear(shared[2])
                    step.set_shared_expert(i, shape, weight, *biases_of, *bf16_of)
        return step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()
