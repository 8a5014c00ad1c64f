"""Where the grouped-experts kernel stops paying, per weight layout: a step of T rows through the kernel (one call,
every active expert) against one PyTorch product per expert (oneDNN / MKL GEMMs) on the same weights, taking turns.

    python bench/moe_rows.py --json out/moe_rows.json
    python bench/moe_rows.py --layouts clamped-bf16 --shape 32,2880,2880,4 --rows 1,2,4,8,64

Layouts (random weights of `--shape` E,H,I,K: experts, hidden, expert width, top-k):

- `stacked-fp32` / `stacked-bf16`: `FusedExperts` on their stacked [E, 2I, H] / [E, H, I] weights (the kernel's plain
  path: a dot product over 4 rows at a time, bf16 widened to fp32 as it is read);
- `clamped-fp32` / `clamped-bf16`: gpt-oss's `ClampedSwigluExperts` (biases, clamped SwiGLU), plain too;
- `mxfp4-fp32` / `mxfp4-bf16`: the same experts holding MXFP4 weights (random codes and exponents), which the kernel
  reads in place and the per-expert products dequantize one expert at a time.

Each row count is timed on a fresh random routing (distinct experts per token) with the kernel forced at any rows
per expert; `max_pairs` is the most pairs an expert got, what `GroupedExpertWeights.max_rows` is compared with.
`per_expert / kernel` above 1: the kernel is faster. The engine's limits (`PLAIN_FP32_ROWS`, `PLAIN_BF16_ROWS`,
`GROUPED_KERNEL_ROWS`) are set from these crossovers; packed bf16 experts (the engine's bf16 layout) are measured
on a model's blocks by `bench/moe_decode.py --batches`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import sage_isa  # noqa: E402

LAYOUTS = ("stacked-fp32", "stacked-bf16", "clamped-fp32", "clamped-bf16", "mxfp4-fp32", "mxfp4-bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--shape", default="16,2048,768,8", help="E,H,I,K (default: Qwen3-30B-A3B's expert width, "
                        "16 of its 128 experts)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="comma-separated step sizes T")
    parser.add_argument("--iters", type=int, default=5, help="timed turns per row count (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.layouts = [name for name in args.layouts.split(",") if name]
    if not args.layouts or any(name not in LAYOUTS for name in args.layouts):
        parser.error(f"--layouts takes {', '.join(LAYOUTS)}, not {','.join(args.layouts)!r}")
    try:
        args.shape = tuple(int(v) for v in args.shape.split(","))
        args.rows = [int(v) for v in args.rows.split(",") if v]
    except ValueError:
        parser.error("--shape takes E,H,I,K and --rows T1,T2,... as integers")
    if len(args.shape) != 4 or min(args.shape) < 1 or args.shape[3] > args.shape[0] or not args.rows:
        parser.error(f"--shape takes E,H,I,K with K <= E, not {args.shape}")
    if any(name.startswith("mxfp4") for name in args.layouts) and (args.shape[1] % 32 or args.shape[2] % 32):
        parser.error("the mxfp4 layouts need H and I in multiples of 32 (MXFP4's blocks)")
    return args


def make_experts(layout: str, shape: tuple[int, int, int, int]) -> torch.nn.Module:
    from sage_infer.layers.moe import FusedExperts
    from sage_infer.layers.moe_swiglu import ClampedSwigluExperts

    num_experts, hidden, inter, _ = shape
    kind, dtype = layout.split("-")
    torch.manual_seed(0)
    experts = (FusedExperts(num_experts, hidden, inter) if kind == "stacked"
               else ClampedSwigluExperts(num_experts, hidden, inter, alpha=1.702, limit=7.0))
    if kind == "mxfp4":
        experts.keep_mxfp4()
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if param.dtype == torch.uint8:  # FP4 codes, or exponents near 2^-6 (weights of about 0.02)
                param.copy_(torch.randint(0, 256, param.shape, dtype=torch.uint8) if name.endswith("_blocks")
                            else torch.randint(118, 124, param.shape, dtype=torch.uint8))
            else:
                param.normal_(0, 0.02)
    experts = experts.requires_grad_(False).to(DTYPES[dtype])
    experts.kernel_rows = 1 << 30  # the kernel at any rows per expert: the comparison sets the limit
    return experts


def time_rows(experts: torch.nn.Module, shape: tuple[int, int, int, int], rows: int, iters: int) -> dict:
    """Median ms of the kernel and of the per-expert products on steps of `rows` rows, taking turns."""
    from sage_infer.layers.moe import group_by_expert, run_grouped

    num_experts, hidden, _, top_k = shape
    kernel = experts.grouped_kernel()
    dtype = experts.gate_up_proj_bias.dtype if hasattr(experts, "gate_up_proj_bias") else experts.gate_up_proj.dtype
    gen = torch.Generator().manual_seed(rows)
    times: dict[str, list[float]] = {"kernel": [], "per_expert": []}
    most = 0
    for i in range(iters + 1):
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)])
        weights = torch.softmax(torch.randn(rows, top_k, generator=gen), dim=-1).to(dtype)
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        groups = group_by_expert(ids, num_experts)
        most = max(most, max(groups.counts))
        paths = {"kernel": (None, kernel), "per_expert": (experts.expert, None)}
        for name in (list(paths) if i % 2 == 0 else list(paths)[::-1]):
            start = time.perf_counter()
            run_grouped(x, weights, groups, *paths[name])
            if i:  # the first turn warms up
                times[name].append(time.perf_counter() - start)
    kernel_ms, per_expert_ms = (statistics.median(times[name]) * 1e3 for name in ("kernel", "per_expert"))
    return {"rows": rows, "max_pairs": most, "mean_pairs": rows * top_k / num_experts, "kernel_ms": kernel_ms,
            "per_expert_ms": per_expert_ms, "per_expert_over_kernel": per_expert_ms / kernel_ms}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from sage_infer.layers.moe_grouped import GroupedExpertWeights

    report = {"shape": dict(zip(("experts", "hidden", "inter", "top_k"), args.shape)), "threads": args.threads,
              "isa": sage_isa(), "loadavg": list(os.getloadavg()), "layouts": {}}
    print(f"E,H,I,K = {args.shape}, {args.threads} threads, kernels {report['isa']}, load {report['loadavg'][0]:.1f}")
    with torch.no_grad():
        for layout in args.layouts:
            experts = make_experts(layout, args.shape)
            kernel = experts.grouped_kernel()
            if not isinstance(kernel, GroupedExpertWeights):
                print(f"  {layout}: the kernel does not run it here ({kernel})")
                report["layouts"][layout] = {"skipped": kernel}
                continue
            results = [time_rows(experts, args.shape, rows, args.iters) for rows in args.rows]
            report["layouts"][layout] = {"results": results}
            for r in results:
                print(f"  {layout:12} T {r['rows']:5d} (pairs an expert: max {r['max_pairs']:4d}, mean "
                      f"{r['mean_pairs']:6.1f}): kernel {r['kernel_ms']:8.2f} ms, per-expert {r['per_expert_ms']:8.2f} "
                      f"ms, per-expert / kernel {r['per_expert_over_kernel']:.2f}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
