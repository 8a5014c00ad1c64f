"""`/v1/responses` behind a router: a stored response lives on the worker that created it.

A replica keeps the conversation of each response it stored, and its KV (`server.responses`), so a
request continuing one (``previous_response_id``), ``GET`` / ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items`` must reach that worker and no other. The router learns who
holds each response from the answers it relays (the ``id`` of a JSON answer, of a stream's
``response.created`` event) into a bounded map; a response it has not seen (the router restarted, or
another router created it) is looked for on each worker in turn. A new conversation goes where the
router's policy sends a chat request with the same messages. A worker that holds a response and is
down makes it a 404, as an unknown id is: its state is there only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from sage_infer.router.http import encode, read_body
from sage_infer.server.openai_errors import APIError
from sage_infer.server.responses.stream import ResponseEvents

MAX_OWNERS = 100_000  # responses whose worker the router remembers (the oldest are looked for again)
# a stored response's tenant is the client's bearer token and cache salt: both go to the worker as the client sent
# them (with a deployment key, the router already checked the client's token is that key)
FORWARDED_HEADERS = ("authorization", "x-cache-salt")
CREATED_PREFIX_BYTES = 64 * 1024  # a stream's first event names the response within this many bytes


class ResponseOwners:
    """Response id -> the URL of the worker that stored it, the most recently seen kept."""

    def __init__(self, limit: int = MAX_OWNERS) -> None:
        self.limit = limit
        self._owners: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, url: str) -> None:
        self._owners[response_id] = url
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.limit:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        return self._owners.get(response_id)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


def chat_view(body: dict) -> dict:
    """The chat request a new conversation's first turn renders like (for routing by its prefix): its
    ``instructions`` as the system message, then its input; empty when the input is not what a replica takes."""
    from sage_infer.server.responses.protocol import input_items, to_messages

    raw = body.get("input")
    if not isinstance(raw, str | list):
        return {}
    try:
        messages = to_messages(input_items(raw))
    except APIError:
        return {}
    if isinstance(body.get("instructions"), str):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    view = {"messages": messages}
    for field in ("cache_salt", "user", "tools"):
        if field in body:
            view[field] = body[field]
    return view


class ResponsesRouting:
    """The `/v1/responses` routes of a router. `urls()`: its workers that are up, least busy first;
    `choose(body, request, exclude)`: the worker for a new conversation (None: none left); `hold(url)`: count a
    request in flight there, returning what ends the count; `failed(url, why)`: a call to that worker failed.
    `address(worker)`: the URL and extra headers a worker's name stands for (a data-parallel rank of one server is a
    worker of its own; default: the name is the URL)."""

    def __init__(self, client: Callable[[], httpx.AsyncClient], headers: dict[str, str],
                 urls: Callable[[], list[str]],
                 choose: Callable[[dict, Request, set[str]], Awaitable[str | None]],
                 hold: Callable[[str], Callable[[], None]], failed: Callable[[str, str], None],
                 address: Callable[[str], tuple[str, dict[str, str]]] | None = None) -> None:
        self.client, self.headers, self.urls, self.choose = client, headers, urls, choose
        self.hold, self.failed = hold, failed
        self.address = address or (lambda worker: (worker, {}))
        self.owners = ResponseOwners()

    def forwarded(self, request: Request) -> dict[str, str]:
        return {**self.headers, **{k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}}

    def at(self, worker: str, path: str, request: Request) -> tuple[str, dict[str, str]]:
        """The URL of `path` at `worker` and the headers of a call there on behalf of `request`."""
        base, extra = self.address(worker)
        return f"{base}{path}", {**self.forwarded(request), **extra}

    async def create(self, request: Request) -> Response:
        body = await read_body(request)
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            url = await self.find(previous, request)
            if url is None:
                raise APIError(404, f"Previous response with id '{previous}' not found.", "previous_response_id")
            return await self.send(url, body, request)
        tried: set[str] = set()
        while (url := await self.choose(body, request, tried)) is not None:
            tried.add(url)
            try:
                return await self.send(url, body, request)
            except _Unreachable:
                continue
        raise APIError(503, "no worker is up")

    async def item(self, method: str, response_id: str, request: Request, tail: str = "") -> Response:
        """``GET`` or ``DELETE /v1/responses/{id}``, or ``GET /v1/responses/{id}/input_items`` (`tail`), at the worker
        holding it."""
        url = await self.find(response_id, request)
        if url is None:
            raise APIError(404, f"Response with id '{response_id}' not found.")
        target, headers = self.at(url, f"/v1/responses/{response_id}{tail}", request)
        try:
            reply = await self.client().request(method, target, params=dict(request.query_params), headers=headers)
        except httpx.HTTPError as err:
            self.failed(url, str(err) or type(err).__name__)
            raise APIError(404, f"Response with id '{response_id}' not found (its worker is down).") from None
        if method == "DELETE" and reply.status_code == 200:
            self.owners.forget(response_id)
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    async def find(self, response_id: str, request: Request) -> str | None:
        """The worker that holds `response_id`: remembered, else the first up worker that answers for it."""
        up = self.urls()
        owner = self.owners.owner(response_id)
        if owner is not None:
            return owner if owner in up else None
        for url in up:
            target, headers = self.at(url, f"/v1/responses/{response_id}", request)
            try:
                reply = await self.client().get(target, params=dict(request.query_params), headers=headers)
            except httpx.HTTPError:
                continue
            if reply.status_code == 200:
                self.owners.learn(response_id, url)
                return url
        return None

    async def send(self, url: str, body: dict, request: Request) -> Response:
        """POST the create to `url`: a JSON answer, or its stream relayed; the created id's owner learned."""
        release = self.hold(url)
        target, headers = self.at(url, "/v1/responses", request)
        try:
            upstream = await self.client().send(self.client().build_request(
                "POST", target, content=encode(body), headers=headers), stream=True)
        except httpx.HTTPError as err:
            release()
            self.failed(url, str(err) or type(err).__name__)
            raise _Unreachable from None
        if upstream.status_code == 503 or not upstream.headers.get("content-type", "").startswith(
                "text/event-stream"):
            content = await upstream.aread()
            await upstream.aclose()
            release()
            if upstream.status_code == 503:
                self.failed(url, "HTTP 503")
                raise _Unreachable
            if upstream.status_code == 200:
                self._learn_from(content, url)
            return Response(content, status_code=upstream.status_code, media_type="application/json")

        async def close() -> None:
            await upstream.aclose()
            release()
        return StreamingResponse(self._relay(upstream, url), media_type="text/event-stream",
                                 background=BackgroundTask(close))

    async def _relay(self, upstream: httpx.Response, url: str) -> AsyncIterator[bytes]:
        head = b""
        learned = False
        try:
            async for chunk in upstream.aiter_raw():
                if not learned and len(head) < CREATED_PREFIX_BYTES:
                    head += chunk
                    learned = self._learn_from_events(head, url)
                yield chunk
        except httpx.HTTPError as err:
            self.failed(url, str(err) or type(err).__name__)
            error = {"code": "server_error", "message": f"worker {url} stopped during the request"}
            yield ResponseEvents().error(error).encode()

    def _learn_from(self, content: bytes, url: str) -> None:
        try:
            answer = json.loads(content)
        except ValueError:
            return
        if isinstance(answer, dict) and isinstance(answer.get("id"), str) and answer.get("store", True):
            self.owners.learn(answer["id"], url)

    def _learn_from_events(self, head: bytes, url: str) -> bool:
        """Learn the id from the ``response.created`` event once `head` holds it whole."""
        for event in head.split(b"\n\n")[:-1]:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                try:
                    data = json.loads(line[5:])
                except ValueError:
                    continue
                response = data.get("response") if isinstance(data, dict) else None
                if data.get("type") == "response.created" and isinstance(response, dict):
                    if isinstance(response.get("id"), str) and response.get("store", True):
                        self.owners.learn(response["id"], url)
                    return True
        return False


class _Unreachable(Exception):
    """The chosen worker did not start the request: another one may."""
