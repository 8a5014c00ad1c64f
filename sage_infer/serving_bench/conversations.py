"""Agent sessions as the text conversations agents send (`sage llm bench --workload agent --api chat|responses`).

The planned token segments become words (one word per planned token id, from a fixed list, so a session's text is
the same on every run and every server), and each step is one of:

- ``chat``: ``/v1/chat/completions`` with the whole conversation every step: the instructions and tool definitions
  (a system message), the task, and for each earlier step the server's own answer (an assistant message) and the
  tool's output (a user message). The server cannot know that a request continues a session.
- ``responses``: ``/v1/responses`` with ``previous_response_id`` naming the step before and only the new tool output
  as input (the instructions are given again every step, as OpenAI's API asks); the server keeps the session.

Both stream; TTFT is the first text delta, the prompt and cached tokens come from the usage the server reports.
With ``--tool-calls`` every step offers tools and answers the previous step's call with the tool's output
(`serving_bench.agent_tools`); TTFT is then the first text or tool-call delta.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from sage_infer.serving_bench.agent_tools import StreamedCalls, answer_messages, is_valid_call, tool_fields
from sage_infer.serving_bench.client import JSON_HEADERS, RequestResult, error_message
from sage_infer.serving_bench.sse import SSEDecoder
from sage_infer.serving_bench.workloads import BenchRequest

APIS = ("chat", "responses")
WORDS = ("the", "tool", "call", "result", "file", "line", "error", "value", "list", "open", "read", "write", "path",
         "test", "run", "step", "plan", "next", "check", "state", "code", "data", "name", "type", "field", "table",
         "query", "found", "none", "more", "done", "wait", "start", "stop", "user", "task", "goal", "note", "keep",
         "send", "load", "save", "move", "copy", "find", "match", "count", "sum", "high", "low", "left", "right",
         "first", "last", "new", "old", "good", "bad", "true", "false", "yes", "no", "maybe", "again")


def words(token_ids: list[int]) -> str:
    return " ".join(WORDS[t % len(WORDS)] for t in token_ids)


@dataclass(slots=True)
class Session:
    """What one agent session's next step needs: the conversation so far (chat), the last response's id
    (responses)."""

    has_instructions: bool  # the workload's first segment is the shared instructions and tools
    tools: bool = False  # tool-calling mode: every step offers the tools (`agent_tools`)
    messages: list[dict] = field(default_factory=list)
    previous_id: str | None = None
    calls: list[dict] = field(default_factory=list)  # the last step's valid calls, which the next step answers


def _payload(api: str, model: str, request: BenchRequest, session: Session) -> dict:
    segments = request.segments
    instructions = words(segments[0]) if session.has_instructions else None
    new = words(segments[-1])  # the task at step 0, then the tool's output
    tools = tool_fields(api) if session.tools else {}
    if api == "responses":
        given = ([{"type": "function_call_output", "call_id": call["id"], "output": new} for call in session.calls]
                 or new)
        payload = {"model": model, "input": given, "max_output_tokens": request.output_len, "temperature": 0,
                   "stream": True, "ignore_eos": True, **tools}
        if instructions:
            payload["instructions"] = instructions
        if session.previous_id is not None:
            payload["previous_response_id"] = session.previous_id
        return payload
    if not session.messages:
        session.messages = [{"role": "system", "content": instructions}] if instructions else []
    session.messages.extend([{"role": "tool", "tool_call_id": call["id"], "content": new} for call in session.calls]
                            or [{"role": "user", "content": new}])
    return {"model": model, "messages": session.messages, "max_tokens": request.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **tools}


async def send_step(client: httpx.AsyncClient, api: str, model: str, request: BenchRequest, session: Session,
                    index: int, run_start: float) -> RequestResult:
    """Stream one step of `session` and time it; failures are recorded in the result, never raised."""
    body = json.dumps(_payload(api, model, request, session)).encode()
    result = RequestResult(index, request.conversation, request.turn, request.input_len, request.output_len)
    sent = time.perf_counter()
    result.start_s = sent - run_start
    path = "/v1/responses" if api == "responses" else "/v1/chat/completions"
    try:
        async with client.stream("POST", path, content=body, headers=JSON_HEADERS) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
                return result
            reader = _StepReader(api, result, sent)
            decoder = SSEDecoder()
            async for raw in response.aiter_bytes():
                reader.take(decoder.feed(raw), time.perf_counter())
            reader.take(decoder.close(), time.perf_counter())
        result.e2e_s = time.perf_counter() - sent
        if result.error is None and not reader.done:
            result.error = "stream ended before its last event"
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    if result.error is None:
        calls = reader.calls.in_order()
        if session.tools:
            result.tool_calls = calls
            result.tool_call_valid = bool(calls) and all(is_valid_call(call) for call in calls)
        session.calls = calls if result.tool_call_valid else []
        if api == "responses":
            session.previous_id = reader.response_id
        else:
            session.messages.append(answer_messages(result.text, session.calls))
    return result


class _StepReader:
    """One streamed step's events: text deltas timed, the usage (and the response id) kept."""

    __slots__ = ("api", "result", "sent", "last", "done", "response_id", "calls")

    def __init__(self, api: str, result: RequestResult, sent: float) -> None:
        self.api, self.result, self.sent = api, result, sent
        self.last: float | None = None
        self.done = False
        self.response_id: str | None = None
        self.calls = StreamedCalls()

    def take(self, events: list[str], now: float) -> None:
        for data in events:
            if data == "[DONE]":
                self.done = True
                continue
            try:
                event = json.loads(data)
                text, usage = self._read(event)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                self.result.error = f"malformed SSE event: {data[:120]!r}"
                return
            if text is not None:
                self.last = self.result.add_text(text, now, self.sent, self.last)
            if usage:
                self._usage(usage)

    def _read(self, event: dict) -> tuple[str | None, dict | None]:
        if event.get("error") or event.get("type") == "error":
            error = event.get("error") or event
            self.result.error = f"stream error: {error.get('message', error)}"
            return None, None
        if self.api == "chat":
            choice = event["choices"][0] if event.get("choices") else None
            delta = choice["delta"] if choice else {}
            if delta.get("tool_calls"):
                self.calls.chat_delta(delta["tool_calls"])
                return delta.get("content") or "", event.get("usage")  # timed as a text delta
            return delta.get("content") or None, event.get("usage")
        if event["type"] in ("response.output_text.delta", "response.function_call_arguments.delta"):
            return (event["delta"] or None) if event["type"] == "response.output_text.delta" else "", None
        if event["type"] in ("response.completed", "response.incomplete"):
            self.done = True
            self.response_id = event["response"]["id"]
            self.calls.response_output(event["response"]["output"])
            return None, event["response"]["usage"]
        return None, None

    def _usage(self, usage: dict) -> None:
        result = self.result
        if self.api == "chat":
            result.output_tokens = int(usage.get("completion_tokens", 0))
            result.prompt_tokens = usage.get("prompt_tokens")
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        else:
            result.output_tokens = int(usage.get("output_tokens", 0))
            result.prompt_tokens = usage.get("input_tokens")
            result.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
