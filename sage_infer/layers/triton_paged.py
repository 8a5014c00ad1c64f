"""Paged attention on CUDA in Triton: decode (the GPU counterpart of csrc/paged_decode.cpp) and prefill.

Each decode row's keys and values are read in place from the pool's blocks (``KVPool.block_views``):
no gathered, padded copy of the context per layer and step, which is what the pure-PyTorch path
(`gather_blocks` + `decode_attention_batched`, or `gather_block_levels` + `decode_attention_scaled`)
does and stays the oracle of. Same contract as `cpu_kernels.decode_attention_paged`: out and the
log-sum-exp of the scaled scores, both float32, so cascade attention can merge it.

The work is split as flash-decoding does: one program per (row, KV head, split of the context); a
program's G query heads share its KV head's keys (GQA, no repeat) and go through ``tl.dot`` as one
[G, tile] block, padded to 16 rows. Each split keeps an online softmax over tiles of `TILE` tokens
(whose pool blocks are looked up per token, so any power-of-two block size works) and writes its
partial output with its log-sum-exp; a second kernel merges the splits. The split count is chosen
from the block tables' width, never from the lengths themselves, so a step needs no device sync.

`prefill_attention`: every prefill span of a step (a sequence's chunk of new tokens, its earlier context
already in the pool) in one launch per layer, reading keys and values in place from the pool's blocks, the
step's own included (stored before the call): one program per (tile of `PREFILL_ROWS` queries of a span,
query head), an online softmax over `TILE`-token tiles up to the tile's last query, the causal mask
aligned to the lower-right corner (query i of a span of q tokens over c sees keys j <= c - q + i). The
reference path gathers each span's context (`KVPool.gather_slots`) and attends span by span.

Both kernels take a layer's attention kind (`sage_infer.layers.attention_kinds`, the PyTorch math they are tested
against): a sliding window (decode: each row's tables cut to the blocks the window reaches, each split's loop from
the window's first token; prefill: each tile's key loop from its first query's window, keys masked i - W < j <= i),
a logit soft-cap (``cap * tanh(s / cap)`` on the scaled scores) and attention sinks (each head's sink starts the
online softmax as its max with weight 1, in split 0 only for decode: the lse counts it). Kinds are constexpr flags:
a plain layer's kernels compile without them.

Numerics: scores are the model dtype's products accumulated in fp32, then scaled; the probabilities are
rounded to the value dtype before P·V, as flash attention does. Where the queries or the pool are fp32
(an fp32 model, or an fp32 pool), everything is IEEE fp32 (no TF32): 16-bit keys and values are widened,
the queries never rounded.

Without a GPU the same kernel code runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported) on CPU tensors: slow, for the tests only (tests/conftest.py sets it where no GPU is).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from sage_infer.layers.attention_kinds import FULL_ATTENTION, AttentionKind, window_tables

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: PyTorch's CUDA wheels bring it (`pip install triton` otherwise)
    triton = None
    tl = None

TILE = 64  # tokens per tile of a split (decode) or of a prefill program's key loop
PREFILL_ROWS = 64  # queries per prefill program
MAX_SPLITS = 64  # merge kernel's padded width; splits are never more than this


# The kernels are plain functions here (annotations stay strings, so this module imports without triton);
# `_kernels` compiles them, or wraps them for the interpreter.
def _partial_attention(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, sinks_ptr, scale, softcap, window, tiles_per_split,
    stride_qb, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_tb, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_TOKENS: tl.constexpr, FP32_DOT: tl.constexpr, WIDEN: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """One (row, KV head, split): attention of the KV head's GROUP query heads over the split's tokens (those of
    the row's window when WINDOWED); split 0 holds the sinks' logits (SINKS) in its softmax denominator."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + row)
    first = split * tiles_per_split * TILE_TOKENS
    stop = tl.minimum(first + tiles_per_split * TILE_TOKENS, context_len)  # past the split's last token
    if WINDOWED:  # the row's query (position context_len - 1) sees keys from context_len - window on
        first = tl.maximum(first, context_len - window)
    tiles = tl.maximum(stop - first + TILE_TOKENS - 1, 0) // TILE_TOKENS  # each tile holds a token it sees

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.zeros([GROUP_PAD], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if SINKS:  # one more logit per head in split 0's denominator, with no value: exp(sink - m) to l, nothing to acc
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    offsets = tl.arange(0, TILE_TOKENS)
    for t in range(0, tiles):
        pos = first + t * TILE_TOKENS + offsets
        valid = pos < stop
        block = tl.load(tables_ptr + row * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
        base = block.to(tl.int64) * stride_kblk + (pos % BLOCK_SIZE) * stride_ktok + kv_head * stride_kh
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif WIDEN:  # the interpreter's bf16 dot is wrong: the same exact products, summed in fp32
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (no overflow)
            e = tl.exp(-2.0 * tl.abs(scores / softcap))
            scores = tl.where(scores < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile holds a valid token
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif WIDEN:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i > 0  # a split past the row's context saw nothing: out 0, lse -inf (weight 0 in the merge)
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


def _merge_splits(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One (row, head): the splits' partial outputs weighed by their share of the softmax denominator."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    split_ok = s < num_splits
    flat = row * num_heads + head
    lse = tl.load(part_lse_ptr + flat * num_splits + s, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)  # finite: every row has at least one token, so one split saw it
    weight = tl.exp(lse - top)
    total = tl.sum(weight, 0)
    part = tl.load(part_ptr + (flat * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=split_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / total
    tl.store(out_ptr + flat * HEAD_DIM + d, out, mask=d < HEAD_DIM)
    tl.store(lse_ptr + flat, top + tl.log(total))


def _prefill_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, spans_ptr, tiles_ptr, sinks_ptr, scale, softcap, window,
    stride_qt, stride_qh, stride_kblk, stride_ktok, stride_kh, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr, TILE_TOKENS: tl.constexpr, FP32_DOT: tl.constexpr, WIDEN: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """One (tile of ROWS queries of a span, query head): causal attention over the span's context in the pool
    (under a layer's window, soft-cap and sinks where those flags say so).
    spans: [S, 3] (first row in the flat batch, queries, context tokens); tiles: [N, 2] (span, first query)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    span = tl.load(tiles_ptr + tile * 2)
    first_query = tl.load(tiles_ptr + tile * 2 + 1)
    q_start = tl.load(spans_ptr + span * 3)
    q_len = tl.load(spans_ptr + span * 3 + 1)
    context_len = tl.load(spans_ptr + span * 3 + 2)
    kv_head = head // GROUP

    m = first_query + tl.arange(0, ROWS)
    row_ok = m < q_len
    d = tl.arange(0, HEAD_PAD)
    dim_ok = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32 if FP32_DOT else k_ptr.dtype.element_ty)
    query_pos = context_len - q_len + m  # a padding row (m >= q_len) sees every key up to `end`: finite, unused
    end = tl.minimum(context_len, context_len - q_len + first_query + ROWS)  # keys the tile's last query sees
    lo = 0
    if WINDOWED:  # the first key the tile's first query sees
        lo = tl.maximum(context_len - q_len + first_query - window + 1, 0)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if SINKS:  # the head's sink: one more logit in each query's denominator, with no value
        m_i = tl.zeros([ROWS], dtype=tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
        l_i = l_i + 1.0
    acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)
    offsets = tl.arange(0, TILE_TOKENS)
    for start in range(lo, end, TILE_TOKENS):
        pos = start + offsets
        valid = pos < end
        block = tl.load(tables_ptr + span * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
        base = block.to(tl.int64) * stride_kblk + (pos % BLOCK_SIZE) * stride_ktok + kv_head * stride_kh
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif WIDEN:  # the interpreter's bf16 dot is wrong: the same exact products, summed in fp32
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if SOFTCAP:  # cap * tanh(s / cap), as in the decode kernel
            e = tl.exp(-2.0 * tl.abs(scores / softcap))
            scores = tl.where(scores < 0, -softcap, softcap) * (1.0 - e) / (1.0 + e)
        visible = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        if WINDOWED:
            visible = visible & (pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # -inf only for a query that has seen no key yet (a window's later rows in an early tile): p and alpha 0
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif WIDEN:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i 0 only for padding rows past a window's reach
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


# Integer arguments that change from step to step: the block tables' width, the splits and the tiles per split
# (with the buffers' strides that follow from them). Triton compiles a kernel anew for each integer argument that
# turns 1 or divisible by 16 (it specializes on those), so without this list requests of new lengths compiled up to
# three variants each while serving (a GPU's prefill step of 32 tokens took 713 ms after 29 ms for 16 tokens)
VARYING = {
    _partial_attention: ["tiles_per_split", "stride_tb", "stride_ob", "stride_oh", "stride_lb", "stride_lh"],
    _merge_splits: ["num_splits"],
    _prefill_attention: ["stride_tb"],
}


@cache
def _kernels():
    """The three kernels, compiled for the GPU; under ``TRITON_INTERPRET=1`` (set before triton is imported)
    `triton.jit` wraps them for the interpreter instead."""
    return tuple(triton.jit(fn, do_not_specialize=VARYING[fn])
                 for fn in (_partial_attention, _merge_splits, _prefill_attention))


def interpreting() -> bool:
    """Whether triton was imported with ``TRITON_INTERPRET=1``: kernels run on CPU tensors, in numpy."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable(device: torch.device) -> str | None:
    """None when the Triton kernel can run on `device`, else why not."""
    if triton is None:
        return "triton is not installed (PyTorch's CUDA wheels bring it; or pip install triton)"
    if device.type != "cuda":
        return f"the Triton kernel runs on NVIDIA CUDA devices (device is {device.type})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build (the Triton kernel runs on NVIDIA CUDA devices)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"the Triton kernel needs compute capability 8.0 or newer (bf16 dot products); the GPU has {major}.x"
    return None


def _check_runnable(q: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the Triton kernel is unavailable: triton is not installed")
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError("the Triton kernel takes CPU tensors only under TRITON_INTERPRET=1")


@cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(batch: int, num_kv_heads: int, max_tokens: int, multiprocessors: int,
               wanted: int | None = None) -> tuple[int, int]:
    """(splits, tiles per split) for rows of at most `max_tokens` context: `wanted` splits, by default
    enough programs for about four per multiprocessor; each split at least one tile, at most `MAX_SPLITS`."""
    tiles = max(1, -(-max_tokens // TILE))
    if wanted is None:
        wanted = max(1, -(-4 * multiprocessors // max(1, batch * num_kv_heads)))
    per_split = -(-tiles // max(1, min(tiles, wanted, MAX_SPLITS)))
    return -(-tiles // per_split), per_split


def decode_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    kind: AttentionKind = FULL_ATTENTION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over pool blocks in place. q: [B, H, D] (the model dtype); k_blocks, v_blocks:
    [num_blocks, block_size, KvH, D] contiguous fp32/bf16/fp16 (`KVPool.block_views`); block_tables: [B, W]
    (padding entries are never read); context_lens: [B], each >= 1 and <= W * block_size -> out [B, H, D]
    and lse [B, H], float32. `splits`: how many parts each row's context is cut into (default: `num_splits`'s
    choice). `kind`: a layer's sliding window (the tables cut to the blocks it reaches, then masked to the
    token), logit soft-cap and sinks (with sinks, lse counts them). CPU tensors only under the interpreter
    (`interpreting`)."""
    _check_runnable(q)
    partial, merge, _ = _kernels()
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_blocks.shape
    if kind.window is not None:
        block_tables, context_lens = window_tables(block_tables, context_lens, kind.window, block_size)
    assert k_blocks.is_contiguous() and v_blocks.stride() == k_blocks.stride(), "pool blocks in one layout"
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    multiprocessors = 1 if q.device.type == "cpu" else _multiprocessors(q.device.index or 0)
    splits, tiles_per_split = num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, multiprocessors,
                                         splits)
    out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    sinks = q if kind.sinks is None else kind.sinks.detach().float().contiguous()  # q: a pointer never read
    partial[(batch, num_kv_heads, splits)](
        q, k_blocks, v_blocks, block_tables, context_lens, out, lse, sinks, scale, kind.softcap or 1.0,
        kind.window or 0, tiles_per_split,
        q.stride(0), q.stride(1), k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_TOKENS=TILE, FP32_DOT=torch.float32 in (q.dtype, k_blocks.dtype),
        WIDEN=interpreting(), WINDOWED=kind.window is not None, SOFTCAP=kind.softcap is not None,
        SINKS=kind.sinks is not None,
    )
    if splits == 1:
        return out.view(batch, num_heads, head_dim), lse.view(batch, num_heads)
    merged = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    merged_lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device)
    merge[(batch, num_heads)](out, lse, merged, merged_lse, splits, num_heads,
                              HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return merged, merged_lse


def prefill_tiles(spans: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The prefill kernel's programs along its first axis: (span index, first query) for every tile of
    `PREFILL_ROWS` queries of each span (first row, queries, context tokens), longest spans' tiles first so
    the costliest programs start early."""
    order = sorted(range(len(spans)), key=lambda i: -spans[i][2])
    return [(i, m) for i in order for m in range((spans[i][1] - 1) // PREFILL_ROWS * PREFILL_ROWS, -1, -PREFILL_ROWS)]


def prefill_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    spans: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    kind: AttentionKind = FULL_ATTENTION,
) -> None:
    """Causal attention of every prefill span, written into `out`'s span rows. q, out: [T, H, D] (the model
    dtype; rows outside the spans are left as they are); k_blocks, v_blocks: [num_blocks, block_size, KvH, D]
    contiguous (`KVPool.block_views`), the spans' own keys already stored; block_tables: [S, W] (span s's
    context in its row, padding never read); spans: [S, 3] int (first row in q, queries, context tokens;
    queries <= context tokens); tiles: [N, 2] int (`prefill_tiles`); `kind`: a layer's sliding window, logit soft-cap
    and sinks. CPU tensors only under the interpreter."""
    _check_runnable(q)
    _, _, prefill = _kernels()
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_blocks.shape
    assert k_blocks.is_contiguous() and v_blocks.stride() == k_blocks.stride(), "pool blocks in one layout"
    assert out.shape == q.shape and out.stride(-1) == 1, "out: [T, H, D], last dimension contiguous"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if tiles.shape[0] == 0:
        return
    sinks = q if kind.sinks is None else kind.sinks.detach().float().contiguous()  # q: a pointer never read
    prefill[(tiles.shape[0], num_heads)](
        q, k_blocks, v_blocks, out, block_tables, spans.contiguous(), tiles.contiguous(), sinks, scale,
        kind.softcap or 1.0, kind.window or 0,
        q.stride(0), q.stride(1), k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, ROWS=PREFILL_ROWS, TILE_TOKENS=TILE,
        FP32_DOT=torch.float32 in (q.dtype, k_blocks.dtype), WIDEN=interpreting(), WINDOWED=kind.window is not None,
        SOFTCAP=kind.softcap is not None, SINKS=kind.sinks is not None,
    )
