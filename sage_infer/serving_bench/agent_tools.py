"""The agent workload's tool-calling mode (`sage llm bench --workload agent --api chat|responses --tool-calls`).

Every step offers the same three function tools with ``tool_choice: "required"`` and ``parallel_tool_calls: false``,
as an agent framework sends them; the server's call is read from the stream (chat: ``delta.tool_calls`` pieces by
index; Responses: the ``function_call`` items of the finished response) and checked against the tools: a known
name and arguments that are a JSON object with exactly the declared string parameter, within its length. The next
step answers a valid call with the tool's output (a ``tool`` message with its ``tool_call_id``, or a
``function_call_output`` item with its ``call_id``); after a step without one, the output goes as a plain message.
"""

from __future__ import annotations

import json

MAX_ARGUMENT = 32  # characters of a call's one argument: a call fits in a few dozen tokens
TOOLS = (("read_file", "path", "Read a file of the project."),
         ("run_command", "command", "Run a shell command in the project's directory."),
         ("search_code", "query", "Search the project's code for a string."))
_PARAMETER = {name: parameter for name, parameter, _ in TOOLS}


def _parameters(parameter: str) -> dict:
    return {"type": "object", "properties": {parameter: {"type": "string", "maxLength": MAX_ARGUMENT}},
            "required": [parameter], "additionalProperties": False}


def tool_fields(api: str) -> dict:
    """The request fields that offer the tools (chat: nested under ``function``; Responses: flat)."""
    if api == "responses":
        tools = [{"type": "function", "name": name, "description": text, "parameters": _parameters(parameter)}
                 for name, parameter, text in TOOLS]
    else:
        tools = [{"type": "function", "function": {"name": name, "description": text,
                                                   "parameters": _parameters(parameter)}}
                 for name, parameter, text in TOOLS]
    return {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}


def is_valid_call(call: dict) -> bool:
    """A call of one of the tools, its arguments a JSON object holding exactly its parameter as a short string."""
    parameter = _PARAMETER.get(call.get("name"))
    if parameter is None or not call.get("id"):
        return False
    try:
        arguments = json.loads(call.get("arguments") or "")
    except ValueError:
        return False
    return (isinstance(arguments, dict) and list(arguments) == [parameter] and isinstance(arguments[parameter], str)
            and len(arguments[parameter]) <= MAX_ARGUMENT)


class StreamedCalls:
    """The tool calls of one streamed answer, in order: ``{"id", "name", "arguments"}`` each."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: dict[int, dict] = {}

    def chat_delta(self, pieces: list[dict]) -> None:
        """A chat chunk's ``delta.tool_calls``: the first piece of a call has its id and name, later ones add to its
        arguments."""
        for piece in pieces:
            call = self.calls.setdefault(int(piece.get("index", 0)), {"id": None, "name": "", "arguments": ""})
            function = piece.get("function") or {}
            call["id"] = piece.get("id") or call["id"]
            call["name"] = function.get("name") or call["name"]
            call["arguments"] += function.get("arguments") or ""

    def response_output(self, output: list[dict]) -> None:
        """A finished response's output items: its ``function_call`` items."""
        for item in output:
            if item.get("type") == "function_call":
                self.calls[len(self.calls)] = {"id": item.get("call_id"), "name": item.get("name", ""),
                                               "arguments": item.get("arguments", "")}

    def in_order(self) -> list[dict]:
        return [self.calls[i] for i in sorted(self.calls)]


def answer_messages(text: str, calls: list[dict]) -> dict:
    """The chat assistant message a step's answer becomes in the next step's history."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None,
            "tool_calls": [{"id": c["id"], "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}
