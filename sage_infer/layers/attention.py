"""Paged attention in pure PyTorch: the oracle every faster path is tested against.

K/V live in a `KVPool` and are reached only through its API (`store`, `gather_slots`,
`gather_blocks`), never as raw cache tensors, so the pool may change how it stores them.
A token at logical position ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of queries in the flat token batch.

    Queries are rows ``[q_start, q_start + q_len)``; they attend to the sequence's first
    ``context_len`` tokens, whose slots are ``AttentionMetadata.prefill_slots[slot_start:slot_start + context_len]``.
    """

    q_start: int
    q_len: int
    context_len: int
    slot_start: int


@dataclass(slots=True)
class DecodeGroup:
    """Decode queries of similar context length, padded only to the group's longest."""

    rows: torch.Tensor  # [b] long: rows of these queries in the flat batch
    block_tables: torch.Tensor  # [b, max_blocks_in_group] long, padded with 0
    context_lens: torch.Tensor  # [b] long


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step metadata, built once on the host and moved to the device once."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    prefills: list[PrefillSpan]
    prefill_slots: torch.Tensor | None  # [sum(context_len)] long
    decode_groups: list[DecodeGroup] = field(default_factory=list)


def prefill_attention(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence. q: [q_len, H, D]; k_ctx, v_ctx: [ctx_len, KvH, D] with ctx_len >= q_len.

    The queries are the last q_len positions, so the causal mask is aligned to the
    lower-right corner: query i sees keys j <= i + (ctx_len - q_len).
    """
    q_len, ctx_len = q.shape[0], k_ctx.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None]
    gqa = q.shape[1] != k_ctx.shape[1]
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [q_len, H, D]


def decode_attention_reference(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence, one query. q: [H, D]; k_ctx, v_ctx: [ctx_len, KvH, D] -> [H, D].

    The query heads sharing a KV head are grouped: no K/V repeat.
    """
    num_kv_heads = k_ctx.shape[1]
    qg = q.view(num_kv_heads, -1, q.shape[-1])  # [KvH, G, D]
    scores = torch.einsum("kgd,tkd->kgt", qg.float(), k_ctx.float()) * scale
    probs = scores.softmax(dim=-1)
    return torch.einsum("kgt,tkd->kgd", probs, v_ctx.float()).reshape(q.shape).to(q.dtype)


def decode_attention_batched(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode queries at once, padded to the longest context of the batch.

    q: [B, H, D]; keys, values: [B, T, KvH, D] (`KVPool.gather_blocks`, T >= every context
    length); context_lens: [B] -> [B, H, D]. Same math as `decode_attention_reference`, per
    row, with padded keys masked out; SDPA groups the query heads of each KV head itself
    (``enable_gqa``), no K/V repeat.
    """
    num_heads, num_kv_heads = q.shape[1], keys.shape[2]
    positions = torch.arange(keys.shape[1], device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, T]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[:, :, 0, :]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: KVPool,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V of `layer` in `pool`, then attend. q: [T, H, D]; k, v: [T, KvH, D] -> [T, H, D]."""
    pool.store(layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if span.context_len == span.q_len:  # nothing cached before: the keys are this step's own
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], scale)
            continue
        slots = meta.prefill_slots[span.slot_start : span.slot_start + span.context_len]
        k_ctx, v_ctx = pool.gather_slots(layer, slots, q.dtype)
        out[rows] = prefill_attention(q[rows], k_ctx, v_ctx, scale)
    for group in meta.decode_groups:
        keys, values = pool.gather_blocks(layer, group.block_tables, q.dtype)
        out[group.rows] = decode_attention_batched(q[group.rows], keys, values, group.context_lens, scale)
    return out
