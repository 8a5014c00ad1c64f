"""`model.attention: paged`: decode rows (and short chunks after cached context) read their blocks in place: the C++
kernel on a CPU, the Triton kernel on an NVIDIA GPU (`cpu_kernels.decode_attention_paged` dispatches by device);
an int8 pool's codes and scales through `cpu_kernels.decode_attention_paged_int8` (CPU). On a CPU the kernel also
takes a layer's sliding window, logit soft-cap and attention sinks (`decode_attention_kind`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.layers import cpu_kernels
from sage_infer.layers.attention import DecodeGroup, merge_attention
from sage_infer.layers.attention_backends.base import DecodePart
from sage_infer.layers.attention_kinds import AttentionKind, kernel_kind_args, masked_attention_lse, window_split
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
        if device.type == "cpu":
            return None
        if kind.softcap is not None or kind.sinks is not None:
            return "the Triton paged kernel takes no soft-cap or sinks"
        if kind.window < block_size:
            return f"the Triton paged kernel takes a window of at least a block ({block_size} keys), not {kind.window}"
        return None

    def attend_kind(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float,
                    kind: AttentionKind) -> torch.Tensor:
        """On a CPU the kernel takes the whole kind. On a GPU (a window of at least a block, nothing else) the
        Triton kernel reads the blocks wholly inside each row's window in place; the window's part of the block
        before them (at most block_size - 1 keys per row) is attended in PyTorch; the two merge by their
        log-sum-exp (`sage_infer.layers.attention_kinds.window_split`)."""
        if q.device.type == "cpu":
            return decode_attention_kind(q, pool, layer, group.block_tables, group.context_lens, scale, kind)[0].to(
                q.dtype)
        tables, lens, head, visible = window_split(group.block_tables, group.context_lens, kind.window,
                                                   pool.block_size)
        inner = DecodeGroup(rows=group.rows, block_tables=tables, context_lens=lens, whole_batch=group.whole_batch)
        out, lse = self.attend_lse(q, pool, layer, inner, scale)
        keys, values = pool.gather_blocks(layer, head, q.dtype)  # [b, block_size, KvH, D]
        head_out, head_lse = masked_attention_lse(q, keys, values, visible, scale)
        return merge_attention(head_out, head_lse, out, lse).to(q.dtype)
