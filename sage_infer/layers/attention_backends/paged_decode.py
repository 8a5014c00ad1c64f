"""`model.attention: paged`: decode rows (and short chunks after cached context) read their blocks in place: the C++
kernel on a CPU, the Triton kernel on an NVIDIA GPU (`cpu_kernels.decode_attention_paged` dispatches by device);
an int8 pool's codes and scales through `cpu_kernels.decode_attention_paged_int8` (CPU). Both kernels also take a
layer's sliding window, logit soft-cap and attention sinks (`decode_attention_kind` on a CPU,
`triton_paged.decode_attention`'s `kind` on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.layers import cpu_kernels
from sage_infer.layers.attention import DecodeGroup
from sage_infer.layers.attention_backends.base import DecodePart
from sage_infer.layers.attention_kinds import AttentionKind, kernel_kind_args
from sage_infer.layers.cpu_kernels import decode_attention_paged, decode_attention_paged_int8

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


def decode_attention_kind(q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float,
                          kind: AttentionKind) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ paged kernel under `kind` (CPU), over a float pool's block views or an int8 pool's codes and scales,
    in place: each row's window from the block it starts in, soft-capped scores, the sinks in the softmax's
    denominator. q: [B, H, D] -> (out [B, H, D], lse [B, H]) float32 (with sinks, lse counts the sink)."""
    module = cpu_kernels._module()
    q32, tables, lens = q.float().contiguous(), block_tables.contiguous(), context_lens.contiguous()
    if pool.supports_block_views:
        return tuple(module.paged_decode_attention_kind(q32, *pool.block_views(layer), tables, lens, scale,
                                                        *kernel_kind_args(kind)))
    return tuple(module.paged_decode_attention_int8_kind(q32, *pool.int8_block_views(layer), tables, lens, scale,
                                                         *kernel_kind_args(kind)))


@dataclass(frozen=True)
class PagedDecode(DecodePart):
    """Decode rows read their context in place from the pool's blocks, all rows in one group (the kernel reads
    only each row's own blocks, so padding costs nothing). The pool must have block views (a float pool), or int8
    block views on a CPU (codes widened in registers, each token's scales on its score and probability)."""

    name = "paged"
    in_place = True
    group_rows = 1 << 30

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
        return self.attend_lse(q, pool, layer, group, scale)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if pool.supports_block_views:
            return decode_attention_paged(q, *pool.block_views(layer), group.block_tables, group.context_lens, scale)
        return decode_attention_paged_int8(q, *pool.int8_block_views(layer), group.block_tables, group.context_lens,
                                           scale)

    def declines(self, kind: AttentionKind, device: torch.device, block_size: int) -> str | None:
        return None  # the C++ kernel (CPU) and the Triton kernel (GPU) take any window, soft-cap and sinks

    def attend_kind(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float,
                    kind: AttentionKind) -> torch.Tensor:
        """The whole kind in the kernel, in place: the C++ kernel on a CPU, the Triton kernel on a GPU (each row's
        tables cut to the blocks its window reaches, the window masked to the token)."""
        if q.device.type == "cpu":
            return decode_attention_kind(q, pool, layer, group.block_tables, group.context_lens, scale, kind)[0].to(
                q.dtype)
        from sage_infer.layers.triton_paged import decode_attention  # imports triton: only where the kernel runs

        return decode_attention(q, *pool.block_views(layer), group.block_tables, group.context_lens, scale,
                                kind=kind)[0].to(q.dtype)
