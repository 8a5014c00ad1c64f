"""The grammar a forced tool choice (``required`` or a named function) constrains the output to, so that even a
small model writes a valid call for the given tools, and the parser that reads it back.

In the model's own format when the server's parser is one whose calls are plain text (Hermes/Qwen
``<tool_call>\\n{...}\\n</tool_call>``, Llama 3 JSON), as the model was trained to write them; otherwise vLLM's
shape: a JSON array of ``{"name", "parameters"}`` objects, or the named function's arguments object. With a
reasoning parser the ``<think>`` section comes first, unconstrained (`reasoning_grammar`)."""

from __future__ import annotations

import json
import re

from sage_infer.core.structured_outputs import StructuredOutputsParams
from sage_infer.server.reasoning import END, START
from sage_infer.server.tool_parsers.base import ToolParser
from sage_infer.server.tool_parsers.forced import CallArrayParser, NamedCallParser
from sage_infer.structured.constraints import grammar, json_schema, lark_literal

PARAM = "tools"
UNESCAPED_SLASH = re.compile(r"(?<!\\)((?:\\\\)*)/")  # a / after an even number of backslashes
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as json.dumps writes


def lark_json(schema: dict) -> str:
    """A JSON schema embedded in a Lark grammar, its keys in their order (llguidance makes properties come in the
    order `properties` lists them, and a call is written name first), laid out as ``json.dumps`` writes JSON (no
    whitespace of the model's choosing: a small model would spend its tokens on it)."""
    return "%json " + json.dumps({"x-guidance": JSON_LAYOUT, **schema}, ensure_ascii=False)


def call_schema(name: str, parameters: dict, arguments_key: str = "arguments") -> dict:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def forced_call(functions: dict[str, dict], named: str | None, max_calls: int | None, parser: ToolParser | None,
                reasoning: bool | None) -> tuple[StructuredOutputsParams, ToolParser]:
    """(constraint, parser of its output) for calls of `functions` (name -> parameters schema): at least one, at
    most `max_calls`; `named`: exactly one call of that function. reasoning: None (no reasoning parser), True (the
    answer starts inside ``<think>``), False (it may open one first)."""
    max_calls = 1 if named is not None else max_calls
    wanted = {named: functions[named]} if named is not None else functions
    name = parser.name if parser is not None else None
    if name in ("hermes", "llama3_json"):
        key, begin, end, separator = (("arguments", "<tool_call>\n", "\n</tool_call>", "\n") if name == "hermes"
                                      else ("parameters", "", "", "; "))
        item = lark_json(one_of([call_schema(n, p, key) for n, p in wanted.items()]))
        if begin:
            item = f"{lark_literal(begin)} {item} {lark_literal(end)}"
        upper = "" if max_calls is None else max_calls - 1
        repeat = "" if max_calls == 1 else f" ({lark_literal(separator)} item){{0,{upper}}}"
        return grammar(reasoning_grammar(f"item{repeat}", reasoning) + f"item: {item}\n", param=PARAM), parser
    if named is not None:
        body, reader = wanted[named], NamedCallParser(named)
    else:
        body = {"type": "array", "minItems": 1,
                "items": one_of([call_schema(n, p, "parameters") for n, p in wanted.items()])}
        if max_calls is not None:
            body["maxItems"] = max_calls
        reader = CallArrayParser()
    if reasoning is None:
        return json_schema(body, param=PARAM), reader
    return grammar(reasoning_grammar("body", reasoning) + f"body: {lark_json(body)}\n", param=PARAM), reader


def reasoning_grammar(body: str, reasoning: bool | None) -> str:
    """Lark rules: `start` is the reasoning section (when there is a reasoning parser), then `body`."""
    if reasoning is None:
        return f"start: {body}\n"
    think = "think GAP" if reasoning else f"({lark_literal(START)} think GAP)?"
    return (f"start: {think} {body}\n"
            f"think[lazy]: THINK_TEXT {lark_literal(END)}\n"
            "THINK_TEXT: /(.|\\n)*/\n"
            "GAP: /[ \\n]*/\n")


def after_reasoning(spec: StructuredOutputsParams, reasoning: bool) -> StructuredOutputsParams:
    """A constraint (``response_format``, ``structured_outputs``: JSON, a regex, a choice) applied after the
    reasoning section. A grammar of the client's is refused: embedding its rules in this one is not built."""
    if spec.kind == "grammar":
        raise ValueError(f"{spec.param}: a grammar constraint with a reasoning parser is not implemented yet (JSON "
                         "schemas, json_object, regex and choice are)")
    return grammar(reasoning_grammar("body", reasoning) + f"body: {lark_body(spec)}\n", param=spec.param)


def lark_body(spec: StructuredOutputsParams) -> str:
    """The Lark expression of a JSON, regex or choice constraint: JSON through llguidance's ``%json``, a regex as a
    terminal (a ``/`` in it escaped), a choice as alternatives of literals."""
    if spec.kind == "regex":
        return "/" + UNESCAPED_SLASH.sub(r"\1\\/", spec.spec) + "/"
    if spec.kind == "choice":
        return "(" + " | ".join(lark_literal(option) for option in json.loads(spec.spec)) + ")"
    return lark_json(json.loads(spec.spec) if spec.kind == "json" else {"type": "object"})
