"""Turn per-request measurements into the numbers a serving benchmark reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sage_infer.serving_bench.client import RequestResult

PERCENTILES = (50, 90, 99)
# Counters the sage server exports on /metrics (prompt tokens looked up / found in the prefix cache).
PREFIX_QUERIES = "sage:prefix_cache_queries_total"
PREFIX_HITS = "sage:prefix_cache_hits_total"
PREFIX_LOWER_HITS = "sage:prefix_cache_lower_hits_total"  # loaded from a lower KV tier (sage with tiers)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, interpolating linearly between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles of durations given in seconds, reported in milliseconds."""
    values = [v * 1000.0 for v in values_s]
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def prefix_hit_rate(before: dict[str, float], after: dict[str, float], hits: str = PREFIX_HITS) -> float | None:
    """Server prefix-cache hit rate over the run: delta `hits` / delta queries; None if not exported."""
    if not all(name in counters for name in (PREFIX_QUERIES, hits) for counters in (before, after)):
        return None
    queries = after[PREFIX_QUERIES] - before[PREFIX_QUERIES]
    return (after[hits] - before[hits]) / queries if queries > 0 else None


def summarize(
    results: Sequence[RequestResult], duration_s: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, object]:
    """Every reported number, from the successful requests (errors are only counted)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    queries = _delta(before, after, PREFIX_QUERIES)
    hits = _delta(before, after, PREFIX_HITS)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) * per_second,
        "input_throughput": input_tokens * per_second,
        "output_throughput": output_tokens * per_second,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prefix_hit_rate": prefix_hit_rate(before, after),
        "prefix_lower_hit_rate": prefix_hit_rate(before, after, PREFIX_LOWER_HITS),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "mean_cached_tokens": sum(cached) / len(cached) if cached else None,
        "cached_token_fraction": sum(cached) / input_tokens if cached and input_tokens else None,
        "by_turn": by_turn(ok),
        **tool_call_counts(ok),
    }


def tool_call_counts(ok: Sequence[RequestResult]) -> dict[str, object]:
    """Tool-calling mode: of the answered steps that offered tools, those whose calls were all valid (and at least
    one); {} when no step offered tools."""
    offered = [r for r in ok if r.tool_call_valid is not None]
    if not offered:
        return {}
    valid = sum(bool(r.tool_call_valid) for r in offered)
    return {"tool_calls": {"steps": len(offered), "valid": valid, "valid_fraction": valid / len(offered)}}


def by_turn(ok: Sequence[RequestResult]) -> list[dict[str, object]]:
    """Per turn (round of a conversation, step of an agent session): requests, prompt length, TTFT and the
    share of prompt tokens the server said it had cached. Later turns carry longer histories: this is where
    reuse shows (or does not)."""
    rows = []
    for turn in sorted({r.turn for r in ok}):
        mine = [r for r in ok if r.turn == turn]
        prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in mine)
        cached = [r.cached_tokens for r in mine if r.cached_tokens is not None]
        rows.append({"turn": turn, "requests": len(mine), "mean_prompt_tokens": prompt / len(mine),
                     "ttft_ms": distribution_ms([r.ttft_s for r in mine if r.ttft_s is not None]),
                     "cached_token_fraction": sum(cached) / prompt if cached and prompt else None})
    return rows


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    return after[name] - before[name] if name in before and name in after else None
