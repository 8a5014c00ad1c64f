"""What a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` ask for, checked against each
other (a bad combination is a 400 naming the field)."""

from __future__ import annotations

from dataclasses import dataclass

from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import ChatCompletionRequest, NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """mode: none (tools reach the template, the output is not parsed), auto (the model's format is parsed),
    required (at least one call, constrained), named (that function, constrained)."""

    mode: str
    functions: dict[str, dict]  # name -> JSON schema of its arguments
    function: str | None = None  # the named one
    max_calls: int | None = None  # 1 when parallel_tool_calls is false

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


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
        return ToolChoice("named", functions, name, 1)
    return ToolChoice(choice or "auto", functions, None, max_calls)


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
