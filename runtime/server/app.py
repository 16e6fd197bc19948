"""The FastAPI application: OpenAI-compatible completions and chat, models, health, metrics, admin.

Every user error is a 4xx with an OpenAI-style ``{"error": {...}}`` body naming what is wrong, with
the OpenAI API's status codes: 400 for a request that is malformed or invalid (bad JSON, a wrong type,
a value out of range, an unsupported field), 401 without the credential (the gate, before the body is
read), 404 for a model not served, 413 for a body over the limit, 429 when the queue is full; 503
when the engine cannot serve. Nothing a client sends can produce a 5xx or stop the engine thread.
The OpenAPI document declares exactly these.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvdrive.runtime.engine import AsyncEngine, PromptTooLongError, QueueFullError, SamplingParams
from kvdrive.runtime.engine import Request as EngineRequest
from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.prompt.tokenizer import TokenizerError
from kvdrive.runtime.server import schemas as s
from kvdrive.runtime.server.errors import ApiError
from kvdrive.runtime.server.fanout import Fanout
from kvdrive.runtime.server.gate import Gate, GatePolicy
from kvdrive.runtime.server.logprobs import LogprobRenderer
from kvdrive.runtime.server.metrics import ServerMetrics
from kvdrive.runtime.server.prompts import chat_prompt, completion_prompt
from kvdrive.runtime.server.routing_api import RoutingSource, routing_routes
from kvdrive.runtime.server.streaming import collect, stream

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was aborted."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled the moment the client disconnects (its request is then aborted in the engine,
    freeing its slot and pages at the next step). Starlette notices a disconnect by itself only while it
    streams a response; this covers the wait before that: a prefill, or a whole non-streamed answer."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    admin_token: str | None = None
    protect_metadata: bool = False
    max_body_bytes: int = 8 << 20
    default_chat_max_tokens: int = 512
    retry_after_seconds: int = 2
    sse_keepalive_seconds: float = 5.0  # a stream sends an SSE comment line when no token came for this long


@dataclass(frozen=True)
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    tokenizer: Tokenizer
    max_context: int
    request_limit: Callable[[], int]
    metrics: ServerMetrics
    tiers: Callable[[], list[s.TierUsageBody]]
    split: Callable[[], s.EnvelopeSplitBody]
    set_tiers: Callable[[s.TiersUpdate], Awaitable[None]]
    ready: Callable[[], bool]
    started: int
    health: Callable[[], dict[str, str]] = dict  # degraded tier -> why
    routing: RoutingSource | None = None  # what a router learns from this replica (``routing_api``)


def _error(status: int, message: str, kind: str, param: str | None = None,
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
    app.add_middleware(Gate, policy=GatePolicy(api_key=cfg.api_key, admin_token=cfg.admin_token,
                                               protect_metadata=cfg.protect_metadata,
                                               max_body_bytes=cfg.max_body_bytes))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed (nginx's "client closed")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))  # 405: Allow

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
    if state.routing is not None:
        app.include_router(routing_routes(state.routing, {401: ERRORS[401]}))

    def check_model(name: str) -> None:
        if name not in (cfg.model_id, *cfg.aliases):
            raise ApiError(404, f"model {name!r} is not served here (served: {cfg.model_id})", "not_found_error",
                           "model")

    def sampling(body: s._SamplingFields, max_tokens: int | None, prompt_len: int,
                 logprobs: int | None) -> SamplingParams:
        room = state.max_context - prompt_len
        wanted = max_tokens if max_tokens is not None else cfg.default_chat_max_tokens
        vocab = state.tokenizer.vocab_size
        for name, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]),
                          ("stop_token_ids", body.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{name}: token ids must be in [0, {vocab}); got {bad[:5]}", param=name)
        max_tokens = max(1, min(wanted, room))
        if body.min_tokens is not None and body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds the tokens this request may generate "
                                f"({max_tokens})", param="min_tokens")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                              top_p=body.top_p, top_k=max(0, body.top_k), seed=body.seed,
                              stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0,
                              repetition_penalty=body.repetition_penalty or 1.0,
                              logit_bias=tuple((int(k), v) for k, v in (body.logit_bias or {}).items()),
                              min_tokens=body.min_tokens or 0, stop_token_ids=tuple(body.stop_token_ids or ()),
                              logprobs=logprobs)

    def check_length(prompt_len: int, max_tokens: int | None) -> None:
        if prompt_len + 1 > state.max_context:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {state.max_context} "
                                f"tokens (prompt + at least one generated token)", param="prompt")
        if max_tokens is not None and prompt_len + max_tokens > state.max_context:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                                f"context of {state.max_context} tokens", param="max_tokens")

    async def run(prompt_ids: list[int], params: SamplingParams, salt: str | None) -> AsyncIterator[object]:
        request = EngineRequest(uuid.uuid4().hex, tuple(prompt_ids), params, time.perf_counter(), cache_salt=salt)
        arrived, last = request.arrival, None
        try:
            async for out in state.engine.generate(request):
                now = time.perf_counter()
                if out.new_token_ids:
                    if last is None:
                        state.metrics.ttft.observe(now - arrived)
                    else:
                        state.metrics.itl.observe(now - last)
                    last = now
                if out.error:
                    raise ApiError(503, out.error, "server_error")
                yield out
        except QueueFullError as exc:
            raise ApiError(429, f"server busy: {exc}; retry later", "rate_limit_error",
                           headers={"Retry-After": str(cfg.retry_after_seconds)}) from exc
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), param="prompt") from exc

    def samples(prompt_ids: list[int], params: SamplingParams, salt: str | None, n: int) -> Fanout:
        """The ``n`` choices of one prompt (``fanout.py``: the prompt computed once); with a seed, choice i
        samples with seed + i, so the whole answer repeats."""
        def start(i: int) -> AsyncIterator[object]:
            seeded = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**63)
            return run(prompt_ids, seeded, salt)
        return Fanout(start, n)  # type: ignore[arg-type]

    @app.get("/healthz", responses={503: GENERATION_ERRORS[503]})
    async def healthz() -> dict[str, str]:
        if not state.engine.alive:
            raise ApiError(503, "engine thread is not running", "server_error")
        return {"status": "ok"}

    @app.get("/readyz", responses={503: GENERATION_ERRORS[503]})
    async def readyz() -> s.Readiness:
        # a degraded tier (a failing SSD) keeps the pod ready: pages it cannot serve are recomputed, answers
        # stay correct; it is reported here and in kvdrive_tier_degraded for alerts, not hidden from service
        if not state.ready():
            raise ApiError(503, "not ready: model or KV tiers unavailable", "server_error")
        degraded = state.health()
        return s.Readiness(status="degraded" if degraded else "ready", degraded=degraded)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format 0.0.4"},
        401: ERRORS[401]})
    async def metrics() -> Response:
        # rendered on a worker thread: reading the tiers' usage can wait for the store's lock, and the event
        # loop must keep streaming tokens to clients meanwhile (the router scrapes every replica each second)
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=s.ModelList, responses={401: ERRORS[401]})
    async def models() -> s.ModelList:
        # max_model_len: what one request can hold now (the model's context, or less when the KV tiers
        # as configured hold less per request)
        return s.ModelList(data=[s.ModelCard(id=cfg.model_id, created=state.started,
                                             max_model_len=state.request_limit())])

    @app.post("/v1/completions", response_model=s.CompletionResponse, responses=GENERATION_ERRORS)
    async def completions(body: s.CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        try:
            prompt_ids = completion_prompt(body, state.tokenizer)
        except TokenizerError as exc:
            raise ApiError(400, f"prompt: {exc}", param="prompt") from exc
        if isinstance(body.prompt, list) and any(t < 0 or t >= state.tokenizer.vocab_size for t in prompt_ids):
            raise ApiError(400, f"prompt: token ids must be in [0, {state.tokenizer.vocab_size})", param="prompt")
        check_length(len(prompt_ids), body.max_tokens)
        params = sampling(body, body.max_tokens, len(prompt_ids), body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""
        render = (lambda: LogprobRenderer(state.tokenizer, chat=False)) if body.logprobs is not None else None
        outputs = samples(prompt_ids, params, body.cache_salt, body.n)
        if body.stream:
            return await until_disconnect(request, stream(
                rid, outputs, chat=False, model=cfg.model_id,
                include_usage=bool(body.stream_options and body.stream_options.include_usage), prefix=prefix,
                keepalive_s=cfg.sse_keepalive_seconds, render=render))
        done = await until_disconnect(request, collect(outputs, render))
        return JSONResponse(s.CompletionResponse(id=rid, model=cfg.model_id, usage=done.usage, choices=[
            s.CompletionChoice(index=i, text=prefix + c.text, finish_reason=c.finish_reason, logprobs=c.logprobs)
            for i, c in enumerate(done.choices)]).model_dump())

    @app.post("/v1/chat/completions", response_model=s.ChatCompletionResponse, responses=GENERATION_ERRORS)
    async def chat(body: s.ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        try:
            prompt_ids = chat_prompt(body, state.tokenizer)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        max_tokens = body.max_completion_tokens or (body.max_tokens if "max_tokens" in body.model_fields_set else None)
        check_length(len(prompt_ids), max_tokens)
        params = sampling(body, max_tokens, len(prompt_ids), (body.top_logprobs or 0) if body.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        render = (lambda: LogprobRenderer(state.tokenizer, chat=True)) if body.logprobs else None
        outputs = samples(prompt_ids, params, body.cache_salt, body.n)
        if body.stream:
            return await until_disconnect(request, stream(
                rid, outputs, chat=True, model=cfg.model_id,
                include_usage=bool(body.stream_options and body.stream_options.include_usage),
                keepalive_s=cfg.sse_keepalive_seconds, render=render))
        done = await until_disconnect(request, collect(outputs, render))
        return JSONResponse(s.ChatCompletionResponse(id=rid, model=cfg.model_id, usage=done.usage, choices=[
            s.ChatChoice(index=i, message=s.ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                         logprobs=c.logprobs) for i, c in enumerate(done.choices)]).model_dump())

    @app.get("/admin/tiers", response_model=s.TiersResponse, responses={401: ERRORS[401]})
    async def get_tiers() -> s.TiersResponse:
        return s.TiersResponse(tiers=state.tiers(), split=state.split())

    @app.put("/admin/tiers", response_model=s.TiersResponse, responses={
        **ERRORS, 422: {"model": s.ErrorResponse, "description": "impossible budgets (the reason)"}})
    async def put_tiers(body: s.TiersUpdate) -> s.TiersResponse:
        try:
            await state.set_tiers(body)
        except ValueError as exc:  # BudgetError: nothing changed (or, it says, only what it names)
            raise ApiError(422, f"budgets not applied: {exc}", param="tiers") from exc
        log.info("tiers set via admin API: %s", body.model_dump(exclude_none=True))
        return s.TiersResponse(tiers=state.tiers(), split=state.split())

    return app
