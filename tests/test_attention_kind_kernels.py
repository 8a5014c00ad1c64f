"""The CPU kernels under a layer's attention kind (a sliding window, a logit soft-cap, attention sinks, and all three)
against the PyTorch math of `sage_infer.layers.attention_kinds`, at every ISA level this CPU runs (conftest.cpu_isa):
the paged decode kernel over fp32, bf16 and int8 pools (windows shorter and longer than a block, rows of partial
blocks), the flash prefill kernel in fp32 and bf16 (spans from the start and after cached keys, windows of 1 to
more than a tile); GQA throughout, head dims on the kernels' vectorized and generic paths (the flash kernel's widest,
256, too), plain attention beside the kinds."""

from __future__ import annotations

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime.pool import make_kv_pool
from sage_infer.layers.attention import DecodeGroup
from sage_infer.layers.attention_backends.flash_prefill import FlashPrefill, flash_attention_kind
from sage_infer.layers.attention_backends.paged_decode import PagedDecode, decode_attention_kind
from sage_infer.layers.attention_kinds import AttentionKind, kind_decode_attention, kind_prefill_attention
from sage_infer.layers.cpu_kernels import flash_unavailable, kernel_unavailable

pytestmark = [pytest.mark.skipif(kernel_unavailable() is not None, reason=f"CPU kernels: {kernel_unavailable()}"),
              pytest.mark.usefixtures("cpu_isa", "one_thread")]
HEADS, KV_HEADS = 8, 2
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def kinds(window: int, combined_window: int) -> list[AttentionKind]:
    sinks = torch.randn(HEADS) * 1.5
    return [AttentionKind(), AttentionKind(window=window), AttentionKind(softcap=0.7), AttentionKind(sinks=sinks),
            AttentionKind(window=combined_window, softcap=5.0, sinks=sinks)]


def filled_pool(kv_dtype: KVDtype, head_dim: int, block: int, blocks: int):
    pool = make_kv_pool(KVCacheSchema(1, KV_HEADS, head_dim, block).with_dtype(kv_dtype), blocks)
    slots = torch.arange(blocks * block)
    pool.store(0, 2 * torch.randn(blocks * block, KV_HEADS, head_dim), torch.randn(blocks * block, KV_HEADS, head_dim),
               slots)
    return pool


@pytest.mark.parametrize("kv_dtype, head_dim", [(KVDtype.FP32, 64), (KVDtype.BF16, 32), (KVDtype.INT8, 64)])
def test_paged_decode_kernel_takes_window_softcap_and_sinks(kv_dtype, head_dim):
    """Rows of one token, partial and whole blocks, past the window and within it; tables in shuffled blocks."""
    torch.manual_seed(head_dim)
    block, blocks = 16, 40
    pool = filled_pool(kv_dtype, head_dim, block, blocks)
    lens = torch.tensor([1, 5, 15, 16, 17, 47, 48, 49, 100, 130])
    tables = torch.stack([torch.randperm(blocks)[:9] for _ in lens])
    keys, values = pool.gather_blocks(0, tables, torch.float32)  # (int8: dequantized)
    q = torch.randn(len(lens), HEADS, head_dim)
    scale = head_dim**-0.5
    for kind in kinds(5, 21):  # windows shorter and longer than a block
        want = kind_decode_attention(q, keys, values, lens, scale, kind)
        out, _ = decode_attention_kind(q, pool, 0, tables, lens, scale, kind)
        tolerance = FP32 if kv_dtype is not KVDtype.INT8 else {"atol": 1e-4, "rtol": 1e-4}
        torch.testing.assert_close(out, want, **tolerance, msg=lambda m, k=kind: f"{k.describe()}: {m}")
    group = DecodeGroup(rows=torch.arange(len(lens)), block_tables=tables, context_lens=lens)
    got = PagedDecode().attend_kind(q.bfloat16(), pool, 0, group, scale, kind)  # the part: q's dtype back
    assert got.dtype == torch.bfloat16


def test_paged_decode_kernel_softmax_with_a_sink_counts_it_in_the_lse():
    torch.manual_seed(1)
    pool = filled_pool(KVDtype.FP32, 32, 16, 4)
    tables, lens = torch.tensor([[2, 0, 3]]), torch.tensor([40])
    q, sinks = torch.randn(1, HEADS, 32), torch.randn(HEADS)
    _, lse = decode_attention_kind(q, pool, 0, tables, lens, 0.2, AttentionKind(window=9, sinks=sinks))
    keys = pool.gather_blocks(0, tables, torch.float32)[0][0, 31:40]  # the window's 9 keys
    scores = torch.einsum("hd,khd->hk", q[0], keys.repeat_interleave(HEADS // KV_HEADS, dim=1)) * 0.2
    torch.testing.assert_close(lse[0], torch.cat([scores, sinks[:, None]], 1).logsumexp(1), **FP32)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.bfloat16, 32), (torch.float32, 256)])
def test_flash_kernel_takes_window_softcap_and_sinks(dtype, head_dim):
    """Spans from the start and after cached keys, shorter and longer than the window and a 64-key tile, and one of
    many tasks (each of up to 64 query positions, some past their window's start); bf16
    within its rounding of P (against the math on the same bf16 inputs)."""
    if flash_unavailable(head_dim, dtype) is not None:
        pytest.skip(f"flash kernel: {flash_unavailable(head_dim, dtype)}")
    torch.manual_seed(head_dim)
    scale = head_dim**-0.5
    tolerance = FP32 if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for ctx_len, q_len, window in [(37, 37, 1), (150, 90, 100), (200, 1, 40), (90, 23, 5), (700, 600, 100)]:
        q, k, v = (torch.randn(n, h, head_dim).to(dtype) for n, h in ((q_len, HEADS), (ctx_len, KV_HEADS),
                                                                       (ctx_len, KV_HEADS)))
        for kind in kinds(window, 40):
            want = kind_prefill_attention(q.float(), k.float(), v.float(), scale, kind)
            out, _ = flash_attention_kind(q, k, v, scale, kind)
            torch.testing.assert_close(out, want, **tolerance,
                                       msg=lambda m, k=kind, c=ctx_len, n=q_len: f"{k.describe()} {c}/{n}: {m}")
    assert FlashPrefill().attend_kind(q, k, v, scale, kind).dtype == dtype
