"""The grammars of forced tool choices and of JSON after a reasoning section, compiled by the structured-output
compiler (llguidance) for the demo tokenizer: which outputs they allow, token by token."""

from __future__ import annotations

import pytest

from sage_infer.server.tool_parsers import get_tool_parser
from sage_infer.server.tool_parsers.constraint import after_reasoning, forced_call
from sage_infer.structured.constraints import choice, grammar, json_schema, regex
from sage_infer.structured.grammar import compiler_for
from tests.test_tool_calls import demo_tokenizer

FUNCTIONS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
             "get_time": {"type": "object", "properties": {}}}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
ARRAY = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'


def allows(spec, text: str) -> bool:
    """The grammar takes every token of `text` and is then complete."""
    tokenizer = demo_tokenizer()
    matcher = compiler_for(tokenizer, tokenizer.vocab_size).matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.valid_prefix(ids) != len(ids):
        return False
    for token in ids:
        assert matcher.accept(token)
    return matcher.ll.is_accepting()


@pytest.mark.parametrize("parser, text, reader", [("hermes", HERMES, "hermes"), ("llama3_json", LLAMA, "llama3_json"),
                                                  (None, ARRAY, "required"), ("mistral", ARRAY, "required")])
def test_required_is_written_in_the_parsers_format(parser, text, reader):
    spec, read_by = forced_call(FUNCTIONS, None, None, parser and get_tool_parser(parser), None)
    assert read_by.name == reader and allows(spec, text)
    _, calls = read_by.extract(text)
    assert calls and calls[0].name == "get_weather"
    assert not allows(spec, text.replace("get_weather", "get_wether"))  # no function of that name
    assert not allows(spec, "Sure! " + text)  # nothing before the call


def test_required_with_parallel_calls_off_allows_one_call():
    two = HERMES + "\n" + HERMES
    spec, _ = forced_call(FUNCTIONS, None, None, get_tool_parser("hermes"), None)
    assert allows(spec, two)
    spec, _ = forced_call(FUNCTIONS, None, 1, get_tool_parser("hermes"), None)
    assert allows(spec, HERMES) and not allows(spec, two)


def test_named_function_allows_only_that_function():
    spec, _ = forced_call(FUNCTIONS, "get_time", None, get_tool_parser("hermes"), None)
    assert allows(spec, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not allows(spec, HERMES)
    spec, reader = forced_call(FUNCTIONS, "get_weather", None, None, None)  # vLLM's shape: the arguments alone
    assert allows(spec, '{"city": "Paris"}') and not allows(spec, '{"town": "Paris"}')
    assert reader.extract('{"city": "Paris"}')[1][0].name == "get_weather"


def test_call_comes_after_the_reasoning_section():
    thought = "The user wants Paris. I will call get_weather, not print </thin k>.\n</think>\n\n"
    opened, _ = forced_call(FUNCTIONS, None, None, get_tool_parser("hermes"), True)
    assert allows(opened, thought + HERMES) and not allows(opened, HERMES)
    may_open, _ = forced_call(FUNCTIONS, None, None, get_tool_parser("hermes"), False)
    assert allows(may_open, "<think>" + thought + HERMES) and allows(may_open, HERMES)
    assert not allows(may_open, thought + HERMES)


def test_json_schema_applies_after_the_reasoning_section():
    spec = after_reasoning(json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                        "required": ["n"]}), True)
    assert allows(spec, 'Two and two make four.</think>\n{"n": 4}')
    assert not allows(spec, 'Two and two make four.</think>\n{"n": "four"}')
    assert not allows(spec, '{"n": 4}')


def test_a_regex_applies_after_the_reasoning_section():
    spec = after_reasoning(regex(r"[0-9]+/[0-9]+ (a|b)"), True)  # a / in the pattern is escaped for Lark
    assert allows(spec, "Halves of four.</think>\n2/4 a")
    assert not allows(spec, "Halves of four.</think>\n2/4 c")
    assert not allows(spec, "2/4 a")  # the reasoning section was opened by the prompt: it comes first
    may_open = after_reasoning(regex(r"[0-9]+"), False)
    assert allows(may_open, "<think>Count.</think>\n42") and allows(may_open, "42") and not allows(may_open, "x")


def test_a_choice_applies_after_the_reasoning_section():
    spec = after_reasoning(choice(["yes", "no (maybe)"]), True)
    assert allows(spec, "Hm.</think>\nyes") and allows(spec, "Hm.</think>\nno (maybe)")
    assert not allows(spec, "Hm.</think>\nperhaps") and not allows(spec, "Hm.</think>\nyesno")


def test_a_clients_grammar_after_reasoning_is_not_implemented():
    with pytest.raises(ValueError, match="grammar constraint with a reasoning parser is not implemented yet"):
        after_reasoning(grammar('start: "a"'), True)
