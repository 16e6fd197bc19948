"""The errors the HTTP edge answers with: ``ApiError`` (an OpenAI error body, its status, the field it names),
the body itself, and the error responses each route declares in the OpenAPI document."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from kvdrive.runtime.server import response_schemas as s


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = s.ErrorResponse(error=s.ErrorDetail(message=message, type=kind, code=status, param=param))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": s.ErrorResponse, "description": "malformed or invalid request (the message and param say what)"},
    401: {"model": s.ErrorResponse, "description": "missing or invalid Bearer credential"},
    413: {"model": s.ErrorResponse, "description": "request body over the limit"},
}
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    404: {"model": s.ErrorResponse, "description": "the model is not served here"},
    429: {"model": s.ErrorResponse, "description": "queue full; retry after Retry-After seconds"},
    503: {"model": s.ErrorResponse, "description": "the engine cannot serve the request"},
}
