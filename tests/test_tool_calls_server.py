"""Tool calls and reasoning over the real server with the official `openai` client: the demo model behind a
Qwen3-style chat template (tools in <tool_call> tags, `enable_thinking`), so the tool-call format is found in
the template and `tool_choice: required` / a named function make even this small model write valid calls."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.server.launch import build_server
from sage_infer.server.protocol import ChatMessage
from tests.server_fixture import assert_openai_error, serving

DEMO = Path(__file__).resolve().parents[1] / "sage_infer" / "demo_model"
# Qwen3's template, cut to what these tests need: tools and calls in <tool_call> tags, tool results, and the
# reasoning section opened (enable_thinking true) or closed empty (false) by the prompt
QWEN3_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n{{ tool.function.name }}{%- endfor %}"
    "\n</tools>\nCall them in <tool_call></tool_call> tags<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif enable_thinking is defined %}<think>\n{%- endif %}{%- endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city",
                                           "parameters": WEATHER}},  # (the template lists only the names)
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tools") / "demo-qwen3-style"
    shutil.copytree(DEMO, directory)
    (directory / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32", reasoning_parser="qwen3"),
                         kv_pool=KVPoolConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=16), port=0)
    http_server, _, name = build_server(config, drain_seconds=2)
    with serving(http_server) as url:
        yield url, name, http_server.config.app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def chat(client, server, **kwargs):
    return client.chat.completions.create(model=server[1], **{"messages": ASK, "max_tokens": 96, "temperature": 0,
                                                              **kwargs})


def streamed(client, server, **kwargs) -> tuple[dict, str]:
    """The streamed answer put together: content, reasoning_content and calls by index."""
    message, finish_reason = {"content": "", "reasoning_content": "", "tool_calls": {}}, None
    for chunk in chat(client, server, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.index not in message["tool_calls"]:
                    assert call.id and call.type == "function" and call.function.name
                    message["tool_calls"][call.index] = {"name": call.function.name, "arguments": ""}
                message["tool_calls"][call.index]["arguments"] += call.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return message, finish_reason


def assert_valid_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_template_format_is_found(server):
    assert server[2].state.handlers.chat_features.tool_parser.name == "hermes"


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_forced_tool_choice_gives_valid_calls(client, server, tool_choice, names):
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, extra_body=NO_THINKING)
    reply = chat(client, server, **kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert len(calls) == 1 and reply.message.tool_calls[0].id.startswith("call_")
    assert_valid_calls(calls, names)
    message, finish_reason = streamed(client, server, **kwargs)
    assert finish_reason == "tool_calls" and message["content"] == ""
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"].values()] == calls


def test_parallel_calls_under_required_are_each_valid(client, server):
    reply = chat(client, server, tools=TOOLS, tool_choice="required", extra_body=NO_THINKING).choices[0]
    # as many calls as the model writes before it stops or max_tokens cuts the last one off (then that one is
    # left in content): each call returned is valid
    assert reply.finish_reason in ("tool_calls", "length")
    assert_valid_calls([(c.function.name, c.function.arguments) for c in reply.message.tool_calls], set(SCHEMAS))


def test_auto_streamed_and_whole_agree(client, server):
    kwargs = dict(tools=TOOLS, extra_body=NO_THINKING)
    reply = chat(client, server, **kwargs).choices[0]
    message, finish_reason = streamed(client, server, **kwargs)
    assert finish_reason == reply.finish_reason and message["content"] == (reply.message.content or "")
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"].values()] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]


def test_tool_round_trip_goes_back_through_the_template(client, server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with_result = [*history, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C all week."}]
    asked = chat(client, server, messages=history, tools=TOOLS, max_tokens=4, extra_body=NO_THINKING)
    answered = chat(client, server, messages=with_result, tools=TOOLS, max_tokens=4, extra_body=NO_THINKING)
    assert answered.usage.prompt_tokens > asked.usage.prompt_tokens > 0


def test_tool_call_arguments_reach_the_template_as_an_object(model_dir):
    message = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    text = Tokenizer.from_dir(model_dir).apply_chat_template([message.to_template()], add_generation_prompt=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_thinking_prompt_makes_the_answer_reasoning(client, server):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    reply = chat(client, server, max_tokens=12, extra_body=thinking).choices[0]
    assert reply.message.content is None and reply.message.reasoning_content
    message, _ = streamed(client, server, max_tokens=12, extra_body=thinking)
    assert message == {"content": "", "reasoning_content": reply.message.reasoning_content, "tool_calls": {}}
    plain = chat(client, server, max_tokens=12, extra_body=NO_THINKING).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None


@pytest.mark.parametrize("constraint, answer", [({"regex": "[0-9]{1,3} (sunny|rainy)"}, r"[0-9]{1,3} (sunny|rainy)"),
                                                ({"choice": ["yes", "no"]}, "yes|no")])
def test_a_regex_or_choice_is_accepted_after_an_open_reasoning_section(client, server, constraint, answer):
    """The constraint leaves the reasoning free (the demo model does not close it within these tokens, so all of its
    output is reasoning; tests/test_tool_calls_constraint.py checks the answer after `</think>` token by token)."""
    thinking = {"chat_template_kwargs": {"enable_thinking": True}, "structured_outputs": constraint}
    reply = chat(client, server, max_tokens=24, extra_body=thinking).choices[0]
    assert reply.message.reasoning_content
    assert reply.message.content is None or re.fullmatch(answer, reply.message.content.strip())
    # the same greedy reasoning as without the constraint, until the unconstrained answer ends (the constraint
    # forbids the end of text before its answer)
    free = chat(client, server, max_tokens=24, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert reply.message.reasoning_content.startswith(free.choices[0].message.reasoning_content)


BAD = [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": "get_weather"}]}, "messages.1.tool_calls"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages.1.tool_calls.0.function.name"),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_tool_input_is_a_400_naming_the_field(server, fields, param):
    body = {"model": server[1], "messages": ASK, "max_tokens": 4, **fields}
    response = httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=30)
    message = assert_openai_error(response, 400)
    assert response.json()["error"]["param"] == param and param.split(".")[0] in message


@pytest.mark.parametrize("flag, field", [("--tool-call-parser", "model.tool_call_parser"),
                                         ("--reasoning-parser", "model.reasoning_parser")])
def test_unknown_parser_flag_is_one_line_naming_the_field(sage, flag, field):
    bad = sage("llm", "serve", flag, "bogus")
    assert bad.code == 2 and field in bad.err and len(bad.err.strip().splitlines()) == 1


def test_parser_flags_reach_the_config(sage):
    shown = json.loads(sage("config", "show", "--json", "--set", "model.tool_call_parser=mistral").out)
    fields = {f["field"]: f for f in shown["fields"]}
    assert fields["model.tool_call_parser"]["value"] == "mistral"
    assert fields["model.reasoning_parser"]["value"] == "none"
