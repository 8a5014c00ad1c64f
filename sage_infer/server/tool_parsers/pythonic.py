"""Pythonic tool calls: the whole answer is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=3), get_time()]`` (Llama 3.2 and 4 with the pythonic templates, ToolACE,
Granite's pythonic prompts), optionally after ``<|python_start|>`` / ``<|python_tag|>`` and before
``<|python_end|>``. Read with `ast` one argument value at a time, never evaluated: a value must be a literal
(string, number, True/False/None or true/false/null, list, tuple, dict with string keys). Positional arguments,
names, expressions or a repeated keyword make the answer content. An answer that does not start with ``[`` is
content."""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field

from sage_infer.server.tool_parsers.base import CallView, Parsed, ToolParser
from sage_infer.server.tool_parsers.json_scan import skip_space

START_TAGS = ("<|python_start|>", "<|python_tag|>")
END_TAG = "<|python_end|>"
_NAME = re.compile(r"[^\W\d]\w*")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        for tag in START_TAGS:
            if text.startswith(tag, pos):
                pos = skip_space(text, pos + len(tag))
                break
        else:
            if not final and any(tag.startswith(text[pos:]) for tag in START_TAGS):
                return Parsed("")  # empty so far, or may still become a tag
        if pos >= len(text):
            return Parsed(text if final else "")
        if text[pos] != "[":
            return Parsed(text)
        scan = _scan_list(text, pos)
        views = [view for call in scan.calls if (view := call.view()) is not None]
        if scan.broken or (final and not (scan.done and views)):
            # not a list of calls (an empty list neither): content (while streaming, held back once a call was sent)
            return Parsed(text) if final or not views else Parsed("", views)
        return Parsed("", views)


@dataclass(slots=True)
class _Call:
    key: int
    name: str | None = None
    arguments: dict = field(default_factory=dict)
    done: bool = False

    def view(self) -> CallView | None:
        if self.name is None:
            return None
        written = json.dumps(self.arguments, ensure_ascii=False)
        return CallView(self.key, self.name, written if self.done else written[:-1], self.done)


@dataclass(slots=True)
class _ListScan:
    """The calls of a list read as far as the text goes; done: its ``]`` (and an optional end tag) ended the text;
    broken: the text cannot be a list of calls."""

    calls: list[_Call] = field(default_factory=list)
    done: bool = False
    broken: bool = False


def _scan_list(text: str, start: int) -> _ListScan:
    scan = _ListScan()
    pos = skip_space(text, start + 1)
    while pos < len(text):
        if text[pos] == "]":
            scan.done, scan.broken = _list_end(text, pos + 1)
            return scan
        call = _Call(pos)
        scan.calls.append(call)
        pos = _scan_call(text, pos, call)
        if pos is None:
            return scan
        if pos < 0:
            scan.broken = True
            return scan
        pos = skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = skip_space(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            scan.broken = True
            return scan
    return scan


def _list_end(text: str, pos: int) -> tuple[bool, bool]:
    """(done, broken) after the list's ``]``: only space and an optional end tag may follow."""
    pos = skip_space(text, pos)
    if text.startswith(END_TAG, pos):
        pos = skip_space(text, pos + len(END_TAG))
    elif END_TAG.startswith(text[pos:]) and pos < len(text):
        return False, False  # may still become the end tag
    return pos >= len(text), pos < len(text)


def _scan_call(text: str, pos: int, call: _Call) -> int | None:
    """Read ``name(key=value, ...)`` into `call`: the index after its ``)``, None when the text ends inside it,
    -1 when it is not such a call."""
    match = _NAME.match(text, pos)
    if match is None:
        return -1
    paren = skip_space(text, match.end())
    if paren >= len(text):
        return None
    if text[paren] != "(":
        return -1
    call.name = match.group()
    pos = paren + 1
    while True:
        pos = skip_space(text, pos)
        if pos >= len(text):
            return None
        if text[pos] == ")":
            call.done = True
            return pos + 1
        match = _NAME.match(text, pos)
        if match is None:
            return -1  # a positional argument, or not Python
        equals = skip_space(text, match.end())
        if equals >= len(text):
            return None
        if text[equals] != "=" or match.group() in call.arguments:
            return -1
        value_start = skip_space(text, equals + 1)
        stop = _value_end(text, value_start)
        if stop is None or stop < 0:
            return stop
        try:
            call.arguments[match.group()] = literal(text[value_start:stop])
        except ValueError:
            return -1
        pos = stop + 1 if text[stop] == "," else stop


def _value_end(text: str, start: int) -> int | None:
    """Index of the ``,`` or ``)`` ending the argument value at `start` (outside brackets and strings), None when
    the text ends first, -1 on a mismatched bracket."""
    stack: list[str] = []
    pos = start
    while pos < len(text):
        ch = text[pos]
        if ch in "'\"":
            pos = _string_end(text, pos)
            if pos is None:
                return None
            continue
        if ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in ")]}":
            if not stack:
                return pos if ch == ")" else -1
            if stack.pop() != ch:
                return -1
        elif ch == "," and not stack:
            return pos
        pos += 1
    return None


def _string_end(text: str, start: int) -> int | None:
    """Index after the Python string literal whose quote is at `start` (single or triple), None when unfinished."""
    quote = text[start] * 3 if text.startswith(text[start] * 3, start) else text[start]
    pos = start + len(quote)
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text.startswith(quote, pos):
            return pos + len(quote)
        else:
            pos += 1
    return None


def literal(source: str) -> object:
    """The JSON value of a Python literal's text; ValueError when it is not one."""
    try:
        node = ast.parse(f"({source}\n)", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not a Python literal: {source!r}") from None
    return _value(node)


def _value(node: ast.expr) -> object:
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            return value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_value(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        keys = [_value(key) if key is not None else None for key in node.keys]
        if all(isinstance(key, str) for key in keys):
            return dict(zip(keys, (_value(value) for value in node.values), strict=True))
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
