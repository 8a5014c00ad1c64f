"""Request bodies of the OpenAI-compatible API (pydantic at the boundary).

Unknown fields are ignored, as OpenAI clients add their own; known fields are
validated strictly and a bad one is a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sage_infer.core.kv_schema import KVDtype
from sage_infer.server.chat_messages import template_message


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class KVTransferFields(BaseModel):
    """Prefill/decode separation (vLLM's ``kv_transfer_params``); the router sets these, not clients."""

    model_config = ConfigDict(extra="forbid")

    do_remote_decode: bool = False  # to a prefill instance: hold the prompt's KV for a decode instance
    remote_url: str | None = Field(None, max_length=512)  # to a decode instance: the prefill instance holding it
    remote_request_id: str | None = Field(None, max_length=256)
    signature: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # the router's, over the two above (pd_auth.py)
    schema_digest: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    kv_dtype: KVDtype | None = None  # the prefill instance's KV dtype (a decode in another one gets it converted)
    # what a vLLM prefill instance answers (SageKVConnector, --backend vllm): its connector pulls the KV itself
    do_remote_prefill: bool = False
    sage_pd: dict | None = None
    remote_prefill_cached_tokens: int | None = None  # vLLM's: the prefill instance's prefix-cache hits

    @model_validator(mode="after")
    def _one_side(self) -> KVTransferFields:
        pulls = self.remote_url is not None or self.remote_request_id is not None
        if pulls and self.sage_pd is None and (self.remote_url is None or self.remote_request_id is None):
            raise ValueError("kv_transfer_params: remote_url and remote_request_id go together")
        if self.sage_pd is not None and len(str(self.sage_pd)) > 1024:
            raise ValueError("kv_transfer_params.sage_pd: too large")
        if pulls and self.do_remote_decode:
            raise ValueError("kv_transfer_params: do_remote_decode (prefill) and remote_url (decode) exclude "
                             "each other")
        if pulls and not self.remote_url.startswith(("http://", "https://")):
            raise ValueError("kv_transfer_params.remote_url must be an http(s) URL")
        return self


class KVSendRequest(BaseModel):
    """``POST /v1/kv/send`` (prefill role): send a held request's KV to a decode instance."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(max_length=256)
    address: str = Field(max_length=512, pattern=r"^(shm|tcp|torchdist)://")
    transfer_id: str = Field(max_length=256)
    kv_dtype: KVDtype | None = None  # the receiver's KV dtype, when it differs from the sender's


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``. `strict` is accepted and the schema enforced as written (as vLLM
    does): a schema OpenAI's strict mode would refuse (optional properties, no additionalProperties) is served."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json (a schema), regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI + this product's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # beyond OpenAI: what this product is about, plus common vLLM sampling extras
    cache_salt: str | None = Field(None, max_length=256, description="Tenant isolation of cached prefixes.")
    priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="Lower is served first (priority mode).")
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    kv_transfer_params: KVTransferFields | None = None
    # structured outputs (sage_infer.structured): OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, value):
        if value is not None:
            raise ValueError("not supported; use structured_outputs.disable_any_whitespace")
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value


MAX_SEQUENCES = 256  # prompts x n in one completions request


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    logit_bias: dict | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if len(self.prompts()) * self.n > MAX_SEQUENCES:  # one request may not hold a replica for minutes by its size
            raise ValueError(f"at most {MAX_SEQUENCES} sequences per request (prompts x n); send several requests")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self, index: int = 0) -> dict:
        """This message as the chat template reads it (`chat_messages.template_message`); a `MessageError`
        names a bad field."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        return template_message(data, index)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class KVMatchRequest(BaseModel):
    """``POST /v1/kv/match``: how much of this prompt is cached here (the router's question)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = Field(None, max_length=256)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None

    @model_validator(mode="after")
    def _one(self) -> KVMatchRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self
