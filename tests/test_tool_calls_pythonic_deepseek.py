"""The pythonic (Llama 3.2 / 4) and DeepSeek V3 tool-call parsers: whole answers, the same calls from any
chunking of the stream, malformed calls as content; and the pythonic format over the real server."""

from __future__ import annotations

import json
import random
import shutil

import openai
import pytest

from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig
from sage_infer.server.launch import build_server
from sage_infer.server.tool_parsers import ToolCallStream, detect_tool_parser, get_tool_parser
from sage_infer.server.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from tests.server_fixture import serving
from tests.test_tool_calls import DEMO, calls_of, streamed, token_pieces

# What the models write (vLLM's pythonic templates and Llama 3.2 / 4 model cards; DeepSeek's chat templates)
LLAMA32_TWO = '[get_weather(city="San Francisco, CA", unit="celsius"), get_time(tz=\'America/Los_Angeles\')]'
LLAMA4_TAGGED = '<|python_start|>[search(query="a ) tricky ] \\" string", filters={"year": [2020, -1], "open": True, ' \
    '"tags": ("a", "b")}, limit=None)]<|python_end|>'
PYTHONIC_NO_ARGS = "[get_time()]"
PYTHONIC_JSON_WORDS = '[set_flag(on=true, value=null, ratio=1.5e-3, note="""two\nlines""",)]'
DEEPSEEK_V3_TWO = (
    f'Let me check both.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"location": "Beijing", '
    f'"unit": "celsius"}}\n```{CALL_END}\n{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}'
    f'{CALLS_END}')
DEEPSEEK_V31 = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"q": "a }} \\" {CALL_END}"}}{CALL_END}{CALLS_END}'

PYTHONIC_CASES = [
    (LLAMA32_TWO, [("get_weather", {"city": "San Francisco, CA", "unit": "celsius"}),
                   ("get_time", {"tz": "America/Los_Angeles"})]),
    (LLAMA4_TAGGED, [("search", {"query": 'a ) tricky ] " string',
                                 "filters": {"year": [2020, -1], "open": True, "tags": ["a", "b"]}, "limit": None})]),
    (PYTHONIC_NO_ARGS, [("get_time", {})]),
    (PYTHONIC_JSON_WORDS, [("set_flag", {"on": True, "value": None, "ratio": 0.0015, "note": "two\nlines"})]),
]
DEEPSEEK_CASES = [
    (DEEPSEEK_V3_TWO, "Let me check both.", [("get_weather", {"location": "Beijing", "unit": "celsius"}),
                                              ("get_time", {})]),
    (DEEPSEEK_V31, None, [("get_weather", {"q": f'a }} " {CALL_END}'})]),
]
NOT_CALLS = {  # answers that are content, whole: never a call, never an error
    "pythonic": ["The weather is sunny.", "[1] says it is sunny.", "[]", "[get_weather('Paris')]",
                 "[get_weather(city=paris)]", "[get_weather(city='Paris', city='Lyon')]", "[f(a=__import__('os'))]",
                 "[get_weather(city='Paris')] and then some", "[get_weather(city=1 + 2)]",
                 "[get_weather(city='Par"],
    "deepseek_v3": ["Sunny, 21 C.", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{'city': 1}}\n```"
                    f"{CALL_END}{CALLS_END}", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
                    '{"city": "Par', f"{CALLS_BEGIN}{CALL_BEGIN}tool{SEP}get weather\n```json\n{{}}\n```{CALL_END}",
                    f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n["Paris"]\n```{CALL_END}'],
}


@pytest.mark.parametrize("text, expected", PYTHONIC_CASES)
def test_pythonic_reads_calls(text, expected):
    assert calls_of(get_tool_parser("pythonic"), text) == (None, expected)


@pytest.mark.parametrize("text, content, expected", DEEPSEEK_CASES)
def test_deepseek_v3_reads_calls(text, content, expected):
    assert calls_of(get_tool_parser("deepseek_v3"), text) == (content, expected)


@pytest.mark.parametrize("name, text", [(name, text) for name, texts in NOT_CALLS.items() for text in texts])
def test_answer_that_is_no_valid_call_is_content(name, text):
    parser = get_tool_parser(name)
    assert calls_of(parser, text) == (text.strip(), [])


def test_pythonic_arguments_are_read_never_run(monkeypatch):
    monkeypatch.setattr("builtins.eval", lambda *a: pytest.fail("eval called"))
    text = "[f(a=(lambda: 1)(), b=open('x').read())]"
    assert calls_of(get_tool_parser("pythonic"), text) == (text, [])


def chunkings(text: str, markers: tuple[str, ...] = ()) -> list[list[str]]:
    """The text cut as a tokenizer would (markers whole, as special tokens), one character at a time, and at
    random places."""
    pieces, pos = [], 0
    while pos < len(text):
        marker = next((m for m in markers if text.startswith(m, pos)), None)
        stop = pos + len(marker) if marker else min([i for m in markers if (i := text.find(m, pos)) > 0] or
                                                     [len(text)])
        if marker:
            pieces.append(marker)
        else:
            try:
                pieces.extend(token_pieces(text[pos:stop]))
            except AssertionError:  # characters the demo tokenizer does not hold
                pieces.extend(text[pos:stop])
        pos = stop
    rng = random.Random(len(text))
    cuts = [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, n))) for n in (2, 5, 17)]
    randoms = [[text[a:b] for a, b in zip([0, *cut], [*cut, len(text)], strict=True)] for cut in cuts]
    return [pieces, list(text), *randoms]


# content whose format breaks before a call's name is known: the stream sends it as content too (a call that
# breaks later was already sent by name, as in OpenAI's and vLLM's streams)
EARLY_CONTENT = [("pythonic", "The weather is sunny."), ("pythonic", "[1] says it is sunny."), ("pythonic", "[]"),
                 ("deepseek_v3", "Sunny, 21 C."), ("deepseek_v3", NOT_CALLS["deepseek_v3"][3])]
STREAM_CASES = [("pythonic", text) for text, _ in PYTHONIC_CASES] + [
    ("deepseek_v3", text) for text, _, _ in DEEPSEEK_CASES] + EARLY_CONTENT


@pytest.mark.parametrize("name, text", STREAM_CASES)
def test_any_chunking_of_the_stream_gives_the_same_calls(name, text):
    parser = get_tool_parser(name)
    whole = calls_of(parser, text)
    for pieces in chunkings(text, (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)):
        assert streamed(parser, pieces) == whole, pieces


@pytest.mark.parametrize("name, text, sent", [
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz="Europ',
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{")]),
    ("pythonic", "[get_weather(city='Paris', days=three)]", [("get_weather", '{"city": "Paris"')]),
    ("deepseek_v3", f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Par',
     [("get_weather", '{"city": "Par')]),
])
def test_streamed_call_cut_off_or_broken_stays_a_call_with_the_arguments_written(name, text, sent):
    parser = get_tool_parser(name)
    for pieces in chunkings(text):
        assert streamed(parser, pieces, parse_arguments=False) == (None, sent)
    assert calls_of(parser, text) == (text, [])  # whole, the unfinished or broken call is content


def test_pythonic_arguments_stream_one_argument_at_a_time():
    stream = ToolCallStream(get_tool_parser("pythonic"))
    pieces = [d["function"]["arguments"] for ch in LLAMA32_TWO for d in stream.feed(ch)[1]]
    assert pieces[:3] == ["{", '"city": "San Francisco, CA"', ', "unit": "celsius"}']  # `)` closes the last


def test_names_and_template_detection():
    assert get_tool_parser("llama4_pythonic").name == "pythonic"
    assert get_tool_parser("deepseekv3").name == get_tool_parser("deepseek_v31").name == "deepseek_v3"
    assert get_tool_parser("deepseek_v3").needs_special_tokens and not get_tool_parser("pythonic").needs_special_tokens
    assert detect_tool_parser(f"{{{{ '{CALLS_BEGIN}' }}}}") == "deepseek_v3"
    # vLLM's Llama 3.2 pythonic template writes the format out (with Llama's <|python_tag|> elsewhere)
    assert detect_tool_parser("<|python_tag|>... in the format of [func_name1(params_name1=params_value1)]") \
        == "pythonic"


# -- over the server: the demo model behind a pythonic template -------------------------------------------------

PYTHONIC_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nIf you decide to invoke any of the function(s), you MUST put it in the format "
    "of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]<|im_end|>\n"
    "{%- endif %}{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# the demo model never saw a tool: the regex makes it write a pythonic call, which the parser reads back
WRITE_A_CALL = {"structured_outputs": {"regex": r'\[get_weather\(city="(Paris|Lyon)", days=[1-7]\)\]'}}


@pytest.fixture(scope="module")
def pythonic_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pythonic") / "demo-pythonic"
    shutil.copytree(DEMO, directory)
    (directory / "chat_template.jinja").write_text(PYTHONIC_TEMPLATE)
    config = ServeConfig(model=ModelConfig(path=str(directory), dtype="fp32"), kv_pool=KVPoolConfig(num_blocks=128),
                         scheduler=SchedulerConfig(max_num_seqs=4), port=0)
    http_server, _, name = build_server(config, drain_seconds=2)
    with serving(http_server) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), name, http_server.config.app


def test_pythonic_calls_over_the_server_whole_and_streamed(pythonic_server):
    client, model, app = pythonic_server
    assert app.state.handlers.chat_features.tool_parser.name == "pythonic"  # found in the template
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0, extra_body=WRITE_A_CALL)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (call,) = reply.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Lyon") and 1 <= arguments["days"]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                calls.setdefault(delta.index, [delta.function.name, ""])[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls.values()) == [["get_weather", call.function.arguments]]


def test_required_with_the_pythonic_parser_is_constrained_in_json(pythonic_server):
    client, model, _ = pythonic_server
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0).choices[0]
    assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
    call = reply.message.tool_calls[0].function
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Lyon")
