"""`QuantizationProfile`: how weights and KV are quantized for one deployment."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sage_infer.core.kv_schema import KVDtype, ScaleLayout


class WeightQuant(str, enum.Enum):
    NONE = "none"
    INT8_WEIGHT_ONLY = "int8_wo"  # int8 weights, activations in fp16/bf16
    INT4_WEIGHT_ONLY = "int4_wo"  # int4 weights (grouped), activations in fp16/bf16
    FP8 = "fp8"  # fp8 e4m3 weights and activations


@dataclass(frozen=True, slots=True)
class QuantizationProfile:
    """Weight and KV quantization choices, checked for consistency at construction.

    `group_size` applies to grouped int4 weights and to int4/int8 KV with per-channel
    groups; `None` means one group per row/token.
    """

    weights: WeightQuant = WeightQuant.NONE
    weight_group_size: int | None = None
    kv_dtype: KVDtype = KVDtype.BF16
    kv_scale_layout: ScaleLayout = ScaleLayout.NONE
    kv_group_size: int | None = None
    calibrated: bool = False  # scales come from calibration data, not computed on the fly

    def __post_init__(self) -> None:
        if self.kv_dtype.is_quantized == (self.kv_scale_layout is ScaleLayout.NONE):
            raise ValueError(
                f"kv_dtype {self.kv_dtype.value} with kv_scale_layout {self.kv_scale_layout.value}: "
                "quantized KV dtypes need scales and unquantized ones must have none"
            )
        if self.weights is WeightQuant.INT4_WEIGHT_ONLY and self.weight_group_size is None:
            raise ValueError("int4 weights need weight_group_size (e.g. 128)")
        for name in ("weight_group_size", "kv_group_size"):
            size = getattr(self, name)
            if size is not None and (size <= 0 or size & (size - 1)):
                raise ValueError(f"{name} must be a positive power of two, got {size}")

    @property
    def kv_compression_ratio(self) -> float:
        """Storage ratio of KV values against bf16 (scales not counted)."""
        return 16 / self.kv_dtype.bits
