"""`KVPool`: the preallocated paged KV cache every layer reads and writes through block tables."""

from __future__ import annotations

import torch

from sage_infer.config.serve import KVPoolConfig
from sage_infer.core.dtypes import TORCH_DTYPES
from sage_infer.core.kv_schema import KVCacheSchema, KVLayout
from sage_infer.errors import ConfigError, NotAvailableError


class KVPoolSizeError(ConfigError, ValueError):
    """The KV budget cannot hold one block (or no budget was given). A ValueError and a one-line CLI error."""


class KVQuantizationNotImplemented(NotAvailableError, NotImplementedError):
    """The schema asks for a quantized KV dtype, which this build cannot store yet."""


def torch_dtype_of(schema: KVCacheSchema) -> torch.dtype:
    """The element type that stores `schema.dtype`; quantized dtypes raise `KVQuantizationNotImplemented`."""
    if schema.dtype.is_quantized:
        raise KVQuantizationNotImplemented(
            f"KV dtype {schema.dtype.value}: KV quantization is not implemented yet",
            hint="use kv_dtype fp16, bf16 or fp32",
        )
    return TORCH_DTYPES[schema.dtype]


def bytes_per_block(schema: KVCacheSchema, dtype: torch.dtype | None = None) -> int:
    """Bytes one block takes in the pool: K and V of all layers (`schema.bytes_per_block` unless `dtype` overrides)."""
    itemsize = (dtype if dtype is not None else torch_dtype_of(schema)).itemsize
    return schema.num_layers * schema.elements_per_block_per_layer * itemsize


class KVPool:
    """Preallocated paged KV cache of one model on one device.

    ``kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) is
    one allocation; ``k_cache[layer] = kv_cache[0, layer]`` and ``v_cache[layer] =
    kv_cache[1, layer]`` are contiguous views ``[num_blocks, block_size, num_kv_heads,
    head_dim]``. An HND schema swaps the block_size and num_kv_heads axes. Slot ``s`` of
    the cache is token ``s % block_size`` of block ``s // block_size``.
    """

    def __init__(
        self,
        schema: KVCacheSchema,
        num_blocks: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_blocks < 1:
            raise KVPoolSizeError(f"a KV pool needs at least 1 block, got num_blocks={num_blocks}")
        schema_dtype = torch_dtype_of(schema)
        self.schema = schema
        self.num_blocks = num_blocks
        self.block_size = schema.block_size
        self.num_layers = schema.num_layers
        self.num_kv_heads = schema.num_kv_heads
        self.head_dim = schema.head_dim
        self.dtype = dtype if dtype is not None else schema_dtype
        self.device = torch.device(device)
        if schema.layout is KVLayout.NHD:
            block_shape = (schema.block_size, schema.num_kv_heads, schema.head_dim)
        else:
            block_shape = (schema.num_kv_heads, schema.block_size, schema.head_dim)
        # zeros, not empty: unwritten slots must never hold NaN that a masked kernel could still touch
        self.kv_cache = torch.zeros(
            (2, schema.num_layers, num_blocks, *block_shape), dtype=self.dtype, device=self.device
        )
        self.k_cache: list[torch.Tensor] = [self.kv_cache[0, layer] for layer in range(schema.num_layers)]
        self.v_cache: list[torch.Tensor] = [self.kv_cache[1, layer] for layer in range(schema.num_layers)]

    @classmethod
    def from_config(
        cls,
        schema: KVCacheSchema,
        config: KVPoolConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        available_bytes: int | None = None,
    ) -> KVPool:
        """Size the pool from `config`: `num_blocks`, else `memory_budget`, else a share of `available_bytes`."""
        if config.block_size != schema.block_size:
            raise ValueError(f"kv_pool.block_size={config.block_size} differs from the schema's {schema.block_size}")
        num_blocks = cls.blocks_for_config(schema, config, dtype, available_bytes)
        return cls(schema, num_blocks, device=device, dtype=dtype)

    @staticmethod
    def blocks_for_config(
        schema: KVCacheSchema,
        config: KVPoolConfig,
        dtype: torch.dtype | None = None,
        available_bytes: int | None = None,
    ) -> int:
        """How many blocks `from_config` allocates (no allocation); raises `KVPoolSizeError` below one."""
        if config.num_blocks is not None:
            return config.num_blocks
        per_block = bytes_per_block(schema, dtype)
        if config.memory_budget is not None:
            budget, source = int(config.memory_budget), f"kv_pool.memory_budget={int(config.memory_budget)} bytes"
        elif available_bytes is not None:
            budget = int(available_bytes * config.memory_utilization)
            source = f"{config.memory_utilization} x {available_bytes} available bytes = {budget} bytes"
        else:
            raise KVPoolSizeError(
                "cannot size the KV pool: set kv_pool.num_blocks or kv_pool.memory_budget",
                hint="e.g. SAGE_KV_POOL__MEMORY_BUDGET=2GiB",
            )
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise KVPoolSizeError(
                f"KV budget too small: {source} holds no block of {per_block} bytes",
                hint=f"raise kv_pool.memory_budget to at least {per_block} bytes or set kv_pool.num_blocks",
            )
        return num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of K and V across all layers and blocks."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def __repr__(self) -> str:
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, num_layers={self.num_layers}, "
            f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )
