"""Per-step token-mask fill of a batch, llguidance as sage_infer calls it and xgrammar as vLLM's CPU build does,
on the demo tokenizer (vocab 4096) and the bounded schema of bench/structured_vs_vllm.py, which runs it twice and
reads its JSON from stdout: llguidance in sage's venv (the version sage serves with), xgrammar in vLLM's.

Each sequence then takes a random allowed token, so the matchers walk real JSON; a finished one starts over.
xgrammar: one `fill_next_token_bitmask` per sequence into a shared bitmask, as vLLM's xgrammar backend fills a step
(serially below its parallel threshold); llguidance: one `fill_bitmask` call for the batch (its thread pool).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_vs_vllm import PERSON  # noqa: E402

from sage_infer.models.loader import DEMO_MODEL_DIR  # noqa: E402


def allowed_of(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    import numpy as np

    bits = bitmask[row].numpy().view("uint8")
    return np.flatnonzero(np.unpackbits(bits, bitorder="little")[:vocab]).tolist()


def llguidance_cost(batch: int, steps: int, rng: random.Random) -> float:
    from sage_infer.models.tokenizer import Tokenizer
    from sage_infer.structured import json_schema
    from sage_infer.structured.grammar import GrammarCompiler
    from sage_infer.structured.masks import fill_bitmask

    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    compiler, vocab, spec = GrammarCompiler(tokenizer, tokenizer.vocab_size), tokenizer.vocab_size, json_schema(PERSON)
    matchers = [compiler.matcher(spec) for _ in range(batch)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        bitmask = fill_bitmask([(m, []) for m in matchers], vocab)
        times.append(time.perf_counter() - start)
        for i in range(batch):
            matchers[i].accept(rng.choice(allowed_of(bitmask, i, vocab)))
            if matchers[i].is_finished:
                matchers[i] = compiler.matcher(spec)
    return statistics.mean(times) * 1e6


def xgrammar_cost(batch: int, steps: int, rng: random.Random) -> float:
    import transformers
    import xgrammar as xgr

    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    vocab = json.loads((DEMO_MODEL_DIR / "config.json").read_text())["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON), any_whitespace=True)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        times.append(time.perf_counter() - start)
        for i, matcher in enumerate(matchers):
            eos = tokenizer.eos_token_id
            allowed = [t for t in allowed_of(bitmask, i, vocab) if t != eos] or [eos]
            matcher.accept_token(rng.choice(allowed))
            if matcher.is_terminated():
                matchers[i] = xgr.GrammarMatcher(compiled)
    return statistics.mean(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--libraries", default="llguidance,xgrammar")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from importlib.metadata import version

    libraries = args.libraries.split(",")
    costs = {"llguidance": llguidance_cost, "xgrammar": xgrammar_cost}
    rows = []
    for batch in (1, 8, 32):
        for library in libraries:
            us = costs[library](batch, args.steps, random.Random(0))
            rows.append({"library": library, "batch": batch, "fill_us_per_step": us, "fill_us_per_token": us / batch})
    print(json.dumps({"versions": {name: version(name) for name in libraries}, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
