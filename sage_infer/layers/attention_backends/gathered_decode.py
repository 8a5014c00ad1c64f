"""`model.attention: torch`: decode rows over gathered copies of their blocks, PyTorch ops (the oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sage_infer.core.kv_schema import KVDtype
from sage_infer.layers.attention import (
    DecodeGroup,
    attention_with_lse,
    decode_attention_batched,
    decode_attention_scaled,
)
from sage_infer.layers.attention_backends.base import DecodePart

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


@dataclass(frozen=True)
class GatheredDecode(DecodePart):
    """Decode rows over gathered copies of their blocks, sorted into groups of similar context length and padded
    per group (the oracle)."""

    name = "torch"

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
        # masked SDPA is fast on fp32 K/V and several times slower on bf16; bf16/fp16 and quantized pools widen
        # their context once to fp32 and use two matmuls instead (docs/benchmarks.md, "decode attention")
        if pool.schema.dtype is KVDtype.FP32:
            keys, values = pool.gather_blocks(layer, group.block_tables, q.dtype)
            return decode_attention_batched(q, keys, values, group.context_lens, scale)
        levels, scales = pool.gather_block_levels(layer, group.block_tables)
        return decode_attention_scaled(q, levels, scales, group.context_lens, scale)

    def attend_lse(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = pool.gather_blocks(layer, group.block_tables, q.dtype)  # [b, W, KvH, D]
        b, num_heads, head_dim = q.shape
        grouped = q.view(b, keys.shape[2], -1, head_dim)  # [b, KvH, G, D]
        positions = torch.arange(keys.shape[1], device=q.device)
        mask = (positions[None, :] < group.context_lens[:, None])[:, None, None, :]  # [b, 1, 1, W]
        out, lse = attention_with_lse(grouped, keys.transpose(1, 2), values.transpose(1, 2), scale, mask)
        return out.reshape(b, num_heads, head_dim), lse.reshape(b, num_heads)
