"""An assistant answer's shape in a chat completion: reasoning (``reasoning_content``), tool calls
(``tool_calls``, finish reason ``tool_calls``) and content, from the finished text or while it streams.

`ChatFeatures` holds the server's parsers (``--reasoning-parser``, ``--tool-call-parser`` or the one
the chat template shows) and gives each request its `AnswerShape`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sage_infer.core.messages import ModelInfo
from sage_infer.core.structured_outputs import StructuredOutputsParams
from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import ChatCompletionRequest
from sage_infer.server.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from sage_infer.server.tool_parsers import ToolCallStream, ToolParser, detect_tool_parser, get_tool_parser
from sage_infer.server.tool_parsers.choice import ToolChoice, tool_choice_of
from sage_infer.server.tool_parsers.constraint import after_reasoning, forced_call
from sage_infer.structured.constraints import StructuredOutputError
from sage_infer.structured.grammar import compiler_for


@dataclass(slots=True)
class AnswerShape:
    """How one request's answers are read. Nothing set: the text is the content, as it comes."""

    reasoning: ReasoningParser | None = None
    open_at_start: bool = False  # the prompt leaves the answer inside the reasoning section
    tools: ToolParser | None = None
    max_calls: int | None = None
    choice: ToolChoice | None = None
    constraint: StructuredOutputsParams | None = None  # what a forced tool choice constrains the output to
    reasoning_state: str | None = None  # ReasoningParser.state of the prompt

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
    own format when its text shows one) or ``none`` (tool calls under ``auto`` stay content). `bind` fits them to
    the served model."""

    def __init__(self, tool_call_parser: str = "auto", reasoning_parser: str = "none") -> None:
        self.tool_call_parser = tool_call_parser
        self.tool_parser = None if tool_call_parser in ("auto", "none") else get_tool_parser(tool_call_parser)
        self.reasoning = None if reasoning_parser == "none" else get_reasoning_parser(reasoning_parser)
        self.compile: Callable[[StructuredOutputsParams], object] | None = None

    def bind(self, model: ModelInfo) -> ChatFeatures:
        """Resolve ``auto`` from the model's chat template; check constraints with the model's grammar compiler."""
        tokenizer = model.tokenizer
        if self.tool_call_parser == "auto" and (name := detect_tool_parser(getattr(tokenizer, "chat_template", None))):
            self.tool_parser = get_tool_parser(name)
        if tokenizer is not None:
            self.compile = lambda spec: compiler_for(tokenizer, model.vocab_size).compile(spec)
        return self

    def shape(self, body: ChatCompletionRequest, prompt: str) -> AnswerShape:
        """How to read this request's answers (a bad tools / tool_choice combination is a 400)."""
        choice = tool_choice_of(body)
        state = None if self.reasoning is None else self.reasoning.state(prompt)
        shape = AnswerShape(self.reasoning, state == "open", choice=choice, reasoning_state=state)
        if choice is None or choice.mode == "none":
            return shape
        shape.max_calls = choice.max_calls
        if choice.mode == "auto":
            shape.tools = self.tool_parser
            return shape
        reasoning = None if state in (None, "closed") else state == "open"
        shape.constraint, shape.tools = forced_call(choice.functions, choice.function, choice.max_calls,
                                                    self.tool_parser, reasoning)
        return shape

    def structured(self, shape: AnswerShape, requested: StructuredOutputsParams | None
                   ) -> StructuredOutputsParams | None:
        """The constraint of this request's output: the forced tool choice's, or the one the request asked for
        (``response_format``...), after the reasoning section when there is a reasoning parser. Blocking (it
        compiles): call it off the event loop."""
        spec = requested
        if shape.constraint is not None:
            if requested is not None:
                raise APIError(400, f"tool_choice: a forced tool choice cannot be combined with {requested.param}",
                               "tool_choice")
            spec = shape.constraint
        elif spec is not None and shape.reasoning_state in ("open", "maybe"):
            try:
                spec = after_reasoning(spec, shape.reasoning_state == "open")
            except ValueError as err:
                raise APIError(400, str(err), requested.param) from None
        if spec is not None and spec is not requested and self.compile is not None:
            try:
                self.compile(spec)
            except StructuredOutputError as err:
                raise APIError(400, f"{err.param}: {err}", err.param) from None
        return spec
