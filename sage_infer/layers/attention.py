"""Paged attention: the per-step metadata, the PyTorch reference math (the oracle every faster path is tested
against), and `paged_attention`, a layer's entry point, which runs the step's `AttentionBackend`
(`sage_infer.layers.attention_backends`: the parts chosen once at build, the reference or the kernels).

K/V live in a `KVPool` and are reached only through its API (`store`, `gather_slots`,
`gather_blocks`, `block_views`), never as raw cache tensors, so the pool may change how it stores them.
A token at logical position ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

Cascade attention: when several sequences of a step start with the same pool blocks (one
system prompt found in the prefix cache), `AttentionMetadata.shared` names those blocks and
the sequences' query rows. They attend to the shared keys once, all together (one kernel
call per layer), and to the rest of their context on their own; the two results are merged
by their log-sum-exp. Without `shared` every sequence reads its whole context (the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool
    from sage_infer.layers.attention_backends import AttentionBackend
    from sage_infer.layers.attention_kinds import AttentionKind


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of queries in the flat token batch.

    Queries are rows ``[q_start, q_start + q_len)``; they attend to the sequence's first
    ``context_len`` tokens (over gathered context, their slots are
    ``AttentionMetadata.prefill_context[slot_start:slot_start + context_len]``).
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
    whole_batch: bool = False  # rows are exactly 0..b-1 (the step's or the participants' every row, in order)


def decode_groups(rows: list[int], tables: list[list[int]], lens: list[int], tensor,
                  group_rows: int) -> list[DecodeGroup]:
    """Decode rows as groups of at most `group_rows`: sorted by context length when there are several, each
    padded only to its own longest table. `tensor` moves a host list to the step's device."""
    if len(rows) <= group_rows:  # one group: the order changes nothing (and rows stay in batch order)
        order = list(range(len(rows)))
    else:
        order = sorted(range(len(rows)), key=lambda i: lens[i])
    groups = []
    for start in range(0, len(order), group_rows):
        chosen = order[start : start + group_rows]
        width = max(len(tables[i]) for i in chosen)
        groups.append(DecodeGroup(
            rows=tensor([rows[i] for i in chosen]),
            block_tables=tensor([tables[i] + [0] * (width - len(tables[i])) for i in chosen]),
            context_lens=tensor([lens[i] for i in chosen]),
            whole_batch=len(chosen) == len(rows) and rows == list(range(len(rows))),
        ))
    return groups


@dataclass(slots=True)
class SharedPrefix:
    """Leading KV blocks that several sequences of the step share, and those sequences' queries.

    Each participant's context is the ``num_tokens`` shared tokens followed by its own suffix.
    `prefills` and `decode_groups` describe the suffixes, numbered among the participants:
    query row ``i`` of theirs is row ``rows[i]`` of the flat batch, and ``context_len`` counts
    the tokens after the shared prefix (a span's ``slot_start`` still indexes
    `AttentionMetadata.prefill_context`; a group's block tables start after the shared blocks).
    """

    block_ids: torch.Tensor  # [S] long: the shared blocks, in order
    num_tokens: int  # S * block_size
    rows: torch.Tensor  # [N] long: the participants' query rows in the flat batch
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention metadata, as the step's backend derived it from the step's batch
    (`AttentionBackend.prepare`), built on the host and moved to the device once.

    `prefills` and `decode_groups` cover the sequences outside `shared` (all of them without it). How prefill
    spans read their earlier context is the prefill part's own business (`prefill_context`): the gathered parts
    put the slots of every span with earlier context there (a span's ``slot_start`` indexes them, ``[sum of
    those context_len]`` long), a part that reads blocks in place puts what its kernel takes.
    """

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    prefills: list[PrefillSpan]
    prefill_context: object | None  # the prefill part's: gathered slots ([N] long tensor), or its kernel's tables
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    shared: SharedPrefix | None = None
    # the backend that prepared this metadata; None: the reference (PyTorch ops only)
    backend: AttentionBackend | None = None
    # KV groups (a model with sliding-window layers, `sage_infer.kv_runtime.kv_groups`): each group's metadata, and
    # per model layer (its group, its layer in the pool's blocks); empty: one table for every layer
    groups: tuple[AttentionMetadata, ...] = ()
    layer_map: tuple[tuple[int, int], ...] = ()

    @property
    def decode_in_place(self) -> bool:
        """Decode groups (also `shared`'s) are read in place from the pool's blocks, all rows in one group."""
        return self.backend is not None and self.backend.decode_in_place

    def pure_decode_group(self) -> DecodeGroup | None:
        """The one group of a pure decode step read in place (every row one new token, in batch order, no
        prefill span and no shared prefix), or None for any other step."""
        if self.decode_in_place and not self.prefills and self.shared is None and len(self.decode_groups) == 1 \
                and self.decode_groups[0].whole_batch:
            return self.decode_groups[0]
        return None

    def cascade_decode_group(self, num_rows: int) -> DecodeGroup | None:
        """The suffix group of a decode step whose `num_rows` rows all attend `shared` (each one new token, in
        batch order, read in place after the shared blocks), or None for any other step."""
        shared = self.shared
        if self.decode_in_place and shared is not None and not self.prefills and not self.decode_groups \
                and not shared.prefills and len(shared.decode_groups) == 1 and shared.decode_groups[0].whole_batch \
                and len(shared.rows) == num_rows:
            return shared.decode_groups[0]
        return None


def prefill_attention(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence. q: [q_len, H, D]; k_ctx, v_ctx: [ctx_len, KvH, D] with ctx_len >= q_len.

    The queries are the last q_len positions, so the causal mask is aligned to the
    lower-right corner: query i sees keys j <= i + (ctx_len - q_len).
    """
    q_len, ctx_len = q.shape[0], k_ctx.shape[0]
    if q_len != ctx_len:  # cached keys, then the chunk's own: two unmasked kernel calls (`chunk_attention_lse`)
        return chunk_attention_lse(q, k_ctx, v_ctx, scale)[0].to(q.dtype)
    qh, kh, vh = q.transpose(0, 1)[None], k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k_ctx.shape[1])
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


def decode_attention_scaled(
    q: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor | None,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode queries at once, padded to the longest context, over head-major fp32 K/V `levels`
    (`KVPool.gather_block_levels`): key ``t`` is ``levels[0, b, h, t] * scales[0, b, h, t]``, value
    likewise with index 1; `scales` None for a float pool.

    q: [B, H, D]; levels: [2, B, KvH, T, D] fp32; scales: [2, B, KvH, T] fp32; context_lens: [B]
    -> [B, H, D]. Two batched matmuls and a softmax in fp32, query heads grouped per KV head (no
    repeat). A quantized pool's key scale multiplies the scores (q·(L·s) = s·(q·L)) and its value
    scale the probabilities (Σ p·(L·s) = Σ (p·s)·L), so K and V are read once, as levels. Masked
    SDPA on gathered bf16 K/V measured several times slower per decode step (docs/benchmarks.md,
    "Decode attention").
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, tokens = levels.shape[2], levels.shape[3]
    qg = q.to(torch.float32).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, levels[0].transpose(-1, -2))  # [B, KvH, G, T]
    scores.mul_(scale if scales is None else scales[0].unsqueeze(2) * scale)
    padded = torch.arange(tokens, device=q.device)[None, :] >= context_lens[:, None]  # [B, T]
    scores.masked_fill_(padded[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    if scales is not None:
        probs.mul_(scales[1].unsqueeze(2))
    return torch.matmul(probs, levels[1]).view(batch, num_heads, head_dim).to(q.dtype)


# -- cascade attention: partial results carry their log-sum-exp ------------------------------


def attention_with_lse_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns each query's log-sum-exp, in plain ops, float32.

    q: [B, KvH, M, D]; k, v: [B, KvH, T, D] (B may be a stride-0 expand); mask: bool
    broadcastable to [B, KvH, M, T] (True: attend; every row must attend to at least one key)
    or None; causal (M == T): query i sees keys j <= i -> out [B, KvH, M, D], lse [B, KvH, M],
    both float32.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()), lse


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse_reference`, on a CPU through PyTorch's flash kernel, which returns the
    log-sum-exp itself (faster than the plain ops of the reference; it takes a mask only as an
    additive bias of q's dtype). The output is computed in q's
    dtype there, the log-sum-exp in float32; both come back float32."""
    if q.device.type != "cpu":
        return attention_with_lse_reference(q, k, v, scale, mask, causal)
    bias = None if mask is None else torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                           scale=scale)
    return out.float(), lse


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from attention over each.

    out_*: [N, H, D], lse_*: [N, H], float32 -> [N, H, D] float32. Part ``a`` weighs its share of
    the union's softmax denominator, ``exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b)``.
    """
    weight_a = torch.sigmoid(lse_a - lse_b)[..., None]
    return out_b + (out_a - out_b) * weight_a


def shared_keys_attention_lse(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries that all see every key. q: [N, H, D]; k_ctx, v_ctx: [C, KvH, D] -> out [N, H, D],
    lse [N, H] (float32).

    The G query heads of each KV head are folded into its query rows ([1, KvH, N * G, D]), so
    one kernel call covers every query and head as one long query block per KV head.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_ctx.shape[1]
    groups = num_heads // num_kv_heads
    folded = q.view(n, num_kv_heads, groups, head_dim).transpose(0, 1).reshape(1, num_kv_heads, n * groups, head_dim)
    out, lse = attention_with_lse(folded, k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None], scale)
    out = out.view(num_kv_heads, n, groups, head_dim).transpose(0, 1).reshape(n, num_heads, head_dim)
    return out, lse.view(num_kv_heads, n, groups).transpose(0, 1).reshape(n, num_heads)


def chunk_attention_lse(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefill_attention` with the log-sum-exp: the queries are the last q_len of ctx_len
    positions (lower-right causal). q: [q_len, H, D]; k_ctx, v_ctx: [ctx_len, KvH, D] ->
    out [q_len, H, D], lse [q_len, H] (float32).

    With cached keys before the chunk (ctx_len > q_len), every query sees all of them: they are
    attended without a mask (`shared_keys_attention_lse`), the chunk's own keys causally, and the
    two merged by their log-sum-exp: faster than one call with a [q_len, ctx_len] mask,
    which the CPU flash kernel takes as a dense additive bias (`bench/flash_attention.py`, docs/benchmarks.md).
    Otherwise the G query heads of a KV head are a batch dimension ([G, KvH, q_len, D]) over K/V
    expanded without a copy.
    """
    q_len, num_heads, head_dim = q.shape
    ctx_len, num_kv_heads = k_ctx.shape[:2]
    if ctx_len > q_len:
        cached = ctx_len - q_len
        out_a, lse_a = shared_keys_attention_lse(q, k_ctx[:cached], v_ctx[:cached], scale)
        out_b, lse_b = chunk_attention_lse(q, k_ctx[cached:], v_ctx[cached:], scale)
        return merge_attention(out_a, lse_a, out_b, lse_b), torch.logaddexp(lse_a, lse_b)
    groups = num_heads // num_kv_heads
    batched = q.view(q_len, num_kv_heads, groups, head_dim).permute(2, 1, 0, 3)  # [G, KvH, q_len, D]
    keys = k_ctx.transpose(0, 1)[None].expand(groups, num_kv_heads, ctx_len, head_dim)
    values = v_ctx.transpose(0, 1)[None].expand(groups, num_kv_heads, ctx_len, head_dim)
    out, lse = attention_with_lse(batched, keys, values, scale, causal=True)
    return out.permute(2, 1, 0, 3).reshape(q_len, num_heads, head_dim), lse.permute(2, 1, 0).reshape(q_len, num_heads)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: KVPool,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    kind: AttentionKind | None = None,
) -> torch.Tensor:
    """Store this step's K/V of `layer` in `pool`, then attend, as the step's backend does (the reference without
    one). q: [T, H, D]; k, v: [T, KvH, D] -> [T, H, D]. `kind`: the layer's sliding window and soft-capping
    (`sage_infer.layers.attention_kinds`; None: plain causal attention)."""
    pool.ready(layer)  # a load admission queued layer by layer (`KVPool.load_rows`) has written this layer
    if meta.groups:  # the layer's KV group: its block tables, and its layer within the group's blocks
        group, layer = meta.layer_map[layer]
        meta = meta.groups[group]
    backend = meta.backend
    if backend is None:
        from sage_infer.layers.attention_backends import REFERENCE as backend
    if kind is None or kind.plain:
        return backend.forward(q, k, v, pool, layer, meta, scale)
    return backend.forward(q, k, v, pool, layer, meta, scale, kind)
