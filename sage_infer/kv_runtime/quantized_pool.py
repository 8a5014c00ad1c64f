"""`QuantizedKVPool`: the KV pool in fp8 / int8 / int4, one fp16 scale per token and head.

`make_kv_pool(schema, ...)` with a quantized `schema.dtype` builds one of these. Attention sees the same
API as the float pool: `store` quantizes with the shared `KVCodec`, `gather_*` dequantize to the
dtype attention asks for. Tiers and the transport see bytes: a block row is

    [codes: num_layers, 2 (K, V), block_size, num_kv_heads, code_dim  uint8]
    [scales: num_layers, 2, block_size, num_kv_heads                  fp16 ]

(`code_dim` = head_dim, or head_dim / 2 for int4; the codes are symmetric, `KVCodec`), i.e.
`schema.data_bytes_per_block` then `schema.scale_bytes_per_block`. The scales travel inside the
block, so a block read from a tier or received from a peer decodes with no side channel.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from sage_infer.core.dtypes import TORCH_DTYPES
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, ScaleLayout
from sage_infer.kv_runtime.block_rows import put_blocks, take_blocks
from sage_infer.kv_runtime.pool import (
    GATHER_SCRATCH_MAX_BYTES,
    BlockIds,
    KVPool,
    KVPoolSizeError,
    pool_zeros,
)
from sage_infer.quantization.kv_codec import PARAMS_DTYPE, KVCodec


class QuantizedKVPool(KVPool):
    """Preallocated paged KV cache holding quantized codes plus per-(token, head) fp16 scales.

    Storage, layer-major like the float pool: codes ``[2, num_layers, num_blocks, block_size,
    num_kv_heads, code_dim]`` uint8 and scales ``[2, num_layers, num_blocks, block_size,
    num_kv_heads, 1]`` fp16. `dtype` is ``torch.uint8``: `read_blocks` / `write_blocks`
    move rows of `block_nbytes` raw bytes (``block_shape == (block_nbytes,)``).
    """

    supports_block_views = False  # codes plus scales: kernels that read float blocks in place cannot

    def __init__(self, schema: KVCacheSchema, num_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, huge_pages: bool = False) -> None:
        if num_blocks < 1:
            raise KVPoolSizeError(f"a KV pool needs at least 1 block, got num_blocks={num_blocks}")
        if schema.scale_layout is not ScaleLayout.PER_TOKEN:
            raise ValueError(f"the KV pool quantizes per token and head: scale_layout must be per_token, "
                             f"got {schema.scale_layout.value}")
        if dtype not in (None, torch.uint8):
            raise TypeError(f"a {schema.dtype.value} pool stores uint8 codes, not {dtype}")
        self.schema = schema
        self.codec = KVCodec(schema.dtype, schema.head_dim)
        self.num_blocks = num_blocks
        self.block_size = schema.block_size
        self.num_layers = schema.num_layers
        self.num_kv_heads = schema.num_kv_heads
        self.head_dim = schema.head_dim
        self.dtype = torch.uint8
        self.device = torch.device(device)
        lead = (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads)
        self._codes = pool_zeros((*lead, self.codec.code_dim), torch.uint8, self.device, huge_pages)
        # scale 0: an unwritten slot decodes to zeros, never NaN
        self._params = torch.zeros((*lead, self.codec.num_params), dtype=PARAMS_DTYPE, device=self.device)
        self._code_rows = [self._codes[:, layer].view(2, -1, self.num_kv_heads, self.codec.code_dim)
                           for layer in range(self.num_layers)]
        self._param_rows = [self._params[:, layer].view(2, -1, self.num_kv_heads, self.codec.num_params)
                            for layer in range(self.num_layers)]
        self._workspace: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # gather buffers, grown on demand
        # int8 codes are one signed byte per value with one scale: the paged decode kernel reads them in place
        self.supports_int8_block_views = schema.dtype is KVDtype.INT8 and self.codec.num_params == 1

    @property
    def block_shape(self) -> tuple[int]:
        return (self.block_nbytes,)

    @property
    def block_nbytes(self) -> int:
        return self.schema.bytes_per_block

    # -- attention ---------------------------------------------------------------------------

    def int8_block_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K codes, V codes ``[num_blocks, block_size, num_kv_heads, head_dim]`` int8 and K scales, V scales
        ``[num_blocks, block_size, num_kv_heads, 1]`` fp16 of `layer`: views of the storage (a value is code *
        scale), never written through. Only where `supports_int8_block_views`."""
        if not self.supports_int8_block_views:
            return super().int8_block_views(layer)
        codes, scales = self._codes[:, layer].view(torch.int8), self._params[:, layer]
        return codes[0], codes[1], scales[0], scales[1]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        codes, scales = self.codec.encode(torch.stack((k, v)))  # [2, T, KvH, code_dim], [2, T, KvH, 1]
        for i in (0, 1):  # K, then V: index_copy_ on dim 0 of a contiguous tensor (dim 1 cloned the layer)
            self._code_rows[layer][i].index_copy_(0, slot_mapping, codes[i])
            self._param_rows[layer][i].index_copy_(0, slot_mapping, scales[i])

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A pool-owned scratch of `shape` (None above `GATHER_SCRATCH_MAX_BYTES`: the caller allocates)."""
        numel = math.prod(shape)
        if numel * dtype.itemsize > GATHER_SCRATCH_MAX_BYTES:
            return None
        buf = self._workspace.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self._workspace[(name, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def _gather_codes(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes ``[2, n, num_kv_heads, code_dim]`` and scales ``[2, n, num_kv_heads, 1]`` of `layer` at `slots`."""
        n, heads = slots.numel(), self.num_kv_heads
        codes = self._buffer("codes", (2, n, heads, self.codec.code_dim), torch.uint8)
        if codes is None:
            codes = torch.empty((2, n, heads, self.codec.code_dim), dtype=torch.uint8, device=self.device)
        scales = self._buffer("scales", (2, n, heads, 1), PARAMS_DTYPE)
        if scales is None:
            scales = torch.empty((2, n, heads, 1), dtype=PARAMS_DTYPE, device=self.device)
        for i in (0, 1):  # index_select on dim 0 of contiguous K (V) rows, into half of the workspace
            torch.index_select(self._code_rows[layer][i], 0, slots, out=codes[i])
            torch.index_select(self._param_rows[layer][i], 0, slots, out=scales[i])
        return codes, scales

    def _decode(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K and V of `layer` at `slots` ([n] long): [2, n, num_kv_heads, head_dim] in `dtype`, a view of a
        pool-owned workspace valid until the next `gather_*` call (as the float pool's are)."""
        codes, scales = self._gather_codes(layer, slots)
        shape = (2, slots.numel(), self.num_kv_heads, self.head_dim)
        work = self._buffer("work", shape, torch.float32)
        out = work if dtype == torch.float32 else self._buffer("out", shape, dtype)
        return self.codec.decode(codes, scales, dtype, out=out, work=work)

    def gather_block_levels(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for padded block tables as fp32 levels and scales, head-major for batched matmuls:
        levels ``[2, B, num_kv_heads, W * block_size, head_dim]`` and scales ``[2, B, num_kv_heads, W * block_size]``
        (value = level * scale). Views of pool-owned workspaces, valid until the next `gather_*` call."""
        batch, heads = block_tables.shape[0], self.num_kv_heads
        codes, scales = self._gather_codes(layer, self.block_slots(block_tables))
        narrow, factor = self.codec.levels(codes)
        tokens = narrow.shape[1] // batch
        shape = (2, batch, heads, tokens, self.head_dim)
        levels = self._buffer("work", shape, torch.float32)
        if levels is None:
            levels = torch.empty(shape, dtype=torch.float32, device=self.device)
        # the one widening pass also moves heads before tokens (a strided read)
        levels.copy_(narrow.view(2, batch, tokens, heads, self.head_dim).permute(0, 1, 3, 2, 4))
        scale = scales.view(2, batch, tokens, heads).permute(0, 1, 3, 2).to(torch.float32)
        return levels, scale.mul_(factor) if factor != 1.0 else scale

    def gather_slots(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._decode(layer, slots, dtype)
        return kv[0], kv[1]

    def gather_blocks(self, layer: int, block_tables: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._decode(layer, self.block_slots(block_tables), dtype)
        kv = kv.view(2, block_tables.shape[0], -1, self.num_kv_heads, self.head_dim)
        return kv[0], kv[1]

    # -- tiers and transport: whole blocks, raw bytes ----------------------------------------

    def _row_parts(self, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
        """Views of contiguous CPU rows ``[n, block_nbytes]`` as (codes, scales), each ``[n, 2 * L, chunk_bytes]``
        bytes in the rows' (layer, K/V) order, for `block_rows`; None for other rows (the torch path)."""
        if rows.device.type != "cpu" or not rows.is_contiguous() or rows.dtype != torch.uint8:
            return None
        r, n, two_l = rows.numpy(), rows.shape[0], 2 * self.num_layers
        data = self.schema.data_bytes_per_block
        scales = self.block_nbytes - data
        return (as_strided(r[:, :data], (n, two_l, data // two_l), (r.strides[0], data // two_l, 1)),
                as_strided(r[:, data:], (n, two_l, scales // two_l), (r.strides[0], scales // two_l, 1)))

    def read_blocks(self, block_ids: BlockIds, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy whole blocks out: [n, block_nbytes] uint8 (codes, then scales; see the module docstring)."""
        ids = self._ids(block_ids)
        n = ids.numel()
        if self.device.type == "cpu" and n:  # one gather for the codes, one for the scales, into the rows
            rows = out if out is not None else torch.empty((n, self.block_nbytes), dtype=torch.uint8)
            parts = self._row_parts(rows)
            if parts is not None and take_blocks(self._codes, ids, parts[0]) and take_blocks(self._params, ids,
                                                                                             parts[1]):
                return rows
        codes = self._codes.index_select(2, ids).permute(2, 1, 0, 3, 4, 5).reshape(n, -1)
        params = self._params.index_select(2, ids).permute(2, 1, 0, 3, 4, 5).reshape(n, -1)
        rows = torch.cat((codes, params.view(torch.uint8)), dim=1)
        return rows if out is None else out.copy_(rows)

    def write_blocks(self, block_ids: BlockIds, src: torch.Tensor, threads: int = 1) -> None:
        """Copy whole blocks in, bit-exact: ``src: [n, block_nbytes]`` uint8 as `read_blocks` makes them (`threads`
        as `KVPool.write_blocks`)."""
        ids = self._ids(block_ids)
        n = ids.numel()
        if tuple(src.shape) != (n, self.block_nbytes):
            raise ValueError(f"write_blocks: src shape {tuple(src.shape)} is not [{n}, {self.block_nbytes}]")
        if src.dtype != torch.uint8:
            raise TypeError(f"write_blocks: a {self.schema.dtype.value} pool takes uint8 rows, got {src.dtype}")
        parts = self._row_parts(src) if self.device.type == "cpu" and n else None
        if parts is not None and put_blocks(self._codes, ids, parts[0], threads) and put_blocks(
                self._params, ids, parts[1], threads):
            return
        src = src.to(self.device)
        data = self.schema.data_bytes_per_block
        codes = src[:, :data].reshape(n, self.num_layers, 2, self.block_size, self.num_kv_heads, -1)
        params = src[:, data:].contiguous().view(PARAMS_DTYPE)
        params = params.reshape(n, self.num_layers, 2, self.block_size, self.num_kv_heads, -1)
        self._codes.index_copy_(2, ids, codes.permute(2, 1, 0, 3, 4, 5))
        self._params.index_copy_(2, ids, params.permute(2, 1, 0, 3, 4, 5))

    def write_rows(self, block_ids: BlockIds, rows: torch.Tensor, threads: int = 1) -> None:
        self.write_blocks(block_ids, rows, threads)

    def __repr__(self) -> str:
        return (f"QuantizedKVPool(kv_dtype={self.schema.dtype.value}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, num_layers={self.num_layers}, device={self.device}, "
                f"nbytes={self.nbytes})")


def decode_rows(rows: torch.Tensor, schema: KVCacheSchema, dtype: torch.dtype) -> torch.Tensor:
    """Block rows of `schema` (``[n, schema.bytes_per_block]`` uint8, as `read_blocks` makes them) as values:
    ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` in `dtype` (quantized ones through `KVCodec`)."""
    n = rows.shape[0]
    shape = (n, schema.num_layers, 2, schema.block_size, schema.num_kv_heads)
    if not schema.dtype.is_quantized:
        return rows.contiguous().view(TORCH_DTYPES[schema.dtype]).view(*shape, schema.head_dim).to(dtype)
    codec = KVCodec(schema.dtype, schema.head_dim)
    data = schema.data_bytes_per_block
    codes = rows[:, :data].reshape(*shape, codec.code_dim)
    scales = rows[:, data:].contiguous().view(PARAMS_DTYPE).view(*shape, 1)
    return codec.decode(codes, scales, dtype)


def encode_rows(values: torch.Tensor, schema: KVCacheSchema) -> torch.Tensor:
    """Inverse of `decode_rows`: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` values ->
    ``[n, schema.bytes_per_block]`` uint8 rows of `schema` (quantized ones through `KVCodec`)."""
    n = values.shape[0]
    if not schema.dtype.is_quantized:
        return values.to(TORCH_DTYPES[schema.dtype]).contiguous().view(torch.uint8).reshape(n, -1)
    codes, scales = KVCodec(schema.dtype, schema.head_dim).encode(values)
    return torch.cat((codes.reshape(n, -1), scales.view(torch.uint8).reshape(n, -1)), dim=1)


def convert_rows(rows: torch.Tensor, source: KVCacheSchema, target: KVCacheSchema) -> torch.Tensor:
    """Block rows of `source` re-encoded in `target` (the same blocks in another KV dtype): ``[n,
    source.bytes_per_block]`` -> ``[n, target.bytes_per_block]`` uint8. Values go through fp32 (the
    wider float when both are float); the same rows come back when the schemas are equal."""
    if source == target:
        return rows
    rows = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    floats = [TORCH_DTYPES[s.dtype] for s in (source, target) if not s.dtype.is_quantized]
    wide = floats[0] if len(floats) == 2 and floats[0].itemsize >= floats[1].itemsize else torch.float32
    return encode_rows(decode_rows(rows, source, wide), target)


def convert_blocks(pool: KVPool, block_ids: BlockIds, schema: KVCacheSchema) -> torch.Tensor:
    """`pool`'s blocks re-encoded in `schema` (same shape, another KV dtype): ``[n, schema.bytes_per_block]`` uint8.

    What a prefill instance sends: a decode instance that keeps its KV in another precision, or the
    wire format of `kv_transport.target_dtype`. Only `read_blocks` touches `pool` (a copy, safe off
    the engine thread while the blocks are held).
    """
    rows = pool.read_blocks(block_ids)
    return convert_rows(rows.view(torch.uint8).reshape(rows.shape[0], -1), pool.schema, schema)
