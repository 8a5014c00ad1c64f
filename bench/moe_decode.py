"""Batch-1 decode of a mixture-of-experts model against reading its expert weights: how close the engine's
expert products come to the memory bandwidth, and where a MoE layer's time goes.

    python bench/moe_decode.py --model qwen3-30b-a3b-2l --json out/moe_decode.json
    python bench/moe_decode.py --model qwen3-30b-a3b-2l --profile 1,8,64 --iters 20

A batch-1 decode step reads top_k experts (gate, up and down) in each sparse layer: `expert_mb_per_token`.
Measured in one process after every expert and every plain tensor has been used once (a first touch is page
faults, not reading), taking turns, each on a fresh random routing (a new random hidden state, so the experts
read are cold in the caches, as in a real decode; a step's 8 x 9.4 MB per layer do not fit the L3):

- `layer`: the model's MoE blocks as the engine built them (its linears, its elementwise ops) on one row,
  every sparse layer in turn: expert bytes / median time = the layers' expert read rate (routing included);
- `plain read`: the same number of bytes of the same kind of tensors, the top_k experts' gate, up and down
  weights of a random routing in every layer, summed by `torch.sum` (each expert's weights one contiguous
  tensor, read as fp32 words): what reading those bytes costs with nothing else to do;
- `one expert alone`: each expert's products on one row by themselves, every expert once in a random order
  (median): the kernel's read rate without the rest of the layer;
- `decode step`: one 128-token prompt then `--decode-tokens` greedy tokens through `LLM.generate`; the step
  time is (wall - first token) / (tokens - 1), its expert read rate expert bytes / step time (the step also
  reads attention and lm_head weights and runs Python: the whole-step rate is the stricter one).

`read_ratio` = the layer's rate / the plain read's (the target is >= 0.8); `step_ratio` = the step's rate / the
plain read's. `--profile 1,8`: torch.profiler over the MoE blocks at those row counts, the top ops by self CPU time.

The layers run on each expert path of `--experts` in the same turns, the paths' order alternating: `grouped` (the
router, its top-k and all active experts in one kernel call, csrc/moe_experts.cpp's `moe_block`; the engine's path
for every step, except packed bf16 experts at the levels without bf16 dot products, where only steps of up to
`GROUPED_KERNEL_ROWS` pairs per expert take it), `grouped-python` (the same experts' kernel with the router's
product, its top-k, the grouping and the sum of the outputs by PyTorch ops) and `per-expert` (one product per active
expert, two kernel calls each).
The decode step and `--profile` run on the first path of `--experts`.
`--batches 1,8,32,128`: three paths on a step of that many rows (random routing), taking turns: `grouped` with the
kernel forced at any pair count, `per-expert`, and `engine` (the engine's own split: the kernel up to its limit of
pairs per expert, where it has one, and for packed bf16 experts the busier experts on their own oneDNN weights, all
grouped in C++): where the grouped kernel stops paying (the pairs per expert `GROUPED_KERNEL_ROWS` is set by); a
batch of 512 rows is a prefill chunk's step (32 pairs per expert on Qwen3-30B-A3B's 128 experts, top 8).
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
from bench.engine_vs_vllm import DEFAULT_CACHE, sage_isa  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402
from sage_infer.layers.moe import routes_in_kernel, run_block, run_routed  # noqa: E402

KERNEL_STEPS = (run_block, run_routed, routes_in_kernel)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MOE_MODELS = sorted(name for name, spec in MODELS.items() if (spec.arch or "").endswith("moe"))
PROMPT_TOKENS = 128
PATHS = ("grouped", "per-expert", "engine")  # `--batches`
EXPERT_PATHS = ("grouped", "grouped-python", "per-expert")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default=MOE_MODELS[0], choices=MOE_MODELS)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=40, help="timed turns of the layers and of the plain read")
    parser.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens of the whole-step run")
    parser.add_argument("--profile", default="", help="comma-separated row counts (e.g. 1,8,64) to run the MoE blocks "
                        "at under torch.profiler (none by default)")
    parser.add_argument("--experts", default="grouped,per-expert", help="expert paths the layer turns time, "
                        "comma-separated: grouped (one kernel call for the router and all active experts), "
                        "grouped-python (the same experts' kernel, routed and grouped by PyTorch ops), per-expert")
    parser.add_argument("--batches", default="", help="comma-separated decode batch sizes (e.g. 1,8,32,128) to time "
                        "both expert paths at (none by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="where built models are kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.decode_tokens < 2:
        parser.error("--iters must be >= 1 and --decode-tokens >= 2")
    try:
        args.profile = [int(rows) for rows in args.profile.split(",") if rows]
    except ValueError:
        parser.error(f"--profile takes row counts such as 1,8,64, not {args.profile!r}")
    args.experts = tuple(path for path in args.experts.split(",") if path)
    if not args.experts or any(path not in EXPERT_PATHS for path in args.experts):
        parser.error(f"--experts takes {', '.join(EXPERT_PATHS)}, not {','.join(args.experts)!r}")
    try:
        args.batches = [int(rows) for rows in args.batches.split(",") if rows]
    except ValueError:
        parser.error(f"--batches takes batch sizes such as 1,8,32, not {args.batches!r}")
    return args


def use_path(blocks: dict, path: str | None, rows: int | None = None) -> None:
    """The experts of every block on `path` (None: as the engine built them): `grouped` for steps of up to `rows`
    pairs per expert (default `GROUPED_KERNEL_ROWS`), `grouped-python` too with the router's product, its top-k and
    the grouping by PyTorch ops (`run_block`, `run_routed` and the C++ routing declined), `per-expert` never,
    `engine` up to the kernel's own limit (`kernel_rows` None)."""
    from sage_infer.layers import moe

    python = path == "grouped-python"
    moe.run_block, moe.run_routed, moe.routes_in_kernel = (
        (lambda *args: None), (lambda *args: None), (lambda *args: False)) if python else KERNEL_STEPS
    for block in blocks.values():
        if path is not None:
            block.experts.kernel_rows = (None if path == "engine" else
                                         (rows or moe.GROUPED_KERNEL_ROWS) if path.startswith("grouped") else 0)


def expert_weights(model_dir: Path, layers: list[int], num_experts: int, dtype: torch.dtype) -> dict:
    """(layer, expert) -> that expert's gate, up and down weights as one contiguous tensor, read from the
    checkpoint (the plain read's tensors: the engine's own are packed for oneDNN, opaque to torch)."""
    from safetensors import safe_open

    weights = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for layer in layers:
            for e in range(num_experts):
                parts = [f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{name}.weight").to(dtype).reshape(-1)
                         for name in ("gate_proj", "up_proj", "down_proj")]
                weights[layer, e] = torch.cat(parts)
    return weights


def plain_read(tensors: list[torch.Tensor]) -> float:
    """Seconds to sum `tensors` (each read as fp32 words: a pure read of their bytes)."""
    start = time.perf_counter()
    for t in tensors:
        t.view(torch.float32).sum()
    return time.perf_counter() - start


def touch_all(blocks: dict, weights: dict, ops, hidden: int, dtype: torch.dtype) -> None:
    """Run every expert once and read every plain tensor once: a first touch of a weight is page faults and
    allocator work, not reading (a server that has run a while has used every expert)."""
    x = torch.randn(1, hidden).to(dtype)
    for block in blocks.values():
        for e in range(block.experts.num_experts):
            block.experts.expert(e, x, ops)
    plain_read(list(weights.values()))


def expert_alone_s(blocks: dict, ops, hidden: int, dtype: torch.dtype) -> float:
    """Median seconds of one expert's products on one row, every expert of every sparse layer once, in a random
    order (in index order a neighbour's weights often follow in memory, which the prefetchers reward)."""
    x = torch.randn(1, hidden).to(dtype)
    pairs = [(block, e) for block in blocks.values() for e in range(block.experts.num_experts)]
    times = []
    for i in torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1)).tolist():
        block, e = pairs[i]
        start = time.perf_counter()
        block.experts.expert(e, x, ops)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_turns(blocks: dict, weights: dict, ops, hidden: int, dtype: torch.dtype, iters: int, seed: int,
                paths: tuple[str, ...] = ()) -> dict:
    """Median seconds of the MoE blocks on one row and of a plain read of as many expert bytes, taking turns:
    ``layer_s`` for the blocks as built, or with `paths` ``layer_s_<path>`` for each (their order alternating)."""
    from sage_infer.layers.moe import route

    touch_all(blocks, weights, ops, hidden, dtype)
    gen = torch.Generator().manual_seed(seed)
    names = paths or (None,)
    layer_s: dict = {path: [] for path in names}
    read_s = []
    for i in range(iters + 2):  # the first two turns warm up
        times = {}
        for path in (names if i % 2 == 0 else names[::-1]):
            use_path(blocks, path)
            x = torch.randn(1, hidden, generator=gen).to(dtype)  # a fresh routing: cold experts
            start = time.perf_counter()
            for block in blocks.values():
                block(x, ops)
            times[path] = time.perf_counter() - start
        other = torch.randn(1, hidden, generator=gen).to(dtype)  # another routing: cold experts for the read
        picked = [weights[index, e] for index, block in blocks.items()
                  for e in route(block.gate(other), block.top_k, block.renormalize)[1][0].tolist()]
        read = plain_read(picked)
        if i >= 2:
            for path, seconds in times.items():
                layer_s[path].append(seconds)
            read_s.append(read)
    result = {"read_s": statistics.median(read_s), "read_s_min": min(read_s)}
    for path, values in layer_s.items():
        suffix = f"_{path}" if path else ""
        result |= {f"layer_s{suffix}": statistics.median(values), f"layer_s_min{suffix}": min(values)}
    return result


def batch_sweep(blocks: dict, ops, hidden: int, dtype: torch.dtype, batches: list[int], iters: int) -> list[dict]:
    """Median ms of the MoE blocks on a step of each batch size, on each of `PATHS` (`grouped`: the kernel forced at
    any pair count), taking turns; with the most and the mean pairs per active expert."""
    from sage_infer.layers.moe import group_by_expert, route

    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        times: dict = {path: [] for path in PATHS}
        counts = []
        for i in range(iters + 1):
            x = torch.randn(batch, hidden, generator=gen).to(dtype)
            for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                use_path(blocks, path, rows=1 << 30)
                start = time.perf_counter()
                for block in blocks.values():
                    block(x, ops)
                if i:
                    times[path].append(time.perf_counter() - start)
            block = next(iter(blocks.values()))
            groups = group_by_expert(route(block.gate(x), block.top_k, block.renormalize)[1], len(block.expert_tokens))
            counts.append((max(groups.counts), batch * block.top_k / len(groups.spans)))
        grouped, per_expert, engine = (statistics.median(times[path]) * 1e3 for path in PATHS)
        rows.append({"batch": batch, "max_pairs": max(c[0] for c in counts),
                     "mean_pairs": statistics.mean(c[1] for c in counts), "grouped_ms": grouped,
                     "per_expert_ms": per_expert, "engine_ms": engine, "speedup": per_expert / grouped,
                     "engine_speedup": per_expert / engine})
    return rows


def decode_step_s(llm, vocab: int, tokens: int, seed: int) -> float:
    """Seconds per batch-1 decode step: one 128-token prompt, `tokens` greedy tokens, after the first."""
    from sage_infer import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
    start = time.monotonic()
    out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]
    wall = time.monotonic() - start
    return (wall - (out.metrics.first_token_time - start)) / (len(out.outputs[0].token_ids) - 1)


def instrument_kernels() -> None:
    """Wrap sage's C++ kernels the MoE blocks call (pybind: torch.profiler sees no op in them) in `kernel::<name>`
    regions, as bench/profile_engine_step.py does."""
    from sage_infer.layers import cpu_kernels

    if cpu_kernels.kernel_unavailable() is not None:
        return
    kernels = cpu_kernels._module()
    for name in ("small_linear", "silu_mul"):
        def kernel(*args, __f=getattr(kernels, name), __label=f"kernel::{name}", **kwargs):
            with torch.profiler.record_function(__label):
                return __f(*args, **kwargs)

        setattr(kernels, name, kernel)


def profile_blocks(blocks: dict, ops, hidden: int, dtype: torch.dtype, rows: int, iters: int) -> dict:
    """torch.profiler over `iters` passes of the MoE blocks on `rows` random rows: ms per pass, and the top ops
    by self time (the rest of the wall time is Python)."""
    from torch.profiler import ProfilerActivity, profile

    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(iters)]
    for block in blocks.values():
        block(xs[0], ops)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for x in xs:
            for block in blocks.values():
                block(x, ops)
        wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    op_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / iters
    return {"pass_ms": wall * 1e3 / iters, "ops_ms": op_ms,
            "top": [{"op": e.key, "calls": e.count // iters, "self_ms_per_pass": e.self_cpu_time_total / 1e3 / iters}
                    for e in events[:14]]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from sage_infer import LLM
    from sage_infer.layers.moe import SparseMoeBlock

    dtype = DTYPES[args.dtype]
    model_dir = prepare_model(MODELS[args.model], args.model_cache, args.seed)
    llm = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=8, kv_memory="1GiB")
    runner = llm.engine.runner
    cfg = runner.model.config
    layers = runner.model.model.layers
    blocks = {i: layer.mlp for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)}
    first = next(iter(blocks.values()))
    num_experts, top_k, inter = first.experts.num_experts, first.top_k, first.experts.intermediate_size
    element = torch.tensor([], dtype=dtype).element_size()
    expert_bytes = len(blocks) * top_k * 3 * cfg.hidden_size * inter * element
    weights = expert_weights(model_dir, list(blocks), num_experts, dtype)
    ops = runner.step.ops
    kernel = first.experts.grouped_kernel()
    with torch.no_grad():
        turns = timed_turns(blocks, weights, ops, cfg.hidden_size, dtype, args.iters, args.seed, args.experts)
        sweep = batch_sweep(blocks, ops, cfg.hidden_size, dtype, args.batches, max(3, args.iters // 4))
        use_path(blocks, args.experts[0])  # the decode step and the profiles run on the first path listed
        alone_s = expert_alone_s(blocks, ops, cfg.hidden_size, dtype)
        step_s = decode_step_s(llm, cfg.vocab_size, args.decode_tokens, args.seed)
        if args.profile:
            instrument_kernels()
        profiles = {rows: profile_blocks(blocks, ops, cfg.hidden_size, dtype, rows, min(args.iters, 20))
                    for rows in args.profile}
    rate = lambda seconds: expert_bytes / seconds / 1e9  # noqa: E731
    paths = {path: {"layer_ms": turns[f"layer_s_{path}"] * 1e3, "layer_ms_min": turns[f"layer_s_min_{path}"] * 1e3,
                    "layer_gb_s": rate(turns[f"layer_s_{path}"]),
                    "read_ratio": turns["read_s"] / turns[f"layer_s_{path}"]} for path in args.experts}
    main_path = args.experts[0]
    turns |= {"layer_s": turns[f"layer_s_{main_path}"], "layer_s_min": turns[f"layer_s_min_{main_path}"]}
    report = {"paths": paths, "main_path": main_path, "batch_sweep": sweep,
              "grouped_kernel": kernel if isinstance(kernel, str) else ("packed bf16" if kernel.packed
                                                                        else f"plain {kernel.dtype}"),
              "model": args.model, "model_dir": str(model_dir), "dtype": args.dtype, "threads": args.threads,
              "iters": args.iters, "sparse_layers": list(blocks), "experts": num_experts, "top_k": top_k,
              "expert_intermediate": inter, "hidden": cfg.hidden_size, "ops": ops.name, "isa": sage_isa(),
              "expert_mb_per_token": expert_bytes / 1e6, "loadavg": list(os.getloadavg()),
              "layer_ms": turns["layer_s"] * 1e3, "plain_read_ms": turns["read_s"] * 1e3,
              "layer_gb_s": rate(turns["layer_s"]), "plain_read_gb_s": rate(turns["read_s"]),
              "layer_ms_min": turns["layer_s_min"] * 1e3, "plain_read_ms_min": turns["read_s_min"] * 1e3,
              "expert_alone_ms": alone_s * 1e3, "expert_alone_gb_s": expert_bytes / len(blocks) / top_k / alone_s / 1e9,
              "decode_step_ms": step_s * 1e3, "decode_step_expert_gb_s": rate(step_s),
              "read_ratio": turns["read_s"] / turns["layer_s"], "step_ratio": turns["read_s"] / step_s,
              "profiles": {str(rows): ops_ for rows, ops_ in profiles.items()}}
    print_report(report)
    write_json(args.json, report)
    return 0


def print_report(r: dict) -> None:
    print(f"{r['model']} {r['dtype']}, {r['threads']} threads, kernels {r['isa']}, load {r['loadavg'][0]:.1f}, "
          f"ops {r['ops']}: {len(r['sparse_layers'])} sparse "
          f"layers x top {r['top_k']} of {r['experts']} experts (x {r['expert_intermediate']}), "
          f"{r['expert_mb_per_token']:.1f} MB of expert weights per token")
    print(f"  grouped kernel: {r['grouped_kernel']}")
    for path, p in r["paths"].items():
        print(f"  MoE layers, 1 row, {path:10}: {p['layer_ms']:7.2f} ms  {p['layer_gb_s']:6.1f} GB/s  "
              f"(min {p['layer_ms_min']:.2f} ms)  read_ratio {p['read_ratio']:.2f}")
    print(f"  plain read                   : {r['plain_read_ms']:7.2f} ms  {r['plain_read_gb_s']:6.1f} GB/s  "
          f"(min {r['plain_read_ms_min']:.2f} ms)")
    print(f"  one expert alone             : {r['expert_alone_ms']:7.3f} ms  {r['expert_alone_gb_s']:6.1f} GB/s  "
          f"(median over every expert, each on its own)")
    print(f"  decode step                  : {r['decode_step_ms']:7.2f} ms  {r['decode_step_expert_gb_s']:6.1f} "
          f"GB/s of experts")
    print(f"  read_ratio ({r['main_path']} layers / plain read) = {r['read_ratio']:.2f}   step_ratio (step / plain "
          f"read) = {r['step_ratio']:.2f}   (target >= 0.8)")
    for row in r["batch_sweep"]:
        print(f"  batch {row['batch']:4d} (pairs per expert: max {row['max_pairs']}, mean {row['mean_pairs']:.1f}): "
              f"grouped {row['grouped_ms']:.2f} ms, per-expert {row['per_expert_ms']:.2f} ms, engine "
              f"{row['engine_ms']:.2f} ms; per-expert / grouped {row['speedup']:.2f}, per-expert / engine "
              f"{row['engine_speedup']:.2f}")
    for rows, prof in r["profiles"].items():
        print(f"  profile, {rows} row(s): {prof['pass_ms']:.2f} ms per pass over the sparse layers (profiled), "
              f"{prof['ops_ms']:.2f} ms in ops, the rest Python")
        for op in prof["top"]:
            print(f"    {op['op'][:48]:48} {op['calls']:6d} calls {op['self_ms_per_pass']:8.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
