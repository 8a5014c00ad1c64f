"""Drive an OpenAI-compatible server: stream completions, timestamp every SSE chunk.

The SSE stream is parsed here rather than by a client library so each chunk is
timestamped the moment its bytes arrive: TTFT and inter-token latency are measured
on the wire, not after a library has buffered and decoded them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from sage_infer.errors import SageError, UsageError
from sage_infer.serving_bench.sse import SSEDecoder
from sage_infer.serving_bench.stats import PREFIX_HITS, PREFIX_LOWER_HITS, PREFIX_QUERIES
from sage_infer.serving_bench.workloads import BenchRequest

JSON_HEADERS = {"Content-Type": "application/json"}
KEEPALIVE_EXPIRY_S = 2.0  # below the keep-alive of the servers it measures (uvicorn: 5 s)


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds; `start_s` counts from the start of the run."""

    index: int
    conversation: int
    turn: int
    input_len: int
    max_tokens: int
    start_s: float = 0.0
    ttft_s: float | None = None  # send -> first chunk with non-empty text
    e2e_s: float | None = None  # send -> end of stream
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    output_tokens: int = 0  # usage.completion_tokens (text-chunk count if the server sent no usage)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    text: str = ""  # the streamed text, to compare servers' greedy output
    tool_calls: list[dict] | None = None  # tool-calling mode: the calls the answer made (id, name, arguments)
    tool_call_valid: bool | None = None  # tool-calling mode: one call or more, each valid for the tools offered
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def add_text(self, text: str, now: float, sent: float, last: float | None) -> float:
        """A text chunk that arrived at `now`: the first one's time since `sent` is the TTFT, each later one's gap
        since `last` an inter-token latency. Returns `now` (the next chunk's `last`)."""
        self.text += text
        if last is None:
            self.ttft_s = now - sent
        else:
            self.itl_s.append(now - last)
        return now

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def normalize_url(url: str) -> str:
    """Server root: no trailing slash or ``/v1`` (OpenAI clients are often given ``.../v1``)."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url!r}: expected http://HOST:PORT")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def make_client(url: str, api_key: str | None, concurrency: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=normalize_url(url),
        headers=headers,
        # idle connections are dropped before a server's keep-alive (5 s in uvicorn, so vLLM) can close them: a
        # request sent on a connection the server closes at that moment fails with "server disconnected"
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                            keepalive_expiry=KEEPALIVE_EXPIRY_S),
        # No pool timeout: the semaphore already bounds in-flight requests to the pool size.
        timeout=httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=None),
    )


def error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the body itself (shortened)."""
    try:
        error = json.loads(body)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip()
        return text[:200] or "(empty body)"


async def resolve_model(client: httpx.AsyncClient) -> str:
    """The first model id listed by ``GET /v1/models``."""
    response = await _get(client, "/v1/models")
    if response.status_code != 200:
        hint = "pass --api-key or set SAGE_API_KEY" if response.status_code == 401 else "pass --model NAME"
        raise SageError(f"GET {client.base_url}/v1/models: HTTP {response.status_code}: "
                        f"{error_message(response.content)}", hint=hint)
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise SageError(f"GET {client.base_url}/v1/models listed no model", hint="pass --model NAME") from None


async def scrape_prefix_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's prefix-cache counters from ``GET /metrics``, summed over labels; {} if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await _get(client, "/metrics")
    if response.status_code != 200:
        return {}
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if sample.name in (PREFIX_QUERIES, PREFIX_HITS, PREFIX_LOWER_HITS):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return totals


async def _get(client: httpx.AsyncClient, path: str) -> httpx.Response:
    try:
        return await client.get(path)
    except httpx.TransportError as err:
        raise SageError(f"cannot reach {client.base_url}: {type(err).__name__}: {err}",
                        hint="start the server (sage llm serve) or check --url") from None


async def send_completion(
    client: httpx.AsyncClient, model: str, request: BenchRequest, index: int, run_start: float
) -> RequestResult:
    """Stream one completion and time it; failures are recorded in the result, never raised."""
    payload = {
        "model": model, "prompt": request.prompt_ids(), "max_tokens": request.output_len, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    body = json.dumps(payload).encode()  # encoded before the clock starts: a long prompt takes a while
    result = RequestResult(index, request.conversation, request.turn, request.input_len, request.output_len)
    sent = time.perf_counter()
    result.start_s = sent - run_start
    try:
        async with client.stream("POST", "/v1/completions", content=body, headers=JSON_HEADERS) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
                return result
            done = await _read_stream(response, result, sent)
        if result.e2e_s is None:
            result.e2e_s = time.perf_counter() - sent
        if result.error is None and not done:
            result.error = "stream ended before data: [DONE]"
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    except (ValueError, TypeError) as err:  # a usage chunk with non-numeric counts
        result.error = f"bad response: {err}"
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, sent: float) -> bool:
    """Fill `result` from the SSE body; True once ``[DONE]`` arrived."""
    decoder, timer = SSEDecoder(), _ChunkTimer(result, sent)
    over = False
    # Read to the end even after [DONE] so the connection goes back to the pool.
    async for raw in response.aiter_bytes():
        over = over or timer.take(decoder.feed(raw), time.perf_counter())
    if not over:
        timer.take(decoder.close(), time.perf_counter())
    timer.finish()
    return timer.done


class _ChunkTimer:
    """Timestamps the text chunks of one stream and keeps its usage chunk."""

    __slots__ = ("result", "sent", "last", "text_chunks", "usage", "done")

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.result, self.sent = result, sent
        self.last: float | None = None
        self.text_chunks = 0
        self.usage: dict | None = None
        self.done = False

    def take(self, events: list[str], now: float) -> bool:
        """Consume events that arrived at `now`; True when the stream is over (done or failed)."""
        for data in events:
            if data == "[DONE]":
                self.done = True
                self.result.e2e_s = now - self.sent
                return True
            try:
                chunk = json.loads(data)
                if chunk.get("error"):
                    self.result.error = f"stream error: {error_message(data.encode())}"
                    return True
                text = chunk["choices"][0].get("text") if chunk.get("choices") else None
                self.usage = chunk.get("usage") or self.usage
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                self.result.error = f"malformed SSE chunk: {data[:120]!r}"
                return True
            if text:
                self.last = self.result.add_text(text, now, self.sent, self.last)
                self.text_chunks += 1
        return False

    def finish(self) -> None:
        result, usage = self.result, self.usage
        result.output_tokens = self.text_chunks
        if usage:
            result.output_tokens = int(usage.get("completion_tokens", self.text_chunks))
            result.prompt_tokens = usage.get("prompt_tokens")
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
