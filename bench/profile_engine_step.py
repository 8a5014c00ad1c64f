"""Where a native engine step's time goes: a bench workload (engine_vs_vllm's W1/W2/W3) run once
through `LLM.generate` with every step timed and classified, then a few decode and prefill steps
under `torch.profiler`, their time split into GEMMs, attention, KV store/gather, sampling and the
rest (Python: metadata building, scheduling, postprocess).

    python bench/profile_engine_step.py --model qwen3-11m --dtype fp32 --workload W1
    python bench/profile_engine_step.py --model qwen2.5-0.5b-shape --dtype bf16 --workload W1 --num-prompts 16
    python bench/profile_engine_step.py --cached-context 16384 --chunk 16     # a full prefix hit's one step

A step is `decode` when every scheduled sequence computes one token, `prefill` otherwise (a
mixed step: a prefill chunk plus decode rows, counts as prefill). Output: a table per step kind
(steps, total and mean wall ms, share of the run) and, for the profiled steps, the split by
category (torch.profiler CPU time of the ops and `record_function` regions below).

`--cached-context L`: the step a full prefix hit runs instead: qwen3-11m (fp32, context raised to L) computes an
(L - chunk)-token prompt once, then that prompt with `--chunk` fresh tokens computes only those over the cached
ones (`--repeats` times), taking turns: as decode rows of the paged kernel (every chunk of at most
`IN_PLACE_CHUNK_ROWS`, whatever its context) and as the engine routes it (`IN_PLACE_CHUNK_PAIRS`). Beside that
step, in the same process and taking turns with it: the attention alone (the paged decode kernel over the pool's
blocks, every layer), the same attention as a gather plus PyTorch SDPA, as a gather plus the flash kernel and as
the flash kernel reading the pool's rows in place (what the engine runs), and
the arithmetic bound (the step's GEMM and attention FLOPs at the GEMM rate measured here on the model's layer
shapes at the chunk's rows, as bench/arith_bound.py charges them). Medians, and minimums: on a shared machine a
parallel region whose second thread is descheduled waits for it (a scheduler tick, about 4 ms, each time).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_ab import config_for  # noqa: E402
from bench.engine_vs_vllm import ALL_WORKLOADS, DEFAULT_CACHE, build_workloads  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402

# record_function regions, innermost wins; ops outside all of them are split by name below
REGIONS = {
    "prepare": ("sage_infer.engine.model_runner", "ModelRunner", "prepare"),
    "schedule": ("sage_infer.scheduler.scheduler", "Scheduler", "schedule"),
    "postprocess": ("sage_infer.engine.llm_engine", "LLMEngine", "_append_outputs"),
    "sampling": ("sage_infer.engine.sampler", "Sampler", "__call__"),
    "kv store": ("sage_infer.kv_runtime.pool", "KVPool", "store"),
    "kv gather": ("sage_infer.kv_runtime.pool", "KVPool", "gather_blocks"),
    "kv gather (slots)": ("sage_infer.kv_runtime.pool", "KVPool", "gather_slots"),
    "kv gather (levels)": ("sage_infer.kv_runtime.pool", "KVPool", "gather_block_levels"),
    "attention": ("sage_infer.layers.attention", None, "paged_attention"),
}
# the C++ kernels (sage_infer/layers/csrc, pybind functions: torch.profiler sees no op in them), wrapped in
# `kernel::<name>` regions whose self time is op time of this category
KERNELS = {"small_linear": "GEMM", "paged_decode_attention": "attention", "flash_attention": "attention",
           "rms_norm": "fused ops",
           "add_rms_norm_": "fused ops", "silu_mul": "fused ops", "rope_": "fused ops"}
OPS_DETAIL: dict[str, float] = defaultdict(float)  # filled when --ops (a non-empty dict is the flag)
GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul")


def instrument() -> None:
    """Wrap the functions of `REGIONS` in `torch.profiler.record_function`."""
    import importlib

    for label, (module_name, owner, name) in REGIONS.items():
        module = importlib.import_module(module_name)
        holder = getattr(module, owner) if owner else module
        original = getattr(holder, name)

        def wrapped(*args, __f=original, __label=label, **kwargs):
            with torch.profiler.record_function(f"sage::{__label}"):
                return __f(*args, **kwargs)

        setattr(holder, name, wrapped)
        if owner is None:  # also the name other modules imported
            for other in ("sage_infer.models.llama",):
                mod = importlib.import_module(other)
                if getattr(mod, name, None) is original:
                    setattr(mod, name, wrapped)
    from sage_infer.layers import cpu_kernels

    if cpu_kernels.kernel_unavailable() is None:
        kernels = cpu_kernels._module()  # every call goes through this module's attributes
        for name in KERNELS:
            def kernel(*args, __f=getattr(kernels, name), __label=f"kernel::{name}", **kwargs):
                with torch.profiler.record_function(__label):
                    return __f(*args, **kwargs)

            setattr(kernels, name, kernel)


def categorize(prof) -> dict[str, float]:
    """Self CPU ms per category: an event belongs to its innermost `sage::` region, else to
    GEMM by op name, else to `other ops`; the step's wall minus all op time is Python."""
    totals: dict[str, float] = defaultdict(float)
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    regions = sorted((e for e in events if e.name.startswith("sage::")), key=lambda e: e.time_range.start)
    for event in events:
        if event.name.startswith("sage::") or event.name.startswith("step::"):
            continue
        if event.name.startswith("kernel::"):  # a C++ kernel: its region's self time is the kernel's
            owner = KERNELS[event.name[len("kernel::"):]]
            totals[owner] += event.self_cpu_time_total / 1e3
            if OPS_DETAIL:
                OPS_DETAIL[f"{owner} | {event.name}"] += event.self_cpu_time_total / 1e3
            continue
        start, end = event.time_range.start, event.time_range.end
        owner = None
        for region in regions:  # innermost = the latest-starting region containing the event
            if region.time_range.start <= start and end <= region.time_range.end:
                owner = region.name[len("sage::"):]
        if owner in (None, "attention") and any(event.name.startswith(g) for g in GEMM_OPS):
            owner = "GEMM" if owner is None else "attention"
        totals[owner or "other ops"] += event.self_cpu_time_total / 1e3
        if OPS_DETAIL:
            OPS_DETAIL[f"{owner or 'other ops'} | {event.name}"] += event.self_cpu_time_total / 1e3
    # region self time (Python inside the region, not in any op)
    for region in regions:
        totals[region.name[len("sage::"):] + " (python)"] += region.self_cpu_time_total / 1e3
    return dict(totals)


def run_steps(model_dir: Path, args, profile_at: set[int]):
    """Run the workload on a fresh engine: per step wall ms, kinds, tokens generated, total s (and,
    when `profile_at` names steps, their profiles)."""
    from sage_infer import LLM, SamplingParams

    llm = LLM(config=config_for(model_dir, args.dtype, 4, args.set), device=args.device)
    cfg = llm.engine.runner.model.config
    prompts, max_new = build_workloads(cfg.vocab_size, cfg.max_position_embeddings)[args.workload]
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    llm.generate([[5] * 20], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    original_schedule = engine.scheduler.schedule
    kinds: list[str] = []
    rows: list[int] = []

    def schedule():
        batch = original_schedule()
        kinds.append("decode" if batch.seqs and all(n == 1 for n in batch.num_new_tokens) else "prefill")
        rows.append(sum(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = schedule
    walls: list[float] = []
    profiles: dict[int, dict] = {}
    generated = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step = len(walls)
        t0 = time.perf_counter()
        if step in profile_at:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                outputs = engine.step()
            wall = (time.perf_counter() - t0) * 1e3
            profiles[step] = {"wall_ms": wall, "split": categorize(prof), "rows": rows[-1]}
            if args.device == "cuda":  # the step's GPU kernels, summed: how busy the GPU was
                profiles[step]["split"]["(gpu kernels busy)"] = sum(
                    getattr(e, "self_device_time_total", 0) for e in prof.events()
                    if e.device_type.name == "CUDA") / 1e3
        else:
            outputs = engine.step()
            wall = (time.perf_counter() - t0) * 1e3
        walls.append(wall)
        generated += sum(len(c.delta_token_ids) for o in outputs for c in o.outputs)
    total = time.perf_counter() - start
    if profile_at:
        return walls, kinds, generated, total, profiles
    return walls, kinds, generated, total


def _median_ms(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e3


def _attention_timers(llm, context: int, chunk: int) -> dict:
    """The chunk's attention over `context` cached tokens, every layer, four ways, as zero-argument timers
    (the pool's own blocks, scattered as a prefix hit leaves them; the keys' content does not matter)."""
    import torch.nn.functional as F

    from sage_infer.layers import cpu_kernels

    pool, cfg = llm.engine.runner.pool, llm.engine.runner.model.config
    heads, head_dim, layers = cfg.num_heads, cfg.head_dim, cfg.num_layers
    blocks = -(-context // pool.block_size)
    table = torch.randperm(pool.num_blocks - 1)[:blocks] + 1
    q = torch.randn(chunk, heads, head_dim)
    lens = torch.arange(context - chunk + 1, context + 1)
    tables = table[None].expand(chunk, -1).contiguous()
    scale = head_dim ** -0.5
    mask = torch.ones(chunk, context, dtype=torch.bool).tril(context - chunk)

    def paged():
        for layer in range(layers):
            cpu_kernels.decode_attention_paged(q, *pool.block_views(layer), tables, lens, scale)

    def gathered(attend):
        def run():
            for layer in range(layers):
                keys, values = pool.gather_blocks(layer, table[None], q.dtype)
                attend(keys[0, :context], values[0, :context])
        return run

    def sdpa(k, v):
        F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)

    slots = (table[:, None] * pool.block_size + torch.arange(pool.block_size)).reshape(-1)[:context].contiguous()

    def in_place():  # what the engine runs: the flash kernel packs the keys straight from the pool's rows
        for layer in range(layers):
            cpu_kernels.flash_attention_slots(q, *pool.token_rows(layer), slots, scale)

    return {"attention, paged kernel": paged, "attention, gather + SDPA": gathered(sdpa),
            "attention, gather + flash": gathered(lambda k, v: cpu_kernels.flash_attention(q, k, v, scale, True)),
            "attention, flash in place": in_place}


def cached_hit(args) -> dict:
    """`--cached-context`: a full prefix hit's step against its attention alone and the arithmetic bound."""
    import random

    from bench.arith_bound import gemm_rate, layer_shapes
    from bench.load_vs_recompute import BLOCK, long_model
    from sage_infer import LLM, SamplingParams
    from sage_infer.layers.attention_backends import base

    context, chunk = args.cached_context, args.chunk
    model_dir = long_model(context, args.model_cache)
    overrides = ["model.max_model_len=" + str(context + BLOCK), f"kv_pool.block_size={BLOCK}",
                 f"kv_pool.num_blocks={2 * (context // BLOCK) + 64}", *args.set]
    llm = LLM(config=config_for(model_dir, "fp32", 4, overrides), device="cpu")
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    prefix = [rng.randrange(5, 4096) for _ in range(context - chunk)]
    llm.generate([prefix], one)  # computed once; every later run adds `chunk` fresh tokens to it
    steps: list[float] = []
    runner = llm.engine.runner
    original = runner.run

    def timed(seqs, num_new_tokens):
        start = time.perf_counter()
        try:
            return original(seqs, num_new_tokens)
        finally:
            steps.append(time.perf_counter() - start)

    runner.run = timed
    timers = _attention_timers(llm, context, chunk)
    routes = {"decode rows": sys.maxsize, "as routed": base.IN_PLACE_CHUNK_PAIRS}  # the chunk's route, see base.py
    samples: dict[str, list[float]] = {**{f"{k} {r}": [] for r in routes for k in ("step,", "ttft,")},
                                       **{name: [] for name in timers}}
    for _ in range(args.repeats):
        for route, pairs in routes.items():
            base.IN_PLACE_CHUNK_PAIRS = pairs
            [out] = llm.generate([prefix + [rng.randrange(5, 4096) for _ in range(chunk)]], one)
            assert out.metrics.num_cached_tokens == context - chunk, out.metrics.num_cached_tokens
            samples[f"step, {route}"].append(steps[-1])
            samples[f"ttft, {route}"].append(out.metrics.ttft)
        base.IN_PLACE_CHUNK_PAIRS = routes["as routed"]
        for name, run in timers.items():
            with torch.inference_mode():
                start = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - start)
    cfg = runner.model.config
    shape = {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads, "head_dim": cfg.head_dim,
             "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size}
    llm.close()
    shapes = layer_shapes(shape)
    gemm_gflop = (2 * sum(i * o for i, o in shapes) * cfg.num_layers * chunk
                  + 2 * cfg.hidden_size * cfg.vocab_size) / 1e9
    pairs = sum(range(context - chunk + 1, context + 1))
    attention_gflop = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * pairs / 1e9
    rate = gemm_rate(shapes, chunk, torch.float32, 20)
    ms = {name: _median_ms(xs) for name, xs in samples.items()}
    ms["arithmetic bound"] = (gemm_gflop + attention_gflop) / rate * 1e3
    return {"cached_context": context, "chunk": chunk, "repeats": args.repeats, "threads": args.threads,
            "gemm_gflop": gemm_gflop, "attention_gflop": attention_gflop, "gemm_gflop_s": rate, "median_ms": ms,
            "min_ms": {name: min(xs) * 1e3 for name, xs in samples.items()}}


def print_cached_hit(report: dict) -> None:
    ms = report["median_ms"]
    print(f"full prefix hit: {report['chunk']} tokens computed over {report['cached_context']:,} cached "
          f"(qwen3-11m fp32, {report['threads']} threads; medians of {report['repeats']}, taking turns)")
    print(f"  arithmetic: {report['gemm_gflop']:.2f} GFLOP GEMM + {report['attention_gflop']:.2f} attention at "
          f"{report['gemm_gflop_s']:.0f} GFLOP/s (GEMM rate at {report['chunk']} rows)")
    print(f"  {'':<28} {'median ms':>9} {'÷ bound':>8} {'min ms':>8}")
    for name, value in ms.items():
        least = report["min_ms"].get(name, value)
        print(f"  {name:<28} {value:9.1f} {value / ms['arithmetic bound']:7.2f}x {least:8.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--workload", default="W1", choices=ALL_WORKLOADS)
    parser.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps of each kind")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="ServeConfig overrides, as engine_ab's variants (e.g. model.decode_step=python: the "
                        "one-call decode step hides its layers from the profiler)")
    parser.add_argument("--ops", type=int, default=0, help="also print the N costliest ops (all profiled steps)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: ops' CPU time is their launch cost; '(gpu kernels busy)' sums the GPU's")
    parser.add_argument("--cached-context", type=int, default=0, metavar="L",
                        help="time a full prefix hit's step over L cached tokens instead of a workload (see above)")
    parser.add_argument("--chunk", type=int, default=16, help="with --cached-context: the tokens the hit computes")
    parser.add_argument("--repeats", type=int, default=7, help="with --cached-context: hits timed")
    args = parser.parse_args(argv)
    if args.cached_context and (args.chunk < 16 or args.chunk % 16 or args.chunk >= args.cached_context):
        parser.error("--chunk: whole 16-token blocks, fewer than --cached-context (the cached part is whole blocks)")
    if args.ops:
        OPS_DETAIL["(enabled)"] = 0.0
    torch.set_num_threads(args.threads)
    if args.cached_context:
        report = cached_hit(args)
        print_cached_hit(report)
        write_json(args.json, report, indent=2)
        return 0
    instrument()

    model_dir = prepare_model(MODELS[args.model], args.model_cache)
    # pass 1 times every step; pass 2 (a fresh engine, same steps: greedy, same prompts) profiles
    # a few steps of each kind spread over the run
    walls, kinds, generated, total = run_steps(model_dir, args, set())
    chosen = set()
    for kind in ("decode", "prefill"):
        steps = [i for i, k in enumerate(kinds) if k == kind]
        if steps:
            chosen.update(steps[len(steps) * (j + 1) // (args.profile_steps + 1)] for j in range(args.profile_steps))
    _, kinds2, _, _, profiles = run_steps(model_dir, args, chosen)
    assert kinds2 == kinds, "the profiled pass scheduled different steps"
    report = {"model": args.model, "dtype": args.dtype, "workload": args.workload, "num_prompts": args.num_prompts,
              "threads": args.threads, "wall_s": total, "generated": generated,
              "output_tok_s": generated / total, "steps": {}, "profile": {}}
    print(f"{args.model} {args.dtype} {args.workload}: {generated} tokens in {total:.2f}s "
          f"= {generated / total:.1f} tok/s, {args.threads} threads")
    print(f"{'kind':<8} {'steps':>6} {'total s':>8} {'mean ms':>8} {'share':>6}")
    for kind in ("prefill", "decode"):
        w = [wall for wall, k in zip(walls, kinds) if k == kind]
        if not w:
            continue
        report["steps"][kind] = {"steps": len(w), "total_s": sum(w) / 1e3, "mean_ms": sum(w) / len(w)}
        print(f"{kind:<8} {len(w):>6} {sum(w) / 1e3:>8.2f} {sum(w) / len(w):>8.1f} {sum(w) / 1e3 / total:>6.0%}")
    for kind in ("prefill", "decode"):
        picked = [(i, profiles[i]) for i in sorted(profiles) if kinds[i] == kind]
        if not picked:
            continue
        n = len(picked)
        wall = sum(p["wall_ms"] for _, p in picked)
        split: dict[str, float] = defaultdict(float)
        for _, p in picked:
            for name, ms in p["split"].items():
                split[name] += ms
        busy = split.pop("(gpu kernels busy)", None)
        rows = sorted(split.items(), key=lambda kv: -kv[1]) + [("unaccounted", wall - sum(split.values()))]
        if busy is not None:  # not a share of the host's time: shown after the split
            rows.append(("(gpu kernels busy)", busy))
        print(f"\n{kind}: steps {[i for i, _ in picked]} ({[p['rows'] for _, p in picked]} rows), "
              f"{wall / n:.1f} ms/step under the profiler (self CPU ms per step; unaccounted = wall - sum)")
        report["profile"][kind] = {"steps": [i for i, _ in picked], "wall_ms_per_step": wall / n,
                                   "ms_per_step": {name: ms / n for name, ms in rows}}
        for name, ms in rows:
            print(f"  {name:<24} {ms / n:8.2f} ms  {ms / wall:6.1%}")
    if args.ops:
        OPS_DETAIL.pop("(enabled)")
        print(f"\ncostliest ops over all {len(profiles)} profiled steps (self CPU ms, owner | op):")
        for name, ms in sorted(OPS_DETAIL.items(), key=lambda kv: -kv[1])[: args.ops]:
            print(f"  {ms:9.2f}  {name}")
    write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
