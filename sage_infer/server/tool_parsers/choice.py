"""What a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask for: checked against each
other (a bad combination is a 400 naming the field), and, for ``required`` or a named function, the JSON
schema the output is constrained to (vLLM's shapes: an array of ``{"name", "parameters"}`` objects, or the
named function's arguments object)."""

from __future__ import annotations

from dataclasses import dataclass

from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import ChatCompletionRequest, NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """mode: none (tools reach the template, the output is not parsed), auto (the model's format is parsed),
    required (at least one call, constrained), named (that function, constrained)."""

    mode: str
    function: str | None = None
    max_calls: int | None = None  # 1 when parallel_tool_calls is false
    schema: dict | None = None  # the constraint of required / named


def tool_choice_of(body: ChatCompletionRequest) -> ToolChoice | None:
    """The request's tool choice, or None when it has no tools; a 400 naming the field for a bad combination."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None:
            raise APIError(400, "tool_choice: is only allowed when tools are given", "tool_choice")
        return None
    functions = {}
    for i, tool in enumerate(body.tools):
        function = tool.function
        if function.name in functions:
            param = f"tools.{i}.function.name"
            raise APIError(400, f"{param}: {function.name!r} is given twice", param)
        _check_parameters(function.parameters, f"tools.{i}.function.parameters")
        functions[function.name] = function.parameters or {"type": "object", "properties": {}}
    max_calls = 1 if body.parallel_tool_calls is False else None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise APIError(400, f"tool_choice: function {name!r} is not among the tools given "
                                f"({', '.join(functions)})", "tool_choice.function.name")
        return ToolChoice("named", name, 1, functions[name])
    if choice == "required":
        return ToolChoice("required", None, max_calls, calls_schema(functions, max_calls))
    return ToolChoice(choice or "auto", None, max_calls)


def calls_schema(functions: dict[str, dict], max_calls: int | None) -> dict:
    """The JSON schema of a non-empty array of calls to the given functions."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def _check_parameters(parameters: dict | None, param: str) -> None:
    """A function's parameters must be a JSON schema of an object (checked with jsonschema when installed)."""
    if parameters is None:
        return
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise APIError(400, f"{param}: must be the JSON schema of an object (type \"object\"), not {kind!r}", param)
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:
        return
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as err:
        where = ".".join(str(p) for p in err.absolute_path)
        raise APIError(400, f"{param}: not a valid JSON schema{' at ' + where if where else ''}: "
                            f"{err.message}", param) from None
