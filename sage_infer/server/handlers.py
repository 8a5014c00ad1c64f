"""Request handling behind the routes: validate against the model, run on the backend,
shape OpenAI responses (streaming SSE or one JSON body), record metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import JSONResponse, Response, StreamingResponse

from sage_infer.core.messages import AddRequest, KVTransferParams
from sage_infer.core.outputs import CompletionOutput, RequestOutput
from sage_infer.interfaces.backend import EngineDeadError, InferenceBackend, InvalidRequestError, QueueFullError
from sage_infer.server.chat_answer import AnswerShape, ChatFeatures
from sage_infer.server.logprobs import LogprobFormatter
from sage_infer.server.metrics import ServerMetrics
from sage_infer.server.openai_errors import APIError, error_body
from sage_infer.server.pd_handlers import PDHandlers
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from sage_infer.server.validation import RequestValidator

Started = list[tuple[str, AsyncIterator[RequestOutput]]]  # (request id, its output stream)

log = logging.getLogger("sage_infer.server")


class OpenAIHandlers:
    """The two generation endpoints over any `InferenceBackend`."""

    def __init__(self, backend: InferenceBackend, metrics: ServerMetrics, api_key: str | None = None,
                 allowed_peers: Sequence[str] = (), chat_features: ChatFeatures | None = None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.pd = PDHandlers(backend, api_key, allowed_peers)
        model = backend.model_info()
        self.model_name = model.name
        self.validator = RequestValidator(model)
        self.logprobs = LogprobFormatter(model.tokenizer)
        self.chat_features = (chat_features or ChatFeatures()).bind(model)
        self._in_flight: set[asyncio.Queue] = set()  # the output queue of every request being answered

    def cut_off(self, message: str) -> int:
        """End every request still being answered with a 503 (`message`): a stream gets it as an error event and
        then ``[DONE]``, a plain request as its JSON body; their sub-requests are aborted (KV freed). Called on the
        event loop when a shutdown's drain runs out, before the server drops the connections. How many."""
        for merged in self._in_flight:
            merged.put_nowait((-1, APIError(503, message)))
        return len(self._in_flight)

    # -- shared ---------------------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                           "model")

    async def _start(self, jobs: list[AddRequest]) -> Started:
        """Add every sub-request before any response byte is sent, so errors keep their status."""
        started: Started = []
        try:
            for job in jobs:
                started.append((job.request_id, await self.backend.add_request(job)))
        except BaseException as err:
            self._abort(started)  # siblings already running must not outlive a refused request
            if isinstance(err, InvalidRequestError):
                raise APIError(400, str(err)) from None
            if isinstance(err, QueueFullError):
                raise APIError(429, f"server busy: {err}") from None
            if isinstance(err, EngineDeadError):
                raise APIError(503, str(err)) from None
            raise
        return started

    def _abort(self, started: Started) -> None:
        for request_id, _ in started:
            self.backend.abort(request_id)

    async def _merged(self, started: Started) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every sub-request as they come; aborts the rest on exit."""
        merged: asyncio.Queue = asyncio.Queue()
        done = object()
        finished: set[str] = set()

        async def pump(i: int, request_id: str, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    if output.finished:
                        finished.add(request_id)
                    await merged.put((i, output))
            except BaseException as err:  # noqa: BLE001 - surfaced to the consumer below
                await merged.put((i, err))
            finally:
                await merged.put((i, done))

        tasks = [asyncio.create_task(pump(i, rid, s)) for i, (rid, s) in enumerate(started)]
        remaining = len(tasks)
        self._in_flight.add(merged)
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
            self._in_flight.discard(merged)
            for task in tasks:
                task.cancel()
            # a pump cancelled before it ever ran never closes its stream: abort here too
            self._abort([(rid, s) for rid, s in started if rid not in finished])

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
    def _stream_error(err: Exception) -> dict:
        """An in-band error event; only our own typed errors' words reach the client."""
        if isinstance(err, EngineDeadError):
            return error_body(503, str(err))
        if isinstance(err, APIError):
            return error_body(err.status, err.message, err.param)
        log.error("a streamed generation failed", exc_info=err)  # the client gets no traceback; the operator does
        return error_body(500, "generation failed: internal server error")

    @staticmethod
    def _sse(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"

    # -- /v1/completions ------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, rid: str) -> Response:
        self._check_model(body.model)
        prompts = body.prompts()
        transfer = self.pd.params(body, len(prompts), rid)
        structured = await asyncio.to_thread(self.validator.structured_outputs, body)
        jobs = []
        for i, prompt in enumerate(prompts):
            ids = self.validator.token_ids(prompt)
            params = self.validator.sampling_params(body, self.validator.max_tokens(len(ids), body.max_tokens),
                                                    body.logprobs, structured)
            jobs.append(self._job(f"{rid}-{i}", prompt, ids, params, body, transfer))
        started = await self._start_pd(jobs, body, transfer)
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
        reply = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                 "choices": sorted(choices, key=lambda ch: ch["index"]), "usage": self._usage(finals)}
        if transfer is not None and transfer.hold:
            reply["kv_transfer_params"] = self.pd.held_reply(jobs[0].request_id)
        return JSONResponse(reply)

    @staticmethod
    def _job(request_id: str, prompt: str | list[int], ids: list[int], params, body: SamplingFields,
             transfer: KVTransferParams | None = None) -> AddRequest:
        return AddRequest(request_id, ids, params, prompt=prompt if isinstance(prompt, str) else None,
                          priority=body.priority, cache_salt=body.cache_salt, kv_transfer=transfer)

    async def _start_pd(self, jobs: list[AddRequest], body: SamplingFields,
                        transfer: KVTransferParams | None) -> Started:
        """`_start`, then, for a decode instance, ask the prefill instance for the request's KV."""
        started = await self._start(jobs)
        if transfer is not None and transfer.transfer_id is not None:
            self.pd.pull_soon(body, transfer)  # the request's stream starts now; its tokens follow the KV
        return started

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
        try:
            async for i, output in self._merged(started):
                for c in output.outputs:
                    self._itl(last_seen, (i, c.index), len(c.delta_token_ids))
                if output.finished:
                    finals[i] = output
        except EngineDeadError as err:
            raise APIError(503, str(err)) from None
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
            yield self._sse(self._stream_error(err))
        yield self._sse("[DONE]")

    # -- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, rid: str) -> Response:
        self._check_model(body.model)
        text = self.validator.chat_prompt(body)
        shape = self.chat_features.shape(body, text)
        if shape.tools is not None and shape.tools.needs_special_tokens:
            body.skip_special_tokens = False  # the format's markers are special tokens
        ids = self.validator.token_ids(text, "messages", add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        structured = await asyncio.to_thread(self.validator.structured_outputs, body)
        structured = await asyncio.to_thread(self.chat_features.structured, shape, structured)
        params = self.validator.sampling_params(body, self.validator.max_tokens(len(ids), body.token_limit),
                                                logprobs, structured)
        transfer = self.pd.params(body, 1, rid)
        started = await self._start_pd([self._job(rid, text, ids, params, body, transfer)], body, transfer)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream_chat(started, rid, created, body.n, include_usage, shape),
                                     media_type="text/event-stream")
        final = (await self._collect(started))[0]
        choices = []
        for c in final.outputs:
            message, finish_reason = shape.message(c.text, c.finish_reason)
            choice = {"index": c.index, "message": message,
                      "logprobs": self.logprobs.chat(c.logprobs, c.token_ids) if c.logprobs is not None else None,
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}
            choices.append(choice)
        reply = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                 "choices": choices, "usage": self._usage([final])}
        if transfer is not None and transfer.hold:
            reply["kv_transfer_params"] = self.pd.held_reply(rid)
        return JSONResponse(reply)

    async def _stream_chat(self, started, rid, created, n, include_usage,
                           shape: AnswerShape | None = None) -> AsyncIterator[str]:
        def chunk(choices: list, usage: dict | None = None) -> str:
            data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return self._sse(data)

        finals: list[RequestOutput] = []
        last_seen: dict = {}
        shape = shape or AnswerShape()
        answers = [shape.stream() for _ in range(n)]
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n)])
            async for _, output in self._merged(started):
                for c in output.outputs:
                    self._itl(last_seen, c.index, len(c.delta_token_ids))
                    entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):] if c.logprobs is not None else None
                    delta = answers[c.index].feed(c.delta_text, final=c.finished)
                    if delta or (c.delta_token_ids and (shape.plain or entries is not None)):
                        yield chunk([{"index": c.index, "delta": delta or {"content": ""},
                                      "logprobs": self.logprobs.chat(entries, c.delta_token_ids)
                                      if entries is not None else None, "finish_reason": None}])
                if output.finished:
                    finals.append(output)
                    for c in output.outputs:
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": answers[c.index].finish_reason(c.finish_reason),
                                      "stop_reason": c.stop_reason}])
            if include_usage:
                yield chunk([], self._usage(finals))
        except Exception as err:  # noqa: BLE001 - the status line is already sent: report in-band
            yield self._sse(self._stream_error(err))
        yield self._sse("[DONE]")

