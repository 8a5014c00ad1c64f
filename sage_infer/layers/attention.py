"""Paged attention in pure PyTorch: the oracle every faster path is tested against.

Cache layout per layer (NHD): ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A token at logical position ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v: [T, num_kv_heads, head_dim] into the cache slots given by slot_mapping: [T]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode queries at once, padded to the longest context of the batch.

    q: [B, H, D]; block_tables: [B, max_blocks]; context_lens: [B] -> [B, H, D].
    Same math as `decode_attention_reference`, per row, with padded keys masked out;
    SDPA groups the query heads of each KV head itself (``enable_gqa``), no K/V repeat.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    flat_tables = block_tables.reshape(-1)  # index_select copies whole blocks: ~3x faster than k_cache[tables]
    keys = k_cache.index_select(0, flat_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, flat_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, T]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[:, :, 0, :]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V, then attend. q: [T, H, D]; k, v: [T, KvH, D] -> [T, H, D]."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if span.context_len == span.q_len:  # nothing cached before: the keys are this step's own
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], scale)
            continue
        slots = meta.prefill_slots[span.slot_start : span.slot_start + span.context_len]
        k_ctx, v_ctx = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
        out[rows] = prefill_attention(q[rows], k_ctx.to(q.dtype), v_ctx.to(q.dtype), scale)
    for group in meta.decode_groups:
        out[group.rows] = decode_attention_batched(
            q[group.rows], k_cache, v_cache, group.block_tables, group.context_lens, scale
        )
    return out
