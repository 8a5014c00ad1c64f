"""`/v1/responses`: create (plain or streamed), retrieve, list input items and delete, over the chat endpoint's
machinery.

A request's context is the previous response's conversation (when `previous_response_id` names one of this tenant's
stored responses) followed by its own input; `instructions` go in front as a system message and, as OpenAI does, are
not carried to the next turn. A stored response also asks the backend to retain its KV (when the backend can), so the
next turn's prompt is a prefix hit even after other traffic would have evicted it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from sage_infer.config.responses import ResponsesConfig
from sage_infer.core.messages import AddRequest
from sage_infer.core.outputs import RequestOutput
from sage_infer.server.chat_answer import AnswerShape
from sage_infer.server.handlers import OpenAIHandlers
from sage_infer.server.openai_errors import APIError
from sage_infer.server.responses.chat_request import chat_request, renamed
from sage_infer.server.responses.items import item_objects, item_page
from sage_infer.server.responses.objects import (
    function_call_item,
    message_item,
    output_items,
    output_text_of,
    reasoning_item,
    response_object,
    status_of,
    tool_calls_of,
    usage_of,
)
from sage_infer.server.responses.protocol import ResponsesRequest, input_items, to_messages
from sage_infer.server.responses.store import RESPONSE_ID, ResponseStore, StoredResponse
from sage_infer.server.responses.stream import CallItems, ResponseEvents


def tenant_of(authorization: str, cache_salt: str | None) -> str:
    """Who owns a stored response: a digest of the bearer token and the cache salt (neither is kept)."""
    token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
    digest = hashlib.sha256(b"sage-responses\0")
    for part in (token, "\0" if cache_salt is None else f"={cache_salt}"):
        raw = part.encode("utf-8")
        digest.update(len(raw).to_bytes(4, "little") + raw)
    return digest.hexdigest()


class _Turn:
    """One create request, prepared: its ids, its job, and what to store when it finishes."""

    __slots__ = ("body", "response_id", "created_at", "tenant", "context", "items", "job", "store", "shape")

    def __init__(self, body: ResponsesRequest, response_id: str, tenant: str, context: list[dict],
                 items: list[dict], job: AddRequest, store: bool, shape: AnswerShape) -> None:
        self.body, self.response_id, self.tenant = body, response_id, tenant
        self.created_at = int(time.time())
        self.context, self.items, self.job, self.store, self.shape = context, items, job, store, shape


class ResponsesHandlers:
    """The three routes of `/v1/responses` over `OpenAIHandlers` (validation, backend, metrics) and a store."""

    def __init__(self, handlers: OpenAIHandlers, config: ResponsesConfig, directory: str | None = None) -> None:
        self.handlers = handlers
        self.backend = handlers.backend
        self.config = config
        self.retains_kv = config.kv_share > 0 and bool(getattr(self.backend, "enable_kv_retention",
                                                                lambda _: False)(config.kv_share))
        release = getattr(self.backend, "release_kv", None) if self.retains_kv else None
        self.store = ResponseStore(config.ttl_s, config.max_stored, config.max_stored_bytes, directory,
                                   on_drop=release or (lambda _: None))

    # -- routes ---------------------------------------------------------------------------

    async def create(self, body: ResponsesRequest, tenant: str) -> Response:
        turn = await self._prepare(body, tenant)
        if turn.store and self.retains_kv:
            self.backend.retain_kv(turn.job.request_id, turn.response_id, body.cache_salt, self.config.ttl_s)
        started = await self.handlers._start([turn.job])
        if body.stream:
            return StreamingResponse(self._stream(turn, started), media_type="text/event-stream")
        final = (await self.handlers._collect(started))[0]
        return JSONResponse(self._finish(turn, final))

    def retrieve(self, response_id: str, tenant: str) -> JSONResponse:
        return JSONResponse(self._stored(response_id, tenant).response)

    def input_items(self, response_id: str, tenant: str, query: dict[str, str]) -> JSONResponse:
        return JSONResponse(item_page(self._stored(response_id, tenant).input_items, query))

    def delete(self, response_id: str, tenant: str) -> JSONResponse:
        if not self.store.delete(tenant, self._stored(response_id, tenant).id):
            raise self._not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # -- steps ----------------------------------------------------------------------------

    def _stored(self, response_id: str, tenant: str, param: str | None = None) -> StoredResponse:
        stored = self.store.get(tenant, response_id) if RESPONSE_ID.match(response_id) else None
        if stored is None:
            raise self._not_found(response_id, param)
        return stored

    @staticmethod
    def _not_found(response_id: str, param: str | None = None) -> APIError:
        # another tenant's response and one that never existed get the same answer
        return APIError(404, f"Response with id '{response_id[:128]}' not found.", param)

    async def _prepare(self, body: ResponsesRequest, tenant: str) -> _Turn:
        """Build the conversation and the engine job as a chat completion would (template, tool parsers,
        structured output); every refusal names the Responses field."""
        self.handlers._check_model(body.model)
        previous, earlier_items = [], []
        if body.previous_response_id is not None:
            stored = self._stored(body.previous_response_id, tenant, "previous_response_id")
            previous, earlier_items = stored.messages, stored.input_items + stored.response["output"]
        given = input_items(body.input)
        context = previous + to_messages(given)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + context
        chat = chat_request(body, messages)
        validator, features = self.handlers.validator, self.handlers.chat_features
        try:
            text = validator.chat_prompt(chat)
            shape = features.shape(chat, text)
            if shape.tools is not None and shape.tools.needs_special_tokens:
                chat.skip_special_tokens = False  # the format's markers are special tokens
            ids = validator.token_ids(text, "input", add_special_tokens=False)
            structured = await asyncio.to_thread(validator.structured_outputs, chat)
            structured = await asyncio.to_thread(features.structured, shape, structured)
            params = validator.sampling_params(chat, validator.max_tokens(len(ids), body.max_output_tokens), None,
                                               structured)
        except APIError as err:
            raise renamed(err) from None
        response_id = f"resp_{uuid.uuid4().hex}"
        job = AddRequest(response_id, ids, params, prompt=text, priority=body.priority, cache_salt=body.cache_salt)
        return _Turn(body, response_id, tenant, context, earlier_items + item_objects(given), job,
                     body.store and self.config.max_stored > 0, shape)

    def _finish(self, turn: _Turn, final: RequestOutput, streamed: list[dict] | None = None) -> dict:
        """The finished response's object (its output items: `streamed` as the stream sent them, else from the
        answer); stored, with the conversation through its answer, when asked."""
        completion = final.outputs[0]
        message, _ = turn.shape.message(completion.text, completion.finish_reason)
        status, incomplete = status_of(final)
        output = streamed if streamed is not None else output_items(message, status)
        response = response_object(turn.response_id, turn.created_at, turn.body, self.handlers.model_name,
                                   status=status, output=output, usage=usage_of(final), incomplete=incomplete,
                                   stored=turn.store)
        if turn.store:
            # the answer as the client saw it (a streamed call's id and arguments as streamed)
            said = {"role": "assistant", "content": output_text_of(output)}
            if calls := tool_calls_of(output):
                said["tool_calls"] = calls
            now = time.time()
            stored = StoredResponse(turn.response_id, turn.tenant, now, now + self.config.ttl_s,
                                    turn.context + [said], response, turn.items)
            if not self.store.put(stored):
                response["store"] = False
                if self.retains_kv:
                    self.backend.release_kv(turn.response_id)
        return response

    async def _stream(self, turn: _Turn, started) -> AsyncIterator[str]:
        """The answer's text streams as it comes, in the message item, and its function calls as they are written,
        each its own item; its reasoning (read from the whole answer, as the plain response does) follows as a
        whole item once it is done."""
        events = ResponseEvents()
        calls = CallItems(events)
        item_id = f"msg_{uuid.uuid4().hex}"
        pending = response_object(turn.response_id, turn.created_at, turn.body, self.handlers.model_name,
                                  status="in_progress", output=[], stored=turn.store)
        yield events.created(pending)
        yield events.in_progress(pending)
        yield events.item_added(0, message_item(item_id, None, "in_progress"))
        yield events.part_added(item_id)
        answer, text, final, last_seen = turn.shape.stream(), [], None, {}
        try:
            async for _, output in self.handlers._merged(started):
                completion = output.outputs[0]
                self.handlers._itl(last_seen, 0, len(completion.delta_token_ids))
                fields = answer.feed(completion.delta_text, final=completion.finished)
                if fields.get("content"):
                    text.append(fields["content"])
                    yield events.text_delta(item_id, fields["content"])
                for event in calls.feed(fields.get("tool_calls") or []):
                    yield event
                if output.finished:
                    final = output
            if final is None or final.error:
                raise APIError(500, f"generation failed: {final.error if final else 'the engine stopped'}")
        except Exception as err:  # noqa: BLE001 - the status line is already sent: report in-band
            yield events.error(self.handlers._stream_error(err)["error"])
            return
        for event in self._closing_events(events, turn, final, message_item(item_id, "".join(text), ""), calls):
            yield event

    def _closing_events(self, events: ResponseEvents, turn: _Turn, final: RequestOutput, message: dict,
                        calls: CallItems) -> list[str]:
        """The stream's last events: the message item done, the streamed function calls done (or, when none was
        streamed, the whole answer's as whole items), the reasoning item whole, then the response (stored when
        asked)."""
        completion = final.outputs[0]
        answer, _ = turn.shape.message(completion.text, completion.finish_reason)
        status, _ = status_of(final)
        message["status"] = status
        part = message["content"][0]
        sent = [events.text_done(message["id"], part["text"]), events.part_done(message["id"], part),
                events.item_done(0, message), *calls.done(status)]
        items = [message, *calls.items]
        extra = [] if calls.items else [function_call_item(call, status) for call in answer.get("tool_calls") or []]
        if answer.get("reasoning_content"):
            extra.append(reasoning_item(answer["reasoning_content"], status))
        for item in extra:
            index = len(items)
            items.append(item)
            sent.append(events.item_added(index, {**item, "status": "in_progress"}))
            if item["type"] == "function_call":
                sent += [events.arguments_delta(item["id"], index, item["arguments"]),
                         events.arguments_done(item["id"], index, item["arguments"])]
            sent.append(events.item_done(index, item))
        sent.append(events.finished(self._finish(turn, final, items)))
        return sent
