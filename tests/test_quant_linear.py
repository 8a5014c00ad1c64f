"""Weight-only quantization: round-to-nearest, int32 packing, and the CPU kernel layers against
`QuantLinear`, the reference (dequantize as compressed-tensors does, then F.linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sage_infer.layers.quant_linear import (
    INT8PACK_MAX_ROWS,
    Int4PackLinear,
    Int8PackLinear,
    QuantLinear,
    use_quant_kernels,
)
from sage_infer.quantization.compressed_tensors import pack_int32, unpack_int32
from sage_infer.quantization.weights import WeightScheme, quantize_rtn

SCHEMES = {
    "w8-channel": WeightScheme(8, None, True),
    "w8-channel-asym": WeightScheme(8, None, False),
    "w4-g128": WeightScheme(4, 128, True),
    "w4-g32": WeightScheme(4, 32, True),
    "w4-g32-asym": WeightScheme(4, 32, False),
}


def weight(out_f: int = 96, in_f: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[:, 3] += 0.3  # an outlier column, and rows whose range is lopsided (zero points matter)
    w[::5] += 0.02
    return w


@pytest.mark.parametrize("name", list(SCHEMES))
def test_rtn_rounds_every_weight_to_within_half_a_step(name):
    scheme = SCHEMES[name]
    w = weight()
    qw = quantize_rtn(w, scheme)
    group = scheme.group_of(w.shape[1])
    assert qw.qweight.dtype == torch.int8 and qw.scale.shape == (96, 256 // group)
    assert int(qw.qweight.min()) >= scheme.qmin and int(qw.qweight.max()) <= scheme.qmax
    assert (qw.zero_point is None) == scheme.symmetric
    step = qw.scale.repeat_interleave(group, dim=1)
    assert ((qw.dequantize() - w).abs() <= step * 0.5 + 1e-6).all()  # 1e-6: fp32 rounding of w and q * scale


def test_int8_values_pack_four_per_int32_low_bits_first():
    # compressed-tensors' own example: [1, 2] -> offset 128 -> 129 | 130 << 8 = 33409
    assert pack_int32(torch.tensor([[1, 2]], dtype=torch.int8), 8).tolist() == [[33409]]
    q = torch.arange(-8, 8, dtype=torch.int8).view(2, 8)  # unsigned nibbles 0..7 and 8..15
    assert pack_int32(q, 4).tolist() == [[0x76543210], [0xFEDCBA98 - (1 << 32)]]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_unpack_inverts_pack_with_padding(bits, packed_dim):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (13, 21), generator=g, dtype=torch.int8)  # neither dim a multiple of 8 or 4
    packed = pack_int32(q, bits, packed_dim)
    assert packed.dtype == torch.int32
    assert torch.equal(unpack_int32(packed, bits, (13, 21), packed_dim), q)


KERNEL_CASES = [("w8-channel", Int8PackLinear), ("w8-channel-asym", Int8PackLinear), ("w4-g128", Int4PackLinear),
                ("w4-g32", Int4PackLinear), ("w4-g32-asym", Int4PackLinear)]


@pytest.mark.parametrize("name, kernel", KERNEL_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 5, INT8PACK_MAX_ROWS + 17])
def test_cpu_kernel_layer_matches_the_reference(name, kernel, dtype, tol, rows):
    qw = quantize_rtn(weight().to(dtype), SCHEMES[name])
    bias = torch.randn(96).to(dtype)
    ref = QuantLinear(qw, bias)
    fast = kernel(ref, dtype)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want, got = ref(x), fast(x)
    assert got.dtype == dtype and got.shape == want.shape == (rows, 96)
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    assert torch.equal(fast(x.view(1, rows, 256)).view(rows, 96), got)  # leading dims are flattened


def test_use_quant_kernels_swaps_what_a_kernel_runs_faster_and_keeps_the_rest_on_the_reference():
    def model() -> nn.ModuleDict:
        return nn.ModuleDict({
            "w8": QuantLinear(quantize_rtn(weight(), WeightScheme(8))),
            "w4": QuantLinear(quantize_rtn(weight(), WeightScheme(4, 64))),
            "w8_grouped": QuantLinear(quantize_rtn(weight(), WeightScheme(8, 64))),  # no int8 kernel with groups
            "w4_odd_rows": QuantLinear(quantize_rtn(weight(out_f=40), WeightScheme(4, 64))),  # int4pack: out % 16
            "plain": nn.Linear(256, 96),
        })

    bf16 = model()
    assert use_quant_kernels(bf16, torch.bfloat16) == (2, 2)
    assert isinstance(bf16["w8"], Int8PackLinear) and isinstance(bf16["w4"], Int4PackLinear)
    assert type(bf16["w8_grouped"]) is QuantLinear and type(bf16["w4_odd_rows"]) is QuantLinear
    assert type(bf16["plain"]) is nn.Linear
    fp32, fp16 = model(), model()  # measured: int4pack is slower than the reference in fp32, both in fp16
    assert use_quant_kernels(fp32, torch.float32) == (1, 3) and isinstance(fp32["w8"], Int8PackLinear)
    assert use_quant_kernels(fp16, torch.float16) == (0, 4)
