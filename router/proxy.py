"""Forwarding one request: pick a replica, send it, stream the answer back unbuffered.

A request moves to another replica only while nothing has been streamed to the client: when the chosen
one refuses the connection, answers 5xx, or answers 429 (its queue is full). After the first byte the
answer is the replica's: a replica that fails mid-stream ends the client's connection (an error the
client sees), never a silently truncated answer. The client's own errors (400, 401, 404, 413, 422) come
back from the replica as they are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvdrive.router.backends import Backend
from kvdrive.router.core import Router
from kvdrive.router.metrics import RouterMetrics
from kvdrive.router.selection import NoReplicaError

log = logging.getLogger("kvdrive.router")
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


def error(status: int, message: str, kind: str = "server_error", headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status, "param": None}},
                        status_code=status, headers=dict(headers or {}))


def _headers(raw: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in raw.items() if k.lower() not in HOP_BY_HOP}


async def forward(router: Router, metrics: RouterMetrics, method: str, path_qs: str, headers: Mapping[str, str],
                  body: bytes, digests: dict[tuple[bytes, int], list[bytes]] | None, prompt_tokens: int) -> Response:
    assert router.session is not None
    tried: set[str] = set()
    last: Response | None = None
    health = router.pool.health
    for _ in range(router.config.attempts):
        try:
            b, decision, mine = router.pick(digests, tried)
        except NoReplicaError:
            break
        if tried:
            metrics.retries += 1
        tried.add(b.url)
        b.in_flight += 1
        try:
            resp = await router.session.request(method, b.url + path_qs, headers=_headers(headers), data=body)
        except (TimeoutError, aiohttp.ClientError) as exc:
            b.in_flight -= 1
            b.failed(time.monotonic(), f"{type(exc).__name__}: {exc}", health)
            continue
        if resp.status >= 500 or resp.status == 429:
            payload = await resp.read()
            resp.release()
            b.in_flight -= 1
            if resp.status >= 500:
                b.failed(time.monotonic(), f"HTTP {resp.status}", health)
            last = Response(payload, status_code=resp.status, headers=_headers(resp.headers))
            continue
        b.succeeded()
        metrics.decided(decision.reason, decision.matched_tokens, prompt_tokens)
        if resp.status == 200 and mine:
            router.index.learn(b.url, mine, time.monotonic())  # its pages once the prompt is in
        return StreamingResponse(_relay(resp, b, router), status_code=resp.status, headers=_headers(resp.headers))
    if last is not None:
        return last
    metrics.unavailable += 1
    return error(503, "no KVDrive replica can take this request now; retry later", headers={"Retry-After": "2"})


async def _relay(resp: aiohttp.ClientResponse, b: Backend, router: Router) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    except (TimeoutError, aiohttp.ClientError) as exc:
        b.failed(time.monotonic(), f"mid-stream: {type(exc).__name__}: {exc}", router.pool.health)
        raise
    finally:
        resp.release()
        b.in_flight -= 1
