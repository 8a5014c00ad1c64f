"""The pure-PyTorch paged attention paths agree with plain attention over the same keys."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from sage_infer.layers.attention import (
    AttentionMetadata,
    PrefillSpan,
    decode_attention_batched,
    decode_attention_reference,
    paged_attention,
    prefill_attention,
    store_kv,
)

H, KVH, D, BS = 8, 2, 16, 4


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


def _random_pool(num_blocks=32):
    return torch.zeros(num_blocks, BS, KVH, D), torch.zeros(num_blocks, BS, KVH, D)


def test_batched_decode_equals_per_sequence_reference():
    torch.manual_seed(3)
    rng = random.Random(3)
    k_cache, v_cache = _random_pool()
    free = list(range(32))
    rng.shuffle(free)
    lens = [1, 5, 13, 4]
    tables, refs = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])
        store_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        refs.append((k, v))
    q = torch.randn(len(lens), H, D)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = decode_attention_batched(q, k_cache, v_cache, padded, torch.tensor(lens), D**-0.5)
    for i, (k, v) in enumerate(refs):
        torch.testing.assert_close(out[i], decode_attention_reference(q[i], k, v, D**-0.5), atol=1e-5, rtol=1e-5)


def test_paged_attention_writes_through_the_slot_mapping():
    torch.manual_seed(4)
    k_cache, v_cache = _random_pool(8)
    table = [6, 2, 5]  # non-contiguous blocks
    n = 10
    q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])
    meta = AttentionMetadata(slots, [PrefillSpan(0, n, n, 0)], slots)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(k_cache[2, 1], k[5])  # position 5 -> block table[1] = 2, offset 1
    torch.testing.assert_close(out, dense_causal(q, k, v), atol=1e-5, rtol=1e-5)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(4, 1).transpose(0, 1)[None],
        v.repeat_interleave(4, 1).transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_grouped_decode_through_paged_attention_matches_reference():
    """Decode rows split into length-sorted groups give the per-sequence reference result."""
    from sage_infer.engine.model_runner import ModelRunner

    torch.manual_seed(5)
    rng = random.Random(5)
    k_cache, v_cache = _random_pool(200)
    free = list(range(200))
    rng.shuffle(free)
    lens = [rng.randint(1, 30) for _ in range(20)]  # more rows than one group holds
    tables, contexts = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        store_kv(k[:-1], v[:-1], k_cache, v_cache,
                 torch.tensor([table[i // BS] * BS + i % BS for i in range(n - 1)], dtype=torch.long))
        tables.append(table)
        contexts.append((k, v))
    q = torch.randn(len(lens), H, D)
    new_k = torch.stack([k[-1] for k, _ in contexts])
    new_v = torch.stack([v[-1] for _, v in contexts])
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)])
    groups = ModelRunner._decode_groups(list(range(len(lens))), tables, lens,
                                        lambda values: torch.tensor(values, dtype=torch.long))
    assert len(groups) == 2
    meta = AttentionMetadata(slots, [], None, groups)
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, meta, D**-0.5)
    for i, (k, v) in enumerate(contexts):
        torch.testing.assert_close(out[i], decode_attention_reference(q[i], k, v, D**-0.5), atol=1e-5, rtol=1e-5)
