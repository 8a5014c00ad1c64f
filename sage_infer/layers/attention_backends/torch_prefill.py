"""`model.prefill_attention: torch`: prefill spans one by one over their context, PyTorch's SDPA; shared prefixes
and suffixes with their log-sum-exp in PyTorch (the oracle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sage_infer.layers.attention import chunk_attention_lse, prefill_attention, shared_keys_attention_lse
from sage_infer.layers.attention_backends.base import PrefillPart
from sage_infer.layers.attention_kinds import AttentionKind


@dataclass(frozen=True)
class TorchPrefill(PrefillPart):
    """Prefill spans one by one over gathered context, PyTorch ops."""

    name = "torch"

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        return prefill_attention(q, k_ctx, v_ctx, scale)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_attention_lse(q, k_ctx, v_ctx, scale)

    def declines(self, kind: AttentionKind, device: torch.device) -> str | None:
        return "the torch prefill part is the PyTorch oracle"

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return shared_keys_attention_lse(q, keys, values, scale)
