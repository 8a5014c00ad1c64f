"""Pure decode steps' wall time of a bench model under engine variants, alternating in one process.

    python bench/decode_step_time.py --model gemma3-shape-small --batch 4 --context 2048 \\
        --variant torch-glue model.elementwise=torch model.decode_step=python \\
        --variant cpp-step model.decode_step=sage --repeats 2

Each variant (`ServeConfig` overrides, as bench/engine_ab.py takes them) builds a fresh `LLM`, prefills `--batch`
random prompts of `--context` tokens, then decodes `--new` tokens each; every engine step where each row computes one
token is timed. Output: per variant the median and the best pure decode step (ms, over all repeats), the steps
timed, and whether its greedy tokens equal the first variant's. Decode at a context past the sliding window is where
a model's windowed layers read only their window.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_ab import config_for  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402


def decode_steps(config, prompts: list[list[int]], new: int) -> tuple[list[float], list[list[int]]]:
    """Wall ms of each pure decode step of one run, and each prompt's greedy tokens."""
    from sage_infer import LLM, SamplingParams

    llm = LLM(config=config)
    llm.generate([[7] * 24, [9] * 40], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    engine, params = llm.engine, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    schedule, kinds = engine.scheduler.schedule, []

    def classified():
        batch = schedule()
        kinds.append(bool(batch.seqs) and all(n == 1 for n in batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = classified
    walls, tokens = [], {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        if kinds[-1]:
            walls.append((time.perf_counter() - start) * 1e3)
    del llm
    gc.collect()
    return walls, [tokens[f"p{i}"] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="gemma3-shape-small", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens of each row")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--variant", nargs="+", action="append", required=True, metavar="NAME [KEY=VALUE ...]")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model(MODELS[args.model], args.model_cache)
    configs = {v[0]: config_for(model_dir, args.dtype, args.kv_gib, v[1:]) for v in args.variant}
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 4000) for _ in range(args.context)] for _ in range(args.batch)]
    names = list(configs)
    walls: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            steps, tokens[name] = decode_steps(configs[name], prompts, args.new)
            walls[name] += steps
            print(f"  repeat {rep + 1} {name:<12} median {statistics.median(steps):8.2f} ms", flush=True)
    print(f"\n{args.model} {args.dtype}: {args.batch} rows at {args.context} tokens, {args.new} new, "
          f"{args.threads} threads, {args.repeats} repeats alternating")
    print(f"{'variant':<12} {'median ms':>10} {'best ms':>8} {'steps':>6}  tokens = {names[0]}")
    report = {"model": args.model, "dtype": args.dtype, "batch": args.batch, "context": args.context,
              "new": args.new, "threads": args.threads, "variants": {}}
    for name in names:
        median, best = statistics.median(walls[name]), min(walls[name])
        same = tokens[name] == tokens[names[0]]
        print(f"{name:<12} {median:>10.2f} {best:>8.2f} {len(walls[name]):>6}  {same}")
        report["variants"][name] = {"median_ms": median, "best_ms": best, "steps": len(walls[name]),
                                    "overrides": configs_overrides(args.variant, name), "same_tokens": same}
    if args.json:
        write_json(args.json, report)
    return 0


def configs_overrides(variants: list[list[str]], name: str) -> list[str]:
    return next(v[1:] for v in variants if v[0] == name)


if __name__ == "__main__":
    sys.exit(main())
