"""Outputs constrained to a call by `tool_choice` (so the model's own format does not matter, as in vLLM):
``required`` makes the answer a JSON array ``[{"name": ..., "parameters": {...}}, ...]``, a named function
makes it that function's arguments object."""

from __future__ import annotations

from sage_infer.server.tool_parsers.base import CallView, Parsed, ToolParser, view_of
from sage_infer.server.tool_parsers.json_scan import CallScan, scan_calls_array, skip_space, value_end


class CallArrayParser(ToolParser):
    """``tool_choice: required``: the whole output is an array of calls."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_space(text, 0)
        if start >= len(text):
            return Parsed(text if final else "")
        if text[start] != "[":
            return Parsed(text if final else "")
        scans, stop, broken = scan_calls_array(text, start)
        done = stop is not None or final
        parsed = Parsed("")
        for i, scan in enumerate(scans):
            complete = done or i < len(scans) - 1
            view = view_of(scan, text, len(text), done=complete)
            if view is None and complete or broken:
                return Parsed(text) if final else parsed
            if view is not None:
                parsed.calls.append(view)
        return parsed


class NamedCallParser(ToolParser):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: the whole output is the arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_space(text, 0)
        if start >= len(text) or text[start] != "{":
            return Parsed(text if final or start < len(text) else "")
        stop = value_end(text, start)
        if stop is None:
            return Parsed(text) if final else Parsed("", [CallView(start, self.function, text[start:], False)])
        scan = CallScan(start, name=self.function, args_start=start, args_end=stop, closed=True)
        view = view_of(scan, text, stop, done=True)
        if view is None or skip_space(text, stop) < len(text):
            return Parsed(text) if final else Parsed("")
        return Parsed("", [view])
