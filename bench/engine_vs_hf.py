"""sage_infer `LLM.generate` against Hugging Face transformers, same model, same prompts,
same dtype and thread count, side by side in one process.

    python bench/engine_vs_hf.py --json out/engine_vs_hf.json
    python bench/engine_vs_hf.py --quick
    python bench/engine_vs_hf.py --device cuda --dtype bf16 --threads 4   # both on the GPU

Engines:
  hf-generate-bN   `model.generate` on left-padded batches of N prompts (attention mask,
                   greedy, min_new_tokens == max_new_tokens, eos_token_id=None), batches run
                   one after another in prompt order (no length sorting).
  hf-generate_batch  transformers' own continuous batching (`model.generate_batch`), greedy,
                   EOS disabled; skipped with the error recorded if it fails.
  sage             `LLM.generate` with every request submitted at once.

Workloads (all prompts are random token ids, all requests arrive at t=0, ignore-EOS):
  random         N prompts, lengths uniform in [64, 512], 128 output tokens each.
  shared-prefix  N requests = one shared 1,024-token system prompt + a 16-64 token user
                 suffix each, 32 output tokens each.

Metrics: output tok/s = generated tokens / wall time of the whole workload. TTFT is the
time from the workload's start (t=0, every request already submitted) to a request's first
generated token:
  hf-generate     a `streamer` records when each batch's first decoding step hands its
                  tokens over; a request's TTFT is that moment, measured from the start of
                  the first batch (so later batches include the wait for earlier ones).
  generate_batch  per-token timestamps it records (`record_timestamps=True`), relative to
                  the call's start.
  sage            `metrics.first_token_time` relative to the `generate` call's start.

Output tok/s ratio: sage over the best transformers mode; TTFT ratio: the best (lowest)
transformers median TTFT over sage's median TTFT.

Before timing, each engine runs a short warm-up on unrelated prompts. Sage builds a fresh
`LLM` (empty prefix cache, same warm-up) for every run. Every engine runs `--repeats` times,
interleaved, and keeps its fastest run; the `cpu` column (process CPU seconds / wall seconds
over the timed region, at most the thread count) shows whether the run kept its cores busy
(low either when something else on the machine took them or when the engine itself leaves
them idle, e.g. generate_batch's Python scheduling thread).
The bench also checks that sage's greedy tokens equal transformers' (unpadded, one prompt at
a time) on the first 4 `random` prompts.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402

DEFAULT_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=688, max_position_embeddings=2048)
FIRST_REGULAR_TOKEN = 5  # tiny models reserve ids 0-4 for special tokens


# -- workloads ----------------------------------------------------------------------------


def random_workload(n: int, vocab: int, seed: int, lo: int = 64, hi: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def shared_prefix_workload(n: int, vocab: int, seed: int, system_len: int = 1024,
                           lo: int = 16, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed + 1)
    system = [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(system_len)]
    return [system + [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


# -- helpers ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(name: str, wall: float, cpu: float, generated: int, ttfts: list[float], **extra) -> dict:
    return {
        "engine": name,
        "wall_s": wall,
        # process CPU seconds (all threads) per wall second over the timed region: about the
        # thread count when the run had the cores to itself, lower when something else took them
        "cpu_util": cpu / wall,
        "generated_tokens": generated,
        "output_tok_s": generated / wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        **extra,
    }


class FirstStepStreamer:
    """`generate` streamer that records when the prompt and each decoding step arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def pad_left(prompts: list[list[int]], pad_id: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


# -- engines ------------------------------------------------------------------------------


def hf_generate(model, prompts: list[list[int]], max_new: int, batch: int, pad_id: int) -> tuple[dict, list]:
    """Static batches, left-padded; returns (summary, per-prompt generated tokens)."""
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    generated = 0
    cpu0, start = time.process_time(), time.perf_counter()
    for b in range(0, len(prompts), batch):
        chunk = prompts[b:b + batch]
        ids, mask = pad_left(chunk, pad_id, model.device)
        streamer = FirstStepStreamer()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad_id, streamer=streamer)
        new = out[:, ids.shape[1]:]
        assert new.shape[1] == max_new, new.shape
        generated += new.numel()
        outputs.extend(new.tolist())
        # times[0]: the prompt handed over before the prefill; times[1]: the first generated token
        ttfts.extend([streamer.times[1] - start] * len(chunk))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return summarize(f"hf-generate-b{batch}", wall, cpu, generated, ttfts, batch_size=batch,
                     ttft_method="streamer: time of the batch's first decoding step"), outputs


def hf_generate_batch(model, prompts: list[list[int]], max_new: int, pad_id: int,
                      page_size: int) -> tuple[dict, list]:
    """transformers' continuous batching. Its cache is sized like sage's pool (every request at
    full length, no sharing) and its batch to sage's 2,048-token budget / 64 seats: left to
    itself on a CPU without psutil it sizes the cache to the machine's whole RAM."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=pad_id,
                              bos_token_id=None)
    num_blocks = sum(-(-(len(p) + max_new) // page_size) for p in prompts) + 4
    # the page size is `page_size` in newer transformers (5.24 here) and `block_size` in older ones (5.17, the
    # GPU image's): whichever this one takes
    page_field = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb_config = ContinuousBatchingConfig(**{page_field: page_size}, num_blocks=num_blocks, max_batch_tokens=2048,
                                         max_requests_per_batch=64)
    cpu0, start = time.process_time(), time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config,
                                   record_timestamps=True, progress_bar=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    outs = list(results.values())
    errors = [r.error for r in outs if r.error is not None]
    if len(outs) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(outs)}/{len(prompts)} results; errors: {errors[:3]}")
    generated = sum(len(r.generated_tokens) for r in outs)
    ttfts = [r.timestamps[0] - start for r in outs]
    lengths = sorted({len(r.generated_tokens) for r in outs})
    return summarize("hf-generate_batch", wall, cpu, generated, ttfts, output_lengths=lengths,
                     ttft_method="record_timestamps: first token's timestamp"), \
        [list(r.generated_tokens) for r in outs]


def sage_generate(model_dir: str, dtype: str, prompts: list[list[int]], max_new: int, num_blocks: int | None,
                  warmup: list[list[int]], kv_memory: str | None = None, device: str = "cpu") -> tuple[dict, list]:
    """A fresh `LLM` (empty prefix cache) per call; the pool from `num_blocks` or else `kv_memory`."""
    from sage_infer import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, device=device, num_blocks=num_blocks, kv_memory=kv_memory, max_num_seqs=64,
              max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    llm.generate(warmup, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    cpu0, start = time.process_time(), time.monotonic()
    outs = llm.generate(prompts, params)
    wall, cpu = time.monotonic() - start, time.process_time() - cpu0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"sage failed requests: {errors[:3]}")
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.first_token_time - start for o in outs]
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    return summarize("sage", wall, cpu, generated, ttfts, cached_prompt_tokens=cached, prompt_tokens=prompt_tokens,
                     ttft_method="metrics.first_token_time - generate() start"), \
        [o.outputs[0].token_ids for o in outs]


# -- main ---------------------------------------------------------------------------------


def check_tokens(model, sage_tokens: list[list[int]], prompts: list[list[int]], max_new: int,
                 pad_id: int) -> list[dict]:
    """Sage's greedy tokens against unpadded, one-prompt-at-a-time HF generate."""
    report = []
    for prompt, got in zip(prompts, sage_tokens):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new,
                                 min_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        expected = out[0, len(prompt):].tolist()
        first_diff = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first_diff is None and len(got) != len(expected):
            first_diff = min(len(got), len(expected))
        report.append({"prompt_len": len(prompt), "match": first_diff is None, "first_diff": first_diff})
    return report


def run_workload(name: str, prompts: list[list[int]], max_new: int, args, hf, model_dir: str,
                 num_blocks: int, warmup: list[list[int]], pad_id: int, log) -> dict:
    """Every engine `--repeats` times, interleaved (engine A, B, C, A, B, C, ...) so that load
    from elsewhere on the machine hits them alike; each engine keeps its fastest run."""
    log(f"\n== workload {name}: {len(prompts)} prompts, prompt tokens {sum(map(len, prompts))} "
        f"(len {min(map(len, prompts))}-{max(map(len, prompts))}), {max_new} output tokens each, ignore_eos")
    engines: list[tuple[str, object]] = []
    for batch in dict.fromkeys(min(b, len(prompts)) for b in args.hf_batch):
        engines.append((f"hf-generate-b{batch}", lambda b=batch: hf_generate(hf, prompts, max_new, b, pad_id)))
    errors: dict[str, str] = {}
    if args.no_generate_batch:
        errors["hf-generate_batch"] = "skipped (--no-generate-batch)"
    elif not hasattr(hf, "generate_batch"):
        errors["hf-generate_batch"] = "this transformers has no generate_batch"
    else:
        engines.append(("hf-generate_batch",
                        lambda: hf_generate_batch(hf, prompts, max_new, pad_id, args.cb_page_size)))
    engines.append(("sage", lambda: sage_generate(model_dir, args.dtype, prompts, max_new, num_blocks, warmup,
                                                  device=args.device)))

    best: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    for rep in range(args.repeats):
        for engine, fn in engines:
            if engine in errors:
                continue
            load0 = os.getloadavg()[0]
            try:
                row, out = fn()
            except Exception as err:  # noqa: BLE001 - record and go on, as the brief asks
                if engine == "sage":
                    raise
                errors[engine] = f"{type(err).__name__}: {err}"
                log(f"  {engine} failed: {errors[engine]}")
                if args.verbose:
                    traceback.print_exc()
                continue
            load1 = os.getloadavg()[0]
            row["loadavg_1m"] = [load0, load1]
            log(f"  run {rep + 1}/{args.repeats} {engine:<18} {row['output_tok_s']:8.1f} tok/s  "
                f"wall {row['wall_s']:6.2f}s  TTFT p50 {row['ttft_p50_s']:6.3f}s  cpu {row['cpu_util']:.2f}  "
                f"load {load0:.1f}->{load1:.1f}")
            previous = best.get(engine)
            walls = (previous["all_wall_s"] if previous else []) + [row["wall_s"]]
            if previous is None or row["wall_s"] < previous["wall_s"]:
                best[engine], outputs[engine] = row, out
            best[engine]["all_wall_s"] = walls
    rows = [best[e] for e, _ in engines if e in best]

    hf_rows = [r for r in rows if r["engine"] != "sage"]
    best_tput = max(hf_rows, key=lambda r: r["output_tok_s"])
    best_ttft = min(hf_rows, key=lambda r: r["ttft_p50_s"])
    sage_row = best["sage"]
    return {
        "workload": name,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": max_new,
        "results": rows,
        "errors": errors,
        "best_hf_throughput_engine": best_tput["engine"],
        "speedup_tok_s": sage_row["output_tok_s"] / best_tput["output_tok_s"],
        "best_hf_ttft_engine": best_ttft["engine"],
        "ttft_p50_ratio": best_ttft["ttft_p50_s"] / sage_row["ttft_p50_s"],
        "_outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default=None, help="local HF model dir (default: a random tiny Llama)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--hf-batch", default="16,64", help="comma-separated padded batch sizes for HF generate")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-out", type=int, default=128, help="output tokens, workload random")
    parser.add_argument("--shared-out", type=int, default=32, help="output tokens, workload shared-prefix")
    parser.add_argument("--workloads", default="random,shared-prefix")
    parser.add_argument("--cb-page-size", type=int, default=256, help="generate_batch page size (its default)")
    parser.add_argument("--no-generate-batch", action="store_true", help="skip transformers generate_batch")
    parser.add_argument("--quick", action="store_true", help="8 prompts, 32/16 output tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine (interleaved); the fastest is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: both engines on the GPU (the cpu column is then the host's share)")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.random_out, args.shared_out, args.repeats = 8, 32, 16, 1
    args.hf_batch = [int(b) for b in args.hf_batch.split(",")]
    workloads = args.workloads.split(",")

    import transformers

    torch.set_num_threads(args.threads)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    tmp = None
    if args.model is None:
        from tests.tiny_models import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="engine_vs_hf_")
        model_dir = str(make_tiny_model(Path(tmp.name) / "llama", "llama", **DEFAULT_SHAPE))
        model_desc = "random Llama (tests/tiny_models.py): " + ", ".join(f"{k}={v}" for k, v in DEFAULT_SHAPE.items())
    else:
        model_dir = args.model
        model_desc = model_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval().to(args.device)
    cfg = hf.config
    vocab = cfg.vocab_size
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    params = sum(p.numel() for p in hf.parameters())
    model_desc += f", vocab={vocab}"

    header = {
        "model": model_desc,
        "params": params,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
        "hf_attn_implementation": getattr(cfg, "_attn_implementation", None),
        "quick": args.quick,
        "repeats": args.repeats,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_at_start": os.getloadavg(),
    }
    log(f"model: {model_desc}")
    log(f"params: {params / 1e6:.2f} M, dtype {args.dtype}, threads {header['threads']}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"HF attention {header['hf_attn_implementation']}")

    all_prompts = {
        "random": (random_workload(args.num_prompts, vocab, args.seed), args.random_out),
        "shared-prefix": (shared_prefix_workload(args.num_prompts, vocab, args.seed), args.shared_out),
    }
    # blocks for every request of the largest workload at full length, with no sharing (+ warm-up slack)
    num_blocks = max(sum(-(-(len(p) + n) // 16) for p in ps) for ps, n in all_prompts.values()) + 64
    warmup = random_workload(4, vocab, args.seed + 99, 16, 48)

    # warm both engines' code paths on unrelated prompts
    with torch.inference_mode():
        ids, mask = pad_left(warmup, pad_id, args.device)
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                    eos_token_id=None, pad_token_id=pad_id)

    report = {"header": header, "workloads": []}
    for name in workloads:
        prompts, max_new = all_prompts[name]
        result = run_workload(name, prompts, max_new, args, hf, model_dir, num_blocks, warmup, pad_id, log)
        outputs = result.pop("_outputs")
        if name == "random":
            check = check_tokens(hf, outputs["sage"][:4], prompts[:4], max_new, pad_id)
            result["greedy_check_first4"] = check
            result["greedy_match_first4"] = all(c["match"] for c in check)
            # the padded batch should agree too; informational only (padding may perturb fp32 sums)
            padded = next(k for k in outputs if k.startswith("hf-generate-b"))
            result["sage_vs_padded_hf_all_prompts_match"] = sum(
                a == b for a, b in zip(outputs["sage"], outputs[padded]))
        report["workloads"].append(result)

    # -- table ----------------------------------------------------------------------------
    print()
    print(f"{'workload':<14} {'engine':<18} {'tok/s':>9} {'wall s':>8} {'TTFT p50 s':>11} {'TTFT p99 s':>11} "
          f"{'cpu':>5}")
    for w in report["workloads"]:
        for r in w["results"]:
            print(f"{w['workload']:<14} {r['engine']:<18} {r['output_tok_s']:9.1f} {r['wall_s']:8.2f} "
                  f"{r['ttft_p50_s']:11.3f} {r['ttft_p99_s']:11.3f} {r['cpu_util']:5.2f}")
        for engine, err in w["errors"].items():
            print(f"{w['workload']:<14} {engine:<18} error: {err}")
    print()
    for w in report["workloads"]:
        print(f"{w['workload']}: sage tok/s / best HF ({w['best_hf_throughput_engine']}) = {w['speedup_tok_s']:.2f}x; "
              f"best HF TTFT p50 ({w['best_hf_ttft_engine']}) / sage TTFT p50 = {w['ttft_p50_ratio']:.2f}x")
        if "greedy_check_first4" in w:
            print(f"  greedy tokens match HF generate on first 4 prompts: "
                  f"{'yes' if w['greedy_match_first4'] else 'no'} "
                  f"({[c['first_diff'] for c in w['greedy_check_first4']]} first differing index per prompt); "
                  f"sage == padded HF batch on {w['sage_vs_padded_hf_all_prompts_match']}/{w['num_prompts']} prompts")
    report["header"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.json:
        write_json(args.json, report, indent=2)
        print(f"\nwrote {args.json}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
