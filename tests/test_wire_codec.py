"""The one KV codec (`kv_codec.quantize_groups`), as the wire converter and the pool's block rows use it, against
a plain PyTorch reference written from the format's definition: symmetric, one fp16 scale per group,
scale = amax / qmax; int levels round half up and clamp to +-qmax; fp8 through torch's own float8 cast."""

from __future__ import annotations

import pytest
import torch

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime.quantized_pool import convert_rows, decode_rows, encode_rows
from sage_infer.transport.format import decode, encode, error_bound

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3fnuz": torch.float8_e4m3fnuz}
QMAX = {"int8": 127, "int4": 7}
FORMATS = [*FP8, *QMAX]
# worst relative RMS error each format may show on these values (one scale per 64, outlier channel included)
REL_RMSE = {"fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "fp8_e4m3fnuz": 0.04, "int8": 0.02, "int4": 0.25}


def kv_values(rows: int = 96, cols: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(cols, generator=g).mul(3).add(0.05)
    x[4] *= 50  # an outlier token
    x[:, 2] *= 20  # an outlier channel
    x[7] = 0.0
    return x.to(torch.bfloat16)


def reference(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """decode(encode(x)) per row of `x` (per_token), from the definition, in fp64 where it can be."""
    xf = x.double()
    qmax = torch.finfo(FP8[fmt]).max if fmt in FP8 else QMAX[fmt]
    amax = xf.abs().amax(1, keepdim=True)
    scale = (amax / qmax).clamp(2.0**-24, 65504.0).to(torch.float16).double()
    v = (xf / scale).clamp(-qmax, qmax)
    if fmt in FP8:
        return v.float().to(FP8[fmt]).double() * scale
    return torch.floor(v + 0.5) * scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_matches_the_reference_and_its_error_bound(fmt):
    x = kv_values()
    y = decode(encode(x, fmt), fmt, *x.shape, torch.float32)
    ref = reference(x, fmt)
    scale = (x.double().abs().amax(1, keepdim=True) / (torch.finfo(FP8[fmt]).max if fmt in FP8 else QMAX[fmt]))
    # the codec multiplies by 1/scale in fp32: a value on a rounding boundary may land one level (int) or
    # one fp8 step away from the fp64 reference, never further
    step = scale if fmt in QMAX else ref.abs() * torch.finfo(FP8[fmt]).eps + scale * torch.finfo(FP8[fmt]).tiny
    diff = (y.double() - ref).abs()
    assert (diff <= step * 1.001 + 1e-30).all()
    assert (diff == 0).double().mean() > 0.99
    err = (y.double() - x.double()).abs()
    assert (err <= error_bound(fmt, x).double()).all()
    rel = err.square().mean().sqrt() / x.double().square().mean().sqrt()
    assert rel < REL_RMSE[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_block_rows_round_trip_through_the_same_codec(fmt):
    """A bf16 block row -> the wire's dtype -> bf16 (what a P/D decode worker with a bf16 pool stores) equals
    the converter's per_token round trip of the same values, row of head_dim by row of head_dim."""
    schema = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=32, block_size=4).with_dtype(KVDtype.BF16)
    values = kv_values(rows=3 * 2 * 2 * 4 * 2, cols=32).view(3, 2, 2, 4, 2, 32)  # [n, L, 2, bs, KvH, D]
    rows = encode_rows(values, schema)
    wire = schema.with_dtype(KVDtype(fmt))
    back = convert_rows(convert_rows(rows, schema, wire), wire, schema)
    assert convert_rows(rows, schema, wire).shape == (3, wire.bytes_per_block)
    flat = values.reshape(-1, 32)
    via_converter = decode(encode(flat, fmt), fmt, *flat.shape, torch.bfloat16)
    assert torch.equal(decode_rows(back, schema, torch.bfloat16).reshape(-1, 32), via_converter)


def test_same_schema_rows_are_not_touched():
    schema = KVCacheSchema(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2).with_dtype(KVDtype.INT8)
    rows = torch.randint(0, 255, (2, schema.bytes_per_block), dtype=torch.uint8)
    assert convert_rows(rows, schema, schema) is rows
