"""Weight-only quantized linear layers (W8A16, W4A16): activations stay bf16 / fp16 / fp32.

`QuantLinear` is the reference: dequantize the weight (as compressed-tensors does), then
`F.linear`; it runs on any device (the tests run it on a CPU; no test covers CUDA).
On a CPU, `use_quant_kernels(model, dtype)` swaps each for a layer on PyTorch's weight-only kernels, which
read the int8 / int4 weight directly and so move 2x / 4x fewer bytes in a decode GEMV (where they
are faster than the reference: bf16 activations for both, fp32 for int8; see `cpu_kernel_for`):

  `Int8PackLinear`  int8, one scale per output channel: ``aten._weight_int8pack_mm`` up to
                    `INT8PACK_MAX_ROWS` rows; above that (prefill) the kernel loses to dequantize +
                    oneDNN, so it dequantizes (the int8 weight is the same tensor, no second copy)
  `Int4PackLinear`  int4, groups of 32 / 64 / 128 / 256: ``aten._weight_int4pack_mm_for_cpu`` on the
                    weight `_convert_weight_to_int4pack_for_cpu` lays out (an ISA-specific layout)

Asymmetric weights fold their zero points into the kernels' arithmetic (int4: the kernel's
per-group additive zero; int8: a per-channel correction). Both are tested against `QuantLinear`
(tests/test_quant_linear.py); bench/quant_linear.py measures them (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sage_infer.quantization.weights import QuantizedWeight

INT8PACK_MAX_ROWS = 16  # bench/quant_linear.py: _weight_int8pack_mm loses to dequantize + F.linear above ~16 rows
INT4PACK_GROUPS = (32, 64, 128, 256)


class QuantLinear(nn.Module):
    """``y = x @ dequantize(W).T + b``, the reference. x: [..., in] -> [..., out].

    Buffers: qweight int8 [out, in]; weight_scale [out, groups] (the checkpoint's dtype: the
    dequantized weight is what compressed-tensors computes, then cast to x's dtype);
    weight_zero_point int8 [out, groups] or None.
    """

    def __init__(self, quantized: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = quantized.shape
        self.scheme = quantized.scheme
        self.register_buffer("qweight", quantized.qweight)
        self.register_buffer("weight_scale", quantized.scale)
        self.register_buffer("weight_zero_point", quantized.zero_point)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.weight_scale, self.weight_zero_point, self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.quantized.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


class Int8PackLinear(nn.Module):
    """W8, per output channel, on ``aten._weight_int8pack_mm`` (CPU). x: [..., in] -> [..., out]."""

    def __init__(self, layer: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        assert layer.scheme.num_bits == 8 and layer.scheme.group_size is None
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.scheme = layer.scheme
        self.register_buffer("qweight", layer.qweight)
        scale = layer.weight_scale[:, 0]
        self.register_buffer("scale", scale.to(dtype))
        # (q - z) * s = q * s - z * s: the kernel computes x @ (q * s).T, this row corrects it
        zero = None if layer.weight_zero_point is None else (layer.weight_zero_point[:, 0].to(scale.dtype) * scale)
        self.register_buffer("zero_scale", None if zero is None else zero.to(dtype))
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= INT8PACK_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)
            if self.zero_scale is not None:
                out = out - flat.sum(-1, keepdim=True) * self.zero_scale
        else:
            weight = self.qweight.to(x.dtype) * self.scale[:, None]
            if self.zero_scale is not None:
                weight = weight - self.zero_scale[:, None]
            out = F.linear(flat, weight)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


class Int4PackLinear(nn.Module):
    """W4, groups of 32-256 input columns, on ``aten._weight_int4pack_mm_for_cpu``. x: [..., in] -> [..., out].

    The kernel computes w = (u - 8) * scale + zero from unsigned nibbles u = q + 8, so a symmetric
    weight has zero 0 and an asymmetric one zero = -zero_point * scale.
    Buffers: packed uint8 [out, in / 2] (opaque), scale_zeros [in / group, out, 2] in the model dtype.
    """

    def __init__(self, layer: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        qw = layer.quantized
        assert qw.scheme.num_bits == 4 and qw.group in INT4PACK_GROUPS
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.scheme, self.group = layer.scheme, qw.group
        unsigned = qw.qweight.to(torch.int32) + 8
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
        zeros = (torch.zeros_like(qw.scale) if qw.zero_point is None
                 else -(qw.zero_point.to(qw.scale.dtype) * qw.scale))
        self.register_buffer("scale_zeros", torch.stack([qw.scale, zeros], -1).transpose(0, 1).contiguous().to(dtype))
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scale_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


def cpu_kernel_for(layer: QuantLinear, dtype: torch.dtype) -> type[nn.Module] | None:
    """The CPU kernel layer that runs `layer`'s scheme faster than the reference for `dtype`
    activations, or None (it stays on the reference path).

    Measured (bench/quant_linear.py, docs/benchmarks.md): both kernels have a fast bf16 path;
    with fp32 activations only the int8 one beats the reference, with fp16 neither does.
    """
    scheme = layer.scheme
    if (scheme.num_bits == 8 and scheme.group_size is None and dtype in (torch.bfloat16, torch.float32)
            and hasattr(torch.ops.aten, "_weight_int8pack_mm")):
        return Int8PackLinear
    group = layer.in_features // layer.weight_scale.shape[1]
    if (scheme.num_bits == 4 and group in INT4PACK_GROUPS and layer.out_features % 16 == 0
            and dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")):
        return Int4PackLinear
    return None


def use_quant_kernels(model: nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """Swap the `QuantLinear` layers of a CPU model running `dtype` activations for the CPU kernel
    layers that run their scheme faster (`cpu_kernel_for`).

    Returns (swapped, left on the reference path: a scheme or dtype no kernel runs faster).
    """
    swapped = kept = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantLinear):
            continue
        kernel = cpu_kernel_for(module, dtype)
        if kernel is None:
            kept += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, kernel(module, dtype))
        swapped += 1
    return swapped, kept
