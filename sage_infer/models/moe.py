"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (with its shared expert), Mixtral and OLMoE.

Each is the Llama decoder (`sage_infer.models.llama`: the same attention, norms and forward path) whose MLP is a
`SparseMoeBlock` (`sage_infer.layers.moe`) in the layers the config makes sparse (all of them, or for the Qwen
families those on the ``decoder_sparse_step`` grid and not in ``mlp_only_layers``). OLMoE's q/k norms span all
heads before the head split, and it may clamp q, k and v (`Attention.norm_and_clip`).

Checkpoints store each expert's gate, up and down weights apart (``mlp.experts.<e>.gate_proj.weight``;
Mixtral ``block_sparse_moe.experts.<e>.w1/w3/w2``); the loader renames them (`MoeForCausalLM.checkpoint_rename`)
and stacks them into the experts' two weights (`checkpoint_target`), or, for a checkpoint that stores its experts
quantized, loads each into its own linear (`separate_experts`).
"""

from __future__ import annotations

import dataclasses
import re

from sage_infer.layers.moe import SparseMoeBlock
from sage_infer.models.arch_config import ArchConfig
from sage_infer.models.llama import MLP, LlamaForCausalLM

# what runs stacked experts (`SparseMoeBlock`, `FusedExperts.forward`), for the start-up line
STACKED_EXPERTS = ("on the stacked weights: on a CPU with the fused elementwise ops one grouped-experts kernel call "
                   "(packed bf16 experts without AVX512-BF16: up to 16 rows per expert, more through one oneDNN "
                   "product per expert), on a CUDA device the Triton grouped experts, else one PyTorch product per "
                   "active expert")
_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.")
_MIXTRAL_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder with mixture-of-experts MLPs (`registry.MOE_ARCHITECTURES`). The C++ decode step runs its
    decode steps of up to `decode_step_rows` rows (each sparse layer's routing and experts one kernel call; any rows
    where the router is packed and the busy experts have their own weights: `decode_step_rows_args`); CUDA graphs
    run dense MLPs and are declined for it at build."""

    is_moe = True

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__(cfg)
        moe = cfg.moe
        assert moe is not None, "an MoE architecture's config has MoE fields"
        for i, layer in enumerate(self.model.layers):
            if i not in moe.sparse_layers:
                continue
            shared = None
            if moe.shared_expert_intermediate_size:
                shared = MLP(dataclasses.replace(cfg, intermediate_size=moe.shared_expert_intermediate_size))
            layer.mlp = SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.expert_intermediate_size,
                                       moe.renormalize, shared,
                                       weights_in_hidden_dtype=cfg.architecture != "MixtralForCausalLM")

    def checkpoint_rename(self, name: str) -> str:
        """Checkpoint tensor `name` as this model names it: Mixtral's ``block_sparse_moe`` is ``mlp`` and its
        experts' ``w1``/``w3``/``w2`` are ``gate_proj``/``up_proj``/``down_proj``."""
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PART[m[2]]}.", name)
        return name

    def checkpoint_target(self, name: str) -> tuple[str, tuple[int, slice]] | None:
        """Where (renamed) checkpoint tensor `name` goes when no parameter has its name: one expert's gate, up
        or down weight goes to its rows of the stacked ``gate_up_proj`` (gate then up) or ``down_proj``, as
        (parameter, index into it); None when it belongs nowhere."""
        match = _EXPERT_WEIGHT.match(name)
        if match is None:
            return None
        prefix, expert, part = match[1], int(match[2]), match[3]
        if part == "down_proj":
            return f"{prefix}.down_proj", (expert, slice(None))
        rows = self.config.moe.expert_intermediate_size
        start = 0 if part == "gate_proj" else rows
        return f"{prefix}.gate_up_proj", (expert, slice(start, start + rows))

    def separate_experts(self) -> None:
        """Before loading: every expert as three linears named as the checkpoint names them
        (`FusedExperts.separate_linears`), for a checkpoint that stores its experts quantized."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.experts.separate_linears()

    def expert_tokens(self) -> list[tuple[int, list[int]]]:
        """(layer, (token, expert) pairs routed to each expert since start) for each sparse layer."""
        return [(i, list(layer.mlp.expert_tokens)) for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoeBlock)]

    def describe_experts(self) -> tuple[str, str]:
        """The start-up line's value and reason: experts and routing, sparse layers, what holds the weights."""
        moe = self.config.moe
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        apart = all(block.experts.gate_up_proj is None for block in blocks)
        shared = f", a shared expert of {moe.shared_expert_intermediate_size}" if moe.shared_expert_intermediate_size \
            else ""
        return (f"{moe.num_experts} x {moe.expert_intermediate_size}, top {moe.top_k}",
                f"config.json: {len(blocks)} of {len(self.model.layers)} layers sparse, top-k weights "
                f"{'renormalized' if moe.renormalize else 'as the softmax gives them'}{shared}; a step's experts "
                f"grouped, " + ("one product per active expert on each expert's own linears (model.linear)" if apart
                                else STACKED_EXPERTS))
