"""One-gather block moves between a layer-major pool and block rows (`kv_runtime.block_rows`), against torch's
index_select + permute of the same storage."""

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.pool import KVPool

SCHEMA = KVCacheSchema(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_and_write_blocks_match_the_torch_layout(dtype):
    pool = KVPool(SCHEMA, 9, dtype=dtype)
    pool._kv.copy_(torch.randn(pool._kv.shape).to(dtype))
    ids = torch.tensor([7, 0, 4, 3])
    expected = pool._kv.index_select(2, ids).permute(2, 1, 0, 3, 4, 5).contiguous()  # [n, L, 2, bs, H, D]
    assert torch.equal(pool.read_blocks(ids).view(torch.uint8), expected.view(torch.uint8))
    rows = torch.randn(expected.shape).to(dtype)
    before = pool._kv.clone()
    pool.write_blocks(ids, rows)
    before.index_copy_(2, ids, rows.permute(2, 1, 0, 3, 4, 5))
    assert torch.equal(pool._kv.view(torch.uint8), before.view(torch.uint8))  # and every other block untouched


def test_a_block_id_outside_the_pool_is_refused():
    pool = KVPool(SCHEMA, 4)
    with pytest.raises(IndexError, match="block ids"):
        pool.read_blocks([1, 4])
