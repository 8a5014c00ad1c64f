"""The body of ``POST /v1/responses`` (OpenAI's Responses API), validated at the boundary.

Input items become chat messages for the model's template (`to_messages`). Unknown fields are ignored, as OpenAI
clients add their own; a known field this server does not honour is a 400 naming it, never accepted in silence.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sage_infer.server.openai_errors import APIError


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    """A message: ``{"role": "user", "content": "..."}``, with or without ``"type": "message"``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A tool call the model made earlier, sent back by the client with its result."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=256)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning section the model wrote earlier (a reasoning parser's ``reasoning`` output item), sent back by
    a client that keeps the conversation itself; it goes to the template as the next answer's
    ``reasoning_content``. Encrypted reasoning (another server's) cannot be read here."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("encrypted reasoning cannot be read by this server (send the reasoning's text)")
        return value

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


_ITEMS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                       "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_UNION_TAGS = {"str", "list[InputText]"}  # pydantic names a union's branches in an error's location


def input_items(raw: str | list[dict]) -> list[InputItem]:
    """The body's ``input`` as typed items; a bad item is a 400 naming it (``input[2].role``)."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}]: an input item is an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind not in _ITEMS:
            raise APIError(400, f"input[{i}].type: {kind!r} is not supported (message, function_call, "
                                f"function_call_output, reasoning)", f"input[{i}].type")
        try:
            items.append(_ITEMS[kind].model_validate(item))
        except ValidationError as err:
            worst = max(err.errors(include_url=False), key=lambda e: len(e["loc"]))  # the most specific
            where = f"input[{i}]" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in worst["loc"]
                                            if p not in _UNION_TAGS)
            raise APIError(400, f"{where}: {worst['msg']}", where) from None
    _check_reasoning_order(items)
    return items


def _check_reasoning_order(items: list[InputItem]) -> None:
    """A reasoning item leads to an answer: the assistant message or function call right after it."""
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            after = items[i + 1] if i + 1 < len(items) else None
            if not (isinstance(after, FunctionCallItem) or (isinstance(after, MessageItem)
                                                            and after.role == "assistant")):
                raise APIError(400, f"input[{i}]: a reasoning item comes right before the assistant message or "
                                    "function call it led to", f"input[{i}]")


def to_messages(items: list[InputItem]) -> list[dict]:
    """Input items as chat-template messages, in order; a reasoning item becomes the ``reasoning_content`` of
    the answer after it."""
    messages: list[dict] = []
    reasoning = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
            continue
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    return messages


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = Field(None, max_length=256)
    # beyond OpenAI, as on the other endpoints
    cache_salt: str | None = Field(None, max_length=256, description="Tenant isolation of cached prefixes and of "
                                   "stored responses.")
    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    seed: int | None = None
    ignore_eos: bool = False
    # OpenAI fields this server does not serve: refused by name, never ignored
    background: bool | None = None
    conversation: str | dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    prompt: dict | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return value

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        return value

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        refused = {"background": bool(self.background), "conversation": self.conversation is not None,
                   "truncation": self.truncation == "auto", "top_logprobs": bool(self.top_logprobs),
                   "prompt": self.prompt is not None}
        for name, asked in refused.items():
            if asked:
                raise ValueError(f"{name}: not supported by this server")
        return self
