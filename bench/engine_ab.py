"""A/B of native-engine settings on one bench workload, alternating in one process so machine
noise (another process on the cores) hits every variant alike.

    python bench/engine_ab.py --model qwen3-11m --dtype fp32 --workload W1 \\
        --variant ref model.attention=torch --variant paged model.attention=paged --repeats 3

Each `--variant NAME KEY=VALUE...` is a set of `ServeConfig` overrides (dotted keys; values as
YAML scalars: true/false/ints/strings). Every repeat runs each variant once, the order rotating;
each run builds a fresh `LLM` (empty prefix cache), warms it up and times `generate` on the
workload of bench/engine_vs_vllm.py. Output: per variant the best and median output tok/s, and
whether its greedy tokens equal the first variant's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import ALL_WORKLOADS, DEFAULT_CACHE, build_workloads  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text


def config_for(model_dir: Path, dtype: str, kv_gib: int, overrides: list[str]):
    from sage_infer.config.serve import ServeConfig

    tree: dict = {"model": {"path": str(model_dir), "dtype": dtype}, "kv_pool": {"memory_budget": f"{kv_gib}GiB"},
                  "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}}
    for item in overrides:
        key, _, value = item.partition("=")
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parse_value(value)
    return ServeConfig.model_validate(tree)


def run_once(config, prompts: list[list[int]], max_new: int,
             device: str | None = None) -> tuple[float, list[list[int]]]:
    from sage_infer import LLM, SamplingParams

    llm = LLM(config=config, device=device)
    llm.generate([[7] * 24, [9] * 40], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    start = time.monotonic()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
    wall = time.monotonic() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    del llm
    gc.collect()
    return sum(map(len, tokens)) / wall, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--workload", default="W1", choices=ALL_WORKLOADS)
    parser.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts of the workload")
    parser.add_argument("--variant", nargs="+", action="append", required=True, metavar="NAME [KEY=VALUE ...]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--device", default=None, help="torch device for every variant (default: the preset's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model(MODELS[args.model], args.model_cache)
    configs = {v[0]: config_for(model_dir, args.dtype, args.kv_gib, v[1:]) for v in args.variant}
    vocab = json.loads((model_dir / "config.json").read_text())
    prompts, max_new = build_workloads(vocab["vocab_size"], vocab.get("max_position_embeddings", 4096))[args.workload]
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    names = list(configs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            rate, tokens[name] = run_once(configs[name], prompts, max_new, args.device)
            rates[name].append(rate)
            print(f"  repeat {rep + 1} {name:<12} {rate:9.1f} tok/s", flush=True)
    first = names[0]
    print(f"\n{args.model} {args.dtype} {args.workload} ({len(prompts)} prompts, {max_new} out), "
          f"{args.threads} threads, {args.repeats} repeats alternating")
    print(f"{'variant':<12} {'best tok/s':>10} {'median':>9} {'vs ' + first:>10}  tokens = {first}")
    report = {"model": args.model, "dtype": args.dtype, "workload": args.workload, "num_prompts": len(prompts),
              "threads": args.threads, "device": args.device or "preset", "variants": {}}
    for name in names:
        best, median = max(rates[name]), statistics.median(rates[name])
        same = tokens[name] == tokens[first]
        print(f"{name:<12} {best:10.1f} {median:9.1f} {best / max(rates[first]):9.2f}x  {same}")
        report["variants"][name] = {"overrides": dict(v.split("=", 1) for v in args.variant[names.index(name)][1:]),
                                    "tok_s": rates[name], "best": best, "median": median, "tokens_equal_first": same}
    write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
