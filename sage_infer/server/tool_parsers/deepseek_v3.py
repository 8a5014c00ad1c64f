"""DeepSeek V3 tool calls, after text that is content:
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
once per call, then ``<｜tool▁calls▁end｜>`` (DeepSeek V3, V3-0324, R1-0528); V3.1's shorter
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` is read too. The markers are special tokens:
decode keeps them. Text after ``<｜tool▁calls▁end｜>`` is content."""

from __future__ import annotations

import json
import re

from sage_infer.server.tool_parsers.base import CallView, Parsed, ToolParser, held_marker_prefix
from sage_infer.server.tool_parsers.json_scan import skip_space, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE, FENCE_END = "```json", "```"
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class _Broken(Exception):
    """The call section cannot be read as calls."""


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        begin = text.find(CALLS_BEGIN)
        if begin < 0:
            return Parsed(text if final else text[:len(text) - held_marker_prefix(text, CALLS_BEGIN)])
        parsed = Parsed(text[:begin])
        try:
            rest = _read_calls(text, skip_space(text, begin + len(CALLS_BEGIN)), final, parsed.calls)
        except _Broken:
            return Parsed(text) if final else parsed
        if rest is not None:
            parsed.content += text[rest:]
        return parsed


def _read_calls(text: str, pos: int, final: bool, calls: list[CallView]) -> int | None:
    """Append the calls from `pos` on to `calls`: the index after ``<｜tool▁calls▁end｜>`` (or the text's end once
    the output ended after a complete call), None while the section is still being written."""
    while True:
        if text.startswith(CALLS_END, pos):
            return pos + len(CALLS_END)
        if pos >= len(text) and final and calls and calls[-1].done:
            return pos  # the output ended without the closing marker: the calls are complete
        if text.startswith(CALL_BEGIN, pos):
            view, pos = _read_call(text, pos, final)
            if view is not None:
                calls.append(view)
            if pos is None:
                return None
            pos = skip_space(text, pos)
        elif not final and (CALL_BEGIN.startswith(text[pos:]) or CALLS_END.startswith(text[pos:])):
            return None
        else:
            raise _Broken


def _read_call(text: str, key: int, final: bool) -> tuple[CallView | None, int | None]:
    """The call whose begin marker is at `key`: (what is known of it, the index after its end marker or None while
    it is being written)."""
    head = key + len(CALL_BEGIN)
    sep = text.find(SEP, head)
    if sep < 0:
        return _open(None, final, text, head)
    after = skip_space(text, sep + len(SEP))
    if after >= len(text):
        return _open(None, final)
    if text[after] == "{":  # V3.1: NAME<sep>{...}
        name, args_start, fenced = text[head:sep].strip(), after, False
    else:  # V3: function<sep>NAME\n```json\n{...}\n```
        if text[head:sep].strip() != "function":
            raise _Broken
        newline = text.find("\n", after)
        if newline < 0:
            return _open(None, final, text, after)
        name, fenced = text[after:newline].strip(), True
        fence = skip_space(text, newline)
        if not text.startswith(FENCE, fence):
            return _open(None, final) if FENCE.startswith(text[fence:]) else _broken()
        args_start = skip_space(text, fence + len(FENCE))
    if not _NAME.fullmatch(name):
        raise _Broken
    if args_start >= len(text):
        return _open(CallView(key, name, "", False), final)
    if text[args_start] != "{":
        raise _Broken
    stop = value_end(text, args_start)
    if stop is None:
        return _open(CallView(key, name, text[args_start:], False), final)
    try:
        arguments = json.loads(text[args_start:stop])
    except ValueError:
        raise _Broken from None
    if not isinstance(arguments, dict):
        raise _Broken
    return CallView(key, name, text[args_start:stop], True), _call_end(text, stop, fenced, final)


def _call_end(text: str, pos: int, fenced: bool, final: bool) -> int | None:
    """The index after a call's end marker (and the closing fence before it), None while it may still come."""
    pos = skip_space(text, pos)
    if fenced and text.startswith(FENCE_END, pos):
        pos = skip_space(text, pos + len(FENCE_END))
    if text.startswith(CALL_END, pos):
        return pos + len(CALL_END)
    if pos >= len(text):
        return pos if final else None
    tail = text[pos:]
    if not final and (CALL_END.startswith(tail) or (fenced and FENCE_END.startswith(tail))):
        return None
    raise _Broken


def _open(view: CallView | None, final: bool, text: str = "", start: int = 0) -> tuple[CallView | None, None]:
    """A call the text ends inside: malformed once the output ended, else what is known so far. A header still
    being written must not already hold another marker."""
    marker = text.find("<｜", start) if text else -1
    if final or (marker >= 0 and not SEP.startswith(text[marker:])):
        raise _Broken
    return view, None


def _broken() -> tuple[None, None]:
    raise _Broken
