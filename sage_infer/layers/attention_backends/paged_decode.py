"""`model.attention: paged`: decode rows (and short chunks after cached context) read their blocks in place: the C++
kernel on a CPU, the Triton kernel on an NVIDIA GPU (`cpu_kernels.decode_attention_paged` dispatches by device);
an int8 pool's codes and scales through `cpu_kernels.decode_attention_paged_int8` (CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.layers.attention import DecodeGroup, merge_attention
from sage_infer.layers.attention_backends.base import DecodePart
from sage_infer.layers.attention_kinds import masked_attention_lse, window_split
from sage_infer.layers.cpu_kernels import decode_attention_paged, decode_attention_paged_int8

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


@dataclass(frozen=True)
class PagedDecode(DecodePart):
    """Decode rows read their context in place from the pool's blocks, all rows in one group (the kernel reads
    only each row's own blocks, so padding costs nothing). The pool must have block views (a float pool), or int8
    block views on a CPU (codes widened in registers, each token's scales on its score and probability)."""

    name = "paged"
    in_place = True
    group_rows = 1 << 30
    windowed = True

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
        return self.attend_lse(q, pool, layer, group, scale)[0].to(q.dtype)

    def attend_lse(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if pool.supports_block_views:
            return decode_attention_paged(q, *pool.block_views(layer), group.block_tables, group.context_lens, scale)
        return decode_attention_paged_int8(q, *pool.int8_block_views(layer), group.block_tables, group.context_lens,
                                           scale)

    def attend_window(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float,
                      window: int) -> torch.Tensor:
        """The kernel reads the blocks wholly inside each row's window in place; the window's part of the block
        before them (at most block_size - 1 keys per row) is attended in PyTorch; the two merge by their
        log-sum-exp (`sage_infer.layers.attention_kinds.window_split`)."""
        tables, lens, head, visible = window_split(group.block_tables, group.context_lens, window, pool.block_size)
        inner = DecodeGroup(rows=group.rows, block_tables=tables, context_lens=lens, whole_batch=group.whole_batch)
        out, lse = self.attend_lse(q, pool, layer, inner, scale)
        keys, values = pool.gather_blocks(layer, head, q.dtype)  # [b, block_size, KvH, D]
        head_out, head_lse = masked_attention_lse(q, keys, values, visible, scale)
        return merge_attention(head_out, head_lse, out, lse).to(q.dtype)
