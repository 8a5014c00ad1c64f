"""The KV codec: how quantized K/V values and their scales are computed, packed and read back.

One implementation shared by the KV pool (`QuantizedKVPool`, one scale per token and head), the
tiers (which store the pool's block bytes as they are, scales inside) and the transport's wire
converter (`sage_infer.transport.format.converter`, any group shape), so a block quantized in the
pool is stored and sent without conversion and decodes the same everywhere.

Formats. `fp8_e4m3`, `fp8_e5m2`, `fp8_e4m3fnuz` are symmetric: scale = amax / fp8_max per group
(1 for an all-zero group). `int8`, `int4` are asymmetric: scale = (max - min) / qmax (qmax 255 / 15;
1 for a constant group, which then decodes exactly) and q = round_half_up((x - min) / scale),
stored unsigned; x ~ q * scale + min. int4 packs two values per byte, element 2i in the low
nibble. The wire converter keeps scales and mins in fp32; the pool's `KVCodec` is symmetric, fp16 scales. The math
runs in fp32; fp8 is decoded by moving its bits into fp16 (exact), because the CPU float8 ->
float cast is much slower.
"""

from __future__ import annotations

import math

import torch

from sage_infer.core.kv_schema import KVDtype

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
}
INT_QMAX: dict[str, int] = {"int8": 255, "int4": 15}
QUANTIZED_FORMATS: tuple[str, ...] = (*FP8_DTYPES, *INT_QMAX)
_F32_TINY = torch.finfo(torch.float32).tiny


def group_params(w3: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and min for int formats) of each group of `w3: [outer, group, inner]` fp32 -> [outer, 1, inner]."""
    mx = w3.amax(1, keepdim=True)
    mn = w3.amin(1, keepdim=True)
    if fmt in FP8_DTYPES:
        amax = torch.maximum(mx, mn.neg_())
        # clamp keeps 1/scale finite for subnormal amax; it only makes the scale larger
        scale = (amax / torch.finfo(FP8_DTYPES[fmt]).max).clamp_min_(_F32_TINY)
        return torch.where(amax > 0, scale, 1.0), None
    scale = ((mx - mn) / INT_QMAX[fmt]).clamp_min_(_F32_TINY)
    return torch.where(mx > mn, scale, 1.0), mn


def quantize_groups_(w3: torch.Tensor, fmt: str, scale: torch.Tensor, mn: torch.Tensor | None) -> torch.Tensor:
    """Codes of `w3: [outer, group, inner]` fp32 (overwritten) with `group_params`' scale/min.

    fp8: the values scaled into range, to be cast to the fp8 dtype; int: the integer levels plus 0.5,
    to be cast to uint8 (the truncating cast rounds half up: values lie in [0.5, qmax + 0.5]).
    """
    if fmt in FP8_DTYPES:
        # |x / scale| <= fp8_max up to fp32 rounding, which the cast rounds back to fp8_max
        return w3.mul_(scale.reciprocal())
    return w3.sub_(mn).mul_(scale.reciprocal()).add_(0.5)


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


PARAMS_DTYPE = torch.float16  # 2 bytes per scale keep int8 KV near half of bf16's bytes
_FP16 = torch.finfo(torch.float16)
_FP16_SUBNORMAL = 2.0**-24


class KVCodec:
    """Quantizes K/V vectors with one fp16 scale per vector: one token of one head (`ScaleLayout.PER_TOKEN`).

    ``x: [..., head_dim]`` float <-> ``codes: [..., code_dim]`` uint8 (``code_dim`` = head_dim, or
    head_dim / 2 for int4) and ``scales: [..., 1]`` fp16. Every format is symmetric: fp8 stores
    x / scale with scale = amax / fp8_max; int8 stores round(x / scale) as a signed byte (-127..127),
    int4 round(x / scale) + 7 as an unsigned nibble (0..14), with scale = amax / 127 or amax / 7.
    Against the asymmetric (scale + min) form the wire converter uses, this saves 2 bytes per token
    and head (int8 at head_dim 64: 66 bytes, not 68, against bf16's 128) and cost +0.02 % perplexity
    for int8, +0.6 % for int4 on the demo model (+0.4 % asymmetric; docs/benchmarks.md
    "Compression"). Scales are rounded to fp16 before the codes are computed, and codes are
    clamped, so decoding with the stored scale is as exact as the
    format allows.
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
        self._max = torch.finfo(self._fp8).max if self._fp8 is not None else INT_QMAX[self.fmt] // 2  # z for int

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [..., head_dim]`` -> (codes ``[..., code_dim]`` uint8, scales ``[..., 1]`` fp16)."""
        lead = x.shape[:-1]
        w = x.to(torch.float32, copy=True).view(-1, self.head_dim)
        amax = w.abs().amax(1, keepdim=True)
        scale = (amax / self._max).clamp_(_FP16_SUBNORMAL, _FP16.max).to(PARAMS_DTYPE)
        w.mul_(scale.float().reciprocal_()).clamp_(-self._max, self._max)
        if self._fp8 is not None:
            codes = w.to(self._fp8).view(torch.uint8)
        elif self.fmt == "int8":
            codes = w.add_(self._max + 0.5).floor_().sub_(self._max).to(torch.int8).view(torch.uint8)  # signed
        else:
            codes = pack_int4(w.add_(self._max + 0.5).floor_().to(torch.uint8))  # round half up; codes 0..14
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
        if dtype == torch.float32:
            work = out if out is not None else torch.empty(shape, dtype=torch.float32, device=codes.device)
        elif work is None:
            work = torch.empty(shape, dtype=torch.float32, device=codes.device)
        scale = scales.to(torch.float32)
        if self._fp8 is not None:
            values, factor = fp8_as_fp16(codes, self._fp8)
            work.copy_(values.view(shape)).mul_(scale.mul_(factor))
        elif self.fmt == "int8":  # signed codes: one widening copy, one multiply
            work.copy_(codes.view(torch.int8)).mul_(scale)
        else:
            work.copy_(unpack_int4(codes).view(shape)).sub_(self._max).mul_(scale)
        if work.dtype == dtype and (out is None or out is work):
            return work
        return work.to(dtype) if out is None else out.copy_(work)
