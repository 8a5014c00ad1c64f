"""Tool calls with `tool_choice` required or a named function: the share of replies that are valid calls of the
given tools (names given, arguments valid under their schema by `jsonschema`), streamed and not, over the real
server and the official `openai` client, on the bundled demo model (a small model that never saw a tool), for
each way calls are written: hermes tags, llama3 JSON, and vLLM's JSON array (no parser). JSON out.

    .venv/bin/python bench/tool_calls.py --out out/tool_calls.json

A reply cut off by max_tokens (finish_reason length) is counted apart: its last call is unfinished by
construction, not invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import write_json  # noqa: E402
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig  # noqa: E402
from sage_infer.models.loader import DEMO_MODEL_DIR  # noqa: E402
from sage_infer.server.launch import build_server  # noqa: E402
from tests.server_fixture import serving  # noqa: E402


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# schemas as agent frameworks send them: enums, integers with bounds, nested objects and arrays, optional fields,
# and strings without a length bound
TOOL_SETS = {
    "weather": [tool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city"]})],
    "calendar": [tool("create_event", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "start": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "reminder": {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 0}},
                     "required": ["minutes"], "additionalProperties": False}},
        "required": ["title", "start"], "additionalProperties": False}),
        tool("list_events", {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                             "required": ["day"]})],
    "search": [tool("search", {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 80}, "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
        "sources": {"type": "array", "items": {"enum": ["web", "news", "papers"]}}},
        "required": ["query"], "additionalProperties": False}),
        tool("open_url", {"type": "object", "properties": {"url": {"type": "string", "maxLength": 100}},
                          "required": ["url"], "additionalProperties": False}),
        tool("finish", {"type": "object", "properties": {}, "additionalProperties": False})],
}
PROMPTS = ["What is the weather in Verona?", "Book a meeting with Horatio tomorrow at nine.",
           "Find papers about speculative decoding.", "ROMEO: Speak, what news?"]


def calls_of(reply) -> tuple[list[tuple[str, str]], str]:
    choice = reply.choices[0]
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], choice.finish_reason


def streamed_calls_of(stream) -> tuple[list[tuple[str, str]], str]:
    calls, finish_reason = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, [call.function.name, ""])
                entry[1] += call.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return [tuple(v) for _, v in sorted(calls.items())], finish_reason


def valid(calls: list[tuple[str, str]], tools: list[dict], named: str | None) -> bool:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    try:
        for name, arguments in calls:
            if name not in schemas or (named is not None and name != named):
                return False
            jsonschema.validate(json.loads(arguments), schemas[name], format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return bool(calls)


def run_parser(parser: str, max_tokens: int) -> dict:
    config = ServeConfig(model=ModelConfig(path=str(DEMO_MODEL_DIR), tool_call_parser=parser),
                         kv_pool=KVPoolConfig(num_blocks=512), scheduler=SchedulerConfig(max_num_seqs=16), port=0)
    server, _, model = build_server(config, drain_seconds=2)
    counts = {"replies": 0, "valid": 0, "cut_off": 0, "invalid": 0, "completion_tokens": 0}
    start = time.perf_counter()
    with serving(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for tools in TOOL_SETS.values():
            for named in (None, tools[0]["function"]["name"]):
                choice = "required" if named is None else {"type": "function", "function": {"name": named}}
                for prompt in PROMPTS:
                    kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], tools=tools,
                                  tool_choice=choice, parallel_tool_calls=False, max_tokens=max_tokens,
                                  temperature=0.8, seed=len(counts) + counts["replies"])
                    reply = client.chat.completions.create(**kwargs)
                    counts["completion_tokens"] += reply.usage.completion_tokens
                    for calls, finish_reason in (calls_of(reply),
                                                 streamed_calls_of(client.chat.completions.create(stream=True,
                                                                                                  **kwargs))):
                        counts["replies"] += 1
                        if finish_reason == "length":
                            counts["cut_off"] += 1
                        elif finish_reason == "tool_calls" and valid(calls, tools, named):
                            counts["valid"] += 1
                        else:
                            counts["invalid"] += 1
    finished = counts["replies"] - counts["cut_off"]
    return {**counts, "valid_of_finished": counts["valid"] / finished if finished else None,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = {"model": "demo", "max_tokens": args.max_tokens, "parsers": {}}
    print(f"{'format':<12} {'replies':>7} {'valid':>6} {'cut off':>7} {'invalid':>7} {'valid of finished':>17}")
    for name, label in (("hermes", "hermes"), ("llama3_json", "llama3_json"), ("none", "json array")):
        result = report["parsers"][label] = run_parser(name, args.max_tokens)
        share = result["valid_of_finished"]
        print(f"{label:<12} {result['replies']:>7} {result['valid']:>6} {result['cut_off']:>7} "
              f"{result['invalid']:>7} {'-' if share is None else f'{share:.1%}':>17}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
