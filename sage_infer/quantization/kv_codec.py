"""The KV codec: how quantized K/V values and their scales are computed, packed and read back.

One implementation, `quantize_groups` / `dequantize_groups`, shared by the KV pool (`KVCodec`: one scale per
token and head), the tiers (which store the pool's block bytes as they are, scales inside), prefill/decode
transfers with a wire dtype (the pool's block rows, `kv_runtime.quantized_pool.convert_rows`) and the
transport's chunk converter (`sage_infer.transport.format.converter`, any group shape), so a value quantized
anywhere decodes the same everywhere.

Every format is symmetric with one fp16 scale per group: scale = amax / qmax (fp8_max for fp8, 127 for
int8, 7 for int4), rounded to fp16 before the codes are computed and clamped to fp16's range (its smallest
subnormal for an all-zero group), and codes are clamped, so decoding with the stored scale is as exact as
the format allows. fp8 stores x / scale in the fp8 dtype (`fp8_e4m3`, `fp8_e5m2`, `fp8_e4m3fnuz`); int8
stores round_half_up(x / scale) as a signed byte (-127..127); int4 round_half_up(x / scale) + 7 as an
unsigned nibble (0..14), two per byte, element 2i in the low nibble. The math runs in fp32; fp8 is
decoded by moving its bits into fp16 (exact), because the CPU float8 -> float cast is much slower.

On CPU the same arithmetic runs as one C++ pass over the values (`kv_codec_kernel`, csrc/kv_codec.cpp; `KVCodec`
and the transport's converter call it), equal to the functions here bit for bit; these functions are its
reference and the path wherever it cannot run (another device, no kernel build: the reason is logged once).
"""

from __future__ import annotations

import math

import torch

from sage_infer.core.kv_schema import KVDtype
from sage_infer.quantization.kv_codec_kernel import FORMAT_CODES, kernel_for

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
}
INT_QMAX: dict[str, int] = {"int8": 127, "int4": 7}  # largest |level|; int4 levels are stored + 7
QUANTIZED_FORMATS: tuple[str, ...] = (*FP8_DTYPES, *INT_QMAX)
PARAMS_DTYPE = torch.float16  # 2 bytes per scale keep int8 KV near half of bf16's bytes
_FP16 = torch.finfo(torch.float16)
_FP16_SUBNORMAL = 2.0**-24


def _qmax(fmt: str) -> float:
    return torch.finfo(FP8_DTYPES[fmt]).max if fmt in FP8_DTYPES else INT_QMAX[fmt]


def quantize_groups(w3: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w3: [outer, group, inner]`` fp32 (overwritten) -> (codes, scales ``[outer, 1, inner]`` fp16), one scale
    per (outer, inner) group. Codes are uint8 bytes of ``w3``'s elements in row-major order: ``[outer, group,
    inner]`` for fp8 / int8, ``[outer * group * inner / 2]`` for int4 (two per byte)."""
    qmax = _qmax(fmt)
    # amax and amin, not abs().amax (a full-size temporary) nor aminmax (both measured ~2x and ~7x slower on CPU)
    amax = torch.maximum(w3.amax(1, keepdim=True), w3.amin(1, keepdim=True).neg_())
    scale = amax.div_(qmax).clamp_(_FP16_SUBNORMAL, _FP16.max).to(PARAMS_DTYPE)
    w3.mul_(scale.float().reciprocal_()).clamp_(-qmax, qmax)
    if fmt in FP8_DTYPES:
        return w3.to(FP8_DTYPES[fmt]).view(torch.uint8), scale
    # level + qmax + 0.5 lies in [0.5, 2 qmax + 0.5]: the truncating cast rounds the level half up
    w3.add_(qmax + 0.5)
    if fmt == "int8":
        return w3.to(torch.uint8).sub_(qmax), scale  # wraps to the signed level's byte (two's complement)
    return pack_int4(w3.to(torch.int8).view(torch.uint8).view(-1)), scale  # 0..14 (the int8 cast is faster)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_groups` into ``out: [outer, group, inner]`` fp32 (``scales: [outer, 1, inner]``)."""
    scale = scales.to(torch.float32)
    if fmt in FP8_DTYPES:
        values, factor = fp8_as_fp16(codes, FP8_DTYPES[fmt])
        return out.copy_(values.view(out.shape)).mul_(scale.mul_(factor))
    if fmt == "int8":  # signed codes: one widening copy, one multiply
        return out.copy_(codes.view(torch.int8).reshape(out.shape)).mul_(scale)
    return out.copy_(unpack_int4(codes).view(out.shape)).sub_(INT_QMAX[fmt]).mul_(scale)


def pack_int4(levels: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 values 0..15 -> [..., n] bytes, element 2i in the low nibble of byte i."""
    pairs = levels.contiguous().view(torch.int16)  # little-endian: element 2i is the low byte
    return torch.bitwise_right_shift(pairs, 4).bitwise_or_(pairs).to(torch.uint8)  # q[2i] | q[2i+1] << 4


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """[..., n] packed bytes -> [..., 2n] uint8 values 0..15 (inverse of `pack_int4`)."""
    w = data.to(torch.int16)
    w = torch.bitwise_left_shift(w, 4).bitwise_or_(w).bitwise_and_(0x0F0F)  # q[2i] in byte 0, q[2i+1] in byte 1
    return w.view(torch.uint8)


def fp8_as_fp16(data: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """fp8 bytes as fp16 values v, with the factor f such that the fp8 value is v * f (exact).

    The byte moves to the top of an int16 and an arithmetic shift aligns its exponent and
    mantissa with fp16's (the sign stays at bit 15; its copies are masked off). The bits then
    read as the fp8 value rebased to fp16's exponent bias, subnormals included. NaN codes
    map to finite values.
    """
    info = torch.finfo(dtype)
    shift = round(-math.log2(info.eps)) - 2  # the byte's top mantissa bit sits at 8 + mantissa bits - 1, fp16's at 9
    w = data.to(torch.int16).bitwise_left_shift_(8)
    if shift:
        w.bitwise_right_shift_(shift).bitwise_and_(~(((1 << shift) - 1) << (15 - shift)))
    return w.view(torch.float16), info.tiny / torch.finfo(torch.float16).tiny


class KVCodec:
    """Quantizes K/V vectors with one fp16 scale per vector: one token of one head (`ScaleLayout.PER_TOKEN`).

    ``x: [..., head_dim]`` float <-> ``codes: [..., code_dim]`` uint8 (``code_dim`` = head_dim, or
    head_dim / 2 for int4) and ``scales: [..., 1]`` fp16: `quantize_groups` with one group per vector.
    Symmetric codes cost +0.02 % perplexity for int8, +0.6 % for int4 on the demo model
    (docs/benchmarks.md "Compression").
    """

    num_params = 1

    def __init__(self, kv_dtype: KVDtype, head_dim: int) -> None:
        if not kv_dtype.is_quantized:
            raise ValueError(f"KVCodec: {kv_dtype.value} is not a quantized KV dtype")
        if kv_dtype is KVDtype.INT4 and head_dim % 2:
            raise ValueError(f"int4 KV packs two values per byte and needs an even head_dim, got {head_dim}")
        self.fmt = kv_dtype.value
        self.head_dim = head_dim
        self.code_dim = head_dim // 2 if kv_dtype is KVDtype.INT4 else head_dim
        self._fp8 = FP8_DTYPES.get(self.fmt)
        self._max = INT_QMAX.get(self.fmt)  # int: the level offset of int4's unsigned nibbles

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [..., head_dim]`` -> (codes ``[..., code_dim]`` uint8, scales ``[..., 1]`` fp16)."""
        lead = x.shape[:-1]
        module = kernel_for(x.device, x.dtype, self.fmt, self.head_dim, 1) if x.numel() else None
        if module is not None:
            codes = torch.empty((*lead, self.code_dim), dtype=torch.uint8)
            scales = torch.empty((*lead, 1), dtype=PARAMS_DTYPE)
            module.kv_encode(x.contiguous(), FORMAT_CODES[self.fmt], self.head_dim, 1, codes, scales, False, 0)
            return codes, scales
        w = x.to(torch.float32, copy=True).view(-1, self.head_dim, 1)
        codes, scale = quantize_groups(w, self.fmt)
        return codes.reshape(*lead, self.code_dim), scale.view(*lead, 1)

    def levels(self, codes: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``codes: [..., code_dim]`` -> (levels ``[..., head_dim]`` int8 or fp16, factor): x = level * scale * factor.

        Exact and narrow (1-2 bytes): what attention that folds the scales into its scores and
        probabilities widens once, instead of reading dequantized K/V.
        """
        if self._fp8 is not None:
            return fp8_as_fp16(codes, self._fp8)
        if self.fmt == "int8":
            return codes.view(torch.int8), 1.0
        return unpack_int4(codes).view(*codes.shape[:-1], self.head_dim).view(torch.int8).sub_(self._max), 1.0

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of `encode`: ``[..., head_dim]`` in `dtype` (math in fp32), into `out` when given.

        `work`: an fp32 scratch of the output's shape, used when `dtype` is not fp32. The decode path
        gathers every step: fresh multi-MiB temporaries made glibc fault pages in on every call (costing
        more than the arithmetic), and bf16 elementwise math and `addcmul` measured slower than fp32
        (bench/kv_quant_gather.py times this path).
        """
        shape = (*codes.shape[:-1], self.head_dim)
        module = kernel_for(codes.device, dtype, self.fmt, self.head_dim, 1) if codes.numel() else None
        if module is not None:
            result = out if out is not None and out.is_contiguous() and out.dtype == dtype else None
            result = torch.empty(shape, dtype=dtype) if result is None else result
            module.kv_decode(codes.contiguous(), scales.contiguous(), FORMAT_CODES[self.fmt], self.head_dim, 1, result)
            return result if out is None or result is out else out.copy_(result)
        if dtype == torch.float32:
            work = out if out is not None else torch.empty(shape, dtype=torch.float32, device=codes.device)
        elif work is None:
            work = torch.empty(shape, dtype=torch.float32, device=codes.device)
        dequantize_groups(codes, scales.reshape(-1, 1, 1), self.fmt, work.view(-1, self.head_dim, 1))
        if work.dtype == dtype and (out is None or out is work):
            return work
        return work.to(dtype) if out is None else out.copy_(work)
