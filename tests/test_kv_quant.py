"""Quantized KV in the pool: fp8 / int8 / int4 codes with one fp16 scale per token and head.

The float pool is the oracle: a quantized pool's gathers equal the codec's round trip of what was
stored, whole blocks move bit-exact as bytes (scales inside), and the capacity per byte rises.
"""

from __future__ import annotations

import pytest
import torch

from sage_infer.config.serve import KVPoolConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, ScaleLayout
from sage_infer.kv_runtime.pool import KVPool, make_kv_pool
from sage_infer.kv_runtime.quantized_pool import QuantizedKVPool
from sage_infer.quantization.kv_codec import KVCodec

QUANTIZED = [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2, KVDtype.INT8, KVDtype.INT4]
LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 4


def schema(dtype: KVDtype, head_dim: int = HEAD_DIM) -> KVCacheSchema:
    scales = ScaleLayout.PER_TOKEN if dtype.is_quantized else ScaleLayout.NONE
    return KVCacheSchema(LAYERS, HEADS, head_dim, BLOCK, dtype, scale_layout=scales)


def kv_like(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HEADS, HEAD_DIM, generator=gen) * 3 + 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_quantized_schema_builds_a_quantized_pool(dtype):
    pool = make_kv_pool(schema(dtype), num_blocks=3)
    assert isinstance(pool, QuantizedKVPool)
    assert pool.block_nbytes == schema(dtype).bytes_per_block == pool.read_blocks([0]).shape[1]


@pytest.mark.parametrize("dtype", [KVDtype.INT8, KVDtype.INT4])
def test_int_codes_are_within_half_a_step_of_the_values(dtype):
    x = kv_like(64).float()
    codec = KVCodec(dtype, HEAD_DIM)
    y = codec.decode(*codec.encode(x), torch.float32)
    step = x.abs().amax(-1, keepdim=True) / (127 if dtype is KVDtype.INT8 else 7)  # symmetric around zero
    slack = step * 128 * 2**-11  # the fp16 rounding of the scale, times the largest code
    assert ((y - x).abs() <= step / 2 + slack).all()
    assert (y - x).abs().max() > 0  # a lossy format really was applied


@pytest.mark.parametrize("dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_fp8_codes_keep_the_relative_precision_of_the_format(dtype):
    x = kv_like(64).float()
    codec = KVCodec(dtype, HEAD_DIM)
    y = codec.decode(*codec.encode(x), torch.float32)
    eps = torch.finfo(torch.float8_e4m3fn if dtype is KVDtype.FP8_E4M3 else torch.float8_e5m2).eps
    amax = x.abs().amax(-1, keepdim=True)
    assert ((y - x).abs() <= x.abs() * eps / 2 * 1.01 + amax * 2**-9).all()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_zero_vector_decodes_exactly(dtype):
    codec = KVCodec(dtype, HEAD_DIM)
    x = torch.zeros(3, HEADS, HEAD_DIM)
    assert torch.equal(codec.decode(*codec.encode(x), torch.float32), x)


@pytest.mark.parametrize("dtype", [KVDtype.INT8, KVDtype.INT4])
def test_the_largest_magnitude_decodes_exactly(dtype):  # it maps to the extreme code (fp16-exact scale here)
    codec = KVCodec(dtype, HEAD_DIM)
    x = torch.zeros(1, HEADS, HEAD_DIM)
    x[..., 3], x[..., 5] = -0.75 * (127 if dtype is KVDtype.INT8 else 7) / 8, 0.01
    assert codec.decode(*codec.encode(x), torch.float32)[..., 3].eq(x[..., 3]).all()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_gathers_return_the_codec_round_trip_of_what_was_stored(dtype):
    pool = make_kv_pool(schema(dtype), num_blocks=4)
    k, v = kv_like(6, seed=1), kv_like(6, seed=2)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])  # all of block 1, half of block 2
    pool.store(1, k, v, slots)
    codec = pool.codec
    k_expect, v_expect = (codec.decode(*codec.encode(t), torch.bfloat16) for t in (k, v))
    got_k, got_v = pool.gather_slots(1, slots, torch.bfloat16)
    assert torch.equal(got_k, k_expect) and torch.equal(got_v, v_expect)
    blk_k, blk_v = pool.gather_blocks(1, torch.tensor([[1, 2]]), torch.bfloat16)
    assert blk_k.shape == (1, 2 * BLOCK, HEADS, HEAD_DIM)
    assert torch.equal(blk_k[0, :6], k_expect) and torch.equal(blk_v[0, :6], v_expect)
    assert not blk_k[0, 6:].any()  # unwritten slots read as zeros
    assert not pool.gather_slots(0, slots, torch.float32)[0].any()  # other layers untouched


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_blocks_move_between_pools_as_bytes_bit_exact(dtype):
    src, dst = make_kv_pool(schema(dtype), num_blocks=4), make_kv_pool(schema(dtype), num_blocks=4)
    for layer in range(LAYERS):
        src.store(layer, kv_like(8, layer), kv_like(8, layer + 5), torch.arange(4, 12))
    rows = src.read_blocks([1, 2])
    assert rows.dtype == torch.uint8 and rows.shape == (2, src.block_nbytes)
    dst.write_rows([3, 0], rows.view(torch.uint8))
    assert torch.equal(dst.read_blocks([3, 0]), rows)
    for layer in range(LAYERS):
        assert torch.equal(dst.gather_blocks(layer, torch.tensor([[3, 0]]), torch.float32)[1],
                           src.gather_blocks(layer, torch.tensor([[1, 2]]), torch.float32)[1])


def test_a_block_row_is_codes_then_fp16_scales():
    pool = make_kv_pool(schema(KVDtype.INT8), num_blocks=2)
    k = (torch.arange(HEAD_DIM, dtype=torch.float32) - 8).expand(1, HEADS, HEAD_DIM)  # amax 8: scale 8/127
    pool.store(0, k, k, torch.tensor([0]))
    row = pool.read_blocks([0])[0]
    data = schema(KVDtype.INT8).data_bytes_per_block
    assert row.numel() == data + LAYERS * 2 * BLOCK * HEADS * 2
    codes = row[:data].view(LAYERS, 2, BLOCK, HEADS, HEAD_DIM)
    scales = row[data:].view(torch.float16).view(LAYERS, 2, BLOCK, HEADS)
    assert codes[0, 0, 0, 0].view(torch.int8).tolist() == [round((i - 8) * 127 / 8) for i in range(HEAD_DIM)]
    assert scales[0, 1, 0, 1].item() == pytest.approx(8 / 127, rel=1e-3)
    assert not codes[1].any() and not scales[1].any()  # layer 1 was not written


def test_write_blocks_refuses_rows_of_the_wrong_size_or_type():
    pool = make_kv_pool(schema(KVDtype.INT4), num_blocks=2)
    rows = pool.read_blocks([0, 1])
    with pytest.raises(ValueError, match="shape"):
        pool.write_blocks([0], rows)
    with pytest.raises(TypeError, match="uint8 rows"):
        pool.write_blocks([0, 1], rows.float())


@pytest.mark.parametrize(("dtype", "head_dim", "ratio"), [
    (KVDtype.INT8, 128, 256 / 130), (KVDtype.INT8, 64, 128 / 66), (KVDtype.FP8_E4M3, 64, 128 / 66),
    (KVDtype.INT4, 128, 256 / 66), (KVDtype.INT4, 64, 128 / 34), (KVDtype.INT4, 32, 64 / 18),
])
def test_blocks_per_byte_against_bf16(dtype, head_dim, ratio):
    config = KVPoolConfig(block_size=BLOCK, memory_budget="64MiB")
    blocks = KVPool.blocks_for_config(schema(dtype, head_dim), config)
    bf16 = KVPool.blocks_for_config(schema(KVDtype.BF16, head_dim), config)
    assert blocks / bf16 == pytest.approx(ratio, rel=1e-3)


def test_int4_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        KVCodec(KVDtype.INT4, 15)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_scaled_decode_attention_equals_attention_over_dequantized_kv(dtype):
    from sage_infer.layers.attention import decode_attention_reference, decode_attention_scaled

    pool = make_kv_pool(schema(dtype), num_blocks=8)
    k, v = kv_like(20, seed=3), kv_like(20, seed=4)
    pool.store(1, k, v, torch.arange(20))
    tables = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 0, 1, 4]])  # both padded to 5 blocks (20 tokens)
    lens = torch.tensor([20, 9])
    q = torch.randn(2, 2 * HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    levels, scales = pool.gather_block_levels(1, tables)
    assert levels.shape == (2, 2, HEADS, 5 * BLOCK, HEAD_DIM) and scales.shape == (2, 2, HEADS, 5 * BLOCK)
    got = decode_attention_scaled(q, levels, scales, lens, 0.25)
    keys, values = pool.gather_blocks(1, tables, torch.float32)
    for b in range(2):  # the oracle: plain attention over the dequantized context of each row
        want = decode_attention_reference(q[b], keys[b, : lens[b]], values[b, : lens[b]], 0.25)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
