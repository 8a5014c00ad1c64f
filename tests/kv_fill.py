"""A KV pool holding random keys and values for sequences in shuffled blocks: what the decode kernels'
tests read (the C++ kernel's in tests/test_paged_kernel.py, the Triton kernel's in tests/test_triton_paged.py)."""

from __future__ import annotations

import random

import torch

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime import KVPool

LAYERS, LAYER = 3, 2  # the pool's layers, and the one filled


def filled_pool(lens, num_kv_heads, head_dim, block_size, dtype, seed=0, device=torch.device("cpu")):
    """A pool on `device` whose layer LAYER holds random K/V for sequences of `lens` tokens in shuffled blocks:
    (pool, block tables, per sequence (k, v) [n, KvH, D] as stored, widened to fp32, on the CPU)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    pool = KVPool(KVCacheSchema(LAYERS, num_kv_heads, head_dim, block_size, KVDtype.FP32), num_blocks, dtype=dtype,
                  device=device)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, contexts = [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        pool.store(LAYER, k.to(device), v.to(device), slots.to(device))
        tables.append(table)
        contexts.append((k.to(dtype).float(), v.to(dtype).float()))
    return pool, tables, contexts
