"""The paged decode kernel over an int8 pool (`decode_attention_paged_int8`: codes and fp16 scales read in place)
agrees with the pure-PyTorch oracle, the torch decode path of a quantized pool (`gather_block_levels` +
`decode_attention_scaled`), and its log-sum-exp with attention over the dequantized K/V; at every ISA level this
CPU runs (conftest.cpu_isa)."""

from __future__ import annotations

import random

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime.pool import make_kv_pool
from sage_infer.layers.attention import DecodeGroup, attention_with_lse_reference
from sage_infer.layers.attention_backends.gathered_decode import GatheredDecode
from sage_infer.layers.cpu_kernels import decode_attention_paged_int8, kernel_unavailable, quantize_store_int8_

pytestmark = [pytest.mark.skipif(kernel_unavailable() is not None, reason=f"paged kernel: {kernel_unavailable()}"),
              pytest.mark.usefixtures("cpu_isa")]
LAYERS, LAYER = 2, 1


def int8_pool(lens, num_kv_heads, head_dim, block_size, seed=0):
    """An int8 `QuantizedKVPool` whose layer LAYER holds random K/V (through `store`, which quantizes) for
    sequences of `lens` tokens in shuffled blocks -> (pool, padded block tables [B, W])."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    schema = KVCacheSchema(LAYERS, num_kv_heads, head_dim, block_size).with_dtype(KVDtype.INT8)
    pool = make_kv_pool(schema, num_blocks)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        pool.store(LAYER, 3 * torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim), slots)
        tables.append(table)
    width = max(map(len, tables))
    return pool, torch.tensor([t + [0] * (width - len(t)) for t in tables])


def run_kernel(q, pool, tables, lens, scale):
    return decode_attention_paged_int8(q, *pool.int8_block_views(LAYER), tables, torch.tensor(lens), scale)


@pytest.mark.parametrize("heads, head_dim", [((14, 2), 64), ((6, 2), 64), ((8, 2), 128), ((4, 4), 32), ((4, 2), 96)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_the_kernel_equals_the_torch_path_of_an_int8_pool(heads, head_dim, block_size):
    num_heads, num_kv_heads = heads
    lens = [1, 7, block_size, block_size + 1, 40, 130, 251]  # one token, partial and exact blocks
    pool, tables = int8_pool(lens, num_kv_heads, head_dim, block_size)
    q = torch.randn(len(lens), num_heads, head_dim)
    scale = head_dim**-0.5
    out, lse = run_kernel(q, pool, tables, lens, scale)
    group = DecodeGroup(torch.arange(len(lens)), tables, torch.tensor(lens))
    want = GatheredDecode().attend(q, pool, LAYER, group, scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    keys, values = pool.gather_blocks(LAYER, tables, torch.float32)  # dequantized: [B, W * block_size, KvH, D]
    for i, n in enumerate(lens):
        qg = q[i].view(num_kv_heads, -1, head_dim)[None]
        _, want_lse = attention_with_lse_reference(qg, keys[i, :n].transpose(0, 1)[None],
                                                   values[i, :n].transpose(0, 1)[None], scale)
        torch.testing.assert_close(lse[i], want_lse.reshape(num_heads), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_smaller_than_the_thread_count_splits_by_kv_head_with_the_same_result(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool, tables = int8_pool([70], 2, 64, 16, seed=3)
        q = torch.randn(1, 6, 64)
        out, _ = run_kernel(q, pool, tables, [70], 0.125)
    finally:
        torch.set_num_threads(before)
    group = DecodeGroup(torch.arange(1), tables, torch.tensor([70]))
    torch.testing.assert_close(out, GatheredDecode().attend(q, pool, LAYER, group, 0.125), atol=2e-5, rtol=1e-5)


def test_codes_and_scales_of_other_dtypes_or_sizes_are_clear_errors():
    pool, tables = int8_pool([5], 2, 32, 8)
    k, v, ks, vs = pool.int8_block_views(LAYER)
    q, lens = torch.randn(1, 4, 32), torch.tensor([5])
    with pytest.raises(RuntimeError, match="k/v codes: int8"):
        decode_attention_paged_int8(q, k.view(torch.uint8), v, ks, vs, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="k/v scales: contiguous fp16"):
        decode_attention_paged_int8(q, k, v, ks.float(), vs, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="k/v scales: contiguous fp16"):
        decode_attention_paged_int8(q, k, v, ks[:-1], vs, tables, lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpp_store_writes_the_codes_and_scales_the_pools_store_writes_to_the_bit(dtype):
    """`quantize_store_int8_` (what the C++ decode step stores) against `QuantizedKVPool.store` (`KVCodec.encode`):
    magnitudes from 1e-9 to 3e4, all-zero heads, and K/V as the strided views of a q/k/v product."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, tokens = 6, 2, 64, 16, 200
    schema = KVCacheSchema(LAYERS, kv_heads, head_dim, block_size).with_dtype(KVDtype.INT8)
    reference, pool = make_kv_pool(schema, 20), make_kv_pool(schema, 20)
    magnitude = 10.0 ** torch.randint(-9, 5, (tokens, 1, 1)).float()
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim) * magnitude).to(dtype)
    qkv[::17, heads:] = 0  # every value of some heads zero: the smallest scale
    k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    slots = torch.randperm(20 * block_size)[:tokens]
    reference.store(LAYER, k, v, slots)
    k_codes, v_codes, k_scales, v_scales = pool.int8_block_views(LAYER)
    for src, codes, scales in ((k, k_codes, k_scales), (v, v_codes, v_scales)):
        quantize_store_int8_(src, codes.view(-1, kv_heads, head_dim), scales, slots)
    for got, want in zip(pool.int8_block_views(LAYER), reference.int8_block_views(LAYER)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.int8 else got.view(torch.int16),
                           want.view(torch.uint8) if want.dtype == torch.int8 else want.view(torch.int16))


def test_the_cpp_store_refuses_a_slot_outside_the_pool():
    schema = KVCacheSchema(LAYERS, 2, 32, 8).with_dtype(KVDtype.INT8)
    k_codes, _, k_scales, _ = make_kv_pool(schema, 2).int8_block_views(LAYER)
    with pytest.raises(RuntimeError, match="slot 16 is outside the pool"):
        quantize_store_int8_(torch.randn(1, 2, 32), k_codes.view(-1, 2, 32), k_scales, torch.tensor([16]))
