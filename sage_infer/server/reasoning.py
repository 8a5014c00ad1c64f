"""Reasoning parsers (``--reasoning-parser``): the ``<think>…</think>`` section of an answer becomes
``reasoning_content``, the rest ``content``, whole or while it streams.

- ``deepseek_r1``: the answer is reasoning until ``</think>`` (R1's template opens ``<think>`` in the prompt,
  so the model never writes it); no ``</think>`` at all: all reasoning.
- ``qwen3``: reasoning only when the answer starts with ``<think>`` or the prompt ends with an open
  ``<think>`` (Qwen3 thinking models); otherwise all content, as Qwen3 answers with thinking disabled
  (``chat_template_kwargs: {"enable_thinking": false}``, where the template closes an empty section itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from sage_infer.server.tool_parsers.base import held_marker_prefix

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    opens_by_default: bool  # the answer is reasoning until END even without START

    def state(self, prompt: str) -> str:
        """Where an answer to `prompt` starts: ``open`` (inside the reasoning section: the prompt ends with an open
        ``<think>``, or the model always starts there), ``closed`` (the prompt ends with ``</think>``: the template
        closed an empty section, as Qwen3's does for ``enable_thinking: false``) or ``maybe`` (the model may open
        one)."""
        tail = prompt.rstrip()
        if tail.endswith(END):
            return "closed"
        return "open" if self.opens_by_default or tail.endswith(START) else "maybe"

    def split(self, text: str, open_at_start: bool, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text`. Not final: only what can no longer change (a marker's first characters
        at the end are held back)."""
        body = text.lstrip()
        if body.startswith(START):
            body, open_at_start = body[len(START):], True
        elif not final and START.startswith(body) and body:
            return "", ""  # may still become <think>
        if not open_at_start:
            return "", text
        reasoning, marker, content = body.partition(END)
        if not marker and not final:
            reasoning = reasoning[:len(reasoning) - held_marker_prefix(reasoning, END)]
        return reasoning, content


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_by_default=True),
    "qwen3": ReasoningParser("qwen3", opens_by_default=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return parser


class ReasoningStream:
    """A growing answer's reasoning and content pieces: both concatenate to what `split` gives the finished
    answer, stripped at both ends."""

    def __init__(self, parser: ReasoningParser, open_at_start: bool) -> None:
        self.parser = parser
        self.open_at_start = open_at_start
        self.text = ""
        self.sent = [0, 0]  # characters of (reasoning, content) sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        parts = self.parser.split(self.text, self.open_at_start, final)
        pieces = []
        for i, part in enumerate(parts):
            part = part.strip() if final else part.lstrip().rstrip()
            pieces.append(part[self.sent[i]:] if len(part) > self.sent[i] else "")
            self.sent[i] += len(pieces[-1])
        return pieces[0], pieces[1]
