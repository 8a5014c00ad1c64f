"""OpenAI-style error bodies: ``{"error": {"message", "type", "code"}}``. No tracebacks."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def check_bearer(authorization: str, api_key: str | None) -> None:
    """Raise a 401 `APIError` unless the ``Authorization`` header carries `api_key` (None: no key needed)."""
    if api_key is None:
        return
    token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
    if not token or not secrets.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)")


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def openai_errors(app, log) -> None:
    """Make every error `app` answers OpenAI-style JSON: an `APIError`, a request FastAPI's own validation refused, an
    unknown path or method, and an unexpected failure (a 500 with no internals; the traceback goes to `log`)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

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
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        # the client gets no traceback; the operator does
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        return error_response(500, "internal server error")

