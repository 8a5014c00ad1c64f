"""Schedule a workload against the server: arrivals, conversations, the concurrency limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sage_infer.errors import SageError
from sage_infer.serving_bench.client import (
    RequestResult,
    make_client,
    resolve_model,
    scrape_prefix_counters,
    send_completion,
)
from sage_infer.serving_bench.conversations import Session, send_step
from sage_infer.serving_bench.workloads import Workload


@dataclass(slots=True)
class BenchRun:
    model: str
    results: list[RequestResult]
    duration_s: float
    counters_before: dict[str, float]
    counters_after: dict[str, float]


async def run_workload(
    url: str,
    api_key: str | None,
    model: str | None,
    workload: Workload,
    arrivals_s: Sequence[float],
    concurrency: int,
    on_result: Callable[[RequestResult], None] | None = None,
    api: str = "completions",
    tool_calls: bool = False,
) -> BenchRun:
    """Send `workload`: conversation i starts at ``arrivals_s[i]``, its turns one after another,
    at most `concurrency` requests in flight at once. `api`: completions (token-id prompts), or chat /
    responses (an agent workload as text conversations, `serving_bench.conversations`), with tools offered and
    their calls answered every step when `tool_calls`."""
    assert len(arrivals_s) == len(workload.conversations)
    async with make_client(url, api_key, concurrency) as client:
        model = model or await resolve_model(client)
        before = await scrape_prefix_counters(client)
        slots = asyncio.Semaphore(concurrency)
        results: list[RequestResult] = []
        first_index = [0]
        for turns in workload.conversations[:-1]:
            first_index.append(first_index[-1] + len(turns))
        run_start = time.perf_counter()

        async def conversation(i: int) -> None:
            await asyncio.sleep(max(0.0, run_start + arrivals_s[i] - time.perf_counter()))
            session = Session(has_instructions=bool(workload.info.get("tools_len")), tools=tool_calls)
            for turn, request in enumerate(workload.conversations[i]):
                async with slots:
                    if api == "completions":
                        result = await send_completion(client, model, request, first_index[i] + turn, run_start)
                    else:
                        result = await send_step(client, api, model, request, session, first_index[i] + turn,
                                                 run_start)
                results.append(result)
                if on_result is not None:
                    on_result(result)

        await asyncio.gather(*(conversation(i) for i in range(len(workload.conversations))))
        duration = time.perf_counter() - run_start
        try:
            after = await scrape_prefix_counters(client)
        except SageError:  # the server went away after the last request: keep the results
            after = {}
    results.sort(key=lambda r: r.index)
    return BenchRun(model, results, duration, before, after)
