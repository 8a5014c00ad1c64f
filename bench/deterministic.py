"""Batch invariance over HTTP: N concurrent greedy streams against the same requests served one at a time.

For each mode (the default path, then ``--deterministic``) it starts `sage llm serve`, sends every prompt alone
(completions, greedy, ``logprobs: 1``), then all of them at once as streams, and counts the requests whose
concurrent tokens (and logprobs, to the bit) equal their solo run's. The cost: the concurrent phase's output
tokens per second and the solo phase's mean seconds per request, deterministic over default. JSON out.

    .venv/bin/python bench/deterministic.py --requests 100 --max-tokens 64 --out out/deterministic.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pd import start, stop  # noqa: E402


async def one(client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> tuple[list[str], list[float]]:
    """A streamed greedy completion: its tokens (as the server names them) and their logprobs."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             logprobs=1, stream=True, extra_body={"ignore_eos": True})
    tokens, logprobs = [], []
    async for chunk in stream:
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            logprobs += choice.logprobs.token_logprobs or []
    return tokens, logprobs


async def run_mode(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    start_solo = time.perf_counter()
    solo = [await one(client, model, p, max_tokens) for p in prompts]
    solo_s = time.perf_counter() - start_solo
    start_batch = time.perf_counter()
    together = await asyncio.gather(*(one(client, model, p, max_tokens) for p in prompts))
    batch_s = time.perf_counter() - start_batch
    await client.close()
    tokens = sum(len(t) for t, _ in together)
    return {"same_tokens": sum(a[0] == b[0] for a, b in zip(solo, together)),
            "same_logprobs": sum(a[1] == b[1] for a, b in zip(solo, together)),
            "requests": len(prompts), "concurrent_tok_s": tokens / batch_s, "concurrent_s": batch_s,
            "solo_s_per_request": solo_s / len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled demo model)")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="extra --set for both servers")
    parser.add_argument("--out", default="out/deterministic.json")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(5, 2000) for _ in range(rng.randrange(4, 200))] for _ in range(args.requests)]
    common = ([] if args.model is None else ["--model", args.model]) + [x for s in args.set for x in ("--set", s)]
    common += ["--set", f"scheduler.max_num_seqs={max(args.requests, 1)}",
               "--set", f"scheduler.max_waiting={max(args.requests, 1)}"]
    results = {}
    for mode, flags in (("default", []), ("deterministic", ["--deterministic"])):
        proc, url, _ = start([*common, *flags])
        try:
            results[mode] = asyncio.run(run_mode(url, prompts, args.max_tokens))
        finally:
            stop(proc)
        r = results[mode]
        print(f"{mode:>13}: {r['same_tokens']}/{r['requests']} concurrent streams token-identical to their solo "
              f"run, {r['same_logprobs']}/{r['requests']} logprobs bit-identical; concurrent "
              f"{r['concurrent_tok_s']:.1f} tok/s, solo {r['solo_s_per_request']:.3f} s/request")
    d, b = results["deterministic"], results["default"]
    results["cost"] = {"concurrent_tok_s_ratio": d["concurrent_tok_s"] / b["concurrent_tok_s"],
                       "solo_latency_ratio": d["solo_s_per_request"] / b["solo_s_per_request"]}
    print(f"deterministic / default: concurrent throughput {results['cost']['concurrent_tok_s_ratio']:.2f}x, "
          f"solo latency {results['cost']['solo_latency_ratio']:.2f}x")
    results["args"] = vars(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
