"""Linear layers on oneDNN's prepacked weights (CPU), with `nn.Linear` as the oracle.

`torch.nn.functional.linear` on a CPU tensor re-lays the weight out for oneDNN/MKL on every
call; a small batch (a decode step: one row per sequence) then pays that for each GEMV. Packing
each weight once into oneDNN's blocked layout (what Inductor's weight freezing does) removes it:
measured faster per bf16 layer at 1–16 rows and no slower at 512 (docs/benchmarks.md "Packed
linear layers"). The math is oneDNN's either way, so outputs match `nn.Linear` to rounding.

`pack_linears(model)` swaps every `nn.Linear` of a CPU model for a `PackedLinear`, an lm_head tied
to the embedding too: the packed buffer is then a second copy of that weight (the embedding keeps
reading rows of the original), e.g. +272 MB for Qwen2.5-0.5B's 151,936 x 896 bf16 head, for a faster
head product than the unpacked head's at 1 and 8 rows (`bench/tied_head.py`, docs/benchmarks.md, "Tied
lm_head"), as vLLM's CPU backend also packs the embedding's weight for the head. `model.linear: torch` keeps
plain `nn.Linear`, the reference path the packed one is tested against.

Where oneDNN cannot pack bf16 weights (a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT: bf16 products would be
emulated), a bf16 layer packs an fp32 copy of its weight and computes in fp32 (its output rounded to bf16, as a
bf16 product's is): faster than torch's bf16 product from 4 to 512 rows on an AVX2 CPU. Products of a
few rows, bound by reading the weight, run sage's kernel on the bf16 weight instead (`bf16_rows_linear`: up to 12
rows, faster than torch's bf16 product there), or torch's bf16 product up to 2 rows without the kernels.
The layer keeps the bf16 weight for them next to the fp32 copy (3x the bf16 bytes). bench/packed_linear.py
measures all three; docs/cpu_isa.md has the numbers.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from sage_infer.layers.cpu_kernels import bf16_rows_linear, kernel_unavailable, packed_layout_matches, small_linear

# the row count oneDNN lays packed weights out for: 2,048 (a prefill step's token budget) measured
# faster than 1 for fp32 products of 16-64 rows and no slower at 1 or 2,048 rows, the same in bf16
# (docs/benchmarks.md "Packed linear layers")
PACK_BATCH_HINT = 2048
# `model.decode_linear: sage`: bf16 products of up to this many rows run sage's kernel (csrc/small_linear.cpp)
# on the packed weights; bench/small_linear.py measured it against oneDNN at 1-64 rows
SMALL_LINEAR_ROWS = 32
# where oneDNN packs bf16 for AMX tiles (32-row blocks) its own products win from 4 rows (bench/small_linear.py on a
# 2-vCPU Xeon with AMX: sage ÷ oneDNN 1.29x at 1 row, 1.01x at 2, 0.96x at 4, 0.71x at 8, 0.36x at 32)
SMALL_LINEAR_ROWS_AMX = 2
# bf16 layers on fp32 copies (no bf16 packing on this CPU): products of up to this many rows run on the kept bf16
# weight instead, on sage's kernel or, without the kernels, on torch's bf16 product. Over the 0.5B shape's four
# products of a layer on AVX2 the kernel beats the fp32 copy (which reads twice the bytes) up to 12 rows and loses
# at 16; torch's product beats the copy only at the fewest rows (bench/packed_linear.py, docs/cpu_isa.md)
BF16_ROWS_KERNEL = 12
BF16_ROWS_TORCH = 2


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache
def packing_unavailable(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs `dtype` weights on this CPU, else its reason (it packs a small weight to see)."""
    if not packing_available():
        return "this torch has no oneDNN (mkldnn) linear"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=dtype), 1)
    except RuntimeError as err:
        return str(err).strip().splitlines()[0]
    return None


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with `W` packed for oneDNN once. x: [..., in] -> [..., out].

    With ``small_rows`` > 0 (a bf16 weight, and `small_linear_unavailable()` None), products of up to
    that many rows (`SMALL_LINEAR_ROWS_AMX` where oneDNN packs for AMX tiles) go through sage's `small_linear`
    kernel, which reads the same packed bytes; the layer checks once that they are in one of the kernel's
    layouts, and keeps oneDNN for every product otherwise (`small_rows` is then 0).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT, small_rows: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # bf16 that oneDNN cannot pack here: an fp32 copy, computed in fp32; few-row products on the bf16 weight
        self.dtype, self.weight_bf16, self.bf16_rows, self.rows_kernel = weight.dtype, None, 0, False
        if weight.dtype == torch.bfloat16 and packing_unavailable(torch.bfloat16) is not None:
            self.weight_bf16 = weight.contiguous()
            self.rows_kernel = kernel_unavailable() is None
            self.bf16_rows = BF16_ROWS_KERNEL if self.rows_kernel else BF16_ROWS_TORCH
            weight = weight.float()
        # a buffer, not a parameter: the packed layout is opaque to anything that reads weights
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.bias = None if bias is None else nn.Parameter(bias.to(weight.dtype), requires_grad=False)
        self.bias_bf16 = bias if self.weight_bf16 is not None else None  # the few-row products' (bf16) bias
        # products of up to this many rows compute each row alone, the same way whatever their count (the bf16
        # rows kernel): `model.deterministic` cuts this layer's products into chunks of this many (`tile_linears`)
        self.row_invariant_rows = BF16_ROWS_KERNEL if self.rows_kernel else 0
        self.small_rows = 0
        if small_rows > 0 and weight.dtype == torch.bfloat16:
            address, nbytes = torch.ops.mkldnn.data_ptr(self.packed), torch.ops.mkldnn._nbytes(self.packed)
            block_rows = packed_layout_matches(address, nbytes, weight)  # 64, or 32 where oneDNN packs for AMX
            if block_rows:
                self.small_rows = small_rows if block_rows == 64 else min(small_rows, SMALL_LINEAR_ROWS_AMX)
                self._address, self._nbytes, self._block_rows = address, nbytes, block_rows
                self._bias32 = None if self.bias is None else self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if 0 < flat.shape[0] <= self.small_rows and flat.dtype == torch.bfloat16:
            out = small_linear(flat, self._address, self._nbytes, self.out_features, self._bias32, self._block_rows)
        elif self.weight_bf16 is not None:  # bf16 weights computed in fp32 (no bf16 packing on this CPU)
            if flat.shape[0] <= self.bf16_rows:
                out = (bf16_rows_linear(flat, self.weight_bf16, self.bias_bf16) if self.rows_kernel
                       else torch.nn.functional.linear(flat, self.weight_bf16, self.bias_bf16))
            else:
                out = torch.ops.mkldnn._linear_pointwise(flat.float(), self.packed, self.bias, "none", [],
                                                         "").to(self.dtype)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, small_rows: int = 0) -> int:
    """Replace the `nn.Linear` modules of a CPU model by `PackedLinear` (passing `small_rows`); one that says
    `keep_plain` (a mixture-of-experts router, whose plain weight a kernel reads) keeps its weight and multiplies
    by the packed one (`use_packed`); how many were packed. A weight tied to another module (`tied_linear_bytes`
    says how many bytes) is packed as a copy; the other module keeps the original.

    RuntimeError (and the model unchanged) when oneDNN cannot pack its weights on this CPU.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
               and module.weight.device.type == "cpu"]
    # all first: a failure leaves the model as it was
    packed = [PackedLinear(module, small_rows=small_rows) for _, module in targets]
    for (name, module), replacement in zip(targets, packed):
        if getattr(module, "keep_plain", False):
            module.use_packed(replacement)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement)
    return len(targets)


def tied_linear_bytes(model: nn.Module) -> int:
    """Bytes of the `nn.Linear` weights of `model` that another module holds too (a tied lm_head and
    embedding): what packing them adds, since the other module keeps the original."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, nn.Linear) and seen.get(id(m.weight), 0) > 1)
