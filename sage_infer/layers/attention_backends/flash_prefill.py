"""`model.prefill_attention: sage` on a CPU: prefill spans and shared prefixes through sage's CPU flash kernel
(bf16 and fp32 models)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sage_infer.layers import cpu_kernels
from sage_infer.layers.attention_backends.base import PrefillPart


@dataclass(frozen=True)
class FlashPrefill(PrefillPart):
    """Prefill spans one by one over gathered context, and shared prefixes, through sage's CPU flash kernel."""

    name = "sage"
    flash = True

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        return cpu_kernels.flash_attention(q, k_ctx, v_ctx, scale, causal=True)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.flash_attention(q, k_ctx, v_ctx, scale, causal=True)

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.flash_attention(q, keys, values, scale, causal=False)
