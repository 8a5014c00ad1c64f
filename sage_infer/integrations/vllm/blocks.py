"""vLLM's paged KV caches seen as rows of whole-block bytes, the unit sage's tiers store.

On CPU vLLM keeps one ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` tensor per
layer (K then V inside each (block, head) tile, written by an ISA-specific kernel). Block `b`
of a layer is the contiguous slice ``kv[b]``; the connector never interprets it. A block's
bytes in a store are those slices of every layer, in layer order:

    row: [num_layers, num_kv_heads, block_size, 2 * head_size]   (as uint8, bytes_per_block long)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sage_infer.core.dtypes import FLOAT_DTYPES
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.errors import NotAvailableError

_KV_DTYPES = {dtype: KVDtype(name) for name, dtype in FLOAT_DTYPES.items()}


def kv_dtype_of(dtype: torch.dtype) -> KVDtype:
    """sage's name for vLLM's cache dtype; quantized (fp8) caches are not supported yet."""
    try:
        return _KV_DTYPES[dtype]
    except KeyError:
        raise NotAvailableError(f"SageKVConnector: KV cache dtype {dtype} is not supported "
                                "(fp32, fp16, bf16 are)") from None


def block_schema(num_layers: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype
                 ) -> KVCacheSchema:
    """The schema the tiers size their records by: same bytes per block as vLLM's layout.

    Its layout field says NHD (sage has no enum value for vLLM's tile order); what keeps a
    vLLM block from being read as a sage one is the store key, whose extra key names
    vLLM's layout (`keys.vllm_layout`), and the Redis key prefix.
    """
    return KVCacheSchema(num_layers, num_kv_heads, head_size, block_size, kv_dtype_of(dtype))


class PagedBlocks:
    """Copies whole blocks between vLLM's per-layer caches and ``[n, bytes_per_block]`` uint8 rows."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size: int) -> None:
        """`kv_caches`: per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, CPU, contiguous."""
        if not kv_caches:
            raise NotAvailableError("SageKVConnector: vLLM registered no KV caches")
        first = kv_caches[0]
        for kv in kv_caches:
            if kv.dim() != 4 or kv.shape[2] != block_size or kv.device.type != "cpu":
                raise NotAvailableError(
                    f"SageKVConnector supports vLLM's CPU layout [num_blocks, num_kv_heads, block_size, "
                    f"2 * head_size] with block_size {block_size}; got {tuple(kv.shape)} on {kv.device}")
            if kv.shape != first.shape or kv.dtype != first.dtype or not kv.is_contiguous():
                raise NotAvailableError("SageKVConnector needs every layer's cache contiguous, of one shape "
                                        f"and dtype; got {tuple(kv.shape)} {kv.dtype} after {tuple(first.shape)}")
        self.num_blocks = first.shape[0]
        self.num_layers = len(kv_caches)
        self.num_kv_heads = first.shape[1]
        self.head_size = first.shape[3] // 2
        self.dtype = first.dtype
        # [num_blocks, layer_bytes] uint8 views of the caches: writes through them land in vLLM's tensors
        self._layers = [kv.view(torch.uint8).view(self.num_blocks, -1) for kv in kv_caches]
        self.layer_bytes = self._layers[0].shape[1]
        self.bytes_per_block = self.num_layers * self.layer_bytes

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' bytes as ``[n, bytes_per_block]`` uint8 rows (a copy: vLLM may reuse the blocks next)."""
        n = len(block_ids)
        if out is None:
            out = torch.empty((n, self.bytes_per_block), dtype=torch.uint8)
        rows = out[:n].view(n, self.num_layers, self.layer_bytes)
        self._check(block_ids)
        # one memcpy per (block, layer) tile: index_select + a strided copy into `rows` measured slower
        # (bench/vllm_connector.py --part copy)
        for i, block in enumerate(block_ids):
            for layer, cache in enumerate(self._layers):
                rows[i, layer].copy_(cache[block])
        return out[:n]

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Write ``rows[i]`` (``[n, bytes_per_block]`` uint8) into vLLM block ``block_ids[i]`` of every layer."""
        n = len(block_ids)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (n, self.bytes_per_block):
            raise ValueError(f"rows must be uint8 [{n}, {self.bytes_per_block}], got {rows.dtype} {tuple(rows.shape)}")
        per_layer = rows.view(n, self.num_layers, self.layer_bytes)
        self._check(block_ids)
        # one memcpy per tile: index_copy_ from the strided per-layer view measured far slower
        # (bench/vllm_connector.py --part copy)
        for i, block in enumerate(block_ids):
            for layer, cache in enumerate(self._layers):
                cache[block].copy_(per_layer[i, layer])

    def _check(self, block_ids: Sequence[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise ValueError(f"block ids out of range [0, {self.num_blocks}): {list(block_ids)[:8]}")
