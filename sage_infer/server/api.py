"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, /version."""

from __future__ import annotations

import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sage_infer import __version__
from sage_infer.server.async_engine import AsyncEngine
from sage_infer.server.errors import APIError, error_response
from sage_infer.server.handlers import OpenAIHandlers
from sage_infer.server.metrics import ServerMetrics
from sage_infer.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_BODY_BYTES = 4 * 1024 * 1024


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="sage_infer", version=__version__, docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine, model_name)
    engine.on_finished = metrics.record_finished
    handlers = OpenAIHandlers(engine, model_name, metrics)
    app.state.engine, app.state.metrics, app.state.accepting = engine, metrics, True

    async def body_of(request: Request, schema):
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > max_body_bytes:
                raise APIError(413, f"request body over {max_body_bytes} bytes")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"request body is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            message = first["msg"].removeprefix("Value error, ")
            raise APIError(400, f"{field}: {message}" if field else message, field) from None

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not token or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)")

    def accepting() -> None:
        if not app.state.accepting:
            raise APIError(503, "the server is shutting down")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(400, str(err.errors()[0].get("msg", "invalid request")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"internal error ({type(err).__name__})")

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return error_response(503, "the engine stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "sage_infer",
                "max_model_len": engine.engine.max_model_len}
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

    return app
