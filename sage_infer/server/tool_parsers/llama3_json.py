"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``, several
separated by ``;``, optionally after ``<|python_tag|>``. An answer that does not start with one is content."""

from __future__ import annotations

from sage_infer.server.tool_parsers.base import Parsed, ToolParser, view_of
from sage_infer.server.tool_parsers.json_scan import scan_call, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return Parsed("")  # may still become the tag
        if pos < len(text) and text[pos] != "{":
            return Parsed(text)
        if pos >= len(text):
            return Parsed(text if final else "")
        parsed = Parsed("")
        while pos < len(text):
            scan = scan_call(text, pos)
            if not scan.closed:
                if not final and not scan.broken:
                    if (view := view_of(scan, text, len(text), done=False)) is not None:
                        parsed.calls.append(view)
                    return parsed
                return Parsed(text) if final else parsed
            view = view_of(scan, text, len(text), done=True)
            if view is None:
                return Parsed(text) if final else parsed
            parsed.calls.append(view)
            pos = skip_space(text, scan.stop)
            if pos < len(text) and text[pos] == ";":
                pos = skip_space(text, pos + 1)
            elif pos < len(text):
                return Parsed(text) if final else parsed
        return parsed
