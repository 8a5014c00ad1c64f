"""Weight-only quantized linear kernels on CPU against the bf16 ones, one layer at a time.

    python bench/quant_linear.py --rows 1,32 --threads 2 --json out/quant_linear.json
    python bench/quant_linear.py --torchao /tmp/torchao_pkg     # also torchao 0.18's CPU paths

Shapes are Qwen2.5-0.5B's linear layers (in -> out): 896->896 (q, o), 896->128 (k, v),
896->4864 (gate, up), 4864->896 (down). Each kernel cycles through enough copies of its weight
that they add up to `--footprint` bytes of bf16 weights (default 512 MiB, about the 0.5B model's
linears), so every call reads its weight from DRAM as a decode step does, not from the 32 MiB
L3. A repeat is one pass over the copies; the table shows the median µs per call over
`--repeats` passes, the weight bytes moved per second, and the speed-up against the prepacked
bf16 oneDNN linear (`PackedLinear`, what the engine runs by default on a CPU).

Kernels:
  bf16 F.linear, bf16 packed        the unquantized baselines
  w8 ref, w4g128 ref, w4g32 ref     sage's reference path: dequantize the weight, then F.linear
  w8 int8pack                       torch.ops.aten._weight_int8pack_mm (int8 [N, K], bf16 scales [N])
  w4gG int4pack                     torch.ops.aten._weight_int4pack_mm_for_cpu on the weight from
                                    _convert_weight_to_int4pack_for_cpu, group G
  ao w8, ao w4g128                  torchao Int8WeightOnlyConfig / PrototypeInt4WeightOnlyConfig
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sage_infer.layers.linear import PackedLinear  # noqa: E402

SHAPES = {"q/o 896->896": (896, 896), "k/v 896->128": (896, 128), "gate/up 896->4864": (896, 4864),
          "down 4864->896": (4864, 896)}


def int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def int4_group(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 in [-8, 7] per group: (q int8 [N, K], scale [N, K/group])."""
    n, k = w.shape
    grouped = w.view(n, k // group, group)
    scale = grouped.abs().amax(-1).clamp(min=1e-8) / 7.5
    q = torch.round(grouped / scale[..., None]).clamp(-8, 7)
    return q.view(n, k).to(torch.int8), scale


def linear_of(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype).requires_grad_(False)
    layer.weight.copy_(weight)
    return layer


def kernels(w: torch.Tensor, dtype: torch.dtype, torchao: bool) -> dict[str, tuple[Callable, Callable, int]]:
    """name -> (make one copy of the weight, call(x, copy), weight bytes per call)."""
    n, k = w.shape
    wd = w.to(dtype)
    q8, s8 = int8_channel(w)
    s8 = s8.to(dtype)
    out: dict[str, tuple[Callable, Callable, int]] = {
        "bf16 F.linear": (lambda: wd.clone(), lambda x, c: F.linear(x, c), wd.nbytes),
        # packed for one row, as the figures in docs/benchmarks.md ("Packed linear") were taken
        "bf16 packed": (lambda: PackedLinear(linear_of(wd), batch_hint=1), lambda x, c: c(x), wd.nbytes),
        "w8 ref": (lambda: (q8.clone(), s8.clone()),
                   lambda x, c: F.linear(x, c[0].to(x.dtype) * c[1][:, None]), q8.nbytes + s8.nbytes),
        "w8 int8pack": (lambda: (q8.clone(), s8.clone()),
                        lambda x, c: torch.ops.aten._weight_int8pack_mm(x, c[0], c[1]), q8.nbytes + s8.nbytes),
    }
    for group in (128, 32):
        q4, s4 = int4_group(w, group)
        s4 = s4.to(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q4.to(torch.int32) + 8), 1)
        # the kernel computes (q - 8) * scale + zero; symmetric: zero 0. [K/group, N, 2]
        scale_zeros = torch.stack([s4, torch.zeros_like(s4)], -1).transpose(0, 1).contiguous()
        nbytes = packed.nbytes + s4.nbytes
        out[f"w4g{group} ref"] = (
            lambda q4=q4, s4=s4: (q4.clone(), s4.clone()),
            lambda x, c, g=group: F.linear(x, (c[0].view(n, k // g, g).to(x.dtype) * c[1][..., None]).view(n, k)),
            nbytes)
        out[f"w4g{group} int4pack"] = (
            lambda p=packed, sz=scale_zeros: (p.clone(), sz.clone()),
            lambda x, c, g=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, c[0], g, c[1]), nbytes)
    if torchao:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        def ao_copy(config) -> nn.Module:
            layer = linear_of(wd)
            quantize_(layer, config)
            return layer

        out["ao w8"] = (lambda: ao_copy(Int8WeightOnlyConfig()), lambda x, c: c(x), q8.nbytes + s8.nbytes)
        out["ao w4g128"] = (lambda: ao_copy(PrototypeInt4WeightOnlyConfig(group_size=128)), lambda x, c: c(x),
                            k * n // 2 + 2 * 2 * n * k // 128)
    return out


def measure(make: Callable, call: Callable, copies: int, x: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds per call over `repeats` passes through `copies` weight copies; and one output."""
    held = [make() for _ in range(copies)]
    with torch.inference_mode():
        out = call(x, held[0])
        for c in held:  # warm-up pass
            call(x, c)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for c in held:
                call(x, c)
            times.append((time.perf_counter() - start) / copies)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32", help="activation rows (tokens) per call, comma-separated")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--footprint", default=512, type=int, help="MiB of bf16 weights cycled through per kernel")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="which of: " + ", ".join(SHAPES))
    parser.add_argument("--torchao", default=None, help="a directory holding torchao 0.18 (pip install --target)")
    parser.add_argument("--kernels", default=None, help="comma-separated subset of the kernel names (default: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.torchao:
        sys.path.insert(0, args.torchao)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for shape_name in args.shapes.split(","):
        k, n = SHAPES[shape_name]
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        copies = max(1, args.footprint * 2**20 // (n * k * 2))
        for name, (make, call, nbytes) in kernels(w, dtype, bool(args.torchao)).items():
            if args.kernels and name not in args.kernels.split(",") and name != "bf16 packed":
                continue
            for rows in rows_list:
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
                seconds, _ = measure(make, call, copies, x, args.repeats)
                results.append({"shape": shape_name, "in": k, "out": n, "rows": rows, "kernel": name,
                                "us": seconds * 1e6, "weight_bytes": nbytes, "gb_s": nbytes / seconds / 1e9})
                print(f"  {shape_name:18} rows {rows:3} {name:16} {seconds * 1e6:9.1f} us", file=sys.stderr)
    base = {(r["shape"], r["rows"]): r["us"] for r in results if r["kernel"] == "bf16 packed"}
    for r in results:
        r["speedup_vs_bf16_packed"] = base[(r["shape"], r["rows"])] / r["us"]
    print(f"\n{args.dtype} activations, {args.threads} threads, {args.footprint} MiB of bf16 weights cycled per "
          f"kernel, median of {args.repeats} passes; torch {torch.__version__}")
    print(f"| {'shape (in->out)':18} | rows | {'kernel':16} | {'µs':>8} | {'GB/s':>6} | {'vs bf16 packed':>14} |")
    print(f"|{'-' * 20}|-----:|{'-' * 18}|{'-' * 9}:|{'-' * 7}:|{'-' * 15}:|")
    for r in sorted(results, key=lambda r: (list(SHAPES).index(r["shape"]), r["rows"])):
        print(f"| {r['shape']:18} | {r['rows']:4} | {r['kernel']:16} | {r['us']:8.1f} | {r['gb_s']:6.1f} | "
              f"{r['speedup_vs_bf16_packed']:13.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
                                         "footprint_mib": args.footprint, "torch": torch.__version__,
                                         "cpu": platform.processor() or platform.machine(), "results": results},
                                        indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
