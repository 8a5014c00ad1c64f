"""Hermes / Qwen tool calls: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, any
number of them, with text before, between or after (Qwen2.5, Qwen3, Hermes 2/3, QwQ)."""

from __future__ import annotations

from sage_infer.server.tool_parsers.base import Parsed, ToolParser, held_marker_prefix, view_of
from sage_infer.server.tool_parsers.json_scan import CallScan, scan_call, skip_space

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed("")
        content: list[str] = []
        pos = 0
        while True:
            begin = text.find(START, pos)
            if begin < 0:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - held_marker_prefix(tail, START)])
                break
            content.append(text[pos:begin])
            scan, close = _scan_region(text, begin + len(START), final)
            body_end = close if close >= 0 else len(text)
            if close < 0 and not final:  # still being written: show what is known
                if (view := view_of(scan, text, body_end, done=False)) is not None:
                    view.key = begin
                    parsed.calls.append(view)
                break
            stop = close + len(END) if close >= 0 else len(text)
            view = view_of(scan, text, body_end, done=True)
            view = view if view is not None and _only_space_after(text, scan, body_end) else None
            if view is None:  # a malformed call stays in the answer as text
                content.append(text[begin:stop])
            else:
                view.key = begin
                parsed.calls.append(view)
            pos = stop
            if close < 0:
                break
        parsed.content = "".join(content)
        return parsed


def _scan_region(text: str, body: int, final: bool) -> tuple[CallScan, int]:
    """The call after a start tag and where its end tag is (-1: not yet). The object is read first, so an end tag
    inside one of its strings does not end it; an object still open at the end tag (read up to the tag) can only
    be told from one with the tag in a string once it is malformed or the output ended."""
    start = skip_space(text, body)
    scan = scan_call(text, start)
    if scan.closed:
        return scan, text.find(END, scan.stop)
    if not scan.broken and not final:
        return scan, -1
    close = text.find(END, body)
    return (scan_call(text, start, close), close) if close >= 0 else (scan, close)


def _only_space_after(text: str, scan: CallScan, end: int) -> bool:
    return scan.stop is None or skip_space(text, scan.stop, end) == end
