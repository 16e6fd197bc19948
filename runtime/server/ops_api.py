"""The operations routes: liveness and readiness, Prometheus metrics, and the live tier budgets
(``/admin/tiers``, which the operator's tuner drives). ``/health`` is vLLM's liveness route (200 and an empty
body), which load generators such as guidellm check before they start."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from kvdrive.runtime.server import admin_schemas as a
from kvdrive.runtime.server.errors import ERRORS, GENERATION_ERRORS, ApiError
from kvdrive.runtime.server.response_schemas import ErrorResponse
from kvdrive.runtime.server.state import ServerState

log = logging.getLogger(__name__)


def ops_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    def check_alive() -> None:
        if not state.engine.alive:
            raise ApiError(503, "engine thread is not running", "server_error")

    @router.get("/healthz", responses={503: GENERATION_ERRORS[503]})
    async def healthz() -> dict[str, str]:
        check_alive()
        return {"status": "ok"}

    @router.get("/health", responses={200: {"description": "the engine runs (vLLM's liveness route)"},
                                       503: GENERATION_ERRORS[503]})
    async def health() -> Response:
        check_alive()
        return Response(status_code=200)

    @router.get("/readyz", responses={503: GENERATION_ERRORS[503]})
    async def readyz() -> a.Readiness:
        # a degraded tier (a failing SSD) keeps the pod ready: pages it cannot serve are recomputed, answers
        # stay correct; it is reported here and in kvdrive_tier_degraded for alerts, not hidden from service
        if not state.ready():
            raise ApiError(503, "not ready: model or KV tiers unavailable", "server_error")
        degraded = state.health()
        return a.Readiness(status="degraded" if degraded else "ready", degraded=degraded)

    @router.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format 0.0.4"},
        401: ERRORS[401]})
    async def metrics() -> Response:
        # rendered on a worker thread: reading the tiers' usage can wait for the store's lock, and the event
        # loop must keep streaming tokens to clients meanwhile (the router scrapes every replica each second)
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/admin/tiers", response_model=a.TiersResponse, responses={401: ERRORS[401]})
    async def get_tiers() -> a.TiersResponse:
        return a.TiersResponse(tiers=state.tiers(), split=state.split())

    @router.put("/admin/tiers", response_model=a.TiersResponse, responses={
        **ERRORS, 422: {"model": ErrorResponse, "description": "impossible budgets (the reason)"}})
    async def put_tiers(body: a.TiersUpdate) -> a.TiersResponse:
        try:
            await state.set_tiers(body)
        except ValueError as exc:  # BudgetError: nothing changed (or, it says, only what it names)
            raise ApiError(422, f"budgets not applied: {exc}", param="tiers") from exc
        log.info("tiers set via admin API: %s", body.model_dump(exclude_none=True))
        return a.TiersResponse(tiers=state.tiers(), split=state.split())

    return router
