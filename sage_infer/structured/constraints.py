"""Builders of `StructuredOutputsParams`: the one way code (the server's request fields, tool calling's
`tool_choice: required`) says what an output must look like. Nothing here compiles; `GrammarCompiler` does, and
refuses what the grammar library cannot honour with a `StructuredOutputError` naming the request field."""

from __future__ import annotations

import json

from sage_infer.core.structured_outputs import StructuredOutputsParams


class StructuredOutputError(ValueError):
    """A constraint that cannot be served (malformed, unsupported feature, too slow to compile). `param` is the
    request field it came from; the message is written for the client."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


def json_schema(schema: dict | bool | str, *, whitespace_flexible: bool = True,
                param: str = "response_format.json_schema.schema") -> StructuredOutputsParams:
    """Output one JSON value valid under `schema` (a dict, true/false, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {err}", param) from None
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError("a JSON schema must be an object (or true/false)", param)
    spec = json.dumps(schema, ensure_ascii=False)  # key order kept: properties are written in schema order
    return StructuredOutputsParams("json", spec, whitespace_flexible, param)


def any_of_json_schemas(schemas: list[dict], *, whitespace_flexible: bool = True,
                        param: str = "tools") -> StructuredOutputsParams:
    """Output one JSON value valid under one of `schemas` (e.g. one call of any of several tools)."""
    if not schemas:
        raise StructuredOutputError("at least one JSON schema is needed", param)
    return json_schema({"anyOf": list(schemas)}, whitespace_flexible=whitespace_flexible, param=param)


def json_object(*, whitespace_flexible: bool = True, param: str = "response_format") -> StructuredOutputsParams:
    """Output any one JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return StructuredOutputsParams("json_object", "", whitespace_flexible, param)


def regex(pattern: str, *, param: str = "structured_outputs.regex") -> StructuredOutputsParams:
    """Output text matching `pattern` in full (Rust `regex` syntax, as vLLM's llguidance backend)."""
    if not isinstance(pattern, str) or not pattern:
        raise StructuredOutputError("the regex must be a non-empty string", param)
    return StructuredOutputsParams("regex", pattern, True, param)


def choice(options: list[str], *, param: str = "structured_outputs.choice") -> StructuredOutputsParams:
    """Output exactly one of `options`."""
    if not options or not all(isinstance(o, str) and o for o in options):
        raise StructuredOutputError("choice must be a non-empty list of non-empty strings", param)
    return StructuredOutputsParams("choice", json.dumps(list(options), ensure_ascii=False), True, param)


def grammar(text: str, *, param: str = "structured_outputs.grammar") -> StructuredOutputsParams:
    """Output text of a context-free grammar: Lark syntax as llguidance reads it (``start: ...``; a JSON schema
    inline with ``%json {...}``), or GBNF (``root ::= ...``, converted to Lark)."""
    if not isinstance(text, str) or not text.strip():
        raise StructuredOutputError("the grammar must be a non-empty string", param)
    return StructuredOutputsParams("grammar", text, True, param)


def lark_json(schema: dict) -> str:
    """A JSON schema as a Lark rule body (``%json {...}``), to embed a JSON value in a grammar."""
    return "%json " + json.dumps(schema, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (matched as bytes of text, whatever tokens spell it)."""
    return json.dumps(text, ensure_ascii=False)


def tagged_json(begin: str, schemas: list[dict], end: str, *, min_items: int = 1, max_items: int | None = None,
                separator: str = "\n", param: str = "tools") -> StructuredOutputsParams:
    """Output `min_items`..`max_items` (None: no bound) blocks ``begin JSON end``, separated by `separator`, the
    JSON of each valid under one of `schemas`. The shape of tool calls: Hermes/Qwen ``<tool_call>\\n{...}\\n
    </tool_call>``, or, with ``begin="[TOOL_CALLS]"`` and an array schema, Mistral's."""
    if not schemas:
        raise StructuredOutputError("at least one JSON schema is needed", param)
    if min_items < 1 or (max_items is not None and max_items < min_items):
        raise StructuredOutputError("tagged_json: need 1 <= min_items <= max_items", param)
    body = schemas[0] if len(schemas) == 1 else {"anyOf": list(schemas)}
    more = f"({lark_literal(separator)} item)"
    upper = "" if max_items is None else str(max_items - 1)
    repeat = "" if max_items == 1 else f" {more}{{{min_items - 1},{upper}}}"
    text = (f"start: item{repeat}\n"
            f"item: {lark_literal(begin)} value {lark_literal(end)}\n"
            f"value: {lark_json(body)}\n")
    return StructuredOutputsParams("grammar", text, True, param)
