"""Check a request against the served model once, in the front end: render the chat
template, tokenize, bound the context, build `SamplingParams`. The backend then gets
token ids it does not need to tokenize or check again."""

from __future__ import annotations

import math

from sage_infer.core.messages import ModelInfo
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.structured_outputs import StructuredOutputsParams
from sage_infer.server.chat_messages import MessageError
from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import ChatCompletionRequest, SamplingFields
from sage_infer.structured.constraints import StructuredOutputError
from sage_infer.structured.grammar import compiler_for
from sage_infer.structured.request_constraint import constraint_from_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class RequestValidator:
    """Turns prompts into validated token ids and bodies into `SamplingParams` for one model."""

    def __init__(self, model: ModelInfo) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size

    def token_ids(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids: text is tokenized (after the size check), ids are range-checked."""
        if isinstance(prompt, str):
            self.check_size(prompt, param)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param)
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        return ids

    def match_ids(self, body) -> list[int]:
        """A KV-aware router's question (`KVMatchRequest`): the prompt's token ids, as a completion of that prompt or
        a chat of those messages gets them."""
        if body.messages is not None:
            return self.token_ids(self.chat_prompt(body), "messages", add_special_tokens=False)
        return self.token_ids(body.prompt)

    def check_size(self, text: str, param: str = "prompt") -> None:
        """Reject a text that cannot fit the context without tokenizing it.

        No token covers more than `max_bytes_per_token` bytes of text, so a text of N bytes
        has at least N / max_bytes_per_token tokens; tokenizing megabytes only to learn
        they are too long would cost seconds of CPU per request.
        """
        per_token = self.model.max_bytes_per_token
        if per_token is None or len(text) * 4 < per_token * self.max_model_len:
            return  # cheap pre-check on characters (at most 4 UTF-8 bytes each) before encoding
        num_bytes = len(text.encode("utf-8"))
        at_least = math.ceil(num_bytes / per_token)
        if at_least >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt is {num_bytes} bytes, which is at least {at_least} tokens (rejected "
                                f"by size, before tokenizing). Please reduce the length.", param)

    def max_tokens(self, num_prompt: int, requested: int | None) -> int:
        """Tokens the completion may have: what was asked for, or the rest of the context."""
        if num_prompt >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt has {num_prompt} tokens. Please reduce the length.", "prompt")
        if requested is None:
            return self.max_model_len - num_prompt
        if num_prompt + requested > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                                f"{requested} in the completion). Please reduce the length.", "max_tokens")
        return requested

    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        """The conversation rendered by the model's chat template; a template failure is a 400
        that says what went wrong in the request, never which Python exception it was."""
        try:
            messages = [m.to_template(i) for i, m in enumerate(body.messages)]
        except MessageError as err:
            raise APIError(400, str(err), err.param) from None
        tools = body.template_tools() if hasattr(body, "template_tools") else body.tools
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                      tools=tools, template_kwargs=body.chat_template_kwargs)
        except ValueError as err:  # the tokenizer's ChatTemplateError: written for clients
            raise APIError(400, f"cannot apply the chat template: {err}", "messages") from None
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError: the template's own words
            reason = getattr(err, "message", None)
            message = f"the chat template rejected the messages: {reason}" if isinstance(reason, str) and reason \
                else "the chat template failed to render these messages"
            raise APIError(400, f"cannot apply the chat template: {message}", "messages") from None

    def structured_outputs(self, body: SamplingFields) -> StructuredOutputsParams | None:
        """The output constraint the body asks for (`response_format`, `structured_outputs` or a `guided_*`
        field), compiled once here (cached for the engine) so that a malformed schema, an unsupported feature or
        one that compiles too long is a 400 naming the field. Blocking: call it off the event loop."""
        try:
            spec = constraint_from_request(
                response_format=body.response_format.model_dump(by_alias=True) if body.response_format else None,
                structured_outputs=body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
                if body.structured_outputs else None,
                guided={name: getattr(body, name) for name in GUIDED_FIELDS})
            if spec is not None:
                compiler_for(self.tokenizer, self.vocab_size).compile(spec)
        except StructuredOutputError as err:
            raise APIError(400, f"{err.param}: {err}", err.param) from None
        return spec

    @staticmethod
    def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The body's sampling fields as engine `SamplingParams` (a bad combination is a 400)."""
        try:
            return SamplingParams(
                n=body.n, max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k is None else body.top_k,
                min_p=body.min_p or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                seed=body.seed, stop=body.stop or [], stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens, logprobs=logprobs, structured_outputs=structured,
            )
        except ValueError as err:  # SamplingParams' messages name the field and its range
            raise APIError(400, str(err)) from None
