"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (with its shared expert), Mixtral and OLMoE.

Each is the Llama decoder (`sage_infer.models.llama`: the same attention, norms and forward path) whose MLP is a
`SparseMoeBlock` (`sage_infer.layers.moe`) in the layers the config makes sparse (all of them, or for the Qwen
families those on the ``decoder_sparse_step`` grid and not in ``mlp_only_layers``). OLMoE's q/k norms span all
heads before the head split and are applied by its q/k projections (`NormedProjection`).

Checkpoints store each expert's gate, up and down weights apart (``mlp.experts.<e>.gate_proj.weight``;
Mixtral ``block_sparse_moe.experts.<e>.w1/w3/w2``); the loader stacks them into the experts' two weights by
`MoeForCausalLM.checkpoint_target`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from sage_infer.layers.moe import SparseMoeBlock
from sage_infer.layers.norm import RMSNorm
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.llama import MLP, LlamaForCausalLM

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool

_EXPERT_WEIGHT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                            r"\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": None, "w2": None}  # gate rows, then up


class NormedProjection(nn.Module):
    """OLMoE's q or k projection: ``proj`` then an RMSNorm over its whole output (all heads) and, with
    ``clip_qkv``, a clamp; v's is only clamped."""

    def __init__(self, proj: nn.Module, norm: RMSNorm | None, clip: float | None) -> None:
        super().__init__()
        self.proj, self.norm, self.clip = proj, norm, clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.norm is not None:
            h = self.norm(h)
        return h.clamp(-self.clip, self.clip) if self.clip is not None else h


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with mixture-of-experts MLPs (`registry.MOE_ARCHITECTURES`). Its steps run layer by layer from
    Python: the C++ decode step and CUDA graphs run dense MLPs and are declined for it at build."""

    is_moe = True

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        moe = cfg.moe
        assert moe is not None, "an MoE architecture's config has MoE fields"
        for i, layer in enumerate(self.model.layers):
            if moe.qk_norm_full or moe.clip_qkv is not None:
                _olmoe_projections(layer.self_attn, cfg)
            if i not in moe.sparse_layers:
                continue
            shared = None
            if moe.shared_expert_intermediate_size:
                shared = MLP(dataclasses.replace(cfg, intermediate_size=moe.shared_expert_intermediate_size))
            layer.mlp = SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.expert_intermediate_size,
                                       moe.renormalize, shared,
                                       weights_in_hidden_dtype=cfg.architecture != "MixtralForCausalLM")

    def checkpoint_target(self, name: str) -> tuple[str, tuple[int, slice] | None] | None:
        """Where checkpoint tensor `name` goes when no parameter has its name: (parameter, index into it or None
        for all of it), or None when it belongs nowhere. One expert's gate, up or down weight goes to its rows of
        the stacked ``gate_up_proj`` (gate then up) or ``down_proj``."""
        if match := _EXPERT_WEIGHT.match(name):
            prefix, expert, part = match[1], int(match[2]), _PART[match[3]]
            if part is None:
                return f"{prefix}.mlp.experts.down_proj", (expert, slice(None))
            rows = self.config.moe.expert_intermediate_size
            return f"{prefix}.mlp.experts.gate_up_proj", (expert, slice(part * rows, (part + 1) * rows))
        if ".block_sparse_moe." in name:  # Mixtral's router
            return name.replace(".block_sparse_moe.", ".mlp."), None
        moe = self.config.moe
        if moe.qk_norm_full or moe.clip_qkv is not None:  # OLMoE: q/k norms and clamps live in the projections
            for old, new in ((".self_attn.q_norm.", ".self_attn.q_proj.norm."),
                             (".self_attn.k_norm.", ".self_attn.k_proj.norm."),
                             (".self_attn.q_proj.", ".self_attn.q_proj.proj."),
                             (".self_attn.k_proj.", ".self_attn.k_proj.proj."),
                             (".self_attn.v_proj.", ".self_attn.v_proj.proj.")):
                if old in name:
                    return name.replace(old, new), None
        return None

    def expert_tokens(self) -> list[tuple[int, list[int]]]:
        """(layer, (token, expert) pairs routed to each expert since start) for each sparse layer."""
        return [(i, list(layer.mlp.expert_tokens)) for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoeBlock)]

    def decode_step_unavailable(self, pool: KVPool, fused: bool) -> str | None:
        return "it runs dense MLPs; this model routes tokens to experts (the layer loop runs them grouped)"


def _olmoe_projections(attn: nn.Module, cfg: ArchConfig) -> None:
    """Wrap `attn`'s q, k (and v, when clamped) projections in `NormedProjection`s."""
    clip = cfg.moe.clip_qkv
    full = cfg.moe.qk_norm_full
    attn.q_proj = NormedProjection(attn.q_proj, RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
                                   if full else None, clip)
    attn.k_proj = NormedProjection(attn.k_proj, RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
                                   if full else None, clip)
    if clip is not None:
        attn.v_proj = NormedProjection(attn.v_proj, None, clip)
