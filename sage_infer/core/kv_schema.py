"""`KVCacheSchema`: what one KV block's bytes are.

The schema is the contract that crosses the pool, the tiers and the transport: two
parties that agree on a schema can move a block as raw bytes and read it back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVDtype(str, enum.Enum):
    """Element type of stored K/V. Quantized types carry scales (see `ScaleLayout`)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    FP8_E4M3FNUZ = "fp8_e4m3fnuz"  # ROCm-family (Hygon DCU, MI300) fp8
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def is_quantized(self) -> bool:
        """True when values need a scale to be read back (fp8, int8, int4)."""
        return self in (KVDtype.FP8_E4M3, KVDtype.FP8_E5M2, KVDtype.FP8_E4M3FNUZ, KVDtype.INT8, KVDtype.INT4)


_BITS = {
    KVDtype.FP32: 32,
    KVDtype.FP16: 16,
    KVDtype.BF16: 16,
    KVDtype.FP8_E4M3: 8,
    KVDtype.FP8_E5M2: 8,
    KVDtype.FP8_E4M3FNUZ: 8,
    KVDtype.INT8: 8,
    KVDtype.INT4: 4,
}


class KVLayout(str, enum.Enum):
    """Axis order of the tokens of one layer's K (or V) in a block.

    - ``NHD``: ``[block_size, num_kv_heads, head_dim]`` (vLLM/nano-vllm default), the only
      layout the pool and attention implement (head-major ``HND`` was removed: nothing read it).

    A whole block's bytes (what `KVPool.read_blocks` returns and tiers or the transport move)
    are ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``; the layout value is part
    of the prefix-cache extra key, so a block is only ever reused under the layout it was written in.
    """

    NHD = "NHD"


class ScaleLayout(str, enum.Enum):
    """Granularity of quantization scales (and zero points) for quantized dtypes."""

    NONE = "none"  # unquantized
    PER_TENSOR = "per_tensor"  # one scale per layer for K and one for V
    PER_HEAD = "per_head"  # [num_kv_heads] per layer, K and V
    PER_TOKEN = "per_token"  # [block_size, num_kv_heads] per block, K and V
    PER_CHANNEL = "per_channel"  # [num_kv_heads, head_dim] per layer, K and V


SCALE_BYTES = 2  # the pool stores one fp16 scale per token and head (symmetric codes), next to the codes


@dataclass(frozen=True, slots=True)
class KVCacheSchema:
    """Shape and encoding of the KV cache of one model, block by block.

    One block holds `block_size` tokens of K and V for every layer; in ``NHD`` its bytes are
    ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` (`KVPool.read_blocks`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: KVDtype = KVDtype.BF16
    layout: KVLayout = KVLayout.NHD
    scale_layout: ScaleLayout = ScaleLayout.NONE

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSchema.{name} must be > 0, got {getattr(self, name)}")
        if self.dtype.is_quantized and self.scale_layout is ScaleLayout.NONE:
            raise ValueError(f"KV dtype {self.dtype.value} needs a scale_layout other than 'none'")
        if not self.dtype.is_quantized and self.scale_layout is not ScaleLayout.NONE:
            raise ValueError(f"KV dtype {self.dtype.value} is not quantized; scale_layout must be 'none'")
        if self.dtype is KVDtype.INT4 and self.head_dim % 2:
            raise ValueError("int4 KV packs two values per byte and needs an even head_dim")

    @property
    def elements_per_block_per_layer(self) -> int:
        """K plus V elements of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def data_bytes_per_block(self) -> int:
        """Bytes of K/V values in one block across all layers (int4 packed two per byte)."""
        return self.num_layers * self.elements_per_block_per_layer * self.dtype.bits // 8

    @property
    def scale_bytes_per_block(self) -> int:
        """Bytes of per-block scales across all layers.

        Only per-token scales live in the block; per-tensor/head/channel scales are
        per layer and travel once with the schema, not with each block.
        """
        if self.scale_layout is not ScaleLayout.PER_TOKEN:
            return 0
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * SCALE_BYTES  # one scale, K and V

    @property
    def bytes_per_block(self) -> int:
        return self.data_bytes_per_block + self.scale_bytes_per_block

    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def with_dtype(self, dtype: KVDtype) -> KVCacheSchema:
        """The same blocks in another KV dtype (quantized ones with per-token scales, as the pool keeps them)."""
        scales = ScaleLayout.PER_TOKEN if dtype.is_quantized else ScaleLayout.NONE
        return KVCacheSchema(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, dtype, self.layout,
                             scales)

    def compatible_with(self, other: KVCacheSchema) -> bool:
        """True when blocks can be copied byte-for-byte between the two schemas."""
        return self == other

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": self.dtype.value,
            "layout": self.layout.value,
            "scale_layout": self.scale_layout.value,
            "bytes_per_block": self.bytes_per_block,
        }

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheSchema:
        return cls(
            num_layers=int(data["num_layers"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_dim=int(data["head_dim"]),
            block_size=int(data.get("block_size", 16)),
            dtype=KVDtype(data.get("dtype", "bf16")),
            layout=KVLayout(data.get("layout", "NHD")),
            scale_layout=ScaleLayout(data.get("scale_layout", "none")),
        )
