"""Lower KV tiers (host DRAM, local disk, Redis) on the Mooncake conversation trace, against an
unbounded device pool, plus the tier stores' migration throughput against raw copies, in one run.

    python bench/tiers.py --json out/tiers.json
    python bench/tiers.py --num-requests 100 --quick

Method
  Workload   the first `--num-requests` rows of the Mooncake FAST'25 conversation trace, in
             trace order. Each trace block (hash id, 512 tokens in the trace) becomes one engine
             block of `--block-size` tokens whose ids come from `random.Random(hash_id)` over the
             vocabulary, so prompts that share hash-id prefixes share token prefixes (the trace's
             last, partial block is replayed as a full one). Prompt = its blocks + 1 token drawn
             per request, so every full block of the prompt can be a prefix hit. Greedy,
             `--max-tokens` output tokens, ignore_eos.
  Model      a random Llama (tests/tiny_models.py), fp32, CPU.
  Capacity   D = distinct hash ids of the replayed requests (= distinct full engine blocks).
             device pool = max(`--device-frac` x D, longest prompt + `--max-num-seqs` blocks);
             host = `--host-frac` x D; disk and Redis = `--disk-frac` / `--remote-frac` x D;
             bytes = blocks x `pool.block_nbytes`. The unbounded pool has a block for every
             prompt and output token of the run, so it never evicts.
  Submission sequential `LLM.generate` calls of `--max-num-seqs` prompts in trace order: a
             conversation's next turn arrives after its previous turn finished (as in the
             trace, minutes apart), which one `generate` call with every prompt would not
             give (all turns queued at t=0, a later turn could be admitted before the earlier
             one has written its blocks). TTFT = `metrics.ttft` (arrival = its batch's submit).
  Hit rate   sum of `num_cached_tokens` / sum of prompt tokens, as the engine measured it
             (device hits and blocks loaded back from a tier both count).
  Migration  `bench/tiers_raw.measure`: host put / get_prefix vs a torch copy of the same bytes,
             disk put+flush / get_prefix vs os.pwrite / os.preadv (page cache, no fsync), at the
             engine's block and at a Llama-3-8B-shaped block (bf16, 32 layers x 8 KV heads x 128).
             Also the engine's own demote / load time (HierarchyManager, timed from outside).
  Prefetch   the engine's reads of a queued request's lower-tier blocks (`KVLoader`): issued, used (claimed by
             their request), hit ratio = used / issued (goal >= 0.85), the bytes read and those read for nothing.
             With `--max-num-seqs` prompts a call, a prompt queued behind others is the one a prefetch can serve.
  Simulator  `sim.tiered.replay_tiered` (LRU, the same MigrationPolicy) at the same capacities, on the
             replayed window and on the whole trace: the engine's hit rate should equal the first,
             and the second says what the capacity fractions give over the trace's full hour.
  Threads    one torch thread by default: with two OpenMP threads on a 2-vCPU machine any other
             runnable thread (the disk tier's writer, redis-server, another process) stalls every
             parallel region, and a run measured 30x slower that way.
  Runs       `--runs` interleaved passes over the configurations; each keeps its fastest pass
             (hit rates and tokens do not change between passes).

Every configuration builds a fresh `LLM`; all must produce the same greedy tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_hf import percentile  # noqa: E402
from bench.tiers_raw import measure  # noqa: E402
from sage_infer import LLM, SamplingParams  # noqa: E402
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig  # noqa: E402
from sage_infer.core.kv_schema import KVCacheSchema  # noqa: E402
from sage_infer.sim.replay import TraceRequest, distinct_blocks, load_mooncake  # noqa: E402
from sage_infer.sim.tiered import TierSpec, replay_tiered  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

TRACE = Path("/work/shared/traces/mooncake/conversation_trace.jsonl")
FIRST_REGULAR_TOKEN = 5  # tiny models reserve ids 0-4 for special tokens
LLAMA8B_BLOCK = dict(num_layers=32, num_kv_heads=8, head_dim=128)  # bf16, 2 MiB per 16-token block
GOAL_HIT, GOAL_MIGRATION, GOAL_TTFT, GOAL_PREFETCH = 0.95, 0.85, 1.2, 0.85


# -- workload ---------------------------------------------------------------------------------


def block_tokens(hash_id: int, block_size: int, vocab: int) -> list[int]:
    """The `block_size` token ids that stand for trace block `hash_id` (a pure function of it)."""
    rng = random.Random(hash_id)
    return [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(block_size)]


def build_prompts(requests: list[TraceRequest], block_size: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[t for h in r.hash_ids for t in block_tokens(h, block_size, vocab)] + [rng.randrange(FIRST_REGULAR_TOKEN,
            vocab)] for r in requests]


# -- Redis ------------------------------------------------------------------------------------


@dataclass
class Redis:
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def start_redis() -> Redis | str:
    """A `redis-server` on a free loopback port with persistence off, or why there is none."""
    binary = shutil.which("redis-server")
    if binary is None:
        return "redis-server not installed"
    try:
        import redis
    except ImportError:
        return "the redis package is not installed (pip install 'sage-infer[redis]')"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Redis(f"redis://127.0.0.1:{port}/0", process)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if client.ping():
                return server
        except redis.RedisError:
            time.sleep(0.05)
    server.stop()
    return f"redis-server on port {port} did not answer PING"


# -- one configuration ------------------------------------------------------------------------


@dataclass(slots=True)
class Setup:
    name: str
    device_blocks: int
    tiers: dict[str, object] = field(default_factory=dict)  # TierConfig fields (sizes in blocks until to_bytes)
    tier_blocks: dict[str, int] = field(default_factory=dict)  # for the table


class Stopwatch:
    """Wall seconds spent inside wrapped calls (the engine's demote and load paths)."""

    def __init__(self) -> None:
        self.seconds = {"demote": 0.0, "load": 0.0}

    def wrap(self, kind: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
        return timed


def tier_stats(llm: LLM) -> list[dict]:
    """Per-tier traffic from `EngineStats.tiers`."""
    return [{"tier": s.name, "blocks": s.blocks, "demoted": s.demoted_blocks, "loaded": s.loaded_blocks,
             "errors": s.errors, "checksum_failures": s.checksum_failures} for s in llm.engine.stats().tiers]


def run_setup(setup: Setup, model_dir: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[dict, list]:
    config = ServeConfig(
        model=ModelConfig(path=model_dir, dtype="fp32"),
        kv_pool=KVPoolConfig(block_size=args.block_size, num_blocks=setup.device_blocks),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        tiers=TierConfig(**setup.tiers),
    )
    llm = LLM(config=config, device="cpu")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    # warm-up prompts shorter than a block: they leave no full block behind, so the cache starts empty
    warm = random.Random(-1)
    llm.generate([[warm.randrange(FIRST_REGULAR_TOKEN, args.vocab) for _ in range(args.block_size - 1)]] * 2, params)
    watch = Stopwatch()
    tier_source = llm.engine.kv.source("tiers")
    hierarchy = tier_source.hierarchy if tier_source is not None else None
    if hierarchy is not None:
        hierarchy.read = watch.wrap("load", hierarchy.read)  # the reads, on whichever thread runs them
        manager = llm.engine.kv.block_manager
        manager.on_evict = watch.wrap("demote", manager.on_evict)
    outs = []
    cpu0, start = time.process_time(), time.perf_counter()
    for b in range(0, len(prompts), args.max_num_seqs):
        outs.extend(llm.generate(prompts[b:b + args.max_num_seqs], params))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{setup.name}: {len(errors)} requests failed, first: {errors[0]}")
    ttfts = [o.metrics.ttft for o in outs]
    prompt_tokens = sum(map(len, prompts))
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    block_bytes = llm.engine.runner.pool.block_nbytes
    tiers = tier_stats(llm)
    moved = {"demote": sum(t["demoted"] for t in tiers), "load": sum(t["loaded"] for t in tiers)}
    row = {
        "config": setup.name,
        "device_blocks": setup.device_blocks,
        "tier_blocks": setup.tier_blocks,
        "block_bytes": block_bytes,
        "wall_s": wall,
        "cpu_util": cpu / wall,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(o.metrics.num_cached_tokens for o in outs),
        "hit_rate": sum(o.metrics.num_cached_tokens for o in outs) / prompt_tokens,
        "preemptions": sum(o.metrics.num_preemptions for o in outs),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "output_tok_s": generated / wall,
        "total_tok_s": (prompt_tokens + generated) / wall,
        "tiers": tiers,
        "prefetch": prefetch_row(tier_source, block_bytes),
        "dropped_blocks": hierarchy.stats.dropped_blocks if hierarchy is not None else 0,
        "load_failures": hierarchy.stats.load_failures if hierarchy is not None else 0,
        # the engine's own migration: wall time inside HierarchyManager.on_evict / load; "blocks" are
        # blocks written into (demote) or read from (load) any tier, a host victim moved to disk counts again
        "engine_migration": {kind: {"seconds": watch.seconds[kind], "blocks": moved[kind],
                                    "gb_s": moved[kind] * block_bytes / watch.seconds[kind] / 1e9
                                    if watch.seconds[kind] else None} for kind in moved},
    }
    if hierarchy is not None:
        hierarchy.close()
    return row, [o.outputs[0].token_ids for o in outs]


def prefetch_row(tier_source, block_bytes: int) -> dict | None:
    """The engine's prefetches of queued requests' lower-tier blocks (`KVLoader`): issued, used (claimed with at least
    one block), the hit ratio used ÷ issued, wasted ones by reason, and the blocks / bytes read and wasted."""
    loader = getattr(tier_source, "loader", None)
    if loader is None:
        return None
    stats = loader.stats
    return {"issued": stats.issued, "used": stats.used, "hit_ratio": stats.hit_ratio, "wasted": dict(stats.wasted),
            "blocks_read": stats.blocks_read, "blocks_wasted": stats.blocks_wasted,
            "bytes_read": stats.blocks_read * block_bytes, "bytes_wasted": stats.blocks_wasted * block_bytes}


# -- plan and report --------------------------------------------------------------------------


def plan(args: argparse.Namespace, requests: list[TraceRequest], prompts: list[list[int]],
         remote_url: str | None) -> tuple[list[Setup], dict]:
    """Capacities in engine blocks for every configuration; the tier sizes in bytes need the pool's block size."""
    distinct = distinct_blocks(requests)
    longest = max(-(-len(p) // args.block_size) for p in prompts)
    floor = longest + args.max_num_seqs
    device = max(math.ceil(args.device_frac * distinct), floor)
    unbounded = sum(-(-(len(p) + args.max_tokens) // args.block_size) for p in prompts) + 16
    host, disk, remote = (max(1, math.ceil(f * distinct)) for f in (args.host_frac, args.disk_frac, args.remote_frac))
    sizes = {"distinct_blocks": distinct, "longest_prompt_blocks": longest, "device_blocks": device,
             "device_raised_to_floor": device > math.ceil(args.device_frac * distinct), "host_blocks": host,
             "disk_blocks": disk, "remote_blocks": remote, "unbounded_blocks": unbounded}
    return [Setup("device only", device),
            Setup("+ host", device, {"host_bytes": host}, {"host": host}),
            Setup("+ host + disk", device, {"host_bytes": host, "disk_path": None, "disk_bytes": disk},
                  {"host": host, "disk": disk}),
            Setup("+ redis", device, {"remote_url": remote_url, "remote_bytes": remote}, {"redis": remote}),
            Setup("unbounded device", unbounded)], sizes


def simulate(requests: list[TraceRequest], device_blocks: int, host_blocks: int) -> dict:
    """LRU prefix hit rate of the trace simulator with device + host blocks, device alone, and unbounded."""
    tiered = replay_tiered(requests, "lru", [TierSpec("device", device_blocks), TierSpec("host", host_blocks)])
    device = replay_tiered(requests, "lru", [TierSpec("device", device_blocks)])
    ideal = replay_tiered(requests, "lru", [TierSpec("device", distinct_blocks(requests))]).prefix_hit_rate
    return {"requests": len(requests), "device_blocks": device_blocks, "host_blocks": host_blocks,
            "device_hit": device.prefix_hit_rate, "device_host_hit": tiered.prefix_hit_rate,
            "unbounded_hit": ideal, "device_host_ratio": tiered.prefix_hit_rate / ideal}


def to_bytes(setup: Setup, block_bytes: int) -> None:
    """Turn the block counts of `setup.tiers` into bytes."""
    for key in ("host_bytes", "disk_bytes", "remote_bytes"):
        if key in setup.tiers:
            setup.tiers[key] *= block_bytes


def empty_lower_tiers(setup: Setup, work: Path) -> None:
    """Start a run with empty disk and Redis tiers: both outlive an engine (a restarted engine, or a
    second one on the same Redis, hits what the last run left there), which would flatter a later run."""
    if "disk_path" in setup.tiers:
        setup.tiers["disk_path"] = tempfile.mkdtemp(prefix="disk-tier-", dir=work)
    if setup.tiers.get("remote_url"):
        import redis

        client = redis.Redis.from_url(setup.tiers["remote_url"])
        client.flushdb()
        client.close()


def migration_rows(schema: KVCacheSchema, blocks: int, repeats: int, directory: Path, label: str) -> list[dict]:
    rows = measure(schema, blocks, repeats, directory)
    return [{"block": label, "block_bytes": schema.bytes_per_block, "blocks": blocks, **r}
            for r in rows if r["tier"] != "-"]


def print_report(report: dict) -> None:
    rows = report["results"]
    print(f"\n{report['workload']['requests']} requests, {report['workload']['prompt_tokens']} prompt tokens, "
          f"D = {report['capacity']['distinct_blocks']} distinct blocks of {report['workload']['block_size']} tokens "
          f"({rows[0]['block_bytes'] / 1024:.0f} KiB each)")
    print(f"{'config':<17} {'dev blk':>7} {'tier blk':<17} {'hit':>6} {'/unb':>5} {'TTFT p50':>9} {'/unb':>5} "
          f"{'TTFT p99':>9} {'out tok/s':>9} {'tot tok/s':>9}  tiers demoted/loaded/err")
    for r in rows:
        tiers = " ".join(f"{t['tier']} {t['demoted']}/{t['loaded']}/{t['errors']}" for t in r["tiers"]) or "-"
        blocks = " ".join(f"{k} {v}" for k, v in r["tier_blocks"].items()) or "-"
        print(f"{r['config']:<17} {r['device_blocks']:>7} {blocks:<17} {r['hit_rate']:>6.1%} "
              f"{r['hit_ratio_to_unbounded']:>5.2f} {r['ttft_p50_s'] * 1e3:>7.1f}ms "
              f"{r['ttft_p50_ratio_to_unbounded']:>5.2f} "
              f"{r['ttft_p99_s'] * 1e3:>7.1f}ms {r['output_tok_s']:>9.1f} {r['total_tok_s']:>9.0f}  {tiers}")
    for name, reason in report["skipped"].items():
        print(f"{name:<17} skipped: {reason}")
    print("\nprefetches of queued requests' lower-tier blocks (used = claimed by their request):")
    for r in rows:
        if pf := r.get("prefetch"):
            wasted = ", ".join(f"{k} {v}" for k, v in pf["wasted"].items())
            print(f"  {r['config']:<17} issued {pf['issued']:>6} used {pf['used']:>6} hit {pf['hit_ratio']:>7.2%}  "
                  f"wasted: {wasted}; read {pf['bytes_read'] / 2**20:.1f} MiB, "
                  f"wasted {pf['bytes_wasted'] / 2**20:.1f} MiB")
    print("\nengine migration (time inside HierarchyManager.on_evict / load):")
    for r in rows:
        for kind, m in r["engine_migration"].items():
            if m["blocks"]:
                print(f"  {r['config']:<17} {kind:<6} {m['blocks']:>6} blocks {m['seconds']:>7.3f}s "
                      f"{m['gb_s']:>6.3f} GB/s")
    print(f"\n{'block':<12} {'tier':<5} {'op':<17} {'GB/s':>7}  {'raw peer':<11} {'GB/s':>7} {'ratio':>6}")
    for m in report["migration"]:
        print(f"{m['block']:<12} {m['tier']:<5} {m['op']:<17} {m['gb_s']:>7.2f}  {m['peer']:<11} "
              f"{m['peer_gb_s']:>7.2f} {m['ratio_to_peer']:>6.2f}")
    print("\ntrace simulator (sim.tiered, LRU) at the same fractions of distinct blocks:")
    for sim in report["simulator_lru"]:
        print(f"  {sim['requests']:>6} requests  device {sim['device_blocks']} blocks {sim['device_hit']:.1%}  "
              f"+ host {sim['host_blocks']} blocks {sim['device_host_hit']:.1%}  unbounded {sim['unbounded_hit']:.1%}"
              f"  -> device+host / unbounded {sim['device_host_ratio']:.2f}")
    print(f"\ngreedy tokens identical across configurations: {report['tokens_identical']}"
          + ("" if report["tokens_identical"] else f" (mismatches: {report['token_mismatches']})"))
    for goal in report["goals"]:
        print(f"goal {goal['goal']}: {goal['value']:.3f} vs {goal['target']} -> {'met' if goal['met'] else 'NOT met'}")


def goals(rows: dict[str, dict], migration: list[dict]) -> list[dict]:
    out = []
    if "+ host" in rows:
        out.append({"goal": "hit(device 5% + host 20%) / hit(unbounded) >= 0.95",
                    "value": rows["+ host"]["hit_ratio_to_unbounded"], "target": GOAL_HIT,
                    "met": rows["+ host"]["hit_ratio_to_unbounded"] >= GOAL_HIT})
        out.append({"goal": "TTFT p50(device 5% + host 20%) / TTFT p50(unbounded) <= 1.2",
                    "value": rows["+ host"]["ttft_p50_ratio_to_unbounded"], "target": GOAL_TTFT,
                    "met": rows["+ host"]["ttft_p50_ratio_to_unbounded"] <= GOAL_TTFT})
    for name, row in rows.items():
        if (pf := row.get("prefetch")) and pf["issued"]:
            out.append({"goal": f"prefetch hit ratio ({name}) >= 0.85", "value": pf["hit_ratio"],
                        "target": GOAL_PREFETCH, "met": pf["hit_ratio"] >= GOAL_PREFETCH})
    for m in migration:
        if m["op"] in ("put", "get_prefix(out=)", "put + flush"):
            ratio = m["ratio_to_peer"]
            out.append({"goal": f"{m['tier']} {m['op']} ({m['block']} block) / {m['peer']} >= 0.85",
                        "value": ratio, "target": GOAL_MIGRATION, "met": ratio >= GOAL_MIGRATION})
    return out


# -- main -------------------------------------------------------------------------------------


CONFIGS = {"device": "device only", "host": "+ host", "disk": "+ host + disk", "redis": "+ redis",
           "unbounded": "unbounded device"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--num-requests", type=int, default=1000, help="first N trace rows, in trace order")
    parser.add_argument("--block-size", type=int, default=16, help="engine block size = tokens per trace block")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="prompts per generate call (and engine seats)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--device-frac", type=float, default=0.05, help="device pool, fraction of distinct blocks")
    parser.add_argument("--host-frac", type=float, default=0.20)
    parser.add_argument("--disk-frac", type=float, default=1.0)
    parser.add_argument("--remote-frac", type=float, default=1.0)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--runs", type=int, default=2, help="interleaved passes over the configurations")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each migration measurement")
    parser.add_argument("--migration-blocks", type=int, default=64, help="blocks per migration batch (engine block)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see the docstring)")
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="no Llama-8B-shaped migration, no full-trace simulation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    chosen = {CONFIGS[c] for c in args.configs.split(",")} | {CONFIGS["unbounded"]}  # the reference always runs
    torch.set_num_threads(args.threads)
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()

    trace = load_mooncake(args.trace)
    requests = trace[:args.num_requests]
    prompts = build_prompts(requests, args.block_size, args.vocab, args.seed)
    work = Path(tempfile.mkdtemp(prefix="sage-tiers-bench-", dir=args.dir))
    redis = start_redis() if CONFIGS["redis"] in chosen else "not chosen (--configs)"
    skipped = {} if isinstance(redis, Redis) else {CONFIGS["redis"]: redis}
    best: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    try:
        shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     num_key_value_heads=args.kv_heads, intermediate_size=args.hidden * 8 // 3,
                     max_position_embeddings=max(4096, max(map(len, prompts)) + args.max_tokens))
        model_dir = str(make_tiny_model(work / "llama", "llama", vocab_size=args.vocab, **shape))
        setups, sizes = plan(args, requests, prompts, redis.url if isinstance(redis, Redis) else None)
        setups = [s for s in setups if s.name in chosen and s.name not in skipped]
        probe = LLM(config=ServeConfig(model=ModelConfig(path=model_dir, dtype="fp32"),
                                       kv_pool=KVPoolConfig(block_size=args.block_size, num_blocks=8)), device="cpu")
        schema = probe.engine.runner.pool.schema
        block_bytes = probe.engine.runner.pool.block_nbytes
        del probe
        for setup in setups:
            to_bytes(setup, block_bytes)
        print(f"{len(requests)} requests, {sum(map(len, prompts))} prompt tokens, capacities {sizes}", flush=True)
        for run in range(args.runs):
            for setup in setups:
                empty_lower_tiers(setup, work)
                row, out = run_setup(setup, model_dir, prompts, args)
                print(f"  run {run + 1}/{args.runs} {setup.name:<17} hit {row['hit_rate']:.2%}  TTFT p50 "
                      f"{row['ttft_p50_s'] * 1e3:.1f} ms  wall {row['wall_s']:.1f}s  cpu {row['cpu_util']:.2f}",
                      flush=True)
                walls = best[setup.name]["all_wall_s"] if setup.name in best else []
                if setup.name not in best or row["wall_s"] < best[setup.name]["wall_s"]:
                    best[setup.name] = row
                best[setup.name]["all_wall_s"] = walls + [row["wall_s"]]
                if outputs.setdefault(setup.name, out) != out:
                    raise RuntimeError(f"{setup.name}: greedy tokens changed between runs")
        migration = migration_rows(schema, args.migration_blocks, args.repeats, work, "engine")
        if not args.quick:
            migration += migration_rows(KVCacheSchema(block_size=args.block_size, **LLAMA8B_BLOCK), 32, args.repeats,
                                        work, "llama-8b")
    finally:
        if isinstance(redis, Redis):
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)

    results = [best[s.name] for s in setups]
    reference = best[CONFIGS["unbounded"]]
    for r in results:
        r["hit_ratio_to_unbounded"] = r["hit_rate"] / reference["hit_rate"] if reference["hit_rate"] else float("nan")
        r["ttft_p50_ratio_to_unbounded"] = r["ttft_p50_s"] / reference["ttft_p50_s"]
    mismatches = {name: [i for i, (a, b) in enumerate(zip(out, outputs[CONFIGS["unbounded"]])) if a != b][:10]
                  for name, out in outputs.items()}
    mismatches = {name: ids for name, ids in mismatches.items() if ids}
    simulated = [simulate(requests, sizes["device_blocks"], sizes["host_blocks"])]
    if not args.quick and len(trace) > len(requests):
        d = distinct_blocks(trace)
        simulated.append(simulate(trace, math.ceil(args.device_frac * d), math.ceil(args.host_frac * d)))
    report = {
        "header": {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
                   "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "model": shape,
                   "vocab": args.vocab, "dtype": "fp32", "runs": args.runs, "started": started,
                   "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": [load0, os.getloadavg()]},
        "workload": {"trace": str(args.trace), "requests": len(requests), "block_size": args.block_size,
                     "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens,
                     "max_num_seqs": args.max_num_seqs, "submission": "sequential generate() batches in trace order"},
        "capacity": sizes,
        "results": results,
        "skipped": skipped,
        "migration": migration,
        "simulator_lru": simulated,
        "tokens_identical": not mismatches,
        "token_mismatches": mismatches,
    }
    report["goals"] = goals({r["config"]: r for r in results}, migration)
    print_report(report)
    if args.json:
        write_json(args.json, report, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
