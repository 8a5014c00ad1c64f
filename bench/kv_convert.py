"""KV format conversion speed and error: the codec's C++ kernel, the PyTorch codec and a raw copy, side by side.

    python bench/kv_convert.py --sizes 1MiB,16MiB --threads 2 --json out/kv_convert.json

GB/s is source (fp16 or bf16, `--dtype`) bytes over the median time of `--repeats` runs, encoding into and
decoding into preallocated buffers (`out=`), as the transport engine does. Per format:

- `kernel` (`converter.encode` / `decode` where csrc/kv_codec.cpp runs) and `+crc` (`encode_checksummed`: the
  payload's CRC32C computed in the encoding pass, what the transport sends with);
- `torch`: the same calls with ``SAGE_KV_CODEC=torch`` (the PyTorch codec, the kernel's reference), `+crc` adding
  the `crc32c` package over the payload;
- the peers: a copy of the source bytes into a preallocated buffer (`copy`), and that copy followed by the
  package's CRC32C of it (`copy+crc`, what an unconverted checksummed chunk costs);
- `enc/copy`, `dec/copy`: the kernel's ratios to the copy; `+crc/copy+crc`: checksummed encoding's to the
  checksummed copy.

Then the share of inference time the conversion takes, for a stated model (`--model-*`, default the
Qwen2.5-0.5B shape: 24 layers x 2 KV heads x head_dim 64 in bf16 = 12,288 bytes of KV per token) and its
measured speeds (`--prefill-tok-s`, `--decode-step-ms`): a prefill/decode transfer encodes every prompt token
on the prefill side and decodes it on the decode side (`prefill %`: that time over the prompt's prefill time);
a decode step that offloads its new token's KV converts one token per sequence (`step %`, at `--batch`).
Prints a table and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import crc32c
import torch
from pydantic import ByteSize, TypeAdapter

from sage_infer.core.dtypes import FLOAT_DTYPES
from sage_infer.quantization import kv_codec_kernel
from sage_infer.transport.format import (
    WIRE_FORMATS,
    decode,
    encode,
    encode_checksummed,
    encoded_nbytes,
    is_lossless,
    reconstruction_error,
)

COLS = 128  # head_dim
STAT = statistics.median  # --stat min: the best run, for a machine shared with other work


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm: fault pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return STAT(times)


def kv_chunk(nbytes: int, seed: int = 0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[rows, 128] of `dtype` with a per-channel spread and a few outlier channels, like a K cache."""
    g = torch.Generator().manual_seed(seed)
    rows = nbytes // (COLS * 2)
    channel_scale = torch.rand(COLS, generator=g).mul_(2).add_(0.1)
    channel_scale[:4] *= 20
    return (torch.randn(rows, COLS, generator=g) * channel_scale).to(dtype)


def codec_seconds(x: torch.Tensor, fmt: str, granularity: str, repeats: int) -> dict:
    """encode, encode + CRC32C and decode seconds of the codec in use (the kernel, or the PyTorch codec under
    SAGE_KV_CODEC=torch)."""
    rows, cols = x.shape
    payload = torch.empty(encoded_nbytes(fmt, rows, cols, granularity), dtype=torch.uint8)
    decoded = torch.empty_like(x)
    return {
        "enc": median_seconds(lambda: encode(x, fmt, granularity, out=payload), repeats),
        "enc_crc": median_seconds(lambda: encode_checksummed(x, fmt, granularity, out=payload), repeats),
        "dec": median_seconds(lambda: decode(payload, fmt, rows, cols, x.dtype, granularity, out=decoded), repeats),
    }


def measure(x: torch.Tensor, fmt: str, granularity: str, repeats: int) -> dict:
    decoded = torch.empty_like(x)
    src = x.numel() * x.element_size()
    copy_s = median_seconds(lambda: decoded.copy_(x), repeats)
    flat = decoded.view(-1).view(torch.uint8).numpy()
    copy_crc_s = median_seconds(lambda: (decoded.copy_(x), crc32c.crc32c(flat)), repeats)
    kernel = kv_codec_kernel.unavailable() is None
    timed = {"kernel": codec_seconds(x, fmt, granularity, repeats)} if kernel else {}
    os.environ[kv_codec_kernel.CODEC_ENV] = "torch"
    try:
        timed["torch"] = codec_seconds(x, fmt, granularity, max(3, repeats // 4))
    finally:
        os.environ.pop(kv_codec_kernel.CODEC_ENV)
    err = reconstruction_error(x, fmt, granularity)
    result = {"fmt": fmt, "granularity": granularity, "bytes": src, "shape": list(x.shape),
              "copy_gb_s": src / copy_s / 1e9, "copy_crc_gb_s": src / copy_crc_s / 1e9,
              "compression": err.compression, "rel_rmse": err.rel_rmse, "max_abs": err.max_abs}
    for codec, secs in timed.items():
        for op, s in secs.items():
            result[f"{codec}_{op}_gb_s"] = src / s / 1e9
            result[f"{codec}_{op}_us"] = s * 1e6
    return result


def inference_share(r: dict, args: argparse.Namespace) -> dict:
    """Conversion time as a share of the stated model's prefill (encode + decode of every prompt token) and of one
    decode step that converts its new token's KV (`args.batch` sequences)."""
    codec = "kernel" if "kernel_enc_crc_gb_s" in r else "torch"
    per_token = args.model_kv_bytes_per_token
    enc_s = per_token / (r[f"{codec}_enc_crc_gb_s"] * 1e9)
    dec_s = per_token / (r[f"{codec}_dec_gb_s"] * 1e9)
    return {"codec": codec, "prefill_share": (enc_s + dec_s) * args.prefill_tok_s,
            "decode_step_share": enc_s * args.batch / (args.decode_step_ms / 1e3)}


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"{'size':>6} {'format':>13} {'copy':>6} {'copy+crc':>8} {'k enc':>6} {'k +crc':>6} {'k dec':>6} "
          f"{'t enc':>6} {'t +crc':>6} {'t dec':>6} {'enc/copy':>8} {'+crc/copy+crc':>13} {'dec/copy':>8} "
          f"{'prefill %':>9} {'step %':>6} {'ratio':>6} {'rel_rmse':>9}")
    for r in results:
        k = {op: r.get(f"kernel_{op}_gb_s", float("nan")) for op in ("enc", "enc_crc", "dec")}
        t = {op: r[f"torch_{op}_gb_s"] for op in ("enc", "enc_crc", "dec")}
        share = r["share"]
        print(f"{r['bytes'] / 2**20:>4.0f}Mi {r['fmt']:>13} {r['copy_gb_s']:>6.2f} {r['copy_crc_gb_s']:>8.2f} "
              f"{k['enc']:>6.2f} {k['enc_crc']:>6.2f} {k['dec']:>6.2f} {t['enc']:>6.2f} {t['enc_crc']:>6.2f} "
              f"{t['dec']:>6.2f} {k['enc'] / r['copy_gb_s']:>8.2f} {k['enc_crc'] / r['copy_crc_gb_s']:>13.2f} "
              f"{k['dec'] / r['copy_gb_s']:>8.2f} "
              f"{100 * share['prefill_share']:>9.2f} {100 * share['decode_step_share']:>6.3f} "
              f"{r['compression']:>6.2f} {r['rel_rmse']:>9.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1MiB,16MiB")
    parser.add_argument("--formats", default=",".join(f for f in WIRE_FORMATS if not is_lossless(f)))
    parser.add_argument("--granularity", default="per_token")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="the KV's dtype before encoding")
    parser.add_argument("--model-name", default="Qwen2.5-0.5B shape, bf16 KV")
    parser.add_argument("--model-kv-bytes-per-token", type=int, default=24 * 2 * 2 * 64 * 2)
    parser.add_argument("--prefill-tok-s", type=float, default=256.0, help="the model's prefill speed here")
    parser.add_argument("--decode-step-ms", type=float, default=54.0, help="one decode step of the model here")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the decode step")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in args.sizes.split(",")]
    results = []
    for size in sizes:
        for fmt in args.formats.split(","):
            r = measure(kv_chunk(size, dtype=FLOAT_DTYPES[args.dtype]), fmt, args.granularity, args.repeats)
            r["share"] = inference_share(r, args)
            results.append(r)
    load = os.getloadavg()
    print(f"{args.dtype} [rows, {COLS}] {args.granularity}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.stat} of {args.repeats}, load average {load[0]:.2f}; GB/s of source KV (k: kernel "
          f"{kv_codec_kernel.unavailable() or 'in use'}, t: PyTorch codec); shares: {args.model_name}, "
          f"{args.model_kv_bytes_per_token} B/token, prefill {args.prefill_tok_s:g} tok/s, decode step "
          f"{args.decode_step_ms:g} ms x {args.batch}")
    print_table(results, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats, "dtype": args.dtype,
                "stat": args.stat, "load_average": load, "model": args.model_name,
                "model_kv_bytes_per_token": args.model_kv_bytes_per_token, "prefill_tok_s": args.prefill_tok_s,
                "decode_step_ms": args.decode_step_ms, "batch": args.batch}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
