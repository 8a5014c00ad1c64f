"""`sage llm bench`: load-test an OpenAI-compatible server and report latency, throughput and reuse.

Registered by `sage_infer.cli.llm` as ``app.command("bench")(bench)``. Everything heavy
(httpx, matplotlib) is imported inside the command, so registering it costs nothing.
"""

from __future__ import annotations

import asyncio
import math
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from sage_infer.errors import NotAvailableError, SageError, UsageError


class WorkloadKind(str, Enum):
    random = "random"
    shared_prefix = "shared-prefix"
    multi_turn = "multi-turn"
    agent = "agent"
    trace = "trace"


class ApiKind(str, Enum):
    completions = "completions"
    chat = "chat"
    responses = "responses"


SYNTHETIC = {WorkloadKind.random, WorkloadKind.shared_prefix, WorkloadKind.multi_turn, WorkloadKind.agent}
# Which workloads read each optional flag: giving one to another workload is an error, not a no-op.
APPLIES_TO = {
    "--input-len": SYNTHETIC,
    "--output-len": SYNTHETIC,
    "--prefix-len": {WorkloadKind.shared_prefix, WorkloadKind.multi_turn, WorkloadKind.agent},
    "--context-len": {WorkloadKind.multi_turn, WorkloadKind.agent},
    "--turns": {WorkloadKind.multi_turn, WorkloadKind.agent},
    "--rate": SYNTHETIC,
    "--trace-file": {WorkloadKind.trace},
    "--time-scale": {WorkloadKind.trace},
    "--length-scale": {WorkloadKind.trace},
    "--max-input-len": {WorkloadKind.trace},
    "--api": {WorkloadKind.agent},
    "--tool-calls": {WorkloadKind.agent},
}
DEFAULTS = {"input_len": 256, "output_len": 64, "prefix_len": 256, "context_len": 0, "turns": 4, "time_scale": 1.0,
            "length_scale": 1.0, "max_input_len": None}
# where a workload's default differs: multi-turn has no shared system prompt unless asked
WORKLOAD_DEFAULTS = {WorkloadKind.multi_turn: {"prefix_len": 0},
                     WorkloadKind.agent: {"prefix_len": 2048, "context_len": 256, "input_len": 64, "turns": 8}}


UrlOpt = Annotated[str, typer.Option("--url", help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is ok).")]
ApiKeyOpt = Annotated[
    Optional[str], typer.Option("--api-key", envvar="SAGE_API_KEY", help="Send 'Authorization: Bearer KEY'.")
]
ModelIdOpt = Annotated[
    Optional[str], typer.Option("--model", "-m", help="Model id to request (default: first id of /v1/models).")
]
WorkloadOpt = Annotated[WorkloadKind, typer.Option("--workload", "-w", help="What to send.")]
TraceFileOpt = Annotated[
    Optional[Path], typer.Option("--trace-file", dir_okay=False, help="Mooncake JSONL trace (--workload trace).")
]
NumRequestsOpt = Annotated[int, typer.Option("--num-requests", "-n", min=1, help="Requests to send.")]
RateOpt = Annotated[
    Optional[float], typer.Option("--rate", help="Requests/s, Poisson arrivals; inf = all at once. (default inf)")
]
ConcurrencyOpt = Annotated[int, typer.Option("--concurrency", min=1, help="Most requests in flight.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seeds prompts and arrivals; change it to start cache-cold.")]
InputLenOpt = Annotated[
    Optional[int], typer.Option("--input-len", min=1, help="Prompt tokens (random: up to; shared-prefix: suffix; "
                                "multi-turn: new tokens per turn; agent: tool output per step). (default 256; "
                                "agent 64)")
]
OutputLenOpt = Annotated[Optional[int], typer.Option("--output-len", min=1, help="max_tokens (default 64).")]
PrefixLenOpt = Annotated[
    Optional[int], typer.Option("--prefix-len", min=0, help="Tokens every request shares (shared-prefix: the "
                                "prefix, default 256; multi-turn: a system prompt, default 0; agent: "
                                "instructions and tool definitions, default 2048).")
]
ContextLenOpt = Annotated[
    Optional[int], typer.Option("--context-len", min=0, help="Tokens of each conversation's own context after "
                                "the shared prefix (multi-turn: default 0; agent: the task, default 256).")
]
TurnsOpt = Annotated[Optional[int], typer.Option("--turns", min=1, help="Turns per conversation (default 4), steps "
                                                 "per agent session (default 8).")]
TimeScaleOpt = Annotated[
    Optional[float], typer.Option("--time-scale", min=0.0, help="Multiply trace timestamps (0.1 = 10x faster).")
]
LengthScaleOpt = Annotated[
    Optional[float], typer.Option("--length-scale", help="Multiply trace prompt/output lengths and block size.")
]
MaxInputLenOpt = Annotated[
    Optional[int], typer.Option("--max-input-len", min=1, help="Cut trace prompts to this many tokens.")
]
VocabSizeOpt = Annotated[
    int, typer.Option("--vocab-size", min=11, help="Prompt token ids are drawn from [10, vocab-size).")
]
JsonOutOpt = Annotated[
    Optional[str], typer.Option("--json", metavar="OUT", help="Write all numbers and per-request records to OUT "
                                "('-': print them instead of the tables).")
]
ApiOpt = Annotated[
    Optional[ApiKind], typer.Option("--api", help="agent: completions (token-id prompts, the default), chat (text "
                                    "conversations, the whole history every step) or responses (/v1/responses, "
                                    "each step continuing the last by previous_response_id).")
]
ToolCallsOpt = Annotated[
    bool, typer.Option("--tool-calls", help="agent --api chat|responses: every step offers three function tools "
                       "with tool_choice required and answers the previous step's call with the tool's output; "
                       "the report counts the steps that made a valid call.")
]
PlotOpt = Annotated[
    Optional[Path], typer.Option("--plot", dir_okay=False, help="Save TTFT/TPOT/ITL/E2E histograms as a PNG.")
]


def bench(
    url: UrlOpt, api_key: ApiKeyOpt = None, model: ModelIdOpt = None, workload: WorkloadOpt = WorkloadKind.random,
    trace_file: TraceFileOpt = None, num_requests: NumRequestsOpt = 100, rate: RateOpt = None,
    concurrency: ConcurrencyOpt = 16, seed: SeedOpt = 0, input_len: InputLenOpt = None,
    output_len: OutputLenOpt = None, prefix_len: PrefixLenOpt = None, context_len: ContextLenOpt = None,
    turns: TurnsOpt = None, time_scale: TimeScaleOpt = None, length_scale: LengthScaleOpt = None,
    max_input_len: MaxInputLenOpt = None, vocab_size: VocabSizeOpt = 512, json_out: JsonOutOpt = None,
    plot: PlotOpt = None, api: ApiOpt = None, tool_calls: ToolCallsOpt = False,
) -> None:
    """Benchmark a running OpenAI-compatible server (sage llm serve, vLLM, SGLang ...)."""
    from sage_infer.serving_bench.report import bench_document
    from sage_infer.serving_bench.stats import summarize
    from sage_infer.serving_bench.workloads import poisson_arrivals

    chosen = {"input_len": input_len, "output_len": output_len, "prefix_len": prefix_len, "context_len": context_len,
              "turns": turns, "time_scale": time_scale, "length_scale": length_scale, "max_input_len": max_input_len}
    _check_options(workload, chosen, rate, trace_file, json_out, plot)
    _check_flags(workload, {"--api": api, "--tool-calls": tool_calls or None})
    api_name = (api or ApiKind.completions).value
    if tool_calls and api_name == "completions":
        raise UsageError("--tool-calls needs --api chat or --api responses (completions send token ids, no tools)")
    runner = _import_runner()
    from sage_infer.serving_bench.client import normalize_url  # after the check that httpx is there

    url = normalize_url(url)
    defaults = {**DEFAULTS, **WORKLOAD_DEFAULTS.get(workload, {})}
    settings = {k: defaults[k] if v is None else v for k, v in chosen.items()}
    load = _build_workload(workload, trace_file, num_requests, vocab_size, seed, settings)
    arrivals = load.arrivals_s or poisson_arrivals(len(load.conversations), rate or math.inf, seed)

    run = _run_with_progress(runner, url, api_key, model, load, arrivals, concurrency, api_name, tool_calls)
    summary = summarize(run.results, run.duration_s, run.counters_before, run.counters_after)
    config = {"url": url, "model": run.model, "workload": workload.value, "num_requests": load.num_requests,
              "rate": "trace" if load.arrivals_s else ("inf" if rate in (None, math.inf) else rate),
              "concurrency": concurrency, "seed": seed, "vocab_size": vocab_size, "api": api_name,
              **({"tool_calls": True} if tool_calls else {}),
              **{k: v for k, v in settings.items() if workload in APPLIES_TO[_flag(k)]}, **load.info}
    _emit(bench_document(config, summary, run.results), config, summary, run, json_out)
    if plot is not None:
        from sage_infer.serving_bench.report import plot_latencies

        plot_latencies(plot, run.results, f"{workload.value}: {summary['ok']} requests -> {run.model}")
    if summary["ok"] == 0:
        first = next(r.error for r in run.results if r.error)
        raise SageError(f"all {summary['requests']} requests failed; first error: {first}")


def _check_options(workload: WorkloadKind, chosen: dict[str, object], rate: float | None, trace_file: Path | None,
                   json_out: str | None, plot: Path | None) -> None:
    """Every flag the run would trip over, refused before it starts (a `UsageError`)."""
    from sage_infer.serving_bench.report import require_matplotlib

    _check_flags(workload, {**{_flag(k): v for k, v in chosen.items()}, "--rate": rate, "--trace-file": trace_file})
    if rate is not None and not rate > 0:  # also rejects nan
        raise UsageError(f"--rate must be > 0 or inf, got {rate}")
    length_scale = chosen["length_scale"]
    if length_scale is not None and not length_scale > 0:
        raise UsageError(f"--length-scale must be > 0, got {length_scale}")
    if workload is WorkloadKind.trace and trace_file is None:
        raise UsageError("--workload trace needs --trace-file FILE")
    for flag, out in (("--json", None if json_out in (None, "-") else Path(json_out)), ("--plot", plot)):
        if out is not None and not out.parent.is_dir():  # fail now, not after the run
            raise UsageError(f"{flag} {out}: directory {out.parent} does not exist")
    if plot is not None:
        require_matplotlib()


def _emit(document: dict, config: dict, summary: dict, run, json_out: str | None) -> None:
    """The results: JSON on stdout (``--json -``), else the tables (and the JSON to a file with ``--json OUT``)."""
    if json_out == "-":
        from sage_infer.cli.output import emit

        emit(document, True, lambda console: None)
        return
    from sage_infer.cli.output import console
    from sage_infer.serving_bench.report import render, write_json

    if json_out is not None:
        write_json(Path(json_out), document)
    render(console, config, summary, run.results)


def _check_flags(workload: WorkloadKind, given: dict[str, object]) -> None:
    for flag, value in given.items():
        if value is not None and workload not in APPLIES_TO[flag]:
            users = ", ".join(sorted(kind.value for kind in APPLIES_TO[flag]))
            raise UsageError(f"{flag} does not apply to --workload {workload.value}", hint=f"used by: {users}")


def _flag(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def _import_runner():
    try:
        from sage_infer.serving_bench import runner
    except ImportError as err:
        raise NotAvailableError(f"sage llm bench needs httpx ({err})", hint="pip install httpx") from None
    return runner


def _build_workload(kind: WorkloadKind, trace_file: Path | None, num_requests: int, vocab_size: int, seed: int,
                    s: dict[str, object]):
    from sage_infer.serving_bench import workloads

    if kind is WorkloadKind.trace:
        from sage_infer.serving_bench.trace import load_mooncake_trace

        assert trace_file is not None
        return load_mooncake_trace(trace_file, num_requests, time_scale=s["time_scale"],
                                   length_scale=s["length_scale"], max_input_len=s["max_input_len"],
                                   vocab_size=vocab_size, seed=seed)
    if kind is WorkloadKind.shared_prefix:
        return workloads.shared_prefix_workload(num_requests, s["prefix_len"], s["input_len"], s["output_len"],
                                                vocab_size, seed)
    if kind is WorkloadKind.multi_turn:
        return workloads.multi_turn_workload(num_requests, s["turns"], s["input_len"], s["output_len"],
                                             vocab_size, seed, system_len=s["prefix_len"],
                                             context_len=s["context_len"])
    if kind is WorkloadKind.agent:
        return workloads.agent_workload(num_requests, s["turns"], s["prefix_len"], s["context_len"], s["input_len"],
                                        s["output_len"], vocab_size, seed)
    return workloads.random_workload(num_requests, s["input_len"], s["output_len"], vocab_size, seed)


def _run_with_progress(runner, url, api_key, model, load, arrivals, concurrency, api="completions",
                       tool_calls=False):
    """Run the workload with a progress bar on stderr (stdout stays clean for --json -)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("[red]{task.fields[errors]} errors"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True,
                  disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(f"bench {load.name}", total=load.num_requests, errors=0)
        errors = 0

        def on_result(result) -> None:
            nonlocal errors
            errors += result.error is not None
            progress.update(task, advance=1, errors=errors)

        return asyncio.run(runner.run_workload(url, api_key, model, load, arrivals, concurrency, on_result, api,
                                               tool_calls))
