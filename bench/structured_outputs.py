"""Structured outputs' cost: the grammar masks per token at batch 1 / 8 / 32, and decode tokens per second with a
JSON schema against without, at batch 8, on the bundled demo model; plus a new schema's compile time (what the
first request with it waits) against a cached one. JSON out.

    .venv/bin/python bench/structured_outputs.py --out out/structured_outputs.json

Mask time: llguidance's batch executor filling one bitmask row per sequence (`structured.masks.fill_bitmask`),
each sequence then taking a random allowed token, so the matchers walk real JSON; the sampler's unpacking of the
bits onto the logits (`engine.sampler.apply_token_mask`) is timed apart. In serving the fill runs while the model
computes the step (`PendingMasks`), so only what is left of it after the forward, plus the unpacking, is on the
critical path; the decode ratio measures exactly that.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import write_json  # noqa: E402
from sage_infer import LLM, SamplingParams  # noqa: E402
from sage_infer.engine.sampler import apply_token_mask  # noqa: E402
from sage_infer.models.loader import DEMO_MODEL_DIR  # noqa: E402
from sage_infer.models.tokenizer import Tokenizer  # noqa: E402
from sage_infer.structured import json_schema  # noqa: E402
from sage_infer.structured.grammar import GrammarCompiler  # noqa: E402
from sage_infer.structured.masks import TokenMask, fill_bitmask, forbidden_tokens  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
    "role": {"enum": ["king", "queen", "fool", "ghost", "soldier"]},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
    "alive": {"type": "boolean"}}, "required": ["name", "age", "role", "lines", "alive"],
    "additionalProperties": False}
# a string too long to finish within the decode run: every row stays constrained, none ends early
SPEECH = {"type": "object", "properties": {"speaker": {"type": "string", "maxLength": 12},
                                           "speech": {"type": "string", "minLength": 4000}},
          "required": ["speaker", "speech"], "additionalProperties": False}
PROMPTS = ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "First Citizen:\n", "KING LEAR:\n", "Fool:\n", "PORTIA:\n",
           "MACBETH:\n"]


def mask_cost(compiler: GrammarCompiler, batch: int, steps: int, seed: int = 0) -> dict:
    """Mean microseconds to fill a batch's masks (per step and per token) and to apply them to logits."""
    rng = random.Random(seed)
    vocab = compiler.vocab_size
    spec = json_schema(PERSON)
    matchers = [compiler.matcher(spec) for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    fill, apply = [], []
    for _ in range(steps):
        start = time.perf_counter()
        bitmask = fill_bitmask([(m, []) for m in matchers], vocab)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_token_mask(logits.clone(), TokenMask(list(range(batch)), forbidden_tokens(bitmask, vocab)))
        apply.append(time.perf_counter() - start)
        for i, row in enumerate(forbidden_tokens(bitmask, vocab)):
            matchers[i].accept(rng.choice((~row).nonzero().flatten().tolist()))
            if matchers[i].is_finished:
                matchers[i] = compiler.matcher(spec)
    fill_us, apply_us = statistics.mean(fill) * 1e6, statistics.mean(apply) * 1e6
    return {"batch": batch, "steps": steps, "fill_us_per_step": fill_us, "fill_us_per_token": fill_us / batch,
            "apply_us_per_step": apply_us}


def compile_cost(tokenizer: Tokenizer) -> dict:
    """Seconds to compile a schema new to the process, and to find it again in the cache."""
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    start = time.perf_counter()
    compiler.matcher(json_schema(PERSON))
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.matcher(json_schema(PERSON))
    return {"new_schema_ms": first * 1e3, "cached_ms": (time.perf_counter() - start) * 1e3}


def decode_rate(llm: LLM, params: SamplingParams) -> float:
    """Generated tokens per second for the 8 prompts at once."""
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / (time.perf_counter() - start)


def decode_ratio(llm: LLM, plain: SamplingParams, constrained: SamplingParams, pairs: int) -> dict:
    """Runs without and with the schema alternated, `pairs` times: on a machine whose load drifts, each ratio
    compares two runs a few seconds apart. The medians."""
    decode_rate(llm, constrained)  # warm-up: the compile, the first steps
    without, with_schema = [], []
    for _ in range(pairs):
        without.append(decode_rate(llm, plain))
        with_schema.append(decode_rate(llm, constrained))
    return {"tok_s_without": statistics.median(without), "tok_s_with_json_schema": statistics.median(with_schema),
            "ratio": statistics.median(w / p for w, p in zip(with_schema, without)), "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="mask steps per batch size")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per sequence in the decode runs")
    parser.add_argument("--pairs", type=int, default=5, help="decode runs without and with the schema, alternated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    report = {"vocab_size": tokenizer.vocab_size, "compile": compile_cost(tokenizer),
              "masks": [mask_cost(compiler, b, args.steps) for b in (1, 8, 32)]}
    llm = LLM(None, dtype="fp32", device="cpu", kv_memory="64MiB")
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=0,
                                 structured_outputs=json_schema(SPEECH))
    report["decode_batch8"] = {**decode_ratio(llm, plain, constrained, args.pairs), "max_tokens": args.max_tokens}
    report["torch_threads"] = torch.get_num_threads()
    for row in report["masks"]:
        print(f"batch {row['batch']:>2}: mask fill {row['fill_us_per_step']:8.1f} us/step "
              f"({row['fill_us_per_token']:6.1f} us/token), apply {row['apply_us_per_step']:6.1f} us/step")
    d = report["decode_batch8"]
    print(f"decode batch 8: {d['tok_s_without']:.0f} tok/s without, {d['tok_s_with_json_schema']:.0f} tok/s with a "
          f"JSON schema: {d['ratio']:.2f}x")
    c = report["compile"]
    print(f"compile: a new schema {c['new_schema_ms']:.1f} ms, cached {c['cached_ms']:.3f} ms")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
