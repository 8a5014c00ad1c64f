"""Bytes a lower-tier prefix hit moves for a hybrid model (sliding-window and full layers) against the same prompts
with full-attention KV, in one run.

    python bench/kv_groups_tiers.py --json out/kv_groups_tiers.json
    python bench/kv_groups_tiers.py --window 128 --conversations 6 --turns 4

Method
  Models     two random Gemma-3-shaped models with the same weights (`--layers` layers, one full-attention layer in
             six, the rest a sliding window of `--window` keys): "hybrid" as configured (a KV group per layer kind,
             `kv_runtime.kv_groups`), "full" with every layer full attention (`layer_types`), so its KV is the plain
             one-table layout. fp32, CPU, one torch thread.
  Workload   `--conversations` multi-turn conversations of `--turns` turns, taken in turn order across
             conversations; turn 1 is `--first-tokens` random tokens (4 windows by default), each later turn is
             the previous prompt, its `--max-tokens` greedy answer and `--user-tokens` new ones.
  Tiers      a host tier big enough for everything; before every request the device's prefix cache is emptied
             into it (`reset_prefix_cache`: other traffic's eviction pressure, made deterministic), so every
             turn after the first finds its whole prefix in the host tier and loads it back. No hot promotion
             (`tiers.hot_promote_after: 0`): every block loaded is one a request asked for.
  Counted    per request, the hierarchy's loaded and demoted blocks x the pool's block bytes; a hit is a request
             that loaded something. TTFT = `metrics.ttft`; hit rate = cached / prompt tokens.
  Checked    the hybrid engine's tokens with tiers equal its tokens without (every request computed; its
             TTFT is the third row).

Ratios hybrid / full: `load_bytes_per_hit`, `demote_bytes_per_hit` (a sliding group's blocks out of the window are
cached on the device, so they are demoted too, though a hit never loads them), and both directions together.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import write_json  # noqa: E402
from sage_infer import LLM, SamplingParams  # noqa: E402
from sage_infer.config.serve import ServeConfig  # noqa: E402
from tests.tiny_models import save_tokenizer  # noqa: E402

VOCAB = 512


def make_models(root: Path, layers: int, window: int, hidden: int) -> dict[str, Path]:
    """The hybrid model and its full-attention twin (same weights), saved under `root`."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=8192,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, sliding_window=window, query_pre_attn_scalar=24)
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    hybrid = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, layer_types=kinds)).eval()
    full = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, layer_types=["full_attention"]
                                                                        * layers)).eval()
    full.load_state_dict(hybrid.state_dict())
    dirs = {}
    for name, model in (("hybrid", hybrid), ("full", full)):
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        save_tokenizer(dirs[name], VOCAB)
    return dirs


def engine(directory: Path, host_bytes: int, block_size: int) -> LLM:
    config = {"model": {"path": str(directory), "dtype": "fp32"},
              "kv_pool": {"block_size": block_size, "num_blocks": 4096},
              "scheduler": {"max_num_seqs": 1}, "tiers": {"host_bytes": host_bytes, "hot_promote_after": 0}}
    return LLM(config=ServeConfig.model_validate(config))


def conversations(args) -> list[list[list[int]]]:
    """Per conversation, its user tokens per turn (turn 1: the first prompt)."""
    rng = random.Random(args.seed)
    return [[[rng.randrange(3, VOCAB) for _ in range(args.first_tokens if turn == 0 else args.user_tokens)]
             for turn in range(args.turns)] for _ in range(args.conversations)]


def run(llm: LLM, talks: list[list[list[int]]], max_tokens: int, evict: bool) -> dict:
    """Every turn of every conversation, in turn order; per request the tier traffic it caused."""
    kv = llm.engine.kv
    tiers = kv.source("tiers")
    block_nbytes = llm.engine.runner.pool.block_nbytes
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    history = [[] for _ in talks]
    tokens, rows = [], []
    for turn in range(len(talks[0])):
        for c, talk in enumerate(talks):
            prompt = history[c] + talk[turn]
            stats = tiers.hierarchy.stats if tiers is not None else None
            before = (stats.loaded_blocks, stats.demoted_blocks) if stats else (0, 0)
            if evict:  # (its demotions count for this request)
                kv.block_manager.reset_prefix_cache()
            [out] = llm.generate([prompt], params)
            after = (stats.loaded_blocks, stats.demoted_blocks) if stats else (0, 0)
            answer = list(out.outputs[0].token_ids)
            tokens.append(answer)
            history[c] = prompt + answer
            rows.append({"turn": turn, "prompt_tokens": len(prompt), "cached_tokens": out.metrics.num_cached_tokens,
                         "ttft_s": out.metrics.ttft, "loaded_bytes": (after[0] - before[0]) * block_nbytes,
                         "demoted_bytes": (after[1] - before[1]) * block_nbytes})
    return {"tokens": tokens, "requests": rows}


def summary(result: dict) -> dict:
    rows = result["requests"]
    hits = [r for r in rows if r["loaded_bytes"]]
    later = [r for r in rows if r["turn"] > 0]
    return {"requests": len(rows), "tier_hits": len(hits),
            "load_bytes_per_hit": sum(r["loaded_bytes"] for r in hits) / max(1, len(hits)),
            "demote_bytes_per_hit": sum(r["demoted_bytes"] for r in rows) / max(1, len(hits)),
            "hit_rate_later_turns": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"]
                                                                                      for r in later)),
            "ttft_p50_later_turns_s": statistics.median(r["ttft_s"] for r in later) if later else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-tokens", type=int, default=None, help="default: 4 windows")
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.first_tokens = args.first_tokens or 4 * args.window
    torch.set_num_threads(1)
    talks = conversations(args)
    report: dict = {"machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
                    "args": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory() as root:
        dirs = make_models(Path(root), args.layers, args.window, args.hidden)
        results = {name: run(engine(dirs[name], 1 << 30, args.block_size), talks, args.max_tokens, evict=True)
                   for name in ("hybrid", "full")}
        plain = run(engine(dirs["hybrid"], 0, args.block_size), talks, args.max_tokens, evict=True)
    report["hybrid"], report["full"] = summary(results["hybrid"]), summary(results["full"])
    report["hybrid_without_tiers"] = summary(plain)  # every request computed: the TTFT a hit saves
    report["hybrid_tokens_equal_without_tiers"] = results["hybrid"]["tokens"] == plain["tokens"]
    report["load_bytes_per_hit_ratio"] = report["hybrid"]["load_bytes_per_hit"] / report["full"]["load_bytes_per_hit"]
    report["demote_bytes_per_hit_ratio"] = (report["hybrid"]["demote_bytes_per_hit"]
                                            / report["full"]["demote_bytes_per_hit"])
    both = {name: report[name]["load_bytes_per_hit"] + report[name]["demote_bytes_per_hit"]
            for name in ("hybrid", "full")}
    report["tier_bytes_per_hit_ratio"] = both["hybrid"] / both["full"]  # both directions
    print(f"{'layout':20} {'hits':>5} {'load MB/hit':>12} {'demote MB/hit':>14} {'hit rate':>9} {'TTFT p50 ms':>12}")
    for name in ("hybrid", "full", "hybrid_without_tiers"):
        row = report[name]
        print(f"{name:20} {row['tier_hits']:>5} {row['load_bytes_per_hit'] / 1e6:>12.3f} "
              f"{row['demote_bytes_per_hit'] / 1e6:>14.3f} {row['hit_rate_later_turns']:>9.3f} "
              f"{row['ttft_p50_later_turns_s'] * 1e3:>12.1f}")
    print(f"bytes loaded per hit, hybrid / full: {report['load_bytes_per_hit_ratio']:.3f}; demoted: "
          f"{report['demote_bytes_per_hit_ratio']:.3f}; both: {report['tier_bytes_per_hit_ratio']:.3f}; "
          f"hybrid tokens equal without tiers: "
          f"{report['hybrid_tokens_equal_without_tiers']}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
