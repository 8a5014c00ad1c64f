"""A Responses API request as the chat completion request it runs as: its conversation as messages, its function
tools and tool choice, its ``text.format`` as a ``response_format``. The chat endpoint's template, tool-call
parsers and structured outputs then serve it; their errors name the Responses request's fields
(``tools[0].parameters``, ``text.format``), not the chat request's."""

from __future__ import annotations

import re

from sage_infer.server.body import validate_body
from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import ChatCompletionRequest
from sage_infer.server.responses.protocol import ResponsesRequest

_RENAMES = ((re.compile(r"\btools\.(\d+)\.function\.?"), r"tools[\1]."), (re.compile(r"\btools\.(\d+)"), r"tools[\1]"),
            (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
            (re.compile(r"\bresponse_format(\.json_schema)?(\.schema)?\b"), r"text.format\2"),
            (re.compile(r"\bmessages\b"), "input"))


def responses_names(text: str) -> str:
    """A chat request's field names in `text` as the Responses request calls them."""
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text.replace("].:", "]:").rstrip(".")


def renamed(err: APIError) -> APIError:
    return APIError(err.status, responses_names(err.message), responses_names(err.param) if err.param else None)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools (``{"type": "function", "name", "parameters"}``) in the chat format."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}].type: only function tools are served, not {kind!r}", f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: a string (none, auto, required) or {\"type\": \"function\", \"name\": "
                                "...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(body: ResponsesRequest) -> dict | None:
    """``text.format`` as a chat ``response_format``: json_schema's fields move under ``json_schema``."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        fields = fmt.model_dump(exclude={"type"})
        return {"type": "json_schema", "json_schema": fields}
    return fmt.model_dump()


def chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """`body` over the conversation `messages` as a validated chat request (a 400 names the Responses field)."""
    data = {"model": body.model, "messages": messages, "temperature": body.temperature, "top_p": body.top_p,
            "seed": body.seed, "cache_salt": body.cache_salt, "priority": body.priority, "user": body.user,
            "ignore_eos": body.ignore_eos,
            "tools": _tools(body.tools), "tool_choice": _tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls, "response_format": _response_format(body)}
    try:
        return validate_body({k: v for k, v in data.items() if v is not None}, ChatCompletionRequest)
    except APIError as err:
        raise renamed(err) from None
