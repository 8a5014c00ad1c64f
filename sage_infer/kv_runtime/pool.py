"""`KVPool`: the preallocated paged KV cache, and the only code that knows how its bytes are laid out.

Attention writes and reads K/V through `store` / `gather_slots` / `gather_blocks`; tiers and
transports move whole blocks through `read_blocks` / `write_blocks`. Nothing else touches the
storage tensor, so the layout (and later the encoding) can change here alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sage_infer.config.serve import KVPoolConfig
from sage_infer.core.dtypes import TORCH_DTYPES
from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.errors import ConfigError
from sage_infer.hal.huge_pages import zeros_on_huge_pages
from sage_infer.kv_runtime.block_rows import block_row_index, chunk_rows, gather_blocks, scatter_blocks
from sage_infer.kv_runtime.layer_loads import LayerLoads


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool) -> torch.Tensor:
    """The pool's zeroed storage; on a CPU with `huge_pages`, its whole 2 MiB pages are transparent huge
    pages (`sage_infer.hal.huge_pages`): decode attention reads scattered blocks with fewer TLB misses."""
    if huge_pages and device.type == "cpu":
        return zeros_on_huge_pages(shape, dtype)[0]
    return torch.zeros(shape, dtype=dtype, device=device)


class KVPoolSizeError(ConfigError, ValueError):
    """The KV budget cannot hold one block (or no budget was given). A ValueError and a one-line CLI error."""


def torch_dtype_of(schema: KVCacheSchema) -> torch.dtype:
    """The element type that stores an unquantized `schema.dtype` (quantized pools store uint8 codes)."""
    if schema.dtype.is_quantized:
        raise ValueError(f"KV dtype {schema.dtype.value} is stored as uint8 codes plus scales, not one float type")
    return TORCH_DTYPES[schema.dtype]


def bytes_per_block(schema: KVCacheSchema, dtype: torch.dtype | None = None) -> int:
    """Bytes one block takes in the pool: K and V of all layers, with their scales when quantized
    (`schema.bytes_per_block` unless `dtype` overrides the element type of a float pool)."""
    if dtype is None:
        return schema.bytes_per_block
    return schema.num_layers * schema.elements_per_block_per_layer * dtype.itemsize


BlockIds = torch.Tensor | Sequence[int]

GATHER_SCRATCH_MAX_BYTES = 256 << 20  # per K and per V: above this a gather allocates its own output


class KVPool:
    """Preallocated paged KV cache of one model on one device.

    Storage is layer-major, one allocation
    ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 of the first
    axis is K, 1 is V; tokens in NHD order), so each layer's K and V are dense tensors that
    attention gathers from. A block-major layout (one block = one byte range) copies whole
    blocks faster but makes every decode gather scatter over all layers, and end-to-end decode
    measured slower with it (`bench/kv_pool_layout.py`, docs/benchmarks.md "KV pool layout"):
    attention gathers every step, tiers move a block only when it is evicted or reused.

    `read_blocks` / `write_blocks` still speak whole blocks: row ``i`` is block ``i``'s
    ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (the byte format tiers and the
    transport store and send). Slot ``s`` is token ``s % block_size`` of block ``s // block_size``.
    """

    supports_block_views = True  # `block_views`: K/V blocks in one float dtype (a quantized pool: no)
    supports_int8_block_views = False  # `int8_block_views`: an int8 pool's codes and scales (`QuantizedKVPool`)
    layer_loads: LayerLoads | None = None  # `enable_layer_loads`

    def __init__(
        self,
        schema: KVCacheSchema,
        num_blocks: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        huge_pages: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise KVPoolSizeError(f"a KV pool needs at least 1 block, got num_blocks={num_blocks}")
        if schema.dtype.is_quantized and type(self) is KVPool:
            raise ValueError(f"kv_dtype {schema.dtype.value} is quantized: its pool is a QuantizedKVPool "
                             "(make_kv_pool picks the class for a schema)")
        schema_dtype = torch_dtype_of(schema)
        self.schema = schema
        self.num_blocks = num_blocks
        self.block_size = schema.block_size
        self.num_layers = schema.num_layers
        self.num_kv_heads = schema.num_kv_heads
        self.head_dim = schema.head_dim
        self.dtype = dtype if dtype is not None else schema_dtype
        self.device = torch.device(device)
        # zeros, not empty: unwritten slots must never hold NaN that a masked kernel could still touch
        self._kv = pool_zeros((2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim),
                              self.dtype, self.device, huge_pages)
        # per layer: K and V as [num_blocks, block_size, KvH, D] (whole-block gathers) and as flat
        # token rows [num_blocks * block_size, KvH, D] (slot writes and slot gathers): every access
        # is one index_select / index_copy_ on dim 0 of a contiguous tensor (the fast path)
        self._blocks = [(self._kv[0, layer], self._kv[1, layer]) for layer in range(self.num_layers)]
        self._rows = [(k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim))
                      for k, v in self._blocks]
        # Gather workspace, K and V, grown on demand: a fresh multi-MiB output per layer and group
        # made glibc map and fault in new pages on every call (measured on the shared-prefix bench,
        # docs/benchmarks.md "KV pool layout"). Gathers larger than the cap allocate.
        self._scratch: list[torch.Tensor] = [torch.empty(0, dtype=self.dtype, device=self.device)] * 2
        self._levels = torch.empty(0, dtype=torch.float32, device=self.device)  # `gather_block_levels`

    # -- sizing ---------------------------------------------------------------------------

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
        build = make_kv_pool if cls is KVPool else cls  # (a quantized schema: the quantized pool)
        return build(schema, num_blocks, device=device, dtype=dtype)

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
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block as `read_blocks` returns it: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (K and V of all layers): the size of one `read_blocks` row."""
        return self._kv[:, :, 0].numel() * self._kv.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of K and V across all layers and blocks."""
        return self.num_blocks * self.block_nbytes

    # -- attention: one layer, any slots ----------------------------------------------------

    def _select(self, which: int, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``source.index_select(0, index)`` into workspace `which` (0: K, 1: V) when it fits the cap."""
        shape = (index.numel(), *source.shape[1:])
        numel = math.prod(shape)
        if numel * source.element_size() > GATHER_SCRATCH_MAX_BYTES:
            return source.index_select(0, index)
        if self._scratch[which].numel() < numel:
            self._scratch[which] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return torch.index_select(source, 0, index, out=self._scratch[which][:numel].view(shape))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's K and V of `layer` into the cache.

        k, v: [T, num_kv_heads, head_dim] (any float dtype; cast to the pool's);
        slot_mapping: [T] long, the slot of each token.
        """
        k_rows, v_rows = self._rows[layer]
        if k.dtype != self.dtype:  # (a same-dtype .to is a no-op, but still a dispatch per layer and step)
            k, v = k.to(self.dtype), v.to(self.dtype)
        k_rows.index_copy_(0, slot_mapping, k)
        v_rows.index_copy_(0, slot_mapping, v)

    def block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as the pool holds them, ``[num_blocks, block_size, num_kv_heads, head_dim]``
        each, contiguous: for kernels that read blocks in place (`sage_infer.layers.cpu_kernels`).
        Only where `supports_block_views` (a float pool); never written through."""
        return self._blocks[layer]

    def int8_block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """An int8 pool's K codes, V codes, K scales and V scales of `layer` as stored, for the paged decode kernel
        that reads them in place (`cpu_kernels.decode_attention_paged_int8`). Only where
        `supports_int8_block_views`."""
        raise NotImplementedError(f"a {self.schema.dtype.value} pool has no int8 block views")

    def token_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as token rows ``[num_blocks * block_size, num_kv_heads, head_dim]`` (slot ``s``
        is row ``s``), the memory `block_views` shows as blocks: for a kernel that stores a step's K/V
        itself, making the writes `store` makes (`model.decode_step`). Only where `supports_block_views`."""
        return self._rows[layer]

    def gather_slots(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at `slots` ([n] long), each [n, num_kv_heads, head_dim] in `dtype`.

        What a prefill chunk with cached context attends to. In the pool's dtype the results are
        views of a pool-owned workspace, valid until the next `gather_*` call (`.clone()` to keep).
        """
        k_rows, v_rows = self._rows[layer]
        return self._select(0, k_rows, slots).to(dtype), self._select(1, v_rows, slots).to(dtype)

    def block_slots(self, block_tables: torch.Tensor) -> torch.Tensor:
        """The slots of every token of the blocks `block_tables` names (any shape), block by block: ``[n *
        block_size]`` long (slot ``b * block_size + i`` is token ``i`` of block ``b``)."""
        offsets = torch.arange(self.block_size, device=block_tables.device)
        return (block_tables.reshape(-1, 1) * self.block_size + offsets).reshape(-1)

    def gather_blocks(
        self, layer: int, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for padded block tables, whole blocks at a time.

        block_tables: [B, W] long (padding entries may name any valid block; the caller masks
        them) -> keys, values: [B, W * block_size, num_kv_heads, head_dim] in `dtype`, token
        ``j`` of row ``b`` being position ``j`` of that sequence. In the pool's dtype the results
        are views of a pool-owned workspace, valid until the next `gather_*` call.
        """
        flat = block_tables.reshape(-1)
        k_blocks, v_blocks = self._blocks[layer]
        shape = (block_tables.shape[0], -1, self.num_kv_heads, self.head_dim)
        return (self._select(0, k_blocks, flat).view(shape).to(dtype),
                self._select(1, v_blocks, flat).view(shape).to(dtype))

    def gather_block_levels(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, None]:
        """K and V of `layer` for padded block tables as fp32, head-major for batched matmuls (what
        `decode_attention_scaled` reads): ``[2, B, num_kv_heads, W * block_size, head_dim]``, and no scales.

        A view of a pool-owned workspace, valid until the next `gather_*` call.
        """
        batch = block_tables.shape[0]
        flat = block_tables.reshape(-1)
        shape = (2, batch, self.num_kv_heads, flat.numel() // batch * self.block_size, self.head_dim)
        numel = math.prod(shape)
        if numel * 4 > GATHER_SCRATCH_MAX_BYTES:
            levels = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            if self._levels.numel() < numel:
                self._levels = torch.empty(numel, dtype=torch.float32, device=self.device)
            levels = self._levels[:numel].view(shape)
        for i, blocks in enumerate(self._blocks[layer]):  # the widening copy also moves heads before tokens
            picked = self._select(i, blocks, flat).view(batch, -1, self.num_kv_heads, self.head_dim)
            levels[i].copy_(picked.permute(0, 2, 1, 3))
        return levels, None

    # -- tiers and transport: whole blocks, raw bytes ---------------------------------------

    def _ids(self, block_ids: BlockIds) -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            return block_ids.to(device=self.device, dtype=torch.long)
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def read_blocks(self, block_ids: BlockIds, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy whole blocks out: [n, *block_shape] in the pool's dtype, row ``i`` = block ``block_ids[i]``.

        Each row is `block_nbytes` contiguous bytes. `out`, if given, must be a contiguous
        [n, *block_shape] tensor of the pool's dtype and device.
        """
        self.finish_loads()
        ids = self._ids(block_ids)
        if self.device.type == "cpu":  # one gather straight into the rows (`block_rows`)
            rows = out if out is not None else torch.empty((ids.numel(), *self.block_shape), dtype=self.dtype)
            if gather_blocks(self._kv, ids, rows):
                return rows
        picked = self._kv.index_select(2, ids)  # [2, L, n, bs, KvH, D]
        rows = picked.permute(2, 1, 0, 3, 4, 5)  # [n, L, 2, bs, KvH, D]
        if out is None:
            return rows.contiguous()
        return out.copy_(rows)

    def block_chunks(self, block_ids: BlockIds) -> tuple[torch.Tensor, np.ndarray] | None:
        """What `read_blocks` gathers, as byte rows: the storage as ``[2 * L * num_blocks, chunk_bytes]`` uint8 and,
        per block, the rows that make its row format in order (``[n, 2 * L]`` int64), for a gather that checksums
        as it copies (`tiers.rows.ChunkGather`); None where the blocks are not chunks of one contiguous CPU tensor
        (an accelerator, a quantized pool's codes and scales)."""
        if not self.supports_block_views or chunk_rows(self._kv) is None:
            return None
        self.finish_loads()
        ids = self._ids(block_ids)
        source = self._kv.view(torch.uint8).view(2 * self.num_layers * self.num_blocks, -1)
        return source, block_row_index(ids, self.num_layers, self.num_blocks).reshape(ids.numel(), -1)

    def write_blocks(self, block_ids: BlockIds, src: torch.Tensor, threads: int = 1) -> None:
        """Copy whole blocks in, bit-exact: ``src: [n, *block_shape]`` in the pool's dtype (any device).

        Block ids must be distinct (the copy order of duplicates is undefined). `threads`: how many threads a
        large copy on a CPU may split over (`engine_move_threads()` where the engine waits for it).
        """
        ids = self._ids(block_ids)
        if tuple(src.shape) != (ids.numel(), *self.block_shape):
            raise ValueError(f"write_blocks: src shape {tuple(src.shape)} is not "
                             f"[{ids.numel()}, *{self.block_shape}]")
        if src.dtype != self.dtype:  # a silent cast would not be bit-exact
            raise TypeError(f"write_blocks: src dtype {src.dtype} differs from the pool's {self.dtype}")
        self.finish_loads()
        if not scatter_blocks(self._kv, ids, src, threads):  # one scatter from the rows on a CPU (`block_rows`)
            self._kv.index_copy_(2, ids, src.to(self.device).permute(2, 1, 0, 3, 4, 5))

    def write_rows(self, block_ids: BlockIds, rows: torch.Tensor, threads: int = 1) -> None:
        """`write_blocks` from raw rows, ``[n, block_nbytes]`` uint8 (what tiers and transfers carry)."""
        self.write_blocks(block_ids, rows.view(self.dtype).reshape(rows.shape[0], *self.block_shape), threads)

    # -- loads at admission, layer by layer (`layer_loads`) ------------------------------------

    def enable_layer_loads(self) -> None:
        """Let `load_rows` write layer by layer (`sage_infer.kv_runtime.layer_loads`): on a CUDA pool on a copy stream
        beside the compute, on a CPU pool right before each layer's attention."""
        if type(self) is not KVPool:
            raise ValueError(f"layer-wise loads write float blocks; a {self.schema.dtype.value} pool loads whole")
        self.layer_loads = LayerLoads(self._kv, self.num_layers)

    def load_rows(self, block_ids: Sequence[int], rows: torch.Tensor, release: Callable[[torch.Tensor], None],
                  threads: int = 1) -> None:
        """`write_rows` for a step about to attend to these blocks (admission's load of a lower-tier hit or a
        received transfer); `release(rows)` once nothing reads them. With `layer_loads` the rows are written one
        layer at a time, each before the attention of its layer reads the pool (`ready`); otherwise now."""
        loads = self.layer_loads
        if loads is None or not rows.shape[0] or not loads.takes(rows):
            self.write_rows(block_ids, rows, threads)
            release(rows)
            return
        if len(block_ids) != rows.shape[0] or rows.shape[1] != self.block_nbytes:
            raise ValueError(f"load_rows: rows {tuple(rows.shape)} are not [{len(block_ids)}, {self.block_nbytes}]")
        loads.add(block_ids, rows.view(self.dtype).view(rows.shape[0], *self.block_shape), rows, release)

    def ready(self, layer: int) -> None:
        """Layer `layer`'s loaded blocks are written for the next reader (attention calls it before it reads)."""
        loads = self.layer_loads
        if loads is not None and loads.pending:
            loads.ready(layer)

    @property
    def loads_pending(self) -> bool:
        """Admission queued layer-wise writes the next step's attention will wait for."""
        return self.layer_loads is not None and self.layer_loads.pending

    def finish_loads(self) -> None:
        """Every load is written and its rows released (after a step's forward; before a read of the whole pool, or
        a step that reads it outside attention)."""
        if self.layer_loads is not None:
            self.layer_loads.finish()

    def __repr__(self) -> str:
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, num_layers={self.num_layers}, "
            f"dtype={self.dtype}, device={self.device}, nbytes={self.nbytes})"
        )


def make_kv_pool(schema: KVCacheSchema, num_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, huge_pages: bool = False) -> KVPool:
    """The pool for `schema`: a `KVPool` for a float KV dtype, a `QuantizedKVPool` (codes plus scales) for fp8,
    int8 and int4."""
    if schema.dtype.is_quantized:
        from sage_infer.kv_runtime.quantized_pool import QuantizedKVPool  # (it extends KVPool: imported late)

        return QuantizedKVPool(schema, num_blocks, device=device, dtype=dtype, huge_pages=huge_pages)
    return KVPool(schema, num_blocks, device=device, dtype=dtype, huge_pages=huge_pages)
