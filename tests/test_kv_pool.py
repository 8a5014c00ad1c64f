"""The KV pool: one preallocated paged cache whose size follows the schema and the budget."""

from __future__ import annotations

import pytest
import torch

from sage_infer.config.serve import KVPoolConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, KVLayout, ScaleLayout
from sage_infer.errors import ConfigError
from sage_infer.kv_runtime import KVPool, make_kv_pool

SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=KVDtype.FP16)
# K and V x 4 tokens x 2 heads x 8 dims x 2 layers x 2 bytes
BLOCK_BYTES = 2 * 4 * 2 * 8 * 2 * 2


def _kv(n, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, 8, generator=gen).to(dtype), torch.randn(n, 2, 8, generator=gen).to(dtype))


def test_block_shape_and_sizes():
    pool = KVPool(SCHEMA, num_blocks=5)
    assert pool.block_shape == (2, 2, 4, 2, 8)  # layers, K|V, tokens, heads, dims
    assert (pool.num_blocks, pool.block_size, pool.num_layers) == (5, 4, 2)
    assert pool.read_blocks([0, 3]).shape == (2, *pool.block_shape)


@pytest.mark.parametrize("kv_dtype,torch_dtype", [
    (KVDtype.FP32, torch.float32), (KVDtype.FP16, torch.float16), (KVDtype.BF16, torch.bfloat16),
])
def test_dtype_follows_the_schema(kv_dtype, torch_dtype):
    pool = make_kv_pool(KVCacheSchema(1, 1, 4, 4, kv_dtype), num_blocks=2)
    assert pool.dtype == torch_dtype and pool.read_blocks([1]).dtype == torch_dtype


def test_explicit_dtype_overrides_the_schema():
    pool = KVPool(SCHEMA, 2, dtype=torch.float32)
    assert pool.dtype == torch.float32 and pool.block_nbytes == 2 * BLOCK_BYTES


def test_nbytes_is_num_blocks_times_schema_bytes_per_block():
    pool = KVPool(SCHEMA, num_blocks=5)
    assert SCHEMA.bytes_per_block == BLOCK_BYTES
    assert pool.nbytes == 5 * BLOCK_BYTES and pool.block_nbytes == BLOCK_BYTES
    assert pool.read_blocks([4]).numel() * 2 == BLOCK_BYTES  # one row is one block's bytes


def test_hnd_layout_is_gone():
    assert [layout.value for layout in KVLayout] == ["NHD"]
    with pytest.raises(ValueError):
        KVCacheSchema.from_dict({**SCHEMA.to_dict(), "layout": "HND"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_then_gather_slots_returns_what_was_stored_in_the_compute_dtype(dtype):
    pool = KVPool(SCHEMA, num_blocks=6, dtype=dtype)
    slots = torch.tensor([21, 4, 5, 13, 0])  # any order, across blocks
    k0, v0 = _kv(5, 0, dtype)
    k1, v1 = _kv(5, 1, dtype)
    pool.store(0, k0, v0, slots)
    pool.store(1, k1, v1, slots)
    for layer, (k, v) in enumerate([(k0, v0), (k1, v1)]):
        got_k, got_v = pool.gather_slots(layer, slots.flip(0), torch.float32)
        assert got_k.dtype == got_v.dtype == torch.float32
        assert torch.equal(got_k, k.flip(0).float()) and torch.equal(got_v, v.flip(0).float())


def test_store_casts_to_the_pool_dtype():
    pool = KVPool(SCHEMA, num_blocks=2)  # fp16
    k, v = _kv(3, 2)
    pool.store(1, k, v, torch.tensor([0, 5, 7]))
    got_k, got_v = pool.gather_slots(1, torch.tensor([0, 5, 7]), torch.float32)
    assert torch.equal(got_k, k.half().float()) and torch.equal(got_v, v.half().float())


def test_layers_k_v_and_blocks_do_not_share_storage():
    pool = KVPool(SCHEMA, num_blocks=3)
    k, v = _kv(1, 3)
    pool.store(1, k, torch.zeros_like(v), torch.tensor([6]))  # block 1, token 2, layer 1, K only
    blocks = pool.read_blocks([0, 1, 2])
    assert torch.count_nonzero(blocks) == torch.count_nonzero(k)
    assert torch.equal(blocks[1, 1, 0, 2], k[0].half())
    everything_else = blocks.clone()
    everything_else[1, 1, 0, 2] = 0
    assert torch.count_nonzero(everything_else) == 0


def test_gather_blocks_lays_out_positions_in_block_table_order():
    pool = KVPool(SCHEMA, num_blocks=6, dtype=torch.float32)
    tables = torch.tensor([[4, 1, 0], [2, 0, 0]])  # row 1 padded with block 0
    k, v = _kv(12, 4)
    slots = torch.tensor([b * 4 + i for b in (4, 1, 0) for i in range(4)])
    pool.store(1, k, v, slots)
    keys, values = pool.gather_blocks(1, tables, torch.float16)
    assert keys.shape == values.shape == (2, 12, 2, 8) and keys.dtype == torch.float16
    assert torch.equal(keys[0], k.half()) and torch.equal(values[0], v.half())
    assert torch.equal(keys[1, 4:], k[8:].half().repeat(2, 1, 1))  # block 0 twice


def test_gathers_above_the_workspace_cap_allocate_their_own_output(monkeypatch):
    from sage_infer.kv_runtime import pool as pool_module

    pool = KVPool(SCHEMA, num_blocks=4, dtype=torch.float32)
    k, v = _kv(16, 6)
    pool.store(0, k, v, torch.arange(16))
    tables = torch.tensor([[3, 2], [1, 0]])
    in_workspace = [t.clone() for t in pool.gather_blocks(0, tables, torch.float32)]
    monkeypatch.setattr(pool_module, "GATHER_SCRATCH_MAX_BYTES", 0)
    fresh = pool.gather_blocks(0, tables, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(in_workspace, fresh))
    assert torch.equal(pool.gather_slots(0, torch.tensor([5, 9]), torch.float32)[1], v[[5, 9]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_read_write_blocks_round_trip_is_bit_exact_across_pools(dtype):
    src, dst = KVPool(SCHEMA, 8, dtype=dtype), KVPool(SCHEMA, 5, dtype=dtype)
    for layer in range(2):
        k, v = _kv(32, 10 + layer, dtype)
        src.store(layer, k, v, torch.arange(32))
    rows = src.read_blocks([6, 2, 7])
    assert rows.is_contiguous() and rows.shape == (3, *src.block_shape)
    dst.write_blocks(torch.tensor([0, 4, 1]), rows)
    back = dst.read_blocks([0, 4, 1])
    assert torch.equal(back.view(torch.uint8), rows.view(torch.uint8))  # bytes, not values (NaN-safe)
    assert torch.count_nonzero(dst.read_blocks([2, 3])) == 0  # other blocks untouched


def test_read_blocks_into_a_caller_buffer():
    pool = KVPool(SCHEMA, 4)
    pool.store(0, *_kv(4, 5, torch.float16), torch.tensor([12, 13, 14, 15]))
    out = torch.empty(1, *pool.block_shape, dtype=pool.dtype)
    assert pool.read_blocks([3], out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, pool.read_blocks([3]))


def test_write_blocks_rejects_a_wrong_shape_or_dtype():
    pool = KVPool(SCHEMA, 4)
    rows = pool.read_blocks([1, 2])
    with pytest.raises(ValueError, match="shape"):
        pool.write_blocks([1], rows)
    with pytest.raises(TypeError, match="dtype"):
        pool.write_blocks([1, 2], rows.float())


def test_a_quantized_pool_needs_per_token_scales():
    schema = KVCacheSchema(2, 2, 8, 4, KVDtype.FP8_E4M3, scale_layout=ScaleLayout.PER_HEAD)
    with pytest.raises(ValueError, match="per token and head"):
        make_kv_pool(schema, num_blocks=2)


def test_a_quantized_schema_is_refused_by_the_float_pool_and_make_kv_pool_picks_the_class():
    schema = KVCacheSchema(2, 2, 8, 4, KVDtype.INT8, scale_layout=ScaleLayout.PER_TOKEN)
    with pytest.raises(ValueError, match="QuantizedKVPool"):
        KVPool(schema, num_blocks=2)
    assert type(make_kv_pool(schema, num_blocks=2)).__name__ == "QuantizedKVPool"
    assert type(make_kv_pool(SCHEMA, num_blocks=2)) is KVPool


def test_from_config_uses_num_blocks_when_set():
    pool = KVPool.from_config(SCHEMA, KVPoolConfig(block_size=4, num_blocks=7, memory_budget="1MiB"), "cpu")
    assert pool.num_blocks == 7


def test_from_config_divides_the_memory_budget_by_bytes_per_block():
    config = KVPoolConfig(block_size=4, memory_budget=10 * BLOCK_BYTES + BLOCK_BYTES // 2)
    assert KVPool.from_config(SCHEMA, config, "cpu").num_blocks == 10


def test_from_config_takes_a_share_of_available_bytes_without_a_budget():
    config = KVPoolConfig(block_size=4, memory_utilization=0.5)
    pool = KVPool.from_config(SCHEMA, config, "cpu", available_bytes=9 * BLOCK_BYTES)
    assert pool.num_blocks == 4  # 0.5 * 9 blocks' bytes, rounded down


def test_from_config_budget_counts_an_overridden_dtype():
    config = KVPoolConfig(block_size=4, memory_budget=10 * BLOCK_BYTES)
    assert KVPool.from_config(SCHEMA, config, "cpu", dtype=torch.float32).num_blocks == 5


def test_from_config_without_any_size_asks_for_num_blocks_or_budget():
    with pytest.raises(ValueError, match="set kv_pool.num_blocks or kv_pool.memory_budget"):
        KVPool.from_config(SCHEMA, KVPoolConfig(block_size=4), "cpu")


def test_too_small_budget_error_names_budget_and_block_bytes():
    config = KVPoolConfig(block_size=4, memory_budget=BLOCK_BYTES - 1)
    with pytest.raises(ValueError, match=f"{BLOCK_BYTES - 1} bytes.*no block of {BLOCK_BYTES} bytes") as err:
        KVPool.from_config(SCHEMA, config, "cpu")
    assert isinstance(err.value, ConfigError)


def test_from_config_rejects_a_block_size_other_than_the_schema():
    with pytest.raises(ValueError, match="block_size"):
        KVPool.from_config(SCHEMA, KVPoolConfig(block_size=8, num_blocks=2), "cpu")
