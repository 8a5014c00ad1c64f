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
