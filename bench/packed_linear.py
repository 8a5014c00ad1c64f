"""bf16 linear layers on a CPU: torch's bf16 product against `PackedLinear` (oneDNN's packed bf16 where this
CPU packs bf16; else the fp32 copy it falls back to), at the 0.5B shape's layer sizes and 1-512 rows.

    python bench/packed_linear.py [--threads 2] [--json out/packed_linear.json]

Prints ms per product and the ratio torch ÷ PackedLinear (above 1: PackedLinear is faster); writes JSON.
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
from bench.flash_attention import best  # noqa: E402
from sage_infer.hal.cpu import read_cpu_model  # noqa: E402
from sage_infer.hal.isa import selected_level  # noqa: E402
from sage_infer.layers.linear import PackedLinear, packing_unavailable  # noqa: E402

# (out, in) of Qwen2.5-0.5B's stacked q/k/v, o, gate/up and down products
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
ROWS = [1, 2, 3, 4, 8, 64, 512]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the table here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    why = packing_unavailable(torch.bfloat16)
    path = "oneDNN packed bf16" if why is None else f"fp32 copies ({why})"
    print(f"CPU {read_cpu_model()[0]} ({platform.machine()}, kernels level {selected_level({})[0]}), "
          f"{args.threads} threads; PackedLinear: {path}")
    print(f"{'out x in':>12} {'rows':>5} {'torch bf16 ms':>14} {'PackedLinear ms':>16} {'torch/packed':>13}")
    rows_out = []
    with torch.inference_mode():
        for n, k in SHAPES:
            layer = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            packed = PackedLinear(layer)
            for m in ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                plain = best(lambda layer=layer, x=x: layer(x), args.repeats) * 1e3
                fast = best(lambda packed=packed, x=x: packed(x), args.repeats) * 1e3
                rows_out.append({"out": n, "in": k, "rows": m, "torch_bf16_ms": round(plain, 4),
                                 "packed_ms": round(fast, 4), "ratio": round(plain / fast, 3)})
                print(f"{f'{n}x{k}':>12} {m:>5} {plain:>14.3f} {fast:>16.3f} {plain / fast:>12.2f}x")
    write_json(Path(args.json) if args.json else None,
               {"cpu": read_cpu_model()[0], "threads": args.threads, "packed_path": path, "rows": rows_out})


if __name__ == "__main__":
    main()
