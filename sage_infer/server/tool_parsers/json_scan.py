"""Reading tool calls out of text that may still be growing: where a JSON value ends, and the
name and arguments of a call object ``{"name": ..., "arguments": {...}}``, known as far as the
text goes. No JSON grammar here: `json.loads` decides validity once a value is complete."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"
_LITERAL = re.compile(r"[^\s,}\]]+")


def skip_space(text: str, pos: int, end: int | None = None) -> int:
    """The first index at or after `pos` (before `end`) that is not whitespace."""
    end = len(text) if end is None else end
    while pos < end and text[pos].isspace():
        pos += 1
    return pos


def value_end(text: str, start: int, end: int | None = None) -> int | None:
    """Index just past the JSON value starting at `text[start]`, or None when `end` comes first.

    Strings and escapes are followed, so brackets inside strings do not count. A number or a
    literal ends at the first delimiter (and is incomplete while the text ends in it)."""
    end = len(text) if end is None else end
    if start >= end:
        return None
    if text[start] not in '{["':
        match = _LITERAL.match(text, start, end)
        stop = match.end() if match else start
        return stop if stop < end else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, end):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass(slots=True)
class CallScan:
    """What is known of one call object in `text[start:end]`.

    name: the function name once its string is complete. args_start/args_end: the span of the
    arguments value (args_end None while it is still open). closed: the object's ``}`` was seen
    (then `stop` is the index after it). broken: the text cannot be a call object."""

    start: int
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    closed: bool = False
    stop: int | None = None
    broken: bool = False

    def arguments(self, text: str) -> str | None:
        """The complete arguments as a JSON object's text, or None when absent, incomplete or not an object."""
        if self.args_start is None:
            return "{}" if self.closed else None
        if self.args_end is None:
            return None
        raw = text[self.args_start:self.args_end]
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if isinstance(value, str):  # some models send the arguments as a JSON string holding the object
            try:
                decoded = json.loads(value)
            except ValueError:
                return None
            return value if isinstance(decoded, dict) else None
        if value is None:
            return "{}"
        return raw if isinstance(value, dict) else None

    def partial_arguments(self, text: str, end: int) -> str:
        """The arguments' text seen so far when they are an object still being written ('' otherwise)."""
        if self.args_start is None or self.args_end is not None or text[self.args_start] != "{":
            return ""
        return text[self.args_start:end]


def scan_call(text: str, start: int, end: int | None = None) -> CallScan:
    """Walk the call object starting at `text[start]` (a ``{``) up to `end`, key by key."""
    end = len(text) if end is None else end
    scan = CallScan(start)
    if start >= end:
        return scan
    if text[start] != "{":
        scan.broken = True
        return scan
    pos = start + 1
    while True:
        pos = skip_space(text, pos, end)
        if pos >= end:
            return scan
        if text[pos] == "}":
            scan.closed, scan.stop = True, pos + 1
            return scan
        if text[pos] == ",":
            pos += 1
            continue
        pos = _read_member(text, pos, end, scan)
        if pos is None or scan.broken:
            return scan


def _read_member(text: str, pos: int, end: int, scan: CallScan) -> int | None:
    """One ``"key": value`` of a call object; the index after it, or None when the text ends inside it."""
    if text[pos] != '"':
        scan.broken = True
        return None
    key_end = value_end(text, pos, end)
    if key_end is None:
        return None
    key = json.loads(text[pos:key_end])
    colon = skip_space(text, key_end, end)
    if colon >= end:
        return None
    if text[colon] != ":":
        scan.broken = True
        return None
    value_start = skip_space(text, colon + 1, end)
    if value_start >= end:
        return None
    stop = value_end(text, value_start, end)
    if key in ARGUMENT_KEYS and scan.args_start is None:
        scan.args_start, scan.args_end = value_start, stop
    elif key == "name" and stop is not None:
        try:
            name = json.loads(text[value_start:stop])
        except ValueError:
            name = None
        if not isinstance(name, str):
            scan.broken = True
            return None
        scan.name = name
    return stop


def scan_calls_array(text: str, start: int, end: int | None = None) -> tuple[list[CallScan], int | None, bool]:
    """The call objects of a JSON array starting at `text[start]` (a ``[``): (scans, index after ``]`` or None,
    broken)."""
    end = len(text) if end is None else end
    scans: list[CallScan] = []
    pos = start + 1
    while True:
        pos = skip_space(text, pos, end)
        if pos >= end:
            return scans, None, False
        ch = text[pos]
        if ch == "]":
            return scans, pos + 1, False
        if ch == "," and scans:
            pos += 1
            continue
        if ch != "{":
            return scans, None, True
        scan = scan_call(text, pos, end)
        scans.append(scan)
        if scan.broken or not scan.closed:
            return scans, None, scan.broken
        pos = scan.stop
