"""The KV codec's C++ kernel (csrc/kv_codec.cpp, `kv_codec_kernel`) against the PyTorch codec it replaces on CPU
(`kv_codec.quantize_groups` / `dequantize_groups`, the reference): codes, scales and decoded values equal bit for
bit, at every ISA level this CPU runs; its CRC32C equals the `crc32c` package's; the converter's checksummed
payload is the PyTorch path's payload with the package's CRC of it; and without the kernel the PyTorch codec runs,
the reason logged once."""

from __future__ import annotations

import logging

import crc32c
import pytest
import torch

from sage_infer.core.kv_schema import KVDtype
from sage_infer.quantization import kv_codec_kernel
from sage_infer.quantization.kv_codec import FP8_DTYPES, KVCodec, dequantize_groups, quantize_groups
from sage_infer.quantization.kv_codec_kernel import CODEC_ENV, FORMAT_CODES
from sage_infer.transport.format import converter

FORMATS = list(FORMAT_CODES)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# [outer, group, inner]: head_dim groups (4 batches of 16 scales), a group with a scalar tail (130 = 8 x 16 + 2), one
# with an 8-lane tail (40 = 2 x 16 + 8), per_channel columns with tails (10 = 8 + 2, 24 = 16 + 8), and a tiny group
SHAPES = ((64, 128, 1), (9, 130, 1), (19, 40, 1), (6, 16, 128), (5, 6, 10), (3, 4, 24), (4, 4, 1))


def kernel():
    module = kv_codec_kernel.native()
    if module is None:
        pytest.skip(f"no KV codec kernel here: {kv_codec_kernel.unavailable()}")
    return module


def values(outer: int, group: int, inner: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Groups over 13 decades (fp16 subnormal scales to the clamp at 65504), an all-zero and an all-(-0) group,
    and one of exact half-steps (the int formats' rounding ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(outer, group, inner, generator=g) * torch.logspace(-9, 4, outer).view(-1, 1, 1)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = torch.randint(-300, 300, (group, inner), generator=g) * 0.5
    return x.to(dtype)


def reference(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize_groups(x.to(torch.float32, copy=True), fmt)
    return codes.reshape(-1), scales.reshape(-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_encodes_and_decodes_as_the_torch_codec_bit_for_bit(fmt, cpu_isa):
    module = kernel()
    for shape in SHAPES:
        outer, group, inner = shape
        if fmt == "int4" and inner > 1 and inner % 2:
            continue
        for dtype in FLOATS:
            x = values(*shape, dtype)
            ref_codes, ref_scales = reference(x, fmt)
            codes = torch.empty_like(ref_codes)
            scales = torch.empty(outer * inner, dtype=torch.float16)
            crc = module.kv_encode(x, FORMAT_CODES[fmt], group, inner, codes, scales, True, 0)
            assert torch.equal(codes, ref_codes), (fmt, shape, dtype)
            assert torch.equal(scales.view(torch.int16), ref_scales.view(torch.int16)), (fmt, shape, dtype)
            assert crc == crc32c.crc32c(scales.numpy(), crc32c.crc32c(codes.numpy()))
            exact = torch.empty(shape, dtype=torch.float32)
            dequantize_groups(ref_codes, ref_scales.view(outer, 1, inner), fmt, exact)
            for out_dtype in FLOATS:
                got = torch.empty(shape, dtype=out_dtype)
                module.kv_decode(codes, scales, FORMAT_CODES[fmt], group, inner, got)
                assert torch.equal(got, exact.to(out_dtype)), (fmt, shape, dtype, out_dtype)
                fused = torch.empty(shape, dtype=out_dtype)  # decoding with the CRC of what it reads
                assert module.kv_decode_crc(codes, scales, FORMAT_CODES[fmt], group, inner, fused, 0) == crc
                assert torch.equal(fused, got), (fmt, shape, dtype, out_dtype)


def test_each_level_runs_the_codec_at_its_vector_width(cpu_isa):
    """16 lanes in the AVX-512 builds, 8 in the avx2 build: the bit-for-bit test above covers each width."""
    expected = 16 if cpu_isa.startswith("avx512") else 8 if cpu_isa == "avx2" else 1  # (none: the generic build)
    assert kernel().kv_lanes() == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_fp16_value_rounds_to_the_code_torch_casts_it_to(fmt):
    """Each group is [qmax, 127 values]: its scale is 1, so the codes are the values' own casts (c10's Float8
    rounding, or the int formats' half-up), over every finite fp16 value and 2M random fp32 ones."""
    module = kernel()
    qmax = torch.finfo(FP8_DTYPES[fmt]).max if fmt in FP8_DTYPES else {"int8": 127.0, "int4": 7.0}[fmt]
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    g = torch.Generator().manual_seed(1)
    spread = torch.randn(2_000_000, generator=g) * torch.exp(torch.rand(2_000_000, generator=g) * 30 - 25)
    for v in (every[torch.isfinite(every)], spread):
        v = v.clamp(-qmax, qmax)
        v = v[: v.numel() // 127 * 127].view(-1, 127)
        x = torch.cat([torch.full((v.shape[0], 1), qmax), v], 1).contiguous()
        ref_codes, ref_scales = reference(x.view(-1, 128, 1), fmt)
        codes, scales = torch.empty_like(ref_codes), torch.empty(x.shape[0], dtype=torch.float16)
        module.kv_encode(x, FORMAT_CODES[fmt], 128, 1, codes, scales, False, 0)
        assert torch.equal(scales, ref_scales) and torch.equal(codes, ref_codes)


def test_crc32c_is_the_crc32c_packages_at_every_length_and_start():
    module = kernel()
    g = torch.Generator().manual_seed(2)
    # lengths around the 8-byte words and the kernel's 3 x 256 and 3 x 8192-byte interleaved blocks
    for n in (0, 1, 7, 8, 9, 255, 767, 768, 769, 3 * 8192 - 1, 3 * 8192 + 13, 1 << 20):
        data = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=g)[3:]  # unaligned start
        for start in (0, 0xFFFFFFFF, 12345):
            expected = crc32c.crc32c(data.numpy(), start)
            assert module.crc32c(data, start) == expected == kv_codec_kernel.crc32c(data, start), (n, start)
            dst = torch.empty_like(data)
            assert module.copy_crc32c(dst, data, start) == expected and torch.equal(dst, data)


def test_nothing_to_encode_writes_nothing_and_keeps_the_crc():
    module = kernel()
    none, codes, scales = torch.empty(0), torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.float16)
    assert module.kv_encode(none, FORMAT_CODES["int8"], 128, 1, codes, scales, True, 9) == 9
    module.kv_decode(codes, scales, FORMAT_CODES["int4"], 128, 1, none)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3", "fp16", "bf16"])
@pytest.mark.parametrize("granularity", ["per_token", "per_channel"])
def test_checksummed_payload_is_the_torch_paths_with_the_packages_crc(fmt, granularity, monkeypatch):
    """Large enough that the kernel splits it across threads: the parts' CRCs are joined in order."""
    kernel()
    torch.set_num_threads(2)
    x = values(48, 64, 128, torch.bfloat16, seed=3).view(-1, 128)[:3000].contiguous()  # 3000 x 128 = 384K values
    group = 8 if granularity == "per_channel" else None
    payload, crc = converter.encode_checksummed(x, fmt, granularity, group, crc=7)
    monkeypatch.setenv(CODEC_ENV, "torch")
    expected = converter.encode(x, fmt, granularity, group)
    assert torch.equal(payload, expected)
    assert crc == crc32c.crc32c(expected.numpy(), 7)
    torch_decoded = converter.decode(expected, fmt, *x.shape, torch.bfloat16, granularity, group)
    monkeypatch.delenv(CODEC_ENV)
    assert torch.equal(converter.decode(payload, fmt, *x.shape, torch.bfloat16, granularity, group), torch_decoded)


@pytest.mark.parametrize("kv_dtype", [KVDtype.INT8, KVDtype.INT4, KVDtype.FP8_E5M2])
def test_the_pools_codec_takes_the_kernel_and_gives_the_torch_codecs_bytes(kv_dtype, monkeypatch):
    kernel()
    x = values(40, 32, 64, torch.bfloat16, seed=4).view(2, 20, 32, 64)  # [K/V, tokens, heads, head_dim]
    codec = KVCodec(kv_dtype, 64)
    codes, scales = codec.encode(x)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    decoded = codec.decode(codes, scales, torch.bfloat16, out=out)
    monkeypatch.setenv(CODEC_ENV, "torch")
    ref_codes, ref_scales = codec.encode(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert decoded is out and torch.equal(out, codec.decode(ref_codes, ref_scales, torch.bfloat16))


def test_without_the_kernel_the_torch_codec_runs_and_says_why_once(monkeypatch, caplog):
    monkeypatch.setenv(CODEC_ENV, "torch")
    kv_codec_kernel._logged.discard(f"{CODEC_ENV}=torch")
    with caplog.at_level(logging.INFO, logger=kv_codec_kernel.__name__):
        assert kv_codec_kernel.native() is None and kv_codec_kernel.native() is None
        x = values(8, 16, 8, torch.float16, seed=5).view(-1, 8)
        payload, crc = converter.encode_checksummed(x, "int8")
    lines = [r.getMessage() for r in caplog.records if "PyTorch ops" in r.getMessage()]
    assert lines == ["sage: the KV codec runs on PyTorch ops, not its C++ kernel: SAGE_KV_CODEC=torch"]
    assert crc == crc32c.crc32c(payload.numpy())
    assert kv_codec_kernel.unavailable() == f"{CODEC_ENV}=torch"
