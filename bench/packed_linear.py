"""bf16 linear layers on a CPU: torch's bf16 product against `PackedLinear` (oneDNN's packed bf16 where this
CPU packs bf16; else the fp32 copy it falls back to, and sage's bf16 rows kernel for few rows), at the 0.5B
shape's layer sizes and 1-512 rows.

    python bench/packed_linear.py [--threads 2] [--json out/packed_linear.json]
    python bench/packed_linear.py --cold-layers 24 [--json out/rows_cold.json]

Prints ms per product of torch's bf16 `F.linear`, of the fp32 copy alone and of `bf16_rows_linear` alone (where
they run here), and of `PackedLinear` (what it picks), with the ratio torch ÷ PackedLinear (above 1: faster);
writes JSON. Those weights stay in the caches between repeats; `--cold-layers N` instead runs the rows kernel
over N layers' distinct weights one after another, as a model's decode step does (24 layers of the 0.5B shape:
716 MB, past any L3), and prints ms per pass over all N, the weight bytes read per second and the ratio to one
row (what a verify step of k + 1 rows costs beside a decode step in these products).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.host_copy import best_seconds as best  # noqa: E402
from sage_infer.hal.cpu import read_cpu_model  # noqa: E402
from sage_infer.hal.isa import selected_level  # noqa: E402
from sage_infer.layers.cpu_kernels import BF16_ROWS_KERNEL_MAX, bf16_rows_linear, kernel_unavailable  # noqa: E402
from sage_infer.layers.linear import PackedLinear, packing_unavailable  # noqa: E402

# (out, in) of Qwen2.5-0.5B's stacked q/k/v, o, gate/up and down products
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 64, 512]


COLD_ROWS = [1, 2, 3, 4, 5, 6, 8, 9, 12]


def cold(layers: int, repeats: int, shapes: list[tuple[int, int]] = SHAPES) -> list[dict]:
    """The rows kernel over `layers` layers' distinct weights of `shapes` in turn, at each of COLD_ROWS: ms per pass
    (best of `repeats`), GB/s of weight read and the ratio to the 1-row pass."""
    weights = [[torch.randn(n, k, dtype=torch.bfloat16) for n, k in shapes] for _ in range(layers)]
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    print(f"rows kernel over {layers} layers' weights ({nbytes / 1e6:.0f} MB), ms per pass over all")
    out, first = [], None
    for m in COLD_ROWS:
        xs = [torch.randn(m, k, dtype=torch.bfloat16) for _, k in shapes]

        def run(xs=xs):
            for layer in weights:
                for w, x in zip(layer, xs):
                    bf16_rows_linear(x, w)

        seconds = best(run, repeats)
        first = first or seconds
        out.append({"rows": m, "ms": round(seconds * 1e3, 3), "gb_s": round(nbytes / seconds / 1e9, 2),
                    "vs_one_row": round(seconds / first, 3)})
        print(f"{m:>5} rows {seconds * 1e3:>9.2f} ms {nbytes / seconds / 1e9:>7.1f} GB/s "
              f"{seconds / first:>6.2f}x one row")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the table here as JSON")
    parser.add_argument("--cold-layers", type=int, default=0,
                        help="time the rows kernel over this many layers' distinct weights instead (0: off)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    why = packing_unavailable(torch.bfloat16)
    path = "oneDNN packed bf16" if why is None else f"fp32 copies ({why})"
    print(f"CPU {read_cpu_model()[0]} ({platform.machine()}, kernels level {selected_level({})[0]}), "
          f"{args.threads} threads; PackedLinear: {path}")
    kernel = kernel_unavailable() is None
    if args.cold_layers > 0:
        if not kernel:
            raise SystemExit(f"--cold-layers: the rows kernel is unavailable here ({kernel_unavailable()})")
        with torch.inference_mode():
            cold_rows = cold(args.cold_layers, args.repeats)
        write_json(Path(args.json) if args.json else None,
                   {"cpu": read_cpu_model()[0], "threads": args.threads, "cold_layers": args.cold_layers,
                    "rows": cold_rows})
        return
    print(f"{'out x in':>12} {'rows':>5} {'torch bf16':>11} {'fp32 copy':>10} {'rows kernel':>12} "
          f"{'PackedLinear':>13} {'torch/packed':>13}   (ms per product)")
    rows_out = []
    with torch.inference_mode():
        for n, k in SHAPES:
            layer = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            weight = layer.weight.detach()
            packed = PackedLinear(layer)
            for m in ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                plain = best(lambda layer=layer, x=x: layer(x), args.repeats) * 1e3
                fast = best(lambda packed=packed, x=x: packed(x), args.repeats) * 1e3
                copy = rows = None
                if packed.weight_bf16 is not None:  # the fp32-copy path: time its two parts alone
                    copy = best(lambda packed=packed, x=x: torch.ops.mkldnn._linear_pointwise(
                        x.float(), packed.packed, None, "none", [], "").to(torch.bfloat16), args.repeats) * 1e3
                if kernel and m <= BF16_ROWS_KERNEL_MAX:
                    rows = best(lambda weight=weight, x=x: bf16_rows_linear(x, weight), args.repeats) * 1e3
                rows_out.append({"out": n, "in": k, "rows": m, "torch_bf16_ms": round(plain, 4),
                                 "fp32_copy_ms": None if copy is None else round(copy, 4),
                                 "rows_kernel_ms": None if rows is None else round(rows, 4),
                                 "packed_ms": round(fast, 4), "ratio": round(plain / fast, 3)})
                cells = [f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}" for v, w in ((copy, 10), (rows, 12))]
                print(f"{f'{n}x{k}':>12} {m:>5} {plain:>11.3f} {cells[0]} {cells[1]} {fast:>13.3f} "
                      f"{plain / fast:>12.2f}x")
    write_json(Path(args.json) if args.json else None,
               {"cpu": read_cpu_model()[0], "threads": args.threads, "packed_path": path, "rows": rows_out})


if __name__ == "__main__":
    main()
