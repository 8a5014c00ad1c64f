"""The `/v1/responses` routes: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, and
``GET /v1/responses/{id}/input_items``.

The tenant of a request is its bearer token and its cache salt: ``cache_salt`` in the body (POST), the
``X-Cache-Salt`` header, or the ``cache_salt`` query parameter (GET, DELETE); given twice, they must agree.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sage_infer.server.openai_errors import APIError
from sage_infer.server.responses.handlers import ResponsesHandlers, tenant_of
from sage_infer.server.responses.protocol import ResponsesRequest

MAX_SALT = 256


def salt_of(request: Request, body_salt: str | None = None) -> str | None:
    """The request's cache salt, wherever it was given (a 400 when two places disagree)."""
    given = {s for s in (body_salt, request.headers.get("x-cache-salt"), request.query_params.get("cache_salt"))
             if s is not None}
    if len(given) > 1:
        raise APIError(400, "cache_salt: the body, the X-Cache-Salt header and the query name different salts",
                       "cache_salt")
    salt = next(iter(given), None)
    if salt is not None and len(salt) > MAX_SALT:
        raise APIError(400, f"cache_salt: at most {MAX_SALT} characters", "cache_salt")
    return salt


def add_responses_routes(app: FastAPI, responses: ResponsesHandlers, authorize: Callable[[Request], None],
                         accepting: Callable[[], None], body_of) -> None:

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        authorize(request)
        accepting()
        body = await body_of(request, ResponsesRequest)
        body.cache_salt = salt_of(request, body.cache_salt)
        return await responses.create(body, tenant_of(request.headers.get("authorization", ""), body.cache_salt))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
        authorize(request)
        if request.query_params.get("stream") in ("true", "1"):
            raise APIError(400, "stream: replaying a stored response as a stream is not supported", "stream")
        return responses.retrieve(response_id, tenant_of(request.headers.get("authorization", ""),
                                                         salt_of(request)))

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> JSONResponse:
        authorize(request)
        query = {name: value for name, value in request.query_params.items() if name != "cache_salt"}
        return responses.input_items(response_id, tenant_of(request.headers.get("authorization", ""),
                                                            salt_of(request)), query)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        authorize(request)
        return responses.delete(response_id, tenant_of(request.headers.get("authorization", ""), salt_of(request)))
