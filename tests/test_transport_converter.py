"""KV format conversion: every wire format round-trips within its stated error bound."""

from __future__ import annotations

import struct

import pytest
import torch

from sage_infer.transport.format import (
    WIRE_FORMATS,
    converter,
    decode,
    encode,
    encoded_nbytes,
    error_bound,
    is_lossless,
    reconstruction_error,
)

LOSSY = [f for f in WIRE_FORMATS if not is_lossless(f)]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3fnuz": torch.float8_e4m3fnuz}
ROWS, COLS = 64, 128


def kv_like(dtype: torch.dtype = torch.float16, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> torch.Tensor:
    """Normal values with per-channel spread, outliers, zero and constant columns, then a zero and a constant row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(cols, generator=g).mul(2).add(0.1)
    x[5] *= 40  # outlier token
    x[9, 17] = -300.0  # single spike
    x[:, 3] *= 25  # outlier channel (as in K caches)
    x[:, 7] = 0.0
    x[:, 8] = -2.5
    x[11] = 0.0
    x[13] = 0.75
    return x.to(dtype)


def round_trip(x: torch.Tensor, fmt: str, granularity: str = "per_token", group_size: int | None = None):
    payload = encode(x, fmt, granularity, group_size)
    return decode(payload, fmt, x.shape[0], x.shape[1], x.dtype, granularity, group_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("granularity", ["per_token", "per_channel"])
@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_round_trip_stays_within_error_bound(fmt, granularity, group_size, dtype):
    x = kv_like(dtype)
    y = round_trip(x, fmt, granularity, group_size)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    err = (y.float() - x.float()).abs()
    bound = error_bound(fmt, x, granularity, group_size)
    worst = (err - bound).max().item()
    assert worst <= 0, f"{fmt} {granularity} g={group_size} {dtype}: exceeds bound by {worst}"


@pytest.mark.parametrize("fmt", LOSSY)
def test_error_bound_is_tight(fmt):
    x = kv_like(torch.float32)
    err = (round_trip(x, fmt).float() - x).abs()
    bound = error_bound(fmt, x)
    assert (err / bound.clamp_min(1e-30)).max() > 0.5  # a bound far above the real error would test nothing


def test_int8_bound_is_half_a_step():
    x = torch.arange(-127, 128, dtype=torch.float32).view(1, 255) * 0.5  # amax 63.5 -> step 0.5
    assert error_bound("int8", x).max().item() == pytest.approx(0.25, rel=1e-3)


@pytest.mark.parametrize("dtype,fmt", [
    (torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"),
    (torch.float16, "fp32"), (torch.bfloat16, "fp32"),
])
def test_lossless_casts_are_bit_exact(dtype, fmt):
    x = kv_like(dtype)
    assert is_lossless(fmt)
    assert torch.equal(round_trip(x, fmt).view(torch.uint8), x.view(torch.uint8))
    assert reconstruction_error(x, fmt).max_abs == 0.0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_zero_rows_and_columns_decode_exactly_in_int_formats(fmt):
    x = kv_like(torch.float32)
    y = round_trip(x, fmt)
    assert torch.equal(y[11], x[11])
    xt = kv_like(torch.float32, rows=COLS, cols=ROWS).t().contiguous()
    y = round_trip(xt, fmt, "per_channel")
    assert torch.equal(y[:, 11], xt[:, 11])


@pytest.mark.parametrize("fmt", LOSSY)
def test_all_zero_chunk_decodes_to_zeros(fmt):
    x = torch.zeros(4, 8, dtype=torch.float16)
    assert torch.equal(round_trip(x, fmt), x)


def test_int4_packs_element_2i_in_low_nibble():
    x = torch.tensor([[0.0, 1.0, 2.0, 7.0], [-7.0, -7.0, 7.0, 0.0]])  # amax 7 in both rows: scale 1
    payload = encode(x, "int4")
    assert payload[:4].tolist() == [0x87, 0xE9, 0x00, 0x7E]  # level + 7, element 2i in the low nibble
    assert struct.unpack("<2e", payload[4:8].numpy().tobytes()) == (1.0, 1.0)
    assert payload.numel() == 8 and torch.equal(decode(payload, "int4", 2, 4, torch.float32), x)


def test_int8_payload_is_signed_data_then_fp16_scales():
    x = torch.tensor([[-127.0, 0.0, 63.5, 1.0], [127.0, -63.5, 0.0, 31.75]])
    payload = encode(x, "int8", "per_channel", group_size=2)  # one scale per column over both rows
    assert payload[:8].view(torch.int8).tolist() == [-127, 0, 127, 4, 127, -127, 0, 127]
    assert struct.unpack("<4e", payload[8:16].numpy().tobytes()) == (1.0, 0.5, 0.5, 0.25)
    assert payload.numel() == 16 and torch.equal(decode(payload, "int8", 2, 4, torch.float32, "per_channel", 2), x)


def test_the_wire_codec_is_the_kv_pools_codec():
    """A per_token chunk of head_dim columns encodes to exactly the pool's codes and scales (`KVCodec`)."""
    from sage_infer.core.kv_schema import KVDtype
    from sage_infer.quantization.kv_codec import KVCodec

    x = kv_like(torch.bfloat16)
    for fmt in LOSSY:
        codes, scales = KVCodec(KVDtype(fmt), COLS).encode(x)
        assert torch.equal(encode(x, fmt), torch.cat((codes.reshape(-1), scales.view(torch.uint8).reshape(-1))))


def test_fp8_payload_holds_the_scaled_bytes_and_amax_scale():
    x = torch.tensor([[448.0 * 3, -1.5 * 3, 0.0, 3.0]])
    payload = encode(x, "fp8_e4m3")
    assert torch.equal(payload[:4].view(torch.float8_e4m3fn).float(), torch.tensor([448.0, -1.5, 0.0, 1.0]))
    assert struct.unpack("<e", payload[4:6].numpy().tobytes())[0] == 3.0


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_decode_matches_torch_cast_for_every_code(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    payload = torch.cat([codes, torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)])  # one row, scale 1
    y = decode(payload, fmt, 1, 256, torch.float32)[0]
    ref = codes.view(FP8[fmt]).float()
    finite = torch.isfinite(ref)
    assert torch.equal(y[finite], ref[finite])


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_saturates_through_the_scale(fmt):
    x = torch.tensor([[1e6, -1.5e7, 1.0, 5e-3], [1.2e7, 2.0, -1e7, 0.0]])  # far beyond every fp8 range
    y = round_trip(x, fmt)
    assert torch.isfinite(y).all()
    assert y[0, 1].item() == pytest.approx(-1.5e7, rel=1e-3) and y[1, 0].item() == pytest.approx(1.2e7, rel=1e-3)
    assert (((y - x).abs()) <= error_bound(fmt, x)).all()
    # past fp16 scale * fp8_max a group saturates, still finite
    assert torch.isfinite(round_trip(torch.tensor([[1e30, -1e30, 1.0, 0.0]]), fmt)).all()


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_tiny_values_keep_a_finite_scale(fmt):
    x = torch.tensor([[1e-40, -3e-41, 0.0, 1e-39]])  # fp32 subnormals: amax / fp8_max underflows
    assert torch.isfinite(round_trip(x, fmt)).all()


@pytest.mark.parametrize("granularity,group_size", [("per_token", None), ("per_token", 32), ("per_channel", 8),
                                                    ("per_channel", None)])
@pytest.mark.parametrize("fmt", LOSSY)
def test_row_blocks_convert_like_one_block(monkeypatch, fmt, granularity, group_size):
    x = kv_like()
    whole = encode(x, fmt, granularity, group_size)
    monkeypatch.setattr(converter, "_CPU_BLOCK_ELEMS", 3 * COLS)  # 3 rows: blocks cut groups unless rounded
    num_blocks = len(converter._row_blocks(fmt, ROWS, COLS, granularity, group_size, x.device))
    assert num_blocks == 1 if (granularity, group_size) == ("per_channel", None) else num_blocks > 1
    assert torch.equal(encode(x, fmt, granularity, group_size), whole)
    y = decode(whole, fmt, ROWS, COLS, x.dtype, granularity, group_size)
    monkeypatch.setattr(converter, "_CPU_BLOCK_ELEMS", 1 << 30)
    assert torch.equal(y, decode(whole, fmt, ROWS, COLS, x.dtype, granularity, group_size))


def test_int4_row_blocks_keep_whole_bytes_with_odd_cols(monkeypatch):
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    whole = encode(x, "int4")
    monkeypatch.setattr(converter, "_CPU_BLOCK_ELEMS", 5)  # one row of 5 values is half a byte short
    assert converter._row_blocks("int4", 6, 5, "per_token", None, x.device) == [(0, 2), (2, 4), (4, 6)]
    assert torch.equal(encode(x, "int4"), whole)
    assert torch.equal(decode(whole, "int4", 6, 5, torch.float32), round_trip(x, "int4"))


@pytest.mark.parametrize("granularity,group_size", [("per_token", None), ("per_token", 16), ("per_channel", None),
                                                    ("per_channel", 8)])
@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_payload_size_is_encoded_nbytes(fmt, granularity, group_size):
    x = kv_like(torch.bfloat16, rows=16, cols=64)
    assert encode(x, fmt, granularity, group_size).numel() == encoded_nbytes(fmt, 16, 64, granularity, group_size)


def test_encoded_nbytes_by_hand():
    assert encoded_nbytes("fp16", 4096, 128) == 4096 * 128 * 2
    assert encoded_nbytes("fp8_e5m2", 4096, 128) == 4096 * 128 + 4096 * 2
    assert encoded_nbytes("int8", 4096, 128, group_size=32) == 4096 * 128 + 4096 * 4 * 2
    assert encoded_nbytes("int4", 4096, 128, "per_channel") == 4096 * 64 + 128 * 2
    assert encoded_nbytes("int4", 4096, 128, "per_channel", 256) == 4096 * 64 + 16 * 128 * 2


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_encode_writes_into_out(fmt):
    x = kv_like()
    out = torch.full((encoded_nbytes(fmt, ROWS, COLS),), 0xAB, dtype=torch.uint8)
    assert encode(x, fmt, out=out) is out
    assert torch.equal(out, encode(x, fmt))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3", "int4"])
def test_encode_into_an_unaligned_slice(fmt):
    x = kv_like()
    n = encoded_nbytes(fmt, ROWS, COLS)
    buf = torch.zeros(n + 3, dtype=torch.uint8)
    encode(x, fmt, out=buf[3:])
    assert torch.equal(buf[3:], encode(x, fmt)) and buf[:3].tolist() == [0, 0, 0]
    assert torch.equal(decode(buf[3:], fmt, ROWS, COLS, x.dtype), round_trip(x, fmt))


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_decode_writes_into_out(fmt):
    x = kv_like()
    out = torch.empty_like(x)
    assert decode(encode(x, fmt), fmt, ROWS, COLS, x.dtype, out=out) is out
    assert torch.equal(out, round_trip(x, fmt))


def test_decode_into_a_non_contiguous_cache_slice():
    x = kv_like()
    cache = torch.zeros(COLS, ROWS, dtype=torch.float16)
    decode(encode(x, "int8"), "int8", ROWS, COLS, torch.float16, out=cache.t())
    assert torch.equal(cache.t(), round_trip(x, "int8"))


def test_non_contiguous_input_encodes_like_its_copy():
    x = kv_like(cols=ROWS, rows=COLS).t()
    assert torch.equal(encode(x, "int4", "per_channel"), encode(x.contiguous(), "int4", "per_channel"))


def test_reconstruction_error_reports_compression_and_error():
    x = kv_like()
    r = reconstruction_error(x, "int8", group_size=32)
    assert (r.fmt, r.granularity) == ("int8", "per_token")
    assert r.compression == pytest.approx(ROWS * COLS * 2 / encoded_nbytes("int8", ROWS, COLS, group_size=32))
    assert 0 < r.mean_abs <= r.max_abs and 0 < r.rel_rmse < 0.01
    assert reconstruction_error(x, "int4").rel_rmse > r.rel_rmse


@pytest.mark.parametrize("call,match", [
    (lambda: encode(kv_like(), "int3"), "unknown wire format 'int3'; valid: fp32, fp16, bf16, fp8_e4m3"),
    (lambda: encode(kv_like(), "int8", "per_head"), "unknown granularity 'per_head'; valid: per_token, per_channel"),
    (lambda: encode(kv_like(), "int8", group_size=48), r"group_size 48 must be positive and divide cols \(128\)"),
    (lambda: encode(kv_like(), "int8", "per_channel", 48), r"divide rows \(64\) for per_channel"),
    (lambda: encode(kv_like(), "fp8_e4m3", group_size=0), "group_size 0 must be positive"),
    (lambda: encode(torch.zeros(3, 5), "int4"), "rows \\* cols must be even, got 3 \\* 5"),
    (lambda: encode(torch.zeros(8), "int8"), r"2-D \[rows, cols\] tensor, got shape \(8,\)"),
    (lambda: encode(torch.zeros(2, 4, dtype=torch.int32), "int8"), "float32, float16 or bfloat16, got torch.int32"),
    (lambda: encode(kv_like(), "int8", out=torch.empty(10, dtype=torch.uint8)), "out must be a 1-D uint8 tensor of"),
    (lambda: decode(torch.zeros(100, dtype=torch.uint8), "int8", 4, 8, torch.float16),
     "payload has 100 bytes, int8 per_token \\[4, 8\\] needs 40"),
    (lambda: decode(torch.zeros(40, dtype=torch.uint8), "int8", 4, 8, torch.int8), "dtype must be float32"),
    (lambda: decode(torch.zeros(40, dtype=torch.uint8), "int8", 4, 8, torch.float16, out=torch.empty(8, 4)),
     r"out must be \[4, 8\] torch.float16"),
    (lambda: encoded_nbytes("fp16", 0, 128), "must be non-empty"),
    (lambda: is_lossless("fp64"), "unknown wire format 'fp64'"),
])
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", WIRE_FORMATS)
def test_cuda_payload_decodes_on_cpu(fmt):
    x = kv_like()
    payload = encode(x.cuda(), fmt, group_size=32)
    assert payload.is_cuda and payload.numel() == encoded_nbytes(fmt, ROWS, COLS, group_size=32)
    y_cpu = decode(payload.cpu(), fmt, ROWS, COLS, x.dtype, group_size=32)
    assert ((y_cpu.float() - x.float()).abs() <= error_bound(fmt, x, group_size=32)).all()
    assert torch.equal(decode(payload, fmt, ROWS, COLS, x.dtype, group_size=32).cpu(), y_cpu)
