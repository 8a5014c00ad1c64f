"""What a layer's attention adds to causal ``softmax(q·kᵀ·scale)·v``: a sliding window, logit soft-capping, attention
sinks; and the PyTorch math of such a layer (the oracle of the kernels that take a kind, and the path of the backend
parts that do not: `AttentionBackend.forward_kind`).

A sliding window of W keeps Hugging Face's meaning (``masking_utils.sliding_window_overlay``): the query at
position ``i`` sees the keys at positions ``j`` with ``i - W < j <= i``, W keys with its own. Soft-capping
(Gemma 2's ``attn_logit_softcapping``) turns each scaled score ``s`` into ``cap · tanh(s / cap)`` before the
softmax. Attention sinks (gpt-oss's ``self_attn.sinks``, one learned logit per query head) join each softmax's
denominator as one more score that carries no value: ``p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))``. The CPU
kernels (paged decode, flash prefill) take all three (`kernel_kind_args`), and so do the Triton paged kernels.

Shapes: q_len queries, ctx_len context keys (the queries are the context's last q_len positions), H query heads,
KvH KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

QUERY_TILE = 512  # prefill queries per score matrix: [KvH, G, QUERY_TILE, keys] float32 at most


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """A layer's attention beyond the plain causal one: `window` (keys a query sees, its own included; None: all
    earlier keys), `softcap` (None: no soft-capping) and `sinks` ([H], one extra softmax logit per query head, with
    no value; None: none). Kinds compare by window and soft-cap only (the sinks are a layer's weights)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window holds at least one key (got {self.window})")

    @property
    def plain(self) -> bool:
        """Plain causal attention: every backend's kernels run it."""
        return self.window is None and self.softcap is None and self.sinks is None

    @property
    def window_only(self) -> bool:
        """A sliding window and nothing else."""
        return self.window is not None and self.softcap is None and self.sinks is None

    def describe(self) -> str:
        parts = [f"sliding window {self.window}" if self.window else "full"]
        if self.softcap:
            parts.append(f"soft-capped at {self.softcap:g}")
        if self.sinks is not None:
            parts.append("attention sinks")
        return ", ".join(parts)


FULL_ATTENTION = AttentionKind()


def kernel_kind_args(kind: AttentionKind) -> tuple[int, float, torch.Tensor | None]:
    """`kind` as the CPU kernels' ``window, softcap, sinks`` arguments (csrc/flash.h's `Kind`: 0 for none; the
    sinks fp32 and contiguous)."""
    sinks = None if kind.sinks is None else kind.sinks.detach().float().contiguous()
    return kind.window or 0, kind.softcap or 0.0, sinks


def _scores(q: torch.Tensor, keys: torch.Tensor, scale: float, kind: AttentionKind) -> torch.Tensor:
    """q: [..., KvH, G, M, D]; keys: [..., KvH, T, D] -> scaled (and soft-capped) scores [..., KvH, G, M, T] fp32."""
    scores = torch.matmul(q.float(), keys.float().unsqueeze(-3).transpose(-1, -2)) * scale
    if kind.softcap is not None:
        scores = torch.tanh(scores / kind.softcap) * kind.softcap
    return scores


def _softmax(scores: torch.Tensor, kind: AttentionKind) -> torch.Tensor:
    """scores [..., KvH, G, M, T] -> probabilities over the T keys; with sinks, each head's sink logit is one more
    entry of the softmax, dropped after it (it weighs no value)."""
    if kind.sinks is None:
        return scores.softmax(dim=-1)
    kv_heads, group = scores.shape[-4], scores.shape[-3]
    sinks = kind.sinks.float().view(kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]


def kind_prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float,
                           kind: AttentionKind) -> torch.Tensor:
    """One sequence's span under `kind`, causal to the lower right. q: [q_len, H, D]; k_ctx, v_ctx: [ctx_len, KvH, D]
    -> [q_len, H, D] in q's dtype. Only the keys some query of the span sees are read (with a window, the last
    ``q_len + window - 1``); queries are taken `QUERY_TILE` at a time so the score matrix stays bounded."""
    q_len, num_heads, head_dim = q.shape
    ctx_len, num_kv_heads = k_ctx.shape[:2]
    offset = ctx_len - q_len  # absolute position of the span's first query
    out = torch.empty_like(q)
    for start in range(0, q_len, QUERY_TILE):
        stop = min(q_len, start + QUERY_TILE)
        first = 0 if kind.window is None else max(0, offset + start - kind.window + 1)
        keys, values = k_ctx[first : offset + stop], v_ctx[first : offset + stop]
        q_pos = torch.arange(offset + start, offset + stop, device=q.device)[:, None]
        k_pos = torch.arange(first, offset + stop, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if kind.window is not None:
            visible &= k_pos > q_pos - kind.window
        rows = q[start:stop]
        if kind.softcap is None and kind.sinks is None:  # SDPA takes the mask itself
            out[start:stop] = F.scaled_dot_product_attention(
                rows.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=visible, scale=scale, enable_gqa=num_heads != num_kv_heads)[0].transpose(0, 1)
            continue
        grouped = rows.view(stop - start, num_kv_heads, -1, head_dim).permute(1, 2, 0, 3)  # [KvH, G, M, D]
        scores = _scores(grouped, keys.transpose(0, 1), scale, kind).masked_fill(~visible, float("-inf"))
        probs = _softmax(scores, kind)
        heads = torch.matmul(probs, values.float().transpose(0, 1).unsqueeze(1))  # [KvH, G, M, D]
        out[start:stop] = heads.permute(2, 0, 1, 3).reshape(stop - start, num_heads, head_dim).to(q.dtype)
    return out


def kind_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_lens: torch.Tensor,
                          scale: float, kind: AttentionKind) -> torch.Tensor:
    """Decode queries under `kind`, each the last position of its context. q: [B, H, D]; keys, values:
    [B, T, KvH, D] (`KVPool.gather_blocks`, T >= every context length); context_lens: [B] -> [B, H, D] in q's
    dtype. Tensor ops only (no host sync)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    positions = torch.arange(keys.shape[1], device=q.device)[None, :]
    visible = positions < context_lens[:, None]  # [B, T]
    if kind.window is not None:
        visible &= positions >= (context_lens[:, None] - kind.window)
    grouped = q.view(batch, num_kv_heads, -1, 1, head_dim)  # [B, KvH, G, 1, D]
    scores = _scores(grouped, keys.transpose(1, 2), scale, kind)  # [B, KvH, G, 1, T]
    scores = scores.masked_fill(~visible[:, None, None, None, :], float("-inf"))
    probs = _softmax(scores, kind)
    out = torch.matmul(probs, values.float().transpose(1, 2).unsqueeze(2))  # [B, KvH, G, 1, D]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def window_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, window: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows' block tables cut to the blocks their window reaches, and their context lengths counted from the
    first block kept (a row's mask is the same relative to its new length). block_tables: [B, W] long; context_lens:
    [B] -> ([B, min(W, blocks a window spans)], [B]). Tensor ops only."""
    width = -(-window // block_size) + 1  # W keys starting anywhere in a block span at most this many blocks
    if block_tables.shape[1] <= width:
        return block_tables, context_lens
    first = ((context_lens - window).clamp(min=0) // block_size).clamp(max=block_tables.shape[1] - width)
    columns = first[:, None] + torch.arange(width, device=block_tables.device)[None, :]
    return block_tables.gather(1, columns), context_lens - first * block_size

