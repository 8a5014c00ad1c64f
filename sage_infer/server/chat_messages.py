"""OpenAI chat messages as chat templates read them.

What OpenAI clients send back after a tool call is an assistant message with ``tool_calls`` and
``content: null``, then ``role: tool`` messages with ``tool_call_id``. Templates concatenate
``message['content']`` and read ``tool_call.function.arguments`` as a mapping (``| tojson``,
``.items()``), so, as vLLM does: content null becomes ``""`` and arguments given as a JSON string
become the object they hold."""

from __future__ import annotations

import json


class MessageError(ValueError):
    """A message the template cannot be given; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def template_message(data: dict, index: int) -> dict:
    """One message (a dict of its fields, content already text or None) ready for the template."""
    data = dict(data)
    if data.get("content") is None:
        data["content"] = ""
    if "tool_calls" in data:
        if data["role"] != "assistant":
            raise MessageError("only assistant messages carry tool_calls", f"messages.{index}.tool_calls")
        data["tool_calls"] = [_template_call(call, f"messages.{index}.tool_calls.{i}")
                              for i, call in enumerate(_as_list(data["tool_calls"], f"messages.{index}.tool_calls"))]
    if data["role"] == "tool" and "tool_call_id" in data and not isinstance(data["tool_call_id"], str):
        raise MessageError("must be a string", f"messages.{index}.tool_call_id")
    return data


def _as_list(value: object, param: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise MessageError("must be a list of tool calls", param)
    return value


def _template_call(call: object, param: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise MessageError('must be {"id", "type": "function", "function": {"name", "arguments"}}', param)
    function = dict(call["function"])
    if not isinstance(function.get("name"), str):
        raise MessageError("must be a string", f"{param}.function.name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):  # else the template gets the text as sent
            function["arguments"] = parsed
    elif not isinstance(arguments, dict):
        raise MessageError("must be a JSON object's text", f"{param}.function.arguments")
    return {**call, "type": call.get("type", "function"), "function": function}
