"""torch.compile (Inductor on CPU, weight freezing) against sage's eager paths, on the work of one
decoder layer outside attention: input RMSNorm, the stacked q/k/v projection, o_proj and the residual
add, the second RMSNorm, gate/up, silu(gate) * up, down_proj and the residual add.

    python bench/compile_glue.py --model qwen3-11m        # fp32: hidden 384, inter 1024, 6/2 heads
    python bench/compile_glue.py --model qwen2.5-0.5b     # bf16: hidden 896, inter 4864, 14/2 heads

Three versions of the same module at 1, 64 and 2,048 rows (a batch-1 decode step, a 64-row decode
step, a prefill step): plain PyTorch ops on `nn.Linear` (sage's `model.linear: torch` +
`model.elementwise: torch`), sage's default path (oneDNN-packed linears and the fused C++ ops), and
`torch.compile` of the plain module with `torch._inductor.config.freezing` (Inductor packs the
weights itself and fuses the elementwise ops). Best of N calls, weights cache-hot (one layer).
Attention is left out: it is sage's own paged kernel either way.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from sage_infer.layers import cpu_kernels as kernels  # noqa: E402
from sage_infer.layers.linear import PackedLinear  # noqa: E402
from sage_infer.layers.norm import RMSNorm  # noqa: E402

SHAPES = {  # hidden, intermediate, query heads, KV heads, head_dim, dtype
    "qwen3-11m": (384, 1024, 6, 2, 64, torch.float32),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, torch.bfloat16),
}


class Glue(nn.Module):
    """The plain version; the attention output is stood in for by the q rows of the projection."""

    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_width = heads * head_dim
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(self.q_width, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm1(x))
        x = x + self.o(qkv[:, : self.q_width])
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class SageGlue(nn.Module):
    """The same work the way the engine runs it by default: packed linears, fused C++ passes."""

    def __init__(self, plain: Glue) -> None:
        super().__init__()
        self.plain = plain
        self.qkv, self.o, self.gate_up, self.down = (PackedLinear(m) for m in
                                                     (plain.qkv, plain.o, plain.gate_up, plain.down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.plain
        residual = x.clone()  # the engine updates its residual stream in place
        qkv = self.qkv(kernels.rms_norm(x, p.norm1.weight, p.norm1.eps))
        h = kernels.add_rms_norm_(self.o(qkv[:, : p.q_width]), residual, p.norm2.weight, p.norm2.eps)
        return residual + self.down(kernels.silu_mul(self.gate_up(h)))


def best_ms(fn, x: torch.Tensor, calls: int) -> float:
    for _ in range(3):
        fn(x)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if why := kernels.kernel_unavailable():
        print(f"error: the fused ops are unavailable: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    *shape, dtype = SHAPES[args.model]
    torch.manual_seed(0)
    plain = Glue(*shape).to(dtype).eval().requires_grad_(False)
    sage = SageGlue(plain)
    compiled = torch.compile(plain)
    rows_report = []
    print(f"{args.model} {str(dtype).removeprefix('torch.')}, {args.threads} threads, best of N calls, ms")
    print(f"{'rows':>6} {'torch':>9} {'sage':>9} {'inductor':>9} {'inductor/sage':>14} {'compile s':>10} "
          f"{'max diff':>9}")
    with torch.inference_mode():
        for rows in (1, 64, 2048):
            x = torch.randn(rows, shape[0], dtype=dtype)
            start = time.perf_counter()
            compiled(x)
            compile_s = time.perf_counter() - start
            calls = 30 if rows < 2048 else 5
            row = {"rows": rows, "torch_ms": best_ms(plain, x, calls), "sage_ms": best_ms(sage, x, calls),
                   "inductor_ms": best_ms(compiled, x, calls), "first_compiled_call_s": compile_s,
                   "max_abs_diff_inductor_vs_sage": (compiled(x).float() - sage(x).float()).abs().max().item()}
            rows_report.append(row)
            print(f"{rows:>6} {row['torch_ms']:>9.3f} {row['sage_ms']:>9.3f} {row['inductor_ms']:>9.3f} "
                  f"{row['inductor_ms'] / row['sage_ms']:>13.2f}x {compile_s:>10.1f} "
                  f"{row['max_abs_diff_inductor_vs_sage']:>9.1e}", flush=True)
    write_json(args.json, {"model": args.model, "dtype": str(dtype), "threads": args.threads,
                           "torch": torch.__version__, "rows": rows_report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
