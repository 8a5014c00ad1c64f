"""Load a lower-tier hit or recompute it: TTFT with the prompt's KV in one tier ÷ TTFT with nothing cached.

    python bench/load_vs_recompute.py --json out/load_vs_recompute.json                 # 256 to 16K tokens
    python bench/load_vs_recompute.py --lengths 256,1024,4096,8192,16384,32768       # and 32K (~20 min, loaded)
    python bench/load_vs_recompute.py --lengths 256,1024 --repeats 1          # a quick look
    python bench/load_vs_recompute.py --device cuda --model qwen2.5-0.5b-shape --dtype bf16   # a GPU's device pool

Method
  Model     bench/vllm_models.py's `qwen3-11m` shape (`--model`; random weights, fp32 or `--dtype`, the demo
            tokenizer's vocabulary) with max_position_embeddings raised to the longest prompt, as
            bench/long_context.py scales its model; on `--device` (the device pool there, the tiers in host memory).
  Engine    one `LLM` per tier with that tier alone below the device (`host`, `disk` in a temp directory, and
            `redis` when a redis-server binary is installed: one is started on a loopback port), a device pool
            that holds the longest prompt, chunked prefill (`--budget` tokens a step), hot promotion off (a
            block loaded twice would otherwise come back to the device by itself), a 120 s load deadline.
  Per length and repeat (a fresh random prompt P each repeat; max_tokens 1, greedy):
    recompute  P's first run: nothing cached anywhere, every token computed.
    forced     P's KV evicted from the device into the tier (`reset_prefix_cache`; then `--settle-s` for the
               tier's background checksums and writes), P again with the load-or-compute decision replaced by
               "load every block found".
    decided    evicted again, P again with the engine's own decision (`kv_policy/load_or_compute.py`).
    whole      where the engine loads layer by layer (`--layer-loads`, kv_pool.layer_loads: on a CUDA pool by
               default), forced once more with the load written whole before the step: `layered/whole` is the
               forced TTFT ÷ this one.
  The loaded runs rotate their order between repeats. Prompts of `--long-from` tokens or more are computed
  once (one fresh P; its prefill takes many seconds and varies little), then loaded `--repeats` times each way.
  Prompts under `--short-below` tokens run `--short-repeats` times at least: their TTFTs are short and spread
  most (on a GPU 18-36 ms run to run), and where the decision computes, decided and recompute are the same path,
  so only more runs tell their medians apart.
  TTFT is the engine's own (arrival to first token); the ratio is each median ÷ the recompute median of the same
  length in the same engine. The load time (the tier read, `sage:kv_tier_load_latency_seconds`) is reported
  beside it, and its share of the loaded TTFT.
  Crossover   per tier, the shortest length from which loading (forced) is faster than recomputing at that
              length and every longer one ("all": at every length; "none": at none).
  Goal        decided ÷ recompute <= 1.0 at every length (within `--tolerance`, noise on a loaded machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402

BLOCK = 16
FIRST_REGULAR_TOKEN = 5  # the demo tokenizer's special tokens are 0-4
DEFAULT_LENGTHS = (256, 1024, 4096, 8192, 16384)  # 32768 too: `--lengths ...,32768` (about 2-7 min a tier more)


def long_model(max_len: int, cache_dir: Path, model: str = "qwen3-11m") -> Path:
    """`model` with its context (max_position_embeddings) raised to hold `max_len` tokens and an answer."""
    base = MODELS[model]
    context = max(4096, max_len + BLOCK)
    spec = dataclasses.replace(base, name=f"{base.name}-ctx{context}",
                               shape={**base.shape, "max_position_embeddings": context})
    return prepare_model(spec, cache_dir)


def start_redis() -> tuple[subprocess.Popen, str] | None:
    """A redis-server on a free loopback port, or None when the binary or the client package is missing."""
    binary = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        return None
    if binary is None:
        return None
    from sage_infer.hal.net import free_port

    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return process, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not answer PING within 20 s")


def make_llm(model_dir: Path, tier: str, max_len: int, budget: int, workdir: Path, redis_url: str | None,
             device: str = "cpu", dtype: str = "fp32", layer_loads: str = "auto"):
    from sage_infer import LLM
    from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig

    blocks = 2 * (max_len // BLOCK) + 64  # the prompt and one more: nothing is evicted by the runs themselves
    tier_bytes = 3 * (max_len // BLOCK + 8) * kv_bytes_per_block(model_dir, dtype)  # a prompt's blocks, three times
    tiers = {"host": dict(host_bytes=tier_bytes),
             "disk": dict(host_bytes=0, disk_path=str(workdir / "disk"), disk_bytes=tier_bytes),
             "redis": dict(host_bytes=0, remote_url=redis_url, remote_bytes=tier_bytes)}[tier]
    config = ServeConfig(
        model=ModelConfig(path=str(model_dir), dtype=dtype, max_model_len=max_len + BLOCK),
        kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=blocks, layer_loads=layer_loads),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=budget, enable_chunked_prefill=True),
        tiers=TierConfig(**tiers, load_timeout_s=120, hot_promote_after=0),
    )
    return LLM(config=config, device=device)


def kv_bytes_per_block(model_dir: Path, dtype: str = "fp32") -> int:
    import json

    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * (4 if dtype == "fp32" else 2) * BLOCK


class Probe:
    """One engine with one tier: runs a prompt and says its TTFT, the tokens it found cached, the load time."""

    def __init__(self, llm, settle_s: float) -> None:
        from sage_infer.core.sampling_params import SamplingParams

        self.llm = llm
        self.settle_s = settle_s
        self.one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.hierarchy = llm.engine.kv.source("tiers").hierarchy
        self.rates = self.hierarchy.rates
        self.decide = self.rates.blocks_to_load  # the engine's decision, kept for `decided` runs
        self.pool = llm.engine.runner.pool
        self.layer_loads = self.pool.layer_loads  # None: the engine loads whole (kv_pool.layer_loads off)

    def run(self, prompt: list[int], forced: bool, whole: bool = False) -> dict:
        # forced: every block found below is loaded (the decision off); the rates keep learning either way.
        # whole: this run writes its load into the pool before the step even where the engine loads layer by layer
        self.rates.blocks_to_load = (lambda levels, *_: len(levels)) if forced else self.decide
        self.pool.layer_loads = None if whole else self.layer_loads
        latency = self.hierarchy.stats.load_latency
        load_before = latency.total
        recomputed_before = self.hierarchy.stats.failures["recompute"]
        [out] = self.llm.generate([prompt], self.one)
        return {"ttft_s": out.metrics.ttft, "cached_tokens": out.metrics.num_cached_tokens,
                "load_s": latency.total - load_before,
                "declined_blocks": self.hierarchy.stats.failures["recompute"] - recomputed_before}

    def evict(self) -> None:
        """Every cached block off the device into the tier (as memory pressure would), then a pause: the tier's
        background work on them (the host tier's checksums, the disk tier's writes) finishes, as it has for KV
        that sits in a tier, and a load measures reading it, not the tail of its demotion."""
        self.llm.engine.kv.block_manager.reset_prefix_cache()
        for store in self.hierarchy.stores:
            store.flush()
        time.sleep(self.settle_s)


def measure_length(probe: Probe, length: int, repeats: int, recomputes: int, rng: random.Random,
                   vocab: int) -> dict:
    """`recomputes` fresh prompts, each computed once, then loaded `repeats` times in all (forced and decided
    alternating which goes first)."""
    runs: dict[str, list[dict]] = {"recompute": [], "forced": [], "decided": []}
    modes = ["forced", "decided"]
    if probe.layer_loads is not None:  # the engine loads layer by layer: also forced loads written whole, beside
        modes.append("whole")
        runs["whole"] = []
    # this length's first-use costs out of the way (a staging buffer of its size page-locked, shapes first seen):
    # a prompt computed, then loaded, untimed
    warm = [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(length)]
    for forced in (False, True):
        probe.run(warm, forced=forced)
        probe.evict()
    for r in range(repeats):
        if r < recomputes:
            prompt = [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(length)]
            runs["recompute"].append(probe.run(prompt, forced=False))
            probe.evict()
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            runs[mode].append(probe.run(prompt, forced=mode != "decided", whole=mode == "whole"))
            probe.evict()
    row = {mode: {"ttft_s": statistics.median(x["ttft_s"] for x in rs),
                  "load_s": statistics.median(x["load_s"] for x in rs),
                  "cached_tokens": statistics.median(x["cached_tokens"] for x in rs),
                  "declined_blocks": statistics.median(x["declined_blocks"] for x in rs),
                  "ttft_all_s": [x["ttft_s"] for x in rs]} for mode, rs in runs.items()}
    base = row["recompute"]["ttft_s"]
    row["load_share"] = row["forced"]["load_s"] / row["forced"]["ttft_s"]  # of a loaded prompt's TTFT, the read
    row["forced_ratio"] = row["forced"]["ttft_s"] / base
    row["decided_ratio"] = row["decided"]["ttft_s"] / base
    # the fastest of each against each other: where both compute, what is left of the medians' gap is noise
    row["decided_best_ratio"] = min(row["decided"]["ttft_all_s"]) / min(row["recompute"]["ttft_all_s"])
    if "whole" in row:  # layer by layer ÷ whole before the step, both loading every block
        row["layered_vs_whole"] = row["forced"]["ttft_s"] / row["whole"]["ttft_s"]
    rates = probe.rates
    step, (load_fixed, load_per_block) = rates.steps.line(), rates.load_cost()
    row["rates"] = {"prefill_gflop_s": rates.prefill.per_s / 1e9 if rates.prefill.per_s is not None else None,
                    "read_gb_s": {level: r.per_s / 1e9 for level, r in rates.reads.items() if r.per_s},
                    "step_fixed_ms": step[0] * 1e3 if step else None,  # the fitted step line (load_or_compute.py)
                    "step_marginal_gflop_s": 1e-9 / step[1] if step and step[1] else None,
                    "load_fixed_ms": load_fixed * 1e3, "load_us_per_block": load_per_block * 1e6,
                    # how far into a prompt the line prices blocks; steps and loads left out of the fits as outliers
                    "fitted_to": rates.fitted_to, "step_outliers": rates.steps.outliers,
                    "probed_ms": {n: t * 1e3 for n, t in rates.probed},
                    "load_outliers": rates.loads.outliers}
    return row


def computed_note(row: dict) -> str:
    """What the worst row's decision did: where it computed in every run it ran the recompute path, and the two
    medians differ by the runs' spread alone (given as recompute's own, fastest to slowest)."""
    spread = max(row["recompute"]["ttft_all_s"]) / min(row["recompute"]["ttft_all_s"])
    if row["decided"]["load_s"] == 0 and row["decided"]["cached_tokens"] == 0:
        return (f"  there the decision computed (the recompute path) in at least half the runs, over "
                f"{row['repeats']} repeats; recompute's own runs spread {spread:.2f}x fastest to slowest")
    return (f"  there the decision loaded {row['decided']['cached_tokens']:.0f} tokens (median of {row['repeats']} "
            f"repeats); recompute's own runs spread {spread:.2f}x fastest to slowest")


def crossover(rows: dict[int, dict]) -> str:
    """The shortest length from which forced loading beats recomputing at it and every longer one."""
    lengths = sorted(rows)
    wins = [rows[n]["forced_ratio"] < 1.0 for n in lengths]
    if all(wins):
        return "all"
    if not wins[-1]:
        return "none"
    first = max(i for i, w in enumerate(wins) if not w) + 1
    return str(lengths[first])


def print_table(results: dict[str, dict[int, dict]]) -> None:
    layered = any("whole" in row for rows in results.values() for row in rows.values())
    print(f"{'tier':<6} {'prompt':>7} {'recompute ms':>13} {'forced ms':>10} {'decided ms':>11} "
          f"{'load ms':>8} {'load share':>10} {'forced/rec':>10} {'decided/rec':>11} {'best d/r':>8} "
          f"{'loaded tok':>10}"
          + ("  whole ms  layered/whole" if layered else ""))
    for tier, rows in results.items():
        for length, row in sorted(rows.items()):
            whole = (f" {row['whole']['ttft_s'] * 1e3:>9.1f} {row['layered_vs_whole']:>14.3f}" if 'whole' in row
                     else "")
            print(f"{tier:<6} {length:>7} {row['recompute']['ttft_s'] * 1e3:>13.1f} "
                  f"{row['forced']['ttft_s'] * 1e3:>10.1f} {row['decided']['ttft_s'] * 1e3:>11.1f} "
                  f"{row['forced']['load_s'] * 1e3:>8.1f} {row['load_share']:>10.2f} {row['forced_ratio']:>10.3f} "
                  f"{row['decided_ratio']:>11.3f} {row['decided_best_ratio']:>8.3f} "
                  f"{row['decided']['cached_tokens']:>10.0f}{whole}")
        print(f"{tier:<6} crossover (loading faster from this length on): {crossover(rows)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    parser.add_argument("--tiers", default="host,disk,redis", help="of host, disk, redis (redis: when installed)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-from", type=int, default=16384,
                        help="prompts this long are computed once (a prefill of many seconds varies little), then "
                             "loaded --repeats times")
    parser.add_argument("--short-repeats", type=int, default=9,
                        help="at least this many repeats for prompts under --short-below tokens")
    parser.add_argument("--short-below", type=int, default=2048)
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause after each eviction (see Probe.evict)")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="decided/recompute above 1 + this fails")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "sage-bench-models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="the device pool's device (cpu, cuda)")
    parser.add_argument("--model", default="qwen3-11m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--layer-loads", default="auto", choices=["auto", "on", "off"],
                        help="kv_pool.layer_loads; where the engine loads layer by layer, a third loaded run per "
                             "repeat writes the load whole before the step (`whole`), for the ratio between them")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    model_dir = long_model(max(lengths), args.cache_dir, args.model)
    vocab = 4096
    redis = start_redis() if "redis" in args.tiers.split(",") else None
    tiers = [t for t in args.tiers.split(",") if t != "redis" or redis is not None]
    if "redis" in args.tiers.split(",") and redis is None:
        print("redis: skipped (no redis-server binary or no redis package)")
    results: dict[str, dict[int, dict]] = {}
    started = time.perf_counter()
    try:
        for tier in tiers:
            with tempfile.TemporaryDirectory(prefix="sage-lvr-") as workdir:
                llm = make_llm(model_dir, tier, max(lengths), args.budget, Path(workdir), redis and redis[1],
                               args.device, args.dtype, args.layer_loads)
                probe = Probe(llm, args.settle_s)
                print(f"  {tier}: prefill steps timed at start "
                      + ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in probe.rates.probed), flush=True)
                probe.run([FIRST_REGULAR_TOKEN] * 64, forced=False)  # warm-up: first-call costs out of the way
                rng = random.Random(args.seed)
                results[tier] = {}
                for length in lengths:
                    t0 = time.perf_counter()
                    repeats = max(args.repeats, args.short_repeats) if length < args.short_below else args.repeats
                    recomputes = repeats if length < args.long_from else 1
                    results[tier][length] = measure_length(probe, length, repeats, recomputes, rng, vocab)
                    results[tier][length]["repeats"] = repeats
                    print(f"  {tier} {length}: {time.perf_counter() - t0:.1f} s", flush=True)
                llm.close()
    finally:
        if redis is not None:
            redis[0].kill()
    print_table(results)
    worst = max((row["decided_ratio"], tier, n) for tier, rows in results.items() for n, row in rows.items())
    ok = worst[0] <= 1.0 + args.tolerance
    print(f"worst decided/recompute: {worst[0]:.3f} ({worst[1]}, {worst[2]} tokens) -> "
          f"{'PASS' if ok else 'FAIL'} (<= 1 + {args.tolerance}); fastest against fastest at worst "
          f"{max(row['decided_best_ratio'] for rows in results.values() for row in rows.values()):.3f}")
    print(computed_note(results[worst[1]][worst[2]]))
    machine = platform.processor() or platform.machine()
    if args.device.startswith("cuda"):
        import torch

        machine = torch.cuda.get_device_name(0)
    write_json(args.json, {"machine": machine, "device": args.device, "dtype": args.dtype, "lengths": lengths,
                           "layer_loads": args.layer_loads,
                           "repeats": args.repeats, "budget": args.budget, "model": str(model_dir),
                           "seconds": time.perf_counter() - started,
                           "tiers": {t: {str(n): row for n, row in rows.items()} for t, rows in results.items()},
                           "crossover": {t: crossover(rows) for t, rows in results.items()},
                           "worst_decided_ratio": worst[0], "pass": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
