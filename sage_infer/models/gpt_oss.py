"""gpt-oss (`GptOssForCausalLM`), after transformers' ``modeling_gpt_oss``. Parameter names match Hugging Face so a
checkpoint loads by name.

It is the Llama decoder (`sage_infer.models.llama`: RMSNorms, q/k/v/o projections, here all with biases, neox rotary,
the same forward path) with three differences:

- attention sinks: each layer's ``self_attn.sinks`` [H] is one more logit per head in the softmax's denominator,
  with no value (`SinkAttention`: its `AttentionKind` carries them). The C++ paged decode and flash prefill kernels
  and the Triton kernels take them (and the window); the PyTorch masked path (`sage_infer.layers.attention_kinds`)
  is the reference and the fallback;
- sliding-window layers beside full ones (``layer_types``, ``sliding_window``; every other layer, the first sliding,
  when config.json has no ``layer_types``), KV kept per group (`sage_infer.kv_runtime.kv_groups`);
- the MLP is a mixture of experts with a biased router and clamped SwiGLU experts
  (`sage_infer.layers.moe_swiglu.TopKSoftmaxMoeBlock`), run on their stacked weights: on a CPU by the
  grouped-experts kernel (`sage_infer.layers.moe_grouped`), on a CUDA device by the Triton grouped experts
  (`sage_infer.layers.triton_moe`), else one PyTorch product per expert.

Rope is YaRN as config.json sets it (`sage_infer.layers.rotary`). Checkpoints whose experts are MXFP4
(``quantization_config.quant_method: mxfp4``, how OpenAI ships gpt-oss) keep them MXFP4 on a CPU with the kernels
(`keep_mxfp4`: read in place by the grouped-experts kernel); elsewhere, or with ``dequantize: true``, they load
dequantized to the model's dtype (`checkpoint_combine`, `sage_infer.quantization.mxfp4`). The C++ decode step runs
decode steps of up to `decode_step_rows` rows (sinks, windows, and each layer's router and experts in one kernel
call); CUDA graphs are declined.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sage_infer.layers.attention_kinds import AttentionKind
from sage_infer.layers.moe_swiglu import TopKSoftmaxMoeBlock, mxfp4_rows
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.llama import Attention, LlamaForCausalLM
from sage_infer.quantization import mxfp4


class SinkAttention(Attention):
    """The Llama attention with a learned sink logit per query head (``sinks`` [H]), which its `kind` carries to
    whichever backend attends the layer."""

    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    @property
    def kind(self) -> AttentionKind:
        """The layer's window (from config.json) with its sinks (loaded weights: taken at each step)."""
        return dataclasses.replace(self._kind, sinks=self.sinks)

    @kind.setter
    def kind(self, value: AttentionKind) -> None:
        self._kind = value


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: the Llama decoder with attention sinks and clamped-SwiGLU experts in every layer."""

    is_moe = True

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        moe = cfg.moe
        assert moe is not None and moe.swiglu_limit is not None, "gpt-oss's config has its MoE fields"
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = SinkAttention(cfg, i)
            layer.mlp = TopKSoftmaxMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.expert_intermediate_size,
                                            moe.swiglu_alpha, moe.swiglu_limit)
        self._mxfp4: mxfp4.PairedTensors | None = None  # MXFP4 expert tensors read so far (`checkpoint_combine`)
        self._keeps_mxfp4 = False

    def keep_mxfp4(self) -> None:
        """Before loading: every layer's experts hold the checkpoint's MXFP4 tensors as they are
        (`ClampedSwigluExperts.keep_mxfp4`), not dequantized."""
        for layer in self.model.layers:
            layer.mlp.experts.keep_mxfp4()
        self._keeps_mxfp4 = True

    def checkpoint_combine(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors checkpoint tensor `name` stands for: itself, or for MXFP4 experts' blocks and scales (unless
        the experts keep them as they are), nothing until both of a weight are read, then that weight dequantized
        to the model's dtype."""
        if self._keeps_mxfp4 or not name.endswith(mxfp4.SUFFIXES):
            return [(name, tensor)]
        if self._mxfp4 is None:
            self._mxfp4 = mxfp4.PairedTensors(self.model.norm.weight.dtype, mxfp4_rows)
        done = self._mxfp4.add(name, tensor)
        return [] if done is None else [done]

    def expert_tokens(self) -> list[tuple[int, list[int]]]:
        """(layer, (token, expert) pairs routed to each expert since start) for each layer."""
        return [(i, list(layer.mlp.expert_tokens)) for i, layer in enumerate(self.model.layers)]

    def describe_experts(self) -> tuple[str, str]:
        """The start-up line's value and reason: experts and routing, and what runs them."""
        moe = self.config.moe
        return (f"{moe.num_experts} x {moe.expert_intermediate_size}, top {moe.top_k}",
                f"config.json: {len(self.model.layers)} of {len(self.model.layers)} layers sparse, a biased router's "
                f"top-k logits softmaxed; clamped SwiGLU experts (alpha {moe.swiglu_alpha:g}, limit "
                f"{moe.swiglu_limit:g}) with biases, a step's experts grouped on the stacked weights (on a CPU with "
                f"the fused elementwise ops one grouped-experts kernel call, on a CUDA device the Triton grouped "
                f"experts, else one PyTorch product per expert)"
                + ("; the checkpoint's MXFP4 experts kept as they are (FP4 codes and exponents, read in place by the "
                   "grouped-experts kernel)" if self._keeps_mxfp4 else ""))
