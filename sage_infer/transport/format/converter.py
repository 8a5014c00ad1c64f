"""KV format conversion: a KV-cache tensor to a compact wire payload and back.

Applied on send (`encode`) and undone on receive (`decode`). The input is a 2-D chunk
`x: [rows, cols]`, one row being one token's vector for a head or a layer.

Formats: `fp32`, `fp16`, `bf16` are plain casts (no scales). `fp8_e4m3`, `fp8_e5m2`,
`fp8_e4m3fnuz` (the ROCm-family variant), `int8` and `int4` are the KV pool's own codec
(`sage_infer.quantization.kv_codec.quantize_groups`): symmetric, one fp16 scale per group,
scale = amax / qmax; int8 codes are signed bytes, int4 codes unsigned nibbles (level + 7).
Converting here is the same arithmetic as the pool quantizing its KV, not a second copy of it.

Granularity: `per_token` has one scale per row, or per (row, `group_size` consecutive
columns); `per_channel` one per column, or per (`group_size` consecutive rows, column).

Payload: one flat uint8 tensor, contiguous, little-endian, no padding:

    [data][scales: fp16, quantized formats only]

- data: the [rows, cols] elements row-major in the wire dtype; int4 packs two per byte,
  element 2i in the low nibble and 2i+1 in the high nibble (needs rows * cols even).
- scales: row-major [rows, cols / group_size] for per_token, [rows / group_size, cols] for
  per_channel.

On CPU the quantized formats run the codec's C++ kernel (`kv_codec_kernel`): one pass that reads
the chunk once and writes codes and scales straight into the payload, with the payload's CRC32C
computed as it is written (`encode_checksummed`, what the transport engine sends with). Elsewhere
(a CUDA chunk, no kernel build) it is vectorized torch, the kernel's reference: the math in an
fp32 copy of the chunk, a cache-sized row block at a time on CPU. Both give the same bytes.
Inputs are assumed finite; casts do not saturate (fp32 past the fp16 range becomes inf), and a
group whose amax exceeds 65504 * qmax saturates (its scale is fp16).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from sage_infer.core.dtypes import FLOAT_DTYPES
from sage_infer.quantization.kv_codec import FP8_DTYPES as _FP8
from sage_infer.quantization.kv_codec import INT_QMAX as _INT_QMAX
from sage_infer.quantization.kv_codec import PARAMS_DTYPE, dequantize_groups, quantize_groups
from sage_infer.quantization.kv_codec_kernel import FORMAT_CODES, crc32c, kernel_for

assert sys.byteorder == "little", "the wire payload is little-endian"

_CASTS = FLOAT_DTYPES
WIRE_FORMATS: tuple[str, ...] = (*_CASTS, *_FP8, *_INT_QMAX)
GRANULARITIES: tuple[str, ...] = ("per_token", "per_channel")
_KV_DTYPES = tuple(FLOAT_DTYPES.values())
# elements per CPU row block: 4 MiB of fp32 work stays in cache; 16 MiB chunks in one block ran memory-bound
# (bench/kv_convert.py)
_CPU_BLOCK_ELEMS = 1 << 20


@dataclass(frozen=True, slots=True)
class _Layout:
    """x viewed as [outer, group, inner] has one scale per (outer, inner)."""

    outer: int
    group: int
    inner: int
    data_nbytes: int
    num_params: int  # fp16 scale tensors after the data: 0 (casts) or 1

    @property
    def num_scales(self) -> int:
        return self.outer * self.inner

    @property
    def nbytes(self) -> int:
        return self.data_nbytes + PARAMS_DTYPE.itemsize * self.num_params * self.num_scales


def _layout(fmt: str, rows: int, cols: int, granularity: str, group_size: int | None) -> _Layout:
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {fmt!r}; valid: {', '.join(WIRE_FORMATS)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if rows < 1 or cols < 1:
        raise ValueError(f"KV chunk must be non-empty, got [{rows}, {cols}]")
    dim_name, dim = ("cols", cols) if granularity == "per_token" else ("rows", rows)
    group = dim if group_size is None else group_size
    if group < 1 or dim % group:
        raise ValueError(f"group_size {group_size} must be positive and divide {dim_name} ({dim}) for {granularity}")
    n = rows * cols
    if fmt == "int4" and n % 2:
        raise ValueError(f"int4 packs two values per byte: rows * cols must be even, got {rows} * {cols}")
    if fmt in _CASTS:
        data_nbytes, num_params = n * _CASTS[fmt].itemsize, 0
    else:
        data_nbytes, num_params = (n // 2 if fmt == "int4" else n), 1
    if granularity == "per_token":
        return _Layout(n // group, group, 1, data_nbytes, num_params)
    return _Layout(rows // group, group, cols, data_nbytes, num_params)


def is_lossless(fmt: str) -> bool:
    """True for the plain casts: bit-exact when the source dtype is the wire dtype (or narrower)."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {fmt!r}; valid: {', '.join(WIRE_FORMATS)}")
    return fmt in _CASTS


def encoded_nbytes(
    fmt: str, rows: int, cols: int, granularity: str = "per_token", group_size: int | None = None
) -> int:
    """Size in bytes of the payload `encode` makes for a [rows, cols] chunk."""
    return _layout(fmt, rows, cols, granularity, group_size).nbytes


def _typed(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 slice viewed as `dtype`; copied first when its offset is not aligned for it."""
    if buf.storage_offset() % dtype.itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def _check_kv(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _KV_DTYPES:
        raise ValueError(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")


def _row_blocks(
    fmt: str, rows: int, cols: int, granularity: str, group_size: int | None, device: torch.device
) -> list[tuple[int, int]]:
    """Row ranges converted one at a time (on CPU, so the fp32 temporaries stay in cache);
    each is whole scale groups and whole int4 bytes."""
    unit = 1 if granularity == "per_token" else (group_size or rows)
    if fmt == "int4" and unit * cols % 2:
        unit *= 2
    step = unit * max(1, _CPU_BLOCK_ELEMS // (unit * cols)) if device.type == "cpu" else rows
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _encode_block(
    x: torch.Tensor, lay: _Layout, fmt: str, data: torch.Tensor, scales: torch.Tensor, work: torch.Tensor
) -> None:
    """Quantize `x: [rows, cols]` into `data` (uint8) and `scales` ([num_scales] fp16), using the fp32 scratch
    `work`."""
    w3 = work[: x.numel()].view(x.shape).copy_(x).view(lay.outer, lay.group, lay.inner)
    codes, scale = quantize_groups(w3, fmt)
    data.copy_(codes.reshape(-1))
    scales.copy_(scale.view(-1))


def _payload_for(
    x: torch.Tensor, fmt: str, granularity: str, group_size: int | None, out: torch.Tensor | None
) -> tuple[_Layout, torch.Tensor]:
    """The layout of `x`'s payload and the 1-D uint8 tensor it goes into (`out`, checked, or a new one)."""
    if x.dim() != 2:
        raise ValueError(f"encode expects a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    _check_kv(x, "x")
    lay = _layout(fmt, x.shape[0], x.shape[1], granularity, group_size)
    if out is None:
        return lay, torch.empty(lay.nbytes, dtype=torch.uint8, device=x.device)
    if out.dtype != torch.uint8 or out.shape != (lay.nbytes,) or out.device != x.device:
        raise ValueError(
            f"out must be a 1-D uint8 tensor of {lay.nbytes} bytes on {x.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return lay, out


def _kernel_encode(x: torch.Tensor, fmt: str, lay: _Layout, out: torch.Tensor, crc: int | None) -> tuple[bool, int]:
    """Encode a quantized format with the C++ kernel into contiguous `out`: (whether it ran, the payload's CRC32C
    continuing `crc` when one is asked for, else 0)."""
    module = kernel_for(x.device, x.dtype, fmt, lay.group, lay.inner) if fmt in FORMAT_CODES else None
    if module is None or not out.is_contiguous():
        return False, 0
    data, scales = out[: lay.data_nbytes], out[lay.data_nbytes :]
    fused = crc is not None and module.crc32c_native()  # (else the package checksums the payload after)
    value = module.kv_encode(x.contiguous(), FORMAT_CODES[fmt], lay.group, lay.inner, data, scales, fused, crc or 0)
    return True, value if fused or crc is None else crc32c(out, crc)


def encode(
    x: torch.Tensor,
    fmt: str,
    granularity: str = "per_token",
    group_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode `x: [rows, cols]` (fp32/fp16/bf16, any device) to a 1-D uint8 payload.

    Returns `out` when given (1-D uint8 of exactly `encoded_nbytes`), else a new tensor.
    """
    lay, out = _payload_for(x, fmt, granularity, group_size, out)
    if fmt not in _CASTS and _kernel_encode(x, fmt, lay, out, None)[0]:
        return out  # (the kernel writes bytes: any offset)
    if out.storage_offset() % 4 or not out.is_contiguous():
        return out.copy_(encode(x, fmt, granularity, group_size))
    rows, cols = x.shape
    data = out[: lay.data_nbytes]
    if fmt in _CASTS:
        data.view(_CASTS[fmt]).view(rows, cols).copy_(x)
        return out
    blocks = _row_blocks(fmt, rows, cols, granularity, group_size, x.device)
    work = torch.empty(blocks[0][1] * cols, dtype=torch.float32, device=x.device)
    scales = torch.empty(lay.num_scales, dtype=PARAMS_DTYPE, device=x.device)  # (int4 data may end mid-word)
    for a, b in blocks:  # data and scales of a row block are contiguous slices, proportional to rows
        d0, d1 = lay.data_nbytes * a // rows, lay.data_nbytes * b // rows
        s0, s1 = lay.num_scales * a // rows, lay.num_scales * b // rows
        blk = _layout(fmt, b - a, cols, granularity, group_size)
        _encode_block(x[a:b], blk, fmt, data[d0:d1], scales[s0:s1], work)
    out[lay.data_nbytes :].copy_(scales.view(torch.uint8))
    return out


def encode_checksummed(
    x: torch.Tensor,
    fmt: str,
    granularity: str = "per_token",
    group_size: int | None = None,
    out: torch.Tensor | None = None,
    crc: int = 0,
) -> tuple[torch.Tensor, int]:
    """`encode` of a CPU chunk, and the CRC32C of the payload (continuing `crc`; the `crc32c` package's value).

    Quantized formats compute it in the kernel's encoding pass (the payload is not read again); casts, and
    where the kernel cannot run, checksum the payload after encoding it."""
    if x.device.type != "cpu":
        raise ValueError(f"encode_checksummed: the chunk must be on the CPU, got {x.device}")
    lay, out = _payload_for(x, fmt, granularity, group_size, out)
    ran, value = _kernel_encode(x, fmt, lay, out, crc) if fmt not in _CASTS else (False, 0)
    if ran:
        return out, value
    encode(x, fmt, granularity, group_size, out=out)
    return out, crc32c(out, crc)


class PendingEncode:
    """A CPU chunk to encode where the channel stages its payload (the shm ring, a tcp send buffer): the codec
    writes codes and scales straight there and returns their CRC32C from the same pass, so the chunk is read once
    and no payload tensor is made. A resend encodes again from the (still registered) source."""

    __slots__ = ("x", "fmt", "granularity", "nbytes", "seconds")

    def __init__(self, x: torch.Tensor, fmt: str, granularity: str = "per_token") -> None:
        """`x: [rows, cols]` on the CPU, in a quantized wire format (casts have nothing to encode)."""
        if x.device.type != "cpu" or fmt in _CASTS:
            raise ValueError(f"PendingEncode takes a CPU chunk in a quantized format, got {fmt} on {x.device}")
        self.x, self.fmt, self.granularity = x, fmt, granularity
        self.nbytes = encoded_nbytes(fmt, x.shape[0], x.shape[1], granularity)
        self.seconds = 0.0  # time spent encoding, every write counted

    def __len__(self) -> int:
        return self.nbytes

    def write(self, out: torch.Tensor, crc: bool = True) -> int:
        """Encode into `out` (1-D uint8 of `nbytes`); the payload's CRC32C when `crc`, else 0."""
        start = time.perf_counter()
        if crc:
            value = encode_checksummed(self.x, self.fmt, self.granularity, out=out)[1]
        else:
            encode(self.x, self.fmt, self.granularity, out=out)
            value = 0
        self.seconds += time.perf_counter() - start
        return value


def decode_checksummed(
    payload: torch.Tensor,
    fmt: str,
    out: torch.Tensor,
    granularity: str = "per_token",
    group_size: int | None = None,
    crc: int = 0,
) -> int | None:
    """Decode a quantized payload into contiguous CPU `out: [rows, cols]` and return the payload's CRC32C
    (continuing `crc`) taken in the same pass, so a received chunk is read once to check and decode it; None,
    with nothing written, where the kernel cannot (a cast, another device, no kernel build with it)."""
    if fmt in _CASTS or out.dim() != 2 or not out.is_contiguous() or payload.dtype != torch.uint8:
        return None
    rows, cols = out.shape
    lay = _layout(fmt, rows, cols, granularity, group_size)
    module = kernel_for(payload.device, out.dtype, fmt, lay.group, lay.inner)
    if module is None or not hasattr(module, "kv_decode_crc") or not module.crc32c_native():
        return None
    if payload.dim() != 1 or payload.numel() != lay.nbytes:
        raise ValueError(f"payload has {payload.numel()} bytes, {fmt} {granularity} [{rows}, {cols}] needs "
                         f"{lay.nbytes}")
    return module.kv_decode_crc(payload[: lay.data_nbytes], payload[lay.data_nbytes :], FORMAT_CODES[fmt], lay.group,
                                lay.inner, out, crc)


def _decode_block(
    data: torch.Tensor, fmt: str, lay: _Layout, scales: torch.Tensor, result: torch.Tensor, work: torch.Tensor
) -> None:
    """Dequantize `data` with `scales` ([num_scales] fp16) into contiguous `result: [rows, cols]`."""
    # copy_ converts dtypes vectorized; a mixed-dtype mul/add falls back to a scalar loop on CPU
    w = result if result.dtype == torch.float32 else work[: result.numel()].view(result.shape)
    dequantize_groups(data, scales.view(lay.outer, 1, lay.inner), fmt, w.view(lay.outer, lay.group, lay.inner))
    if w is not result:
        result.copy_(w)


def decode(
    payload: torch.Tensor,
    fmt: str,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    granularity: str = "per_token",
    group_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a payload from `encode` to `[rows, cols]` of `dtype` (written into `out` when given)."""
    lay = _layout(fmt, rows, cols, granularity, group_size)
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    if payload.numel() != lay.nbytes:
        raise ValueError(
            f"payload has {payload.numel()} bytes, {fmt} {granularity} [{rows}, {cols}] needs {lay.nbytes}"
        )
    if dtype not in _KV_DTYPES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if out is not None and (out.shape != (rows, cols) or out.dtype != dtype or out.device != payload.device):
        raise ValueError(
            f"out must be [{rows}, {cols}] {dtype} on {payload.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out is None or not out.is_contiguous():
        result = torch.empty((rows, cols), dtype=dtype, device=payload.device)
    else:
        result = out

    data = payload[: lay.data_nbytes]
    if fmt in _CASTS:
        result.copy_(_typed(data, _CASTS[fmt]).view(rows, cols))
    elif (module := kernel_for(payload.device, dtype, fmt, lay.group, lay.inner)) is not None:
        module.kv_decode(data, payload[lay.data_nbytes :], FORMAT_CODES[fmt], lay.group, lay.inner, result)
    else:
        scales = _typed(payload[lay.data_nbytes :], PARAMS_DTYPE)
        blocks = _row_blocks(fmt, rows, cols, granularity, group_size, payload.device)
        work = torch.empty(blocks[0][1] * cols, dtype=torch.float32, device=payload.device)
        for a, b in blocks:
            d0, d1 = lay.data_nbytes * a // rows, lay.data_nbytes * b // rows
            s0, s1 = lay.num_scales * a // rows, lay.num_scales * b // rows
            blk = _layout(fmt, b - a, cols, granularity, group_size)
            _decode_block(data[d0:d1], fmt, blk, scales[s0:s1], result[a:b], work)
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def error_bound(
    fmt: str, x: torch.Tensor, granularity: str = "per_token", group_size: int | None = None
) -> torch.Tensor:
    """Elementwise worst case of |x - decode(encode(x))| (decoded to x.dtype), fp32 [rows, cols].

    int: half a step (the group's fp16 scale / 2); fp8: half an fp8 ulp relative to |x| plus half
    the subnormal step times the scale; both plus what the clamp cuts off where the scale rounded
    down to fp16 (amax - qmax * scale); casts: half an ulp of the wire dtype (inf past its range,
    0 when x.dtype fits in it). Each adds fp32 arithmetic slack and the rounding back to x.dtype.
    """
    if x.dim() != 2:
        raise ValueError(f"error_bound expects a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    _check_kv(x, "x")
    lay = _layout(fmt, x.shape[0], x.shape[1], granularity, group_size)
    xf = x.to(torch.float32).abs()
    if fmt in _CASTS:
        wire = _CASTS[fmt]
        if wire == x.dtype or wire == torch.float32:
            return torch.zeros_like(xf)
        info = torch.finfo(wire)
        bound = xf * (info.eps / 2) + info.tiny * info.eps / 2
        bound = torch.where(xf <= info.max, bound, math.inf)
    else:
        x3 = xf.view(lay.outer, lay.group, lay.inner)
        _, scale = quantize_groups(x3.clone(), fmt)
        scale = scale.float()
        qmax = torch.finfo(_FP8[fmt]).max if fmt in _FP8 else _INT_QMAX[fmt]
        clipped = (x3.amax(1, keepdim=True) - qmax * scale).clamp_min_(0)
        if fmt in _FP8:
            info = torch.finfo(_FP8[fmt])
            bound = x3 * (info.eps / 2 + 2**-20) + scale * (info.tiny * info.eps / 2) + clipped
        else:
            bound = (scale / 2 + clipped).expand_as(x3) + x3 * 2**-20
        bound = bound.reshape(xf.shape)
    out_info = torch.finfo(x.dtype)
    return bound + (xf + bound) * (out_info.eps / 2) + out_info.tiny * out_info.eps / 2


@dataclass(frozen=True)
class ReconstructionError:
    """How far decode(encode(x)) is from x; compression = source bytes / payload bytes."""

    fmt: str
    granularity: str
    max_abs: float
    mean_abs: float
    rel_rmse: float
    compression: float


def reconstruction_error(
    x: torch.Tensor, fmt: str, granularity: str = "per_token", group_size: int | None = None
) -> ReconstructionError:
    """Round-trip `x` through `fmt` and measure the error (decoding back to x.dtype)."""
    payload = encode(x, fmt, granularity, group_size)
    y = decode(payload, fmt, x.shape[0], x.shape[1], x.dtype, granularity, group_size)
    xf = x.double()
    err = (y.double() - xf).abs_()
    ref_rms = xf.square().mean().sqrt().item()
    err_rms = err.square().mean().sqrt().item()
    rel = err_rms / ref_rms if ref_rms > 0 else (0.0 if err_rms == 0 else math.inf)
    return ReconstructionError(
        fmt=fmt,
        granularity=granularity,
        max_abs=err.max().item(),
        mean_abs=err.mean().item(),
        rel_rmse=rel,
        compression=x.numel() * x.element_size() / payload.numel(),
    )
