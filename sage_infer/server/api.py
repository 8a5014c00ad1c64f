"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models,
/health, /metrics, /version."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sage_infer import __version__
from sage_infer.config.responses import ResponsesConfig
from sage_infer.interfaces.backend import InferenceBackend
from sage_infer.server.body import parse_body
from sage_infer.server.chat_answer import ChatFeatures
from sage_infer.server.handlers import OpenAIHandlers
from sage_infer.server.kv_events import event_stream
from sage_infer.server.metrics import ServerMetrics
from sage_infer.server.openai_errors import APIError, check_bearer, error_response, openai_errors
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest, KVMatchRequest, KVSendRequest
from sage_infer.server.responses.handlers import ResponsesHandlers
from sage_infer.server.responses.routes import add_responses_routes

MAX_BODY_BYTES = 4 * 1024 * 1024


# bodies above this are scanned and parsed off the event loop, so other streams keep flowing
PARSE_IN_THREAD_BYTES = 64 * 1024

log = logging.getLogger("sage_infer.server")


def build_app(backend: InferenceBackend, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, allowed_peers: Sequence[str] = (),
              responses: ResponsesConfig | None = None, responses_dir: str | None = None,
              chat_features: ChatFeatures | None = None) -> FastAPI:
    """The app over `backend`; it uses nothing of the backend beyond `InferenceBackend` (and, for stored
    responses' KV, its optional `retain_kv`). `responses_dir`: where stored responses persist (None: memory)."""
    # the schema is served below, behind the key; the P/D routes between workers are not in it
    app = FastAPI(title="sage_infer", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    model = backend.model_info()
    model_name = model.name
    metrics = ServerMetrics(backend, model_name)
    backend.on_finished(metrics.record_finished)
    handlers = OpenAIHandlers(backend, metrics, api_key, allowed_peers, chat_features)
    app.state.backend, app.state.metrics, app.state.accepting = backend, metrics, True
    app.state.closing = False  # set when a shutdown begins: long-lived streams (KV events) end then
    app.state.handlers = handlers  # `cut_off` when a shutdown's drain runs out (server/launch.py)

    async def body_of(request: Request, schema):
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > max_body_bytes:
                raise APIError(413, f"request body over {max_body_bytes} bytes")
        if len(raw) > PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(parse_body, bytes(raw), schema)
        return parse_body(bytes(raw), schema)

    def authorize(request: Request) -> None:
        check_bearer(request.headers.get("authorization", ""), api_key)

    def accepting() -> None:
        if not app.state.accepting:
            raise APIError(503, "the server is shutting down")

    openai_errors(app, log)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        """The OpenAPI schema of the client routes; it needs the key when one is set, like every route but
        /health, /version and /metrics."""
        authorize(request)
        return JSONResponse(app.openapi())

    _operator_routes(app, backend, metrics)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "sage_infer",
                "max_model_len": model.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        accepting()
        body = await body_of(request, CompletionRequest)
        return await handlers.completions(body, f"cmpl-{uuid.uuid4().hex}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        accepting()
        body = await body_of(request, ChatCompletionRequest)
        return await handlers.chat(body, f"chatcmpl-{uuid.uuid4().hex}")

    app.state.responses = ResponsesHandlers(handlers, responses or ResponsesConfig(), responses_dir)
    add_responses_routes(app, app.state.responses, authorize, accepting, body_of)
    _kv_routes(app, backend, handlers, authorize, body_of)

    return app


def _kv_routes(app: FastAPI, backend: InferenceBackend, handlers: OpenAIHandlers, authorize, body_of) -> None:
    """The routes other sage processes call (not in the OpenAI schema): P/D transfers, and what a KV-aware router
    asks of this instance's cache."""

    @app.post("/v1/kv/send", include_in_schema=False)
    async def kv_send(request: Request) -> JSONResponse:
        """Prefill role: send a held request's KV to a decode instance (called by that instance)."""
        authorize(request)
        body = await body_of(request, KVSendRequest)
        return JSONResponse(await handlers.pd.send(body))

    @app.post("/v1/kv/match", include_in_schema=False)
    async def kv_match(request: Request) -> JSONResponse:
        """How much of a prompt is cached here (asked by a KV-aware router); records nothing."""
        authorize(request)
        body = await body_of(request, KVMatchRequest)
        return JSONResponse(handlers.pd.match(body, handlers.validator))

    @app.post("/v1/kv/hashes", include_in_schema=False)
    async def kv_hashes(request: Request) -> JSONResponse:
        """A prompt's block hashes, as /v1/kv/events names them (a KV-aware router's question)."""
        authorize(request)
        body = await body_of(request, KVMatchRequest)
        return JSONResponse(handlers.pd.hashes(body, handlers.validator))

    @app.get("/v1/kv/events", include_in_schema=False)
    async def kv_events(request: Request) -> JSONResponse:
        """Block hashes the prefix cache stored and removed since event ``since`` (prefill workers).

        The query is read by hand: declaring ``since: int`` as a FastAPI parameter made KV transfers
        through this server several times slower (bench/pd.py, found by bisection; the mechanism
        inside FastAPI was not traced)."""
        authorize(request)
        raw = request.query_params.get("since", "0")
        if not raw.lstrip("-").isdigit() or len(raw) > 20:  # an event number fits in 64 bits
            raise APIError(400, f"since must be an integer, got {raw!r}", "since")
        return JSONResponse(handlers.pd.events(int(raw)))

    @app.get("/v1/kv/events/stream", include_in_schema=False)
    async def kv_event_stream(request: Request) -> StreamingResponse:
        """Every tier's block events and this instance's load, pushed as they happen (`server.kv_events`)."""
        authorize(request)
        if getattr(backend, "kv_events_read", lambda _: None)(-1) is None:
            raise APIError(404, "this instance does not publish KV events (prefix caching off, or a decode worker)")
        return StreamingResponse(event_stream(backend, lambda: app.state.closing), media_type="application/x-ndjson")


def _operator_routes(app: FastAPI, backend: InferenceBackend, metrics: ServerMetrics) -> None:
    """/health, /version and /metrics: open without the key, for supervisors and scrapers."""

    @app.get("/health")
    async def health() -> Response:
        health = backend.health()
        if not health.ok:
            return error_response(503, health.reason or "the engine stopped")
        if health.degraded:  # still serving: what is down costs recompute, not requests
            return JSONResponse({"status": "degraded", "degraded": health.degraded})
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    extra_registries = getattr(backend, "metrics_registries", lambda: [])()  # e.g. the KV pipe's transport

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = generate_latest(metrics.registry) + b"".join(generate_latest(r) for r in extra_registries)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
