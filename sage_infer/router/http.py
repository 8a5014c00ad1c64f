"""What every sage router does with HTTP bodies: read a client's, encode one for a worker, read a worker's answer."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sage_infer import __version__
from sage_infer.server.body import MAX_JSON_DEPTH, json_depth
from sage_infer.server.openai_errors import APIError, check_bearer, error_body, openai_errors

log = logging.getLogger("sage_infer.router")

MAX_BODY_BYTES = 4 * 1024 * 1024
CALL_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=10.0)
# what a worker needs to hash a prompt's blocks (POST /v1/kv/hashes, /v1/kv/match)
MATCH_FIELDS = ("prompt", "messages", "cache_salt", "add_generation_prompt", "chat_template_kwargs", "tools")


def router_app(title: str, router) -> FastAPI:
    """A router's FastAPI app: every error OpenAI-style JSON (its own, an unknown path or method, and an unexpected
    failure: a 500 with no internals for the client, the traceback in the log), ``/version``, and the routes every
    router answers for clients (completions, chat completions, models, responses), with `router`'s start and stop
    as the app's lifespan. `router` has ``handle(path, request)``, ``models(request)``, ``start()``, ``stop()``,
    ``api_key`` and ``responses`` (a `router.responses.ResponsesRouting`)."""
    app = FastAPI(title=title, version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    openai_errors(app, log)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        yield
        await router.stop()

    app.router.lifespan_context = lifespan

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        """The OpenAPI schema of the client routes, behind the key when one is set (as a replica serves it)."""
        check_bearer(request.headers.get("authorization", ""), router.api_key)
        return JSONResponse(app.openapi())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        check_bearer(request.headers.get("authorization", ""), router.api_key)
        return await router.responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        check_bearer(request.headers.get("authorization", ""), router.api_key)
        return await router.responses.item("GET", response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        check_bearer(request.headers.get("authorization", ""), router.api_key)
        return await router.responses.item("DELETE", response_id, request)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        check_bearer(request.headers.get("authorization", ""), router.api_key)
        return await router.responses.item("GET", response_id, request, "/input_items")

    return app


def worker_headers(api_key: str | None) -> dict[str, str]:
    """The headers of every call a router makes to a worker: JSON, and the key when it has one."""
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def encode(body: dict) -> bytes:
    """A body as a worker gets it: JSON with every non-ASCII character escaped, so a lone surrogate a client sent
    travels as the ``\\ud800`` it came as (the worker answers it with a 400) instead of failing to encode here."""
    return json.dumps(body, ensure_ascii=True).encode("ascii")


async def read_body(request: Request) -> dict:
    """The client's JSON object, or an OpenAI-style 4xx; ``kv_transfer_params`` is the router's to set."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(400, f"request JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError, or an integer of over 4,300 digits
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if "kv_transfer_params" in body:
        raise APIError(400, "kv_transfer_params is set by the router, not by clients", "kv_transfer_params")
    return body


def several_prompts(body: dict) -> bool:
    """A completions body with more than one prompt (a list of strings or of token lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt)


def asking_for_usage(body: dict) -> tuple[dict, bool]:
    """A streamed body that asks its worker for the final usage event (the router reads its token counts), and
    whether the client asked for it too (else the router drops it). A ``stream_options`` that is not an object
    goes as it came: the worker's 400 answers it."""
    options = body.get("stream_options") or {}
    wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    if isinstance(options, dict):
        body = {**body, "stream_options": {**options, "include_usage": True}}
    return body, wants_usage


def stream_error(message: str) -> bytes:
    """The end of a stream whose worker stopped mid-way: an OpenAI-style 503 error event, then ``[DONE]``."""
    return f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n".encode()


def usage_event(event: bytes) -> dict | None:
    """The usage an SSE event's final usage chunk (``choices`` empty) carries, or None for any other event."""
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return None
    try:
        data = json.loads(event[len(b"data: "):])
        usage = data["usage"]
        return usage if not data.get("choices") and isinstance(usage, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def usage_of(reply: httpx.Response) -> dict:
    """A JSON answer's usage ({} when it has none)."""
    try:
        usage = reply.json()["usage"]
        return usage if isinstance(usage, dict) else {}
    except (ValueError, KeyError, TypeError):
        return {}


def completion_tokens(usage: dict) -> int:
    try:
        return int(usage["completion_tokens"])
    except (KeyError, TypeError, ValueError):
        return 0


def cached_tokens(usage: dict) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, None when the worker does not report it."""
    try:
        return int(usage["prompt_tokens_details"]["cached_tokens"])
    except (KeyError, TypeError, ValueError):
        return None


def passthrough(reply: httpx.Response) -> APIError:
    """A worker's own OpenAI-style error, as this router's answer."""
    try:
        error = reply.json()["error"]
        return APIError(reply.status_code, error.get("message", "request failed"), error.get("param"))
    except (ValueError, KeyError, TypeError):
        return APIError(reply.status_code, f"the worker answered HTTP {reply.status_code}")


def past_first_token(head: bytes) -> bool:
    """Whether `head` holds a whole SSE event past a chat stream's opening role chunk (which a replica sends as
    the request starts): a token, the usage, an error or the end."""
    for event in head.split(b"\n\n")[:-1]:
        try:
            data = json.loads(event.removeprefix(b"data:"))
        except ValueError:
            return True  # [DONE]
        deltas = [c.get("delta") for c in data.get("choices") or []] if isinstance(data, dict) else []
        if not deltas or any(d != {"role": "assistant", "content": ""} for d in deltas):
            return True
    return False


async def chained(head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield head
    async for chunk in rest:
        yield chunk


async def up_to_first_token(upstream: httpx.Response) -> tuple[bytes, AsyncIterator[bytes]]:
    """Read a worker's SSE stream up to its first token: (what came so far, the rest). Raises httpx.HTTPError or
    StopAsyncIteration when the stream breaks or ends before: then nothing of it has reached the client."""
    chunks, head = upstream.aiter_raw(), b""
    while not past_first_token(head):
        head += await anext(chunks)
    return head, chunks
