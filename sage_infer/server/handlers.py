"""Request handling behind the routes: validate against the model, run on the engine,
shape OpenAI responses (streaming SSE or one JSON body), record metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine.llm_engine import RequestError
from sage_infer.engine.outputs import CompletionOutput, RequestOutput
from sage_infer.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from sage_infer.server.errors import APIError, error_body
from sage_infer.server.logprobs import LogprobFormatter
from sage_infer.server.metrics import ServerMetrics
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


class OpenAIHandlers:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.runner.model.config.vocab_size
        self.logprobs = LogprobFormatter(self.tokenizer)

    # -- shared ---------------------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                           "model")

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        return ids

    def _max_tokens(self, num_prompt: int, requested: int | None) -> int:
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

    def _params(self, body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
                skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from None

    async def _start(self, body: SamplingFields, jobs: list[tuple[str, list[int], SamplingParams]]):
        """Add every sub-request before any response byte is sent, so errors keep their status."""
        started = []
        try:
            for request_id, ids, params in jobs:
                stream = await self.engine.add(request_id, ids, params, priority=body.priority,
                                               cache_salt=body.cache_salt)
                started.append((request_id, stream))
        except (RequestError, ValueError) as err:
            self._abort(started)
            raise APIError(400, str(err)) from None
        except QueueFullError as err:
            self._abort(started)
            raise APIError(429, f"server busy: {err}") from None
        except EngineDeadError as err:
            self._abort(started)
            raise APIError(503, str(err)) from None
        return started

    def _abort(self, started) -> None:
        for request_id, _ in started:
            self.engine.abort(request_id)

    async def _merged(self, started) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every sub-request as they come; aborts the rest on exit."""
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, request_id: str, stream: asyncio.Queue) -> None:
            try:
                async for output in self.engine.outputs(request_id, stream):
                    await merged.put((i, output))
            except BaseException as err:  # noqa: BLE001 - surfaced to the consumer below
                await merged.put((i, err))
            finally:
                await merged.put((i, done))

        tasks = [asyncio.create_task(pump(i, rid, s)) for i, (rid, s) in enumerate(started)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await merged.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    def _usage(self, finals: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        cached = sum(o.metrics.num_cached_tokens for o in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _itl(self, last_seen: dict, key: tuple, num_tokens: int) -> None:
        now = time.monotonic()
        if key in last_seen and num_tokens:
            gap = (now - last_seen[key]) / num_tokens
            self.metrics.record_tokens([gap] * num_tokens)
        if num_tokens:
            last_seen[key] = now

    @staticmethod
    def _sse(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"

    # -- /v1/completions ------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, rid: str) -> Response:
        self._check_model(body.model)
        jobs = []
        for i, prompt in enumerate(body.prompts()):
            ids = self._token_ids(prompt)
            params = self._params(body, self._max_tokens(len(ids), body.max_tokens), body.logprobs)
            jobs.append((f"{rid}-{i}", ids, params))
        started = await self._start(body, jobs)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream_completions(started, rid, created, body.n, include_usage),
                                     media_type="text/event-stream")
        finals = await self._collect(started)
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                choices.append(self._completion_choice(i * body.n + c.index, c, c.text, c.token_ids, c.logprobs))
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": sorted(choices, key=lambda ch: ch["index"]), "usage": self._usage(finals)})

    def _completion_choice(self, index: int, c: CompletionOutput, text: str, token_ids: list[int],
                           entries: list | None, offset: int = 0) -> dict:
        logprobs = None
        if entries is not None:
            logprobs = self.logprobs.completion(entries, token_ids, offset)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    async def _collect(self, started) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(started)
        last_seen: dict = {}
        async for i, output in self._merged(started):
            for c in output.outputs:
                self._itl(last_seen, (i, c.index), len(c.delta_token_ids))
            if output.finished:
                finals[i] = output
        if any(f is None for f in finals):
            raise APIError(503, "the engine stopped before the request finished")
        for final in finals:
            if final.error:
                raise APIError(500, f"generation failed: {final.error}")
        return finals

    async def _stream_completions(self, started, rid, created, n, include_usage) -> AsyncIterator[str]:
        finals: list[RequestOutput] = []
        last_seen: dict = {}
        offsets: dict = {}
        try:
            async for i, output in self._merged(started):
                for c in output.outputs:
                    self._itl(last_seen, (i, c.index), len(c.delta_token_ids))
                    if not c.delta_text and not c.finished and not c.delta_token_ids:
                        continue
                    entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):] if c.logprobs is not None else None
                    offset = offsets.get((i, c.index), 0)
                    offsets[(i, c.index)] = offset + len(c.delta_text)
                    choice = self._completion_choice(i * n + c.index, c, c.delta_text, c.delta_token_ids, entries,
                                                     offset)
                    yield self._sse({"id": rid, "object": "text_completion", "created": created,
                                     "model": self.model_name, "choices": [choice]})
                if output.finished:
                    finals.append(output)
            if include_usage:
                yield self._sse({"id": rid, "object": "text_completion", "created": created,
                                 "model": self.model_name, "choices": [], "usage": self._usage(finals)})
        except Exception as err:  # noqa: BLE001 - the status line is already sent: report in-band
            yield self._sse(error_body(500, f"generation failed: {type(err).__name__}: {err}"))
        yield self._sse("[DONE]")

    # -- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, rid: str) -> Response:
        self._check_model(body.model)
        messages = [m.to_template() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                      tools=body.tools, **(body.chat_template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - template errors are the caller's messages
            raise APIError(400, f"cannot apply the chat template: {err}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, self._max_tokens(len(ids), body.token_limit), logprobs)
        started = await self._start(body, [(rid, ids, params)])
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream_chat(started, rid, created, body.n, include_usage),
                                     media_type="text/event-stream")
        final = (await self._collect(started))[0]
        choices = []
        for c in final.outputs:
            choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                      "logprobs": self.logprobs.chat(c.logprobs, c.token_ids) if c.logprobs is not None else None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                             "choices": choices, "usage": self._usage([final])})

    async def _stream_chat(self, started, rid, created, n, include_usage) -> AsyncIterator[str]:
        def chunk(choices: list, usage: dict | None = None) -> str:
            data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return self._sse(data)

        finals: list[RequestOutput] = []
        last_seen: dict = {}
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n)])
            async for _, output in self._merged(started):
                for c in output.outputs:
                    self._itl(last_seen, c.index, len(c.delta_token_ids))
                    entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):] if c.logprobs is not None else None
                    if c.delta_text or c.delta_token_ids:
                        yield chunk([{"index": c.index, "delta": {"content": c.delta_text},
                                      "logprobs": self.logprobs.chat(entries, c.delta_token_ids)
                                      if entries is not None else None, "finish_reason": None}])
                if output.finished:
                    finals.append(output)
                    for c in output.outputs:
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
            if include_usage:
                yield chunk([], self._usage(finals))
        except Exception as err:  # noqa: BLE001 - the status line is already sent: report in-band
            yield self._sse(error_body(500, f"generation failed: {type(err).__name__}: {err}"))
        yield self._sse("[DONE]")

