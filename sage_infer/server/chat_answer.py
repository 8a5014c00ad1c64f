"""An assistant answer's shape in a chat completion: reasoning (``reasoning_content``), tool calls
(``tool_calls``, finish reason ``tool_calls``) and content, from the finished text or while it streams.

`ChatFeatures` holds the server's parsers (``--reasoning-parser``, ``--tool-call-parser`` or the one
the chat template shows) and gives each request its `AnswerShape`."""

from __future__ import annotations

from dataclasses import dataclass

from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import ChatCompletionRequest
from sage_infer.server.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from sage_infer.server.tool_parsers import ToolCallStream, ToolParser, detect_tool_parser, get_tool_parser
from sage_infer.server.tool_parsers.choice import ToolChoice, tool_choice_of
from sage_infer.server.tool_parsers.forced import CallArrayParser, NamedCallParser


@dataclass(slots=True)
class AnswerShape:
    """How one request's answers are read. Nothing set: the text is the content, as it comes."""

    reasoning: ReasoningParser | None = None
    open_at_start: bool = False  # the prompt leaves the answer inside the reasoning section
    tools: ToolParser | None = None
    max_calls: int | None = None
    choice: ToolChoice | None = None

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished answer's message and finish reason."""
        message: dict = {"role": "assistant", "content": text}
        if self.plain:
            return message, finish_reason
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.open_at_start)
            message["reasoning_content"] = reasoning.strip() or None
            content = content.strip()
        if self.tools is not None:
            content, calls = self.tools.extract(content)
            calls = calls[:self.max_calls]
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        message["content"] = content or None
        return message, finish_reason

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


class AnswerStream:
    """One streamed answer: `feed` each text delta, get the chat delta's fields (``{}``: nothing to send yet);
    `feed(final=True)` once at the end sends what was held back."""

    def __init__(self, shape: AnswerShape) -> None:
        self.shape = shape
        self.reasoning = None if shape.reasoning is None else ReasoningStream(shape.reasoning, shape.open_at_start)
        self.tools = None if shape.tools is None else ToolCallStream(shape.tools, shape.max_calls)

    def feed(self, delta: str, final: bool = False) -> dict:
        if self.shape.plain:
            return {"content": delta} if delta else {}
        fields: dict = {}
        content = delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta, final)
            if reasoning:
                fields["reasoning_content"] = reasoning
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if calls:
                fields["tool_calls"] = calls
        if content:
            fields["content"] = content
        return fields

    def finish_reason(self, reason: str | None) -> str | None:
        called = self.tools is not None and self.tools.num_calls > 0
        return "tool_calls" if called and reason == "stop" else reason


class ChatFeatures:
    """The server's reasoning and tool-call parsers. tool_call_parser: a name, ``auto`` (the chat template's
    own format when its text shows one) or ``none`` (tool calls under ``auto`` stay content)."""

    def __init__(self, tool_call_parser: str | None = "auto", reasoning_parser: str | None = None,
                 chat_template: str | dict | None = None) -> None:
        name = detect_tool_parser(chat_template) if tool_call_parser == "auto" else tool_call_parser
        self.tool_parser = get_tool_parser(name) if name and name != "none" else None
        use_reasoning = reasoning_parser and reasoning_parser != "none"
        self.reasoning = get_reasoning_parser(reasoning_parser) if use_reasoning else None

    def shape(self, body: ChatCompletionRequest, prompt: str) -> AnswerShape:
        """How to read this request's answers (a bad tools / tool_choice combination is a 400)."""
        choice = tool_choice_of(body)
        shape = AnswerShape(self.reasoning, self.reasoning is not None and self.reasoning.opens(prompt),
                            choice=choice)
        if choice is None or choice.mode == "none":
            return shape
        shape.max_calls = choice.max_calls
        if choice.mode == "auto":
            shape.tools = self.tool_parser
        elif choice.mode == "required":
            shape.tools = CallArrayParser()
        else:
            shape.tools = NamedCallParser(choice.function)
        return shape

    @staticmethod
    def constrain(params, shape: AnswerShape):
        """`params` constrained to the JSON schema of the forced tool choice (``required`` or a named function)."""
        if shape.choice is None or shape.choice.schema is None:
            return params
        raise APIError(400, f"tool_choice: {shape.choice.mode!r} needs structured outputs, which are not "
                            "implemented yet; use tool_choice auto or none", "tool_choice")
