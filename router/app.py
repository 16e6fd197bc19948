"""The router's HTTP face: the OpenAI endpoints proxied (``/v1/*``), ``/healthz``, ``/readyz``, ``/metrics``.

Completions and chat requests are read (at most ``max_body_bytes``: 413 past it, as the runtime does),
tokenized off the event loop with the replicas' tokenizer (``prompt_reading.py``) and turned into page
digests; everything else under ``/v1`` goes to the least loaded replica. A body the router cannot read is still
forwarded: the replica answers it with its own 4xx, so the router adds no error contract of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvdrive.router.core import Router
from kvdrive.router.metrics import RouterMetrics
from kvdrive.router.prompt_reading import PROMPTED, bearer, prompt_tokens
from kvdrive.router.proxy import error, forward


class BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


class Listener(Protocol):
    """Another face of the same router, started on its event loop after it (the ext_proc endpoint picker)."""

    async def start(self, metrics: RouterMetrics) -> None: ...

    async def stop(self) -> None: ...


def create_app(router: Router, listeners: Sequence[Listener] = ()) -> FastAPI:
    metrics = RouterMetrics(router)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        started: list[Listener] = []
        try:
            for listener in listeners:
                await listener.start(metrics)
                started.append(listener)
            yield
        finally:
            for listener in reversed(started):
                await listener.stop()
            await router.stop()

    app = FastAPI(title="KVDrive router", version="0.1.0", lifespan=lifespan,
                  description="Prefix-aware routing of OpenAI-compatible requests across KVDrive replicas")
    app.state.metrics = metrics

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        usable = len(router.pool.usable(time.monotonic()))
        if not router.ready():
            why = "no replica reachable yet" if not usable else "tokenizer not learned yet"
            return error(503, f"not ready: {why} ({len(router.pool.backends)} replicas known)")
        return Response(json.dumps({"status": "ready", "replicas": usable}), media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def proxy(path: str, request: Request) -> Response:
        try:
            body = await _read_body(request, router.config.max_body_bytes)
        except BodyTooLarge:
            return error(413, f"request body over {router.config.max_body_bytes} bytes", "invalid_request_error")
        prompt = None
        if request.method == "POST" and path in PROMPTED:
            tenant = bearer(request.headers.get("authorization")) if router.config.isolate_tenants else None
            prompt = await asyncio.to_thread(prompt_tokens, path, body, router.tokenizer, tenant)
        tokens = prompt[0] if prompt is not None else None
        digests = router.digests_for(*prompt) if prompt is not None else None
        qs = f"?{request.url.query}" if request.url.query else ""
        return await forward(router, metrics, request.method, f"/v1/{path}{qs}", request.headers, body, digests,
                             len(tokens) if tokens is not None else 0, request.is_disconnected,
                             routed=request.method == "POST" and path in PROMPTED)

    return app
