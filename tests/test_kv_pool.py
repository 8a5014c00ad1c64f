"""The KV pool: one preallocated paged cache whose size follows the schema and the budget."""

from __future__ import annotations

import pytest
import torch

from sage_infer.config.serve import KVPoolConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, KVLayout, ScaleLayout
from sage_infer.errors import ConfigError, NotAvailableError
from sage_infer.kv_runtime import KVPool

SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=KVDtype.FP16)
# K and V x 4 tokens x 2 heads x 8 dims x 2 layers x 2 bytes
BLOCK_BYTES = 2 * 4 * 2 * 8 * 2 * 2


def test_caches_have_nhd_shape_per_layer():
    pool = KVPool(SCHEMA, num_blocks=5)
    assert len(pool.k_cache) == len(pool.v_cache) == 2
    for cache in (*pool.k_cache, *pool.v_cache):
        assert cache.shape == (5, 4, 2, 8) and cache.is_contiguous()
    assert (pool.num_blocks, pool.block_size, pool.num_layers) == (5, 4, 2)


def test_hnd_schema_puts_heads_before_tokens():
    pool = KVPool(KVCacheSchema(2, 2, 8, 4, KVDtype.FP16, KVLayout.HND), num_blocks=3)
    assert pool.k_cache[0].shape == (3, 2, 4, 8)


@pytest.mark.parametrize("kv_dtype,torch_dtype", [
    (KVDtype.FP32, torch.float32), (KVDtype.FP16, torch.float16), (KVDtype.BF16, torch.bfloat16),
])
def test_dtype_follows_the_schema(kv_dtype, torch_dtype):
    pool = KVPool(KVCacheSchema(1, 1, 4, 4, kv_dtype), num_blocks=2)
    assert pool.k_cache[0].dtype == pool.v_cache[0].dtype == torch_dtype


def test_explicit_dtype_overrides_the_schema():
    assert KVPool(SCHEMA, 2, dtype=torch.float32).v_cache[1].dtype == torch.float32


def test_nbytes_is_num_blocks_times_schema_bytes_per_block():
    pool = KVPool(SCHEMA, num_blocks=5)
    assert SCHEMA.bytes_per_block == BLOCK_BYTES
    assert pool.nbytes == 5 * BLOCK_BYTES and pool.bytes_per_block == BLOCK_BYTES


def test_layers_and_k_v_do_not_share_storage():
    pool = KVPool(SCHEMA, num_blocks=2)
    pool.k_cache[0][1, 2].fill_(1.0)
    assert pool.k_cache[0].sum() == 2 * 8
    assert pool.v_cache[0].sum() == 0 and pool.k_cache[1].sum() == 0
    assert torch.count_nonzero(pool.kv_cache) == 2 * 8


def test_quantized_kv_dtype_is_not_implemented_yet():
    schema = KVCacheSchema(2, 2, 8, 4, KVDtype.FP8_E4M3, scale_layout=ScaleLayout.PER_HEAD)
    with pytest.raises(NotImplementedError, match="KV quantization is not implemented yet") as err:
        KVPool(schema, num_blocks=2)
    assert isinstance(err.value, NotAvailableError)  # the CLI prints it as one line


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
