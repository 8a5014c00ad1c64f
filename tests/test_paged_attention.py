"""The pure-PyTorch paged attention paths agree with plain attention over the same keys."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime import KVPool
from sage_infer.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    decode_attention_batched,
    decode_attention_reference,
    decode_groups,
    paged_attention,
    prefill_attention,
)

H, KVH, D, BS = 8, 2, 16, 4
LAYERS = 3
LAYER = 1  # a middle layer: the pool's per-layer offsets are exercised


def dense_causal(q, k, v):
    """Reference: repeat K/V per group and run full attention with an explicit mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, ctx = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    mask = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_prefill_with_cached_prefix_uses_lower_right_causal_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, H, D), torch.randn(12, KVH, D), torch.randn(12, KVH, D)
    out = prefill_attention(q, k, v, D**-0.5)
    torch.testing.assert_close(out, dense_causal(q, k, v), atol=1e-5, rtol=1e-5)


def test_prefill_without_prefix_is_plain_causal():
    torch.manual_seed(1)
    q, k, v = torch.randn(7, H, D), torch.randn(7, KVH, D), torch.randn(7, KVH, D)
    torch.testing.assert_close(prefill_attention(q, k, v, D**-0.5), dense_causal(q, k, v), atol=1e-5, rtol=1e-5)


def test_grouped_decode_matches_dense():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, H, D), torch.randn(9, KVH, D), torch.randn(9, KVH, D)
    out = decode_attention_reference(q[0], k, v, D**-0.5)
    torch.testing.assert_close(out, dense_causal(q, k, v)[0], atol=1e-5, rtol=1e-5)


def _pool(num_blocks=32, dtype=torch.float32):
    return KVPool(KVCacheSchema(LAYERS, KVH, D, BS, KVDtype.FP32), num_blocks, dtype=dtype)


def _slots(table, start, end):
    return torch.tensor([table[i // BS] * BS + i % BS for i in range(start, end)], dtype=torch.long)


def test_batched_decode_equals_per_sequence_reference():
    torch.manual_seed(3)
    rng = random.Random(3)
    pool = _pool()
    free = list(range(32))
    rng.shuffle(free)
    lens = [1, 5, 13, 4]
    tables, refs = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        pool.store(LAYER, k, v, _slots(table, 0, n))
        tables.append(table)
        refs.append((k, v))
    q = torch.randn(len(lens), H, D)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    keys, values = pool.gather_blocks(LAYER, padded, q.dtype)
    out = decode_attention_batched(q, keys, values, torch.tensor(lens), D**-0.5)
    for i, (k, v) in enumerate(refs):
        torch.testing.assert_close(out[i], decode_attention_reference(q[i], k, v, D**-0.5), atol=1e-5, rtol=1e-5)


def test_paged_attention_writes_through_the_slot_mapping():
    torch.manual_seed(4)
    pool = _pool(8)
    table = [6, 2, 5]  # non-contiguous blocks
    n = 10
    q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
    slots = _slots(table, 0, n)
    meta = AttentionMetadata(slots, [PrefillSpan(0, n, n, 0)], slots)
    out = paged_attention(q, k, v, pool, LAYER, meta, D**-0.5)
    block = pool.read_blocks([2])[0]  # [layers, K|V, tokens, heads, dims]
    torch.testing.assert_close(block[LAYER, 0, 1], k[5])  # position 5 -> block table[1] = 2, offset 1
    torch.testing.assert_close(block[LAYER, 1, 1], v[5])
    torch.testing.assert_close(out, dense_causal(q, k, v), atol=1e-5, rtol=1e-5)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(4, 1).transpose(0, 1)[None],
        v.repeat_interleave(4, 1).transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_grouped_decode_through_paged_attention_matches_reference():
    """Decode rows split into length-sorted groups give the per-sequence reference result."""
    from sage_infer.layers.attention_backends.base import DECODE_GROUP_ROWS

    torch.manual_seed(5)
    rng = random.Random(5)
    pool = _pool(200)
    free = list(range(200))
    rng.shuffle(free)
    lens = [rng.randint(1, 30) for _ in range(20)]  # more rows than one group holds
    tables, contexts = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        pool.store(LAYER, k[:-1], v[:-1], _slots(table, 0, n - 1))
        tables.append(table)
        contexts.append((k, v))
    q = torch.randn(len(lens), H, D)
    new_k = torch.stack([k[-1] for k, _ in contexts])
    new_v = torch.stack([v[-1] for _, v in contexts])
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)])
    groups = decode_groups(list(range(len(lens))), tables, lens, lambda values: torch.tensor(values, dtype=torch.long),
                           DECODE_GROUP_ROWS)
    assert len(groups) == 2
    meta = AttentionMetadata(slots, [], None, groups)
    out = paged_attention(q, new_k, new_v, pool, LAYER, meta, D**-0.5)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i], decode_attention_reference(q[i], k, v, D**-0.5), atol=1e-5, rtol=1e-5)


def test_prefill_over_cached_context_equals_dense_reference():
    """A chunk whose earlier tokens are already in the pool reads them back through gather_slots."""
    torch.manual_seed(6)
    pool = _pool(8, dtype=torch.float16)  # stored in fp16, attended in fp32
    table = [3, 7, 1, 4]
    n, cached = 14, 9
    q = torch.randn(n - cached, H, D)
    k, v = torch.randn(n, KVH, D).half().float(), torch.randn(n, KVH, D).half().float()
    pool.store(LAYER, k[:cached], v[:cached], _slots(table, 0, cached))
    meta = AttentionMetadata(_slots(table, cached, n), [PrefillSpan(0, n - cached, n, 0)], _slots(table, 0, n))
    out = paged_attention(q, k[cached:], v[cached:], pool, LAYER, meta, D**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, dense_causal(q, k, v), atol=1e-5, rtol=1e-5)


def test_blocks_copied_into_another_pool_at_other_ids_attend_the_same():
    """read_blocks/write_blocks move a sequence's KV between pools; attention over the copy is identical."""
    torch.manual_seed(7)
    src, dst = _pool(16), _pool(16)
    table, moved = [9, 2, 14], [0, 11, 5]
    n = 11
    for layer in range(LAYERS):  # every layer: the copy must carry all of them
        src.store(layer, torch.randn(n, KVH, D), torch.randn(n, KVH, D), _slots(table, 0, n))
    dst.write_blocks(moved, src.read_blocks(table))
    q = torch.randn(1, H, D)
    for layer in range(LAYERS):
        outs = []
        for pool, blocks in ((src, table), (dst, moved)):
            group = DecodeGroup(torch.tensor([0]), torch.tensor([blocks]), torch.tensor([n + 1]))
            new_k, new_v = torch.ones(1, KVH, D), torch.ones(1, KVH, D)
            meta = AttentionMetadata(_slots(blocks, n, n + 1), [], None, [group])
            outs.append(paged_attention(q, new_k, new_v, pool, layer, meta, D**-0.5))
        assert torch.equal(outs[0], outs[1])
