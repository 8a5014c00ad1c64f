"""Reasoning parsers and a chat answer's shape (reasoning, content, tool calls), whole and streamed."""

from __future__ import annotations

import json

import pytest

from sage_infer.server.chat_answer import AnswerShape
from sage_infer.server.reasoning import ReasoningStream, get_reasoning_parser
from sage_infer.server.tool_parsers import get_tool_parser
from tests.test_tool_calls import token_pieces

# What the models write
R1 = ("Okay, the user wants 2 + 2. That is basic arithmetic: 2 + 2 = 4.\n</think>\n\n"
      "2 + 2 = **4**.")
QWEN3_THINKING = ("<think>\nOkay, the user asks for the weather in Paris. I should call get_weather.\n</think>\n\n"
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
QWEN3_PROMPT_THINKING = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # thinking templates
QWEN3_PROMPT_NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False


def test_deepseek_r1_answer_starts_inside_the_reasoning():
    parser = get_reasoning_parser("deepseek_r1")
    reasoning, content = parser.split(R1, parser.state("") == "open")
    assert reasoning.strip() == "Okay, the user wants 2 + 2. That is basic arithmetic: 2 + 2 = 4."
    assert content.strip() == "2 + 2 = **4**."


def test_deepseek_r1_without_an_end_is_all_reasoning():
    parser = get_reasoning_parser("deepseek_r1")
    assert parser.split("Still thinking about", True) == ("Still thinking about", "")


def test_qwen3_reads_its_think_tags():
    parser = get_reasoning_parser("qwen3")
    reasoning, content = parser.split(QWEN3_THINKING, parser.state("") == "open")
    assert reasoning.strip().startswith("Okay, the user asks") and content.strip().startswith("<tool_call>")


def test_qwen3_reasoning_follows_the_prompt():
    parser = get_reasoning_parser("qwen3")
    assert parser.state(QWEN3_PROMPT_THINKING) == "open" and parser.state(QWEN3_PROMPT_NO_THINKING) == "closed"
    assert parser.state("<|im_start|>assistant\n") == "maybe"
    assert parser.split("The answer is 4.", False) == ("", "The answer is 4.")


def test_unknown_reasoning_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("bogus")


@pytest.mark.parametrize("name, text, opens", [("deepseek_r1", R1, True), ("qwen3", QWEN3_THINKING, False),
                                               ("qwen3", "No tags here.", False), ("deepseek_r1", "cut off <", True)])
def test_reasoning_streamed_token_by_token_agrees(name, text, opens):
    parser = get_reasoning_parser(name)
    stream, parts = ReasoningStream(parser, opens), ["", ""]
    pieces = token_pieces(text)
    for i, piece in enumerate([*pieces, ""]):
        for j, part in enumerate(stream.feed(piece, final=i == len(pieces))):
            parts[j] += part
    assert tuple(parts) == tuple(part.strip() for part in parser.split(text, opens))


def answer_streamed(shape: AnswerShape, text: str) -> tuple[dict, str]:
    stream, message = shape.stream(), {"reasoning_content": "", "content": "", "tool_calls": {}}
    pieces = token_pieces(text)
    for i, piece in enumerate([*pieces, ""]):
        delta = stream.feed(piece, final=i == len(pieces))
        for key in ("reasoning_content", "content"):
            message[key] += delta.get(key, "")
        for call in delta.get("tool_calls", []):
            entry = message["tool_calls"].setdefault(call["index"], {"name": call["function"].get("name"),
                                                                     "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    return message, stream.finish_reason("stop")


def test_reasoning_then_tool_call_whole_and_streamed():
    shape = AnswerShape(get_reasoning_parser("qwen3"), False, get_tool_parser("hermes"))
    message, finish_reason = shape.message(QWEN3_THINKING, "stop")
    assert finish_reason == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "Okay, the user asks for the weather in Paris. I should call get_weather."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    streamed, streamed_finish = answer_streamed(shape, QWEN3_THINKING)
    assert streamed_finish == "tool_calls" and streamed["content"] == ""
    assert streamed["reasoning_content"] == message["reasoning_content"]
    assert streamed["tool_calls"] == {0: {"name": "get_weather", "arguments": call["function"]["arguments"]}}


def test_answer_without_calls_keeps_its_finish_reason():
    shape = AnswerShape(None, False, get_tool_parser("hermes"))
    assert shape.message("Paris is sunny.", "length") == ({"role": "assistant", "content": "Paris is sunny."},
                                                          "length")
    assert answer_streamed(shape, "Paris is sunny.")[1] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}' \
           '\n</tool_call>'
    message, _ = AnswerShape(None, False, get_tool_parser("hermes"), max_calls=1).message(text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"]
