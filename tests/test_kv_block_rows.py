"""One-gather block moves between a layer-major pool and block rows (`kv_runtime.block_rows`), against torch's
index_select + permute of the same storage."""

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime import block_rows
from sage_infer.kv_runtime.pool import KVPool, make_kv_pool
from sage_infer.kv_runtime.tiers.rows import fused_kernel

SCHEMA = KVCacheSchema(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture(params=["numpy", "kernel"])
def copier(request, monkeypatch):
    """Each move through numpy's fancy indexing and through the C++ row copy (every size takes it here)."""
    if request.param == "numpy":
        monkeypatch.setattr(block_rows, "KERNEL_MIN_BYTES", 1 << 62)
        return None
    if fused_kernel() is None:
        pytest.skip("the C++ KV codec kernel does not load on this machine: moves take numpy's path")
    monkeypatch.setattr(block_rows, "KERNEL_MIN_BYTES", 0)
    calls = []
    real = block_rows.kernel_copy
    monkeypatch.setattr(block_rows, "kernel_copy", lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_and_write_blocks_match_the_torch_layout(dtype, copier):
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
    if copier is not None:
        assert copier == [True, True]  # the gather and the scatter both ran in the kernel


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_write_split_over_threads_is_the_same_write(threads, copier):
    """`write_rows(..., threads)` (admission, the engine waiting): the kernel splits the rows, the pool ends the
    same as after torch's index_copy."""
    schema = KVCacheSchema(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=KVDtype.FP32)
    pool = make_kv_pool(schema, 300)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:200]  # 200 blocks: 25 MiB
    rows = torch.randint(0, 256, (200, schema.bytes_per_block), dtype=torch.uint8)
    expected = pool._kv.clone()
    expected.index_copy_(2, ids, rows.view(torch.float32).view(200, *pool.block_shape).permute(2, 1, 0, 3, 4, 5))
    pool.write_rows(ids.tolist(), rows, threads)
    assert torch.equal(pool._kv.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(pool.read_blocks(ids).view(torch.uint8).reshape(200, -1), rows)
    if copier is not None:
        assert copier == [True, True]


def test_a_block_id_outside_the_pool_is_refused():
    pool = KVPool(SCHEMA, 4)
    with pytest.raises(IndexError, match="block ids"):
        pool.read_blocks([1, 4])


def test_no_blocks_is_an_empty_move():
    pool = KVPool(SCHEMA, 4)
    rows = pool.read_blocks([])
    assert rows.shape == (0, *pool.block_shape)
    pool.write_blocks([], rows)


@pytest.mark.parametrize("kv_dtype", [KVDtype.INT8, KVDtype.FP8_E4M3, KVDtype.INT4])
def test_a_quantized_pool_moves_codes_and_scales_as_the_torch_path_does(kv_dtype, copier):
    pool = make_kv_pool(SCHEMA.with_dtype(kv_dtype), 9)
    pool._codes.copy_(torch.randint(0, 256, pool._codes.shape, dtype=torch.uint8))
    pool._params.copy_(torch.randn(pool._params.shape).to(pool._params.dtype))
    ids = torch.tensor([7, 0, 4, 3])
    n = ids.numel()
    codes = pool._codes.index_select(2, ids).permute(2, 1, 0, 3, 4, 5).reshape(n, -1)
    params = pool._params.index_select(2, ids).permute(2, 1, 0, 3, 4, 5).reshape(n, -1).view(torch.uint8)
    expected = torch.cat((codes, params), dim=1)  # the row format: codes, then scales
    assert torch.equal(pool.read_blocks(ids), expected)
    rows = torch.randint(0, 256, expected.shape, dtype=torch.uint8)
    rows[:, codes.shape[1]:] = torch.randn(n, params.shape[1] // 2).half().view(torch.uint8)  # finite scales
    other = torch.tensor([1, 2, 5, 8])
    before = pool.read_blocks([6])
    pool.write_blocks(other, rows)
    assert torch.equal(pool.read_blocks(other), rows) and torch.equal(pool.read_blocks([6]), before)
    written = pool._codes.index_select(2, other).permute(2, 1, 0, 3, 4, 5).reshape(n, -1)
    assert torch.equal(written, rows[:, : codes.shape[1]])  # where the torch path puts them
