"""Mistral tool calls after the ``[TOOL_CALLS]`` special token: a JSON array of
``{"name", "arguments"}`` objects (tokenizers up to v7: Mistral 7B v0.3, Mixtral, Nemo, Small 3) or,
from v11 on, ``[TOOL_CALLS]name[ARGS]{...}`` once per call (Small 3.2, Magistral, Devstral).
Text before the first marker is content."""

from __future__ import annotations

import json
import re

from sage_infer.server.tool_parsers.base import CallView, Parsed, ToolParser, held_marker_prefix, view_of
from sage_infer.server.tool_parsers.json_scan import CallScan, scan_call, scan_calls_array, skip_space, value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_CALL_ID = re.compile(r"\[CALL_ID\][A-Za-z0-9]*")


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        begin = text.find(MARKER)
        if begin < 0:
            return Parsed(text if final else text[:len(text) - held_marker_prefix(text, MARKER)])
        parsed = Parsed(text[:begin])
        pos = begin
        while pos < len(text):
            if not text.startswith(MARKER, pos):
                return _broken(text, begin, final, parsed)
            start = skip_space(text, pos + len(MARKER))
            if start >= len(text):
                return _broken(text, begin, final, parsed) if final else parsed
            views, stop = _segment(text, start, final)
            if views is None:
                return _broken(text, begin, final, parsed)
            parsed.calls.extend(views)
            if stop is None:
                return parsed
            pos = skip_space(text, stop)
        return parsed


def _broken(text: str, begin: int, final: bool, parsed: Parsed) -> Parsed:
    """A malformed call section: all of it is content once the output ended."""
    return Parsed(text) if final else parsed


def _segment(text: str, start: int, final: bool) -> tuple[list[CallView] | None, int | None]:
    """The calls of one marker's section: (views, index after it or None while open); views None: malformed."""
    if text[start] == "[":
        scans, stop, broken = scan_calls_array(text, start)
        return _views(text, scans, stop is not None or final, broken, stop)
    if text[start] == "{":
        scan = scan_call(text, start)
        return _views(text, [scan], scan.closed or final, scan.broken, scan.stop)
    return _named_segment(text, start, final)


def _views(text: str, scans: list[CallScan], done: bool, broken: bool, stop: int | None = None):
    if broken:
        return None, None
    views = []
    for i, scan in enumerate(scans):
        complete = done or i < len(scans) - 1
        view = view_of(scan, text, len(text), done=complete)
        if view is None and complete:
            return None, None
        if view is not None:
            views.append(view)
    return views, stop if done else None


def _named_segment(text: str, start: int, final: bool) -> tuple[list[CallView] | None, int | None]:
    """``name[ARGS]{...}`` (v11+), optionally with ``[CALL_ID]id`` before ``[ARGS]``."""
    args_at = text.find(ARGS, start)
    if args_at < 0:
        if final:
            return None, None
        return [], None
    name = _CALL_ID.sub("", text[start:args_at]).strip()
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        return None, None
    args_start = skip_space(text, args_at + len(ARGS))
    if args_start >= len(text):
        return (None, None) if final else ([], None)
    stop = value_end(text, args_start)
    if stop is None:
        if final or text[args_start] != "{":
            return (None, None) if final else ([], None)
        return [CallView(start, name, text[args_start:], False)], None
    raw = text[args_start:stop]
    try:
        ok = isinstance(json.loads(raw), dict)
    except ValueError:
        ok = False
    return ([CallView(start, name, raw, True)], stop) if ok else (None, None)
