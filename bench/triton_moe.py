"""The Triton grouped experts (`sage_infer/layers/triton_moe.py`) against the per-expert loop on a CUDA GPU: one MoE
layer of Qwen3-30B-A3B's shape (hidden 2048, 128 experts x 768, top 8; random weights and routing), bf16, at a few
step sizes (tokens per step: decode batches and a prefill chunk), each path's median time over `--iters` runs
(CUDA events) and the largest difference of their outputs (relative to the largest output).

    python bench/triton_moe.py --json out/triton_moe.json
    python bench/triton_moe.py --tokens 1 8 64 512 --iters 20
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sage_infer.layers.moe import FusedExperts, group_by_expert, route, run_grouped
from sage_infer.layers.triton_moe import swiglu_experts


def timed(fn, iters: int) -> float:
    """Median milliseconds of `fn()` over `iters` runs after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(experts: FusedExperts, tokens: int, top_k: int, iters: int) -> dict:
    """Both paths on one step of `tokens` random rows and routing."""
    device, dtype = experts.gate_up_proj.device, experts.gate_up_proj.dtype
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    x = torch.randn(tokens, experts.hidden_size, device=device, dtype=dtype)
    weights, ids = route(torch.randn(tokens, experts.num_experts, device=device), top_k, renormalize=True)
    weights = weights.to(dtype)
    groups = group_by_expert(ids, experts.num_experts)
    with torch.no_grad():
        loop = run_grouped(x, weights, groups, experts.expert)
        fused = swiglu_experts(x, weights, groups, gate_up, down)
        diff = float((fused.float() - loop.float()).abs().max() / loop.float().abs().max())
        loop_ms = timed(lambda: run_grouped(x, weights, groups, experts.expert), iters)
        triton_ms = timed(lambda: swiglu_experts(x, weights, groups, gate_up, down), iters)
    return dict(tokens=tokens, active_experts=len(groups.spans), loop_ms=round(loop_ms, 4),
                triton_ms=round(triton_ms, 4), speedup=round(loop_ms / triton_ms, 2), max_rel_diff=diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/triton_moe.py times the Triton kernels on a CUDA GPU: no CUDA device here")
    torch.manual_seed(0)
    experts = FusedExperts(args.experts, args.hidden, args.width).to("cuda", torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, args.hidden**-0.5)
        experts.down_proj.normal_(0, args.width**-0.5)
    rows = []
    for tokens in args.tokens:
        row = measure(experts, tokens, args.top_k, args.iters)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), shape=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
