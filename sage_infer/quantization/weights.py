"""Weight-only integer quantization of linear weights: the scheme, the quantized tensors, round-to-nearest.

The arithmetic is compressed-tensors' (what llmcompressor writes and vLLM loads), so a checkpoint
sage writes dequantizes to the same numbers in either library:

  symmetric:  scale = absmax / ((qmax - qmin) / 2)        (absmax / 7.5 for int4, / 127.5 for int8)
              q = clamp(round(w / scale), qmin, qmax)
  asymmetric: scale = (max(w, 0) - min(w, 0)) / (qmax - qmin)
              zero_point = clamp(round(qmin - min / scale), qmin, qmax)
              q = clamp(round(w / scale + zero_point), qmin, qmax)
  dequantized w = (q - zero_point) * scale, computed in the scale's dtype (the weight's dtype)

with qmin, qmax = -2**(bits-1), 2**(bits-1) - 1, a zero scale replaced by the dtype's eps, and
one scale (and zero point) per output channel (``group_size None``) or per `group_size` input
columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How one linear weight is quantized: `num_bits` 4 or 8, one scale per output channel
    (`group_size` None) or per `group_size` input columns, with or without zero points."""

    num_bits: int
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise ValueError(f"num_bits must be 4 or 8, got {self.num_bits}")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size must be positive, got {self.group_size}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def group_of(self, in_features: int) -> int:
        """Input columns per scale for a weight with `in_features` columns."""
        return in_features if self.group_size is None else self.group_size

    def check_shape(self, out_features: int, in_features: int) -> None:
        if in_features % self.group_of(in_features):
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {self.group_size}")

    @property
    def name(self) -> str:
        """w8a16, w4a16 (the weight-only naming llmcompressor's presets use), with the grouping."""
        grouping = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"w{self.num_bits}a16-{grouping}" + ("" if self.symmetric else "-asym")


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A quantized [out, in] weight.

    qweight:    int8 [out, in], values in [qmin, qmax] (int4 values are not packed here)
    scale:      [out, in // group] in the dtype of the original weight (group = in for per-channel)
    zero_point: int8 [out, in // group], or None when symmetric
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: WeightScheme

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    @property
    def group(self) -> int:
        return self.qweight.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] as the scales' dtype computes it (then cast to `dtype`)."""
        out, inp = self.shape
        groups = self.scale.shape[1]
        values = self.qweight.view(out, groups, inp // groups).to(self.scale.dtype)
        if self.zero_point is not None:
            values = values - self.zero_point.to(self.scale.dtype)[..., None]
        weight = (values * self.scale[..., None]).view(out, inp)
        return weight if dtype is None else weight.to(dtype)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps


def compute_qparams(w_min: torch.Tensor, w_max: torch.Tensor, scheme: WeightScheme,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (in `dtype`) and zero point (int8, or None when symmetric) from per-group min / max."""
    w_min = torch.minimum(w_min, torch.zeros_like(w_min))
    w_max = torch.maximum(w_max, torch.zeros_like(w_max))
    span = float(scheme.qmax - scheme.qmin)
    if scheme.symmetric:
        scale = torch.maximum(w_min.abs(), w_max) / (span / 2)
        zero_point = None
    else:
        scale = (w_max - w_min) / span
        zero_point = torch.clamp(scheme.qmin - w_min / scale, scheme.qmin, scheme.qmax)
    scale = scale.to(dtype)
    scale = torch.where(scale == 0, torch.tensor(_eps(dtype), dtype=dtype), scale)
    if zero_point is not None:
        zero_point = torch.round(zero_point).to(torch.int8)
    return scale, zero_point


def quantize_with(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  scheme: WeightScheme) -> torch.Tensor:
    """int8 [out, in] values of `weight` [out, in] under per-group `scale` / `zero_point` [out, groups]."""
    out, inp = weight.shape
    groups = scale.shape[1]
    grouped = weight.view(out, groups, inp // groups)
    scaled = grouped / scale[..., None]
    if zero_point is not None:
        scaled = scaled + zero_point.to(weight.dtype)[..., None]
    return torch.clamp(torch.round(scaled), scheme.qmin, scheme.qmax).to(torch.int8).view(out, inp)


def quantize_rtn(weight: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of `weight` [out, in] (min / max of each group)."""
    out, inp = weight.shape
    scheme.check_shape(out, inp)
    group = scheme.group_of(inp)
    grouped = weight.view(out, inp // group, group)
    scale, zero_point = compute_qparams(grouped.amin(-1), grouped.amax(-1), scheme, weight.dtype)
    return QuantizedWeight(quantize_with(weight, scale, zero_point, scheme), scale, zero_point, scheme)
