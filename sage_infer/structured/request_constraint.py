"""The request fields that ask for structured output, as one constraint: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` extras. At most one of them may be given."""

from __future__ import annotations

from typing import Any

from sage_infer.core.structured_outputs import StructuredOutputsParams
from sage_infer.structured import constraints as c
from sage_infer.structured.constraints import StructuredOutputError


def from_response_format(fmt: dict) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}}), already shape-checked; None for plain text. `strict` is honoured as vLLM does: the
    schema is enforced as written (a schema OpenAI's strict mode would refuse is served, not refused)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return c.json_object(param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        if spec.get("schema") is None:
            raise StructuredOutputError("response_format.json_schema.schema is required", "response_format.json_schema")
        return c.json_schema(spec["schema"], param="response_format.json_schema.schema")
    raise StructuredOutputError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                                "response_format.type")


def from_structured_outputs(fields: dict, prefix: str = "structured_outputs") -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` ({json | regex | choice | grammar | json_object, disable_any_whitespace}):
    exactly one kind."""
    flexible = not fields.get("disable_any_whitespace", False)
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
             if fields.get(k) is not None and fields.get(k) is not False]
    if len(given) != 1:
        raise StructuredOutputError(f"{prefix}: give exactly one of json, regex, choice, grammar, json_object "
                                    f"(got {', '.join(given) or 'none'})", prefix)
    return _one(given[0], fields[given[0]], f"{prefix}.{given[0]}", flexible)


def _one(kind: str, value: Any, param: str, whitespace_flexible: bool = True) -> StructuredOutputsParams:
    if kind == "json":
        return c.json_schema(value, whitespace_flexible=whitespace_flexible, param=param)
    if kind == "json_object":
        return c.json_object(whitespace_flexible=whitespace_flexible, param=param)
    if kind == "regex":
        return c.regex(value, param=param)
    if kind == "choice":
        return c.choice(value, param=param)
    return c.grammar(value, param=param)


def constraint_from_request(*, response_format: dict | None = None, structured_outputs: dict | None = None,
                            guided: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None. `guided` holds vLLM's older `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar` (only those given). Two ways of asking at once is an error
    naming the second."""
    asked: list[tuple[str, StructuredOutputsParams | None]] = []
    if response_format is not None:
        asked.append(("response_format", from_response_format(response_format)))
    if structured_outputs is not None:
        asked.append(("structured_outputs", from_structured_outputs(structured_outputs)))
    for name, value in (guided or {}).items():
        if value is not None:
            asked.append((name, _one(name.removeprefix("guided_"), value, name)))
    asked = [(name, spec) for name, spec in asked if spec is not None]
    if len(asked) > 1:
        raise StructuredOutputError(f"ask for structured output one way: {asked[0][0]} and {asked[1][0]} were "
                                    "both given", asked[1][0])
    if not asked:
        return None
    return asked[0][1]
