"""Show a benchmark run: a rich table for people, JSON for machines, a PNG of the latencies."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from sage_infer.errors import NotAvailableError, UsageError
from sage_infer.serving_bench.stats import PERCENTILES, percentile
from sage_infer.tables import table

if TYPE_CHECKING:
    from sage_infer.serving_bench.client import RequestResult

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def request_record(result: RequestResult) -> dict[str, object]:
    """One request as JSON; times in milliseconds."""
    return {
        "index": result.index, "conversation": result.conversation, "turn": result.turn,
        "input_len": result.input_len, "max_tokens": result.max_tokens,
        "start_ms": _ms(result.start_s), "ttft_ms": _ms(result.ttft_s), "tpot_ms": _ms(result.tpot_s),
        "e2e_ms": _ms(result.e2e_s), "itl_ms": [_ms(gap) for gap in result.itl_s],
        "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens,
        "cached_tokens": result.cached_tokens, "status": result.status, "error": result.error,
        **({} if result.tool_calls is None else {"tool_calls": result.tool_calls,
                                                  "tool_call_valid": result.tool_call_valid}),
    }


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    return dict(Counter(r.error for r in results if r.error is not None).most_common())


def bench_document(
    config: dict[str, object], summary: dict[str, object], results: Sequence[RequestResult]
) -> dict[str, object]:
    """Everything `--json` writes: the run's settings, the summary and every request."""
    return {"config": config, "summary": summary, "errors": error_counts(results),
            "requests": [request_record(r) for r in results]}


def write_json(path: Path, document: dict[str, object]) -> None:
    text = json.dumps(document, indent=2) + "\n"
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise UsageError(f"--json {path}: {err.strerror or err}") from None


def render(console: Console, config: dict[str, object], summary: dict[str, object],
           results: Sequence[RequestResult]) -> None:
    """The two tables people read: throughput and cache reuse, then latency percentiles."""
    hit_rate = summary["prefix_hit_rate"]
    rows = [
        ("requests ok / errors", f"{summary['ok']} / {summary['errors']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("input throughput (tok/s)", f"{summary['input_throughput']:.1f}"),
        ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
        ("prefix hit rate (server)", "n/a (no sage:prefix_cache_* counters on /metrics)"
         if hit_rate is None else f"{100 * hit_rate:.1f} %"),
        ("mean cached tokens / request (client)", _fmt(summary["mean_cached_tokens"], ".1f")),
    ]
    calls = summary.get("tool_calls")
    if calls:
        rows.append(("steps with a valid tool call", f"{calls['valid']} / {calls['steps']}"))
    lower = summary.get("prefix_lower_hit_rate")
    if lower:
        rows.insert(6, ("prefix hits from lower KV tiers (server)", f"{100 * lower:.1f} %"))
    title = f"sage llm bench: {config['workload']} -> {config['model']}"
    console.print(table(title, ["metric", "value"], rows))
    latency_rows = [
        (name, *(_fmt(summary[key][stat], ".1f") for stat in ("mean", *(f"p{q}" for q in PERCENTILES))))
        for key, name in LATENCIES
    ]
    console.print(table("Latency (ms)", ["", "mean", *(f"p{q}" for q in PERCENTILES)], latency_rows))
    turns = summary["by_turn"]
    if len(turns) > 1:
        rows = [(t["turn"], t["requests"], f"{t['mean_prompt_tokens']:.0f}", _fmt(t["ttft_ms"]["p50"], ".1f"),
                 _fmt(t["ttft_ms"]["p90"], ".1f"), _fmt(_percent(t["cached_token_fraction"]), ".0f"))
                for t in turns]
        console.print(table("By turn", ["turn", "requests", "prompt tokens", "TTFT p50 (ms)", "TTFT p90 (ms)",
                                        "cached (%)"], rows))
    for message, count in list(error_counts(results).items())[:3]:
        console.print(f"[red]{count} x[/red] {message}")


def plot_latencies(path: Path, results: Sequence[RequestResult], title: str) -> None:
    """Histograms of TTFT, TPOT, ITL and E2E (ms) with their p50 / p90 / p99 marked, as a PNG."""
    Figure = require_matplotlib()
    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [t for r in ok if (t := r.tpot_s) is not None],
        "ITL": [gap for r in ok for gap in r.itl_s],
        "E2E": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    figure = Figure(figsize=(11, 7), layout="constrained")
    figure.suptitle(title)
    for axes, (name, values_s) in zip(figure.subplots(2, 2).flat, series.items()):
        values = sorted(v * 1000.0 for v in values_s)
        axes.set_title(f"{name} ({len(values)} samples)")
        axes.set_xlabel("ms")
        axes.set_ylabel("count")
        if not values:
            axes.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axes.transAxes)
            continue
        axes.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.75)
        for q, color in zip(PERCENTILES, ("tab:green", "tab:orange", "tab:red")):
            axes.axvline(percentile(values, q), color=color, linestyle="--", label=f"p{q}")
        axes.legend()
    try:
        figure.savefig(path, dpi=100)
    except OSError as err:
        raise UsageError(f"--plot {path}: {err.strerror or err}") from None


def require_matplotlib():
    """matplotlib's Figure class (no pyplot, so no GUI backend is ever chosen)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise NotAvailableError("--plot needs matplotlib", hint="pip install matplotlib") from None
    return Figure


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)
