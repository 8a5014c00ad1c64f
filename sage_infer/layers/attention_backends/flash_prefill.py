"""`model.prefill_attention: sage` on a CPU: prefill spans and shared prefixes through sage's CPU flash kernel
(bf16 and fp32 models), which also takes a layer's sliding window, logit soft-cap and attention sinks
(`flash_attention_kind`); for bf16 on a CPU with AMX tiles, through PyTorch's CPU flash kernel (`AmxFlashPrefill`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.layers import cpu_kernels
from sage_infer.layers.attention import chunk_attention_lse, prefill_attention, shared_keys_attention_lse
from sage_infer.layers.attention_backends.base import PrefillPart
from sage_infer.layers.attention_kinds import FULL_ATTENTION, AttentionKind, kernel_kind_args

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


def flash_attention_kind(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         kind: AttentionKind) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_kernels.flash_attention`, causal, under `kind`: each query's window (key tiles wholly before every
    window of a task are not read), soft-capped scores, the sinks in the softmax's denominator. q: [Lq, H, D];
    k, v: [C, KvH, D] -> (out [Lq, H, D], lse [Lq, H]) float32 (with sinks, lse counts the sink)."""
    if q.dtype == torch.bfloat16 and (q.stride(0) % 2 or q.stride(1) % 2):
        q = q.contiguous()
    return tuple(cpu_kernels._module().flash_attention_kind(q, k, v, scale, True, *kernel_kind_args(kind)))


@dataclass(frozen=True)
class FlashPrefill(PrefillPart):
    """Prefill spans one by one over gathered context, and shared prefixes, through sage's CPU flash kernel."""

    name = "sage"
    flash = True
    sage_flash_prefix = True

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        return cpu_kernels.flash_attention(q, k_ctx, v_ctx, scale, causal=True)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.flash_attention(q, k_ctx, v_ctx, scale, causal=True)

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.flash_attention(q, keys, values, scale, causal=False)

    def declines(self, kind: AttentionKind, device: torch.device) -> str | None:
        return None

    def attend_kind(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float,
                    kind: AttentionKind) -> torch.Tensor:
        return flash_attention_kind(q, k_ctx, v_ctx, scale, kind)[0].to(q.dtype)

    def lse_in_pool(self, q: torch.Tensor, pool: KVPool, layer: int, slots: torch.Tensor, scale: float,
                    kind: AttentionKind = FULL_ATTENTION, causal: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel packs the span's keys and values straight from the pool's rows (`flash_attention_slots`):
        no gathered copy of the context. None where the pool's rows are not q's dtype on this CPU."""
        if not pool.supports_block_views or pool.device.type != "cpu" or pool.dtype != q.dtype:
            return None
        k_rows, v_rows = pool.token_rows(layer)
        return cpu_kernels.flash_attention_slots(q, k_rows, v_rows, slots, scale, *kernel_kind_args(kind),
                                                 causal=causal)


@dataclass(frozen=True)
class AmxFlashPrefill(FlashPrefill):
    """A bf16 model on a CPU with AMX tiles (`cpu_kernels.amx_flash_attention`): plain spans, shared prefixes and
    their suffixes through PyTorch's CPU flash kernel, whose tiles run on oneDNN's AMX micro-kernels (3-5x sage's
    AVX512-BF16 kernel there), split as the torch part splits them (a span after cached context: its cached keys
    unmasked, then its own causal, merged by log-sum-exp); layers of another kind (a window, a soft-cap, sinks)
    through sage's kernel, which takes them."""

    sage_flash_prefix = False  # the C++ decode step attends a shared prefix with PyTorch's kernel too

    def lse_in_pool(self, q: torch.Tensor, pool: KVPool, layer: int, slots: torch.Tensor, scale: float,
                    kind: AttentionKind = FULL_ATTENTION, causal: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Plain spans and shared prefixes go to PyTorch's kernel over a gathered copy (None); other kinds to
        sage's, in place."""
        return None if kind.plain else super().lse_in_pool(q, pool, layer, slots, scale, kind, causal)

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        return prefill_attention(q, k_ctx, v_ctx, scale)

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_attention_lse(q, k_ctx, v_ctx, scale)

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return shared_keys_attention_lse(q, keys, values, scale)
