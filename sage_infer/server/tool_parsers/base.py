"""What every tool-call parser gives: the text outside the calls and the calls, from a finished
output (`ToolParser.extract`) or from one growing as it streams (`ToolCallStream`).

A parser is one pure function, `parse(text, final)`, so the streamed and the whole answer come
from the same code: the stream re-reads its text at each delta and sends what became known."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sage_infer.server.tool_parsers.json_scan import CallScan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallView:
    """One call as far as the text shows it. key: where it starts in the text (stable while it grows);
    arguments: complete JSON when `done`, else the part written so far."""

    key: int
    name: str
    arguments: str
    done: bool


@dataclass(slots=True)
class Parsed:
    """content: the text outside the calls (while streaming, only what can no longer turn into a call)."""

    content: str
    calls: list[CallView] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def held_marker_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept back while streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def view_of(scan: CallScan, text: str, end: int, done: bool) -> CallView | None:
    """A call the client may already be told about: its name is known (complete calls are checked by the caller)."""
    if scan.name is None:
        return None
    if done:
        arguments = scan.arguments(text)
        return None if arguments is None else CallView(scan.start, scan.name, arguments, True)
    return CallView(scan.start, scan.name, scan.partial_arguments(text, end), False)


class ToolParser:
    """A model's tool-call format. Subclasses implement `parse`."""

    name = ""
    needs_special_tokens = False  # the format's markers are special tokens: decode must keep them

    def parse(self, text: str, final: bool) -> Parsed:
        """The calls in `text`. final: the output ended, so an unfinished or malformed call is content;
        otherwise content holds only text that can no longer become part of a call."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished output's (content or None, calls)."""
        parsed = self.parse(text, final=True)
        calls = [ToolCall(view.name, view.arguments) for view in parsed.calls if view.done]
        return parsed.content.strip() or None, calls


class ToolCallStream:
    """Feeds a growing output to a parser and returns what to send: content pieces and tool-call deltas in
    OpenAI's shape (index, id, type and name once, then arguments pieces). Content is sent stripped at both
    ends, as `ToolParser.extract` returns it. A call is sent as soon as its name is known, so one that turns out
    unfinished or malformed stays a call here (as in vLLM and OpenAI) while `extract` returns it as content."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = 0
        self.calls_sent: dict[int, list] = {}  # call key -> [index, characters of arguments sent]

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        if final and not set(self.calls_sent).issubset(view.key for view in parsed.calls):
            # a call already sent did not finish (cut off by max_tokens): it is not sent again as content
            parsed = self.parser.parse(self.text, False)
        content = parsed.content.strip() if final else parsed.content.lstrip().rstrip()
        piece = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent += len(piece)
        return piece, [d for view in parsed.calls if (d := self._call_delta(view)) is not None]

    def _call_delta(self, view: CallView) -> dict | None:
        sent = self.calls_sent.get(view.key)
        if sent is None:
            if self.max_calls is not None and len(self.calls_sent) >= self.max_calls:
                return None
            sent = self.calls_sent[view.key] = [len(self.calls_sent), 0]
            delta = {"index": sent[0], "id": new_call_id(), "type": "function",
                     "function": {"name": view.name, "arguments": view.arguments}}
        elif len(view.arguments) > sent[1]:
            delta = {"index": sent[0], "function": {"arguments": view.arguments[sent[1]:]}}
        else:
            return None
        sent[1] = len(view.arguments)
        return delta

    @property
    def num_calls(self) -> int:
        return len(self.calls_sent)
