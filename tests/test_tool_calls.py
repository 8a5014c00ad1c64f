"""Tool-call parsers on the text real models write, whole and streamed token by token."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from sage_infer.models.tokenizer import Tokenizer
from sage_infer.server.tool_parsers import ToolCallStream, detect_tool_parser, get_tool_parser
from sage_infer.server.tool_parsers.forced import CallArrayParser, NamedCallParser

DEMO = Path(__file__).resolve().parents[1] / "sage_infer" / "demo_model"

# What the models write (their chat templates' formats, as in their model cards and docs).
QWEN25_TWO_CALLS = (  # Qwen2.5-7B-Instruct, Qwen's function-calling guide
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, '
    'USA", "date": "2024-10-01"}}\n</tool_call>')
QWEN3_TEXT_THEN_CALL = (
    'I\'ll look up the weather in Paris for you.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
HERMES2_ARGS_FIRST = (  # Hermes 2 Pro writes the arguments before the name
    '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>')
HERMES_PYTHON_DICT = "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>"
HERMES_CUT_OFF = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'  # max_tokens hit
HERMES_NESTED = ('<tool_call>\n{"name": "search", "arguments": {"query": "a } tricky \\" string </tool_call>", '
                 '"filters": {"year": [2020, 2021], "open": true}}}\n</tool_call>')
LLAMA31_CALL = ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                '"unit": "Fahrenheit"}}')
LLAMA31_TAGGED = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA31_TWO = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
              '"format": "celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]')
MISTRAL_V11 = 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'


def calls_of(parser, text):
    content, calls = parser.extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_qwen_parallel_calls():
    content, calls = calls_of(get_tool_parser("hermes"), QWEN25_TWO_CALLS)
    assert content is None
    assert calls == [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                     ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]


def test_hermes_keeps_text_outside_the_calls_as_content():
    content, calls = calls_of(get_tool_parser("hermes"), QWEN3_TEXT_THEN_CALL)
    assert content == "I'll look up the weather in Paris for you."
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_hermes_reads_arguments_written_before_the_name():
    assert calls_of(get_tool_parser("hermes"), HERMES2_ARGS_FIRST)[1] == [
        ("get_stock_fundamentals", {"symbol": "TSLA"})]


def test_hermes_follows_json_strings_holding_brackets_and_the_end_tag():
    _, calls = calls_of(get_tool_parser("hermes"), HERMES_NESTED)
    assert calls == [("search", {"query": 'a } tricky " string </tool_call>',
                                 "filters": {"year": [2020, 2021], "open": True}})]


@pytest.mark.parametrize("text", [HERMES_PYTHON_DICT, HERMES_CUT_OFF,
                                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'])
def test_hermes_call_that_does_not_parse_is_content(text):
    assert calls_of(get_tool_parser("hermes"), text) == (text, [])


def test_arguments_sent_as_a_json_string_are_read():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    assert calls_of(get_tool_parser("hermes"), text)[1] == [("f", {"x": 1})]


@pytest.mark.parametrize("text, expected", [
    (LLAMA31_CALL, [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    (LLAMA31_TAGGED, [("get_weather", {"city": "Paris"})]),
    (LLAMA31_TWO, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
])
def test_llama3_json_reads_calls(text, expected):
    assert calls_of(get_tool_parser("llama3_json"), text) == (None, expected)


@pytest.mark.parametrize("text", ["The weather in Paris is sunny.", '{"name": "get_weather", "parameters": {"city": '])
def test_llama3_json_answer_that_is_no_call_is_content(text):
    assert calls_of(get_tool_parser("llama3_json"), text) == (text.strip(), [])


def test_mistral_reads_the_json_array_format():
    assert calls_of(get_tool_parser("mistral"), MISTRAL_V3) == (None, [
        ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
        ("get_time", {"tz": "Europe/Paris"})])


def test_mistral_reads_the_name_args_format():
    assert calls_of(get_tool_parser("mistral"), MISTRAL_V11) == (
        "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})])


def test_mistral_broken_call_section_is_content():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, oops]'
    assert calls_of(get_tool_parser("mistral"), text) == (text, [])


def test_mistral_asks_to_keep_special_tokens():
    assert get_tool_parser("mistral").needs_special_tokens and not get_tool_parser("hermes").needs_special_tokens


def test_required_and_named_outputs_are_read():
    assert calls_of(CallArrayParser(), '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]') \
        == (None, [("f", {"a": 1}), ("g", {})])
    assert calls_of(NamedCallParser("f"), ' {"a": [1, 2]}') == (None, [("f", {"a": [1, 2]})])


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("bogus")


def test_template_text_names_its_format():
    assert detect_tool_parser("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert detect_tool_parser({"default": "x", "tool_use": "[TOOL_CALLS] {{ tools }}"}) == "mistral"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser(demo_tokenizer().chat_template) is None


# -- streaming ------------------------------------------------------------------------


@functools.cache
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


def token_pieces(text: str) -> list[str]:
    """`text` as a detokenizer hands it out: the new text of each token of a real tokenizer."""
    tokenizer = demo_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        pieces.append(now[len(before):])
        before = now
    assert "".join(pieces) == text
    return pieces


def streamed(parser, pieces: list[str], parse_arguments: bool = True):
    """(content, [(name, arguments)]) put together from the stream's deltas, checking their OpenAI shape."""
    stream, content, calls = ToolCallStream(parser), "", {}
    for i, piece in enumerate([*pieces, ""]):
        text, deltas = stream.feed(piece, final=i == len(pieces))
        content += text
        for delta in deltas:
            index = delta["index"]
            if index not in calls:  # the first delta of a call: id, type and name, once
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                calls[index] = [delta["function"]["name"], ""]
            else:
                assert "id" not in delta and "name" not in delta["function"]
            calls[index][1] += delta["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    read = json.loads if parse_arguments else str
    return content or None, [(name, read(arguments)) for _, (name, arguments) in sorted(calls.items())]


STREAM_CASES = [("hermes", QWEN25_TWO_CALLS), ("hermes", QWEN3_TEXT_THEN_CALL), ("hermes", HERMES2_ARGS_FIRST),
                ("hermes", HERMES_NESTED), ("hermes", HERMES_PYTHON_DICT),
                ("hermes", "Just an answer, <b>no</b> call < here."), ("llama3_json", LLAMA31_CALL),
                ("llama3_json", LLAMA31_TWO), ("llama3_json", LLAMA31_TAGGED), ("llama3_json", "Sunny, 21 C."),
                ("mistral", MISTRAL_V3), ("mistral", MISTRAL_V11)]


FORCED_PARSERS = {"required": CallArrayParser(), "named": NamedCallParser("get_weather")}
STREAM_CASES += [("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", '
                              '"parameters": {"tz": "UTC"}}]'), ("named", '{"city": "Paris", "days": [1, 2]}')]


@pytest.mark.parametrize("name, text", STREAM_CASES)
def test_streamed_token_by_token_gives_the_same_calls(name, text):
    parser = FORCED_PARSERS.get(name) or get_tool_parser(name)
    whole = calls_of(parser, text)
    assert streamed(parser, token_pieces(text)) == whole
    assert streamed(parser, list(text)) == whole  # one character at a time


def test_streamed_arguments_come_in_pieces():
    stream = ToolCallStream(get_tool_parser("hermes"))
    sizes = [len(d["function"]["arguments"]) for piece in token_pieces(QWEN3_TEXT_THEN_CALL)
             for d in stream.feed(piece)[1]]
    assert len(sizes) > 3 and max(sizes) < len('{"city": "Paris", "unit": "celsius"}')


def test_streamed_calls_stop_at_max_calls():
    stream = ToolCallStream(get_tool_parser("hermes"), max_calls=1)
    deltas = [d for piece in [QWEN25_TWO_CALLS, ""] for d in stream.feed(piece, final=not piece)[1]]
    assert {d["index"] for d in deltas} == {0} and stream.num_calls == 1


def test_streamed_call_cut_off_stays_a_call_with_the_arguments_written():
    # sent as soon as its name was known: the client already has it (OpenAI's stream does the same)
    assert streamed(get_tool_parser("hermes"), token_pieces(HERMES_CUT_OFF), parse_arguments=False) == (
        None, [("get_weather", '{"city": "Par')])
