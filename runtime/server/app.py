"""The FastAPI application: OpenAI-compatible completions and chat, models, health, metrics, admin.

Every user error is a 4xx with an OpenAI-style ``{"error": {...}}`` body naming what is wrong, with
the OpenAI API's status codes: 400 for a request that is malformed or invalid (bad JSON, a wrong type,
a value out of range, an unsupported field), 401 without the credential (the gate, before the body is
read), 404 for a model not served, 413 for a body over the limit, 429 when the queue is full; 503
when the engine cannot serve. Nothing a client sends can produce a 5xx or stop the engine thread.
The OpenAPI document declares exactly these.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvdrive.runtime.server.disconnect import ClientGone
from kvdrive.runtime.server.errors import ERRORS, ApiError, error_response
from kvdrive.runtime.server.gate import Gate, GatePolicy
from kvdrive.runtime.server.openai_api import openai_routes
from kvdrive.runtime.server.ops_api import ops_routes
from kvdrive.runtime.server.routing_api import routing_routes
from kvdrive.runtime.server.state import ServerState
from kvdrive.runtime.server.tokenize_api import tokenize_routes


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem as (message, param); a body that is not JSON names no param."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "missing" and not where:
        return "a JSON request body is required", None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where or None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="KVDrive", version="0.1.0",
                  description="OpenAI-compatible LLM serving with a three-tier (GPU/DRAM/SSD) KV cache")
    cfg = state.config
    app.add_middleware(Gate, policy=GatePolicy(api_keys=cfg.api_keys, admin_token=cfg.admin_token,
                                               protect_metadata=cfg.protect_metadata,
                                               max_body_bytes=cfg.max_body_bytes))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed (nginx's "client closed")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))  # 405: Allow

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with its generic 422 replaced by the 400 this server answers."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in doc.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if "HTTPValidationError" in json.dumps(responses.get("422", {})):
                        del responses["422"]
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.include_router(ops_routes(state))
    app.include_router(openai_routes(state))
    app.include_router(tokenize_routes(state))
    if state.routing is not None:
        app.include_router(routing_routes(state.routing, {401: ERRORS[401]}))
    return app
