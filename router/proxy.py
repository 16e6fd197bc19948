"""Forwarding one request: pick a replica, send it, stream the answer back unbuffered.

A request moves to another replica only while nothing has been streamed to the client: when the chosen
one refuses the connection, answers 5xx, or answers 429 (its queue is full). After the first byte the
answer is the replica's: a replica that fails mid-stream ends the client's connection (an error the
client sees), never a silently truncated answer. The client's own errors (400, 401, 404, 413, 422) come
back from the replica as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvdrive.router.backends import Backend
from kvdrive.router.core import Router
from kvdrive.router.metrics import RouterMetrics
from kvdrive.router.selection import NoReplicaError

log = logging.getLogger("kvdrive.router")
T = TypeVar("T")
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


def error(status: int, message: str, kind: str = "server_error", headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status, "param": None}},
                        status_code=status, headers=dict(headers or {}))


def _headers(raw: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in raw.items() if k.lower() not in HOP_BY_HOP}


async def forward(router: Router, metrics: RouterMetrics, method: str, path_qs: str, headers: Mapping[str, str],
                  body: bytes, digests: dict[tuple[bytes, int], list[bytes]] | None, prompt_tokens: int,
                  gone: Callable[[], Awaitable[bool]], routed: bool = True) -> Response:
    """``routed``: a request with a prompt (its decision is counted); ``gone``: whether the client has left
    (checked while the replica has not answered yet: then the replica's request is cancelled too, so it
    frees the prompt's pages instead of computing for nobody)."""
    assert router.session is not None
    tried: set[str] = set()
    last: Response | None = None
    health = router.pool.health
    for _ in range(router.config.attempts):
        try:
            b, decision, mine = router.pick(digests, tried, prompt_tokens)
        except NoReplicaError:
            break
        if tried:
            metrics.retries += 1
        tried.add(b.url)
        sent = Sent(b, max(0, prompt_tokens - decision.matched_tokens), mine)
        sent.claim(router)  # its pages count on that replica from now, while it queues and computes them
        try:
            resp = await _until_gone(router.session.request(method, b.url + path_qs, headers=_headers(headers),
                                                            data=body), gone)
        except ClientGone:
            sent.release(router, learned=False)
            return Response(status_code=499)  # nobody is listening; nginx's code for it, for the access log
        except (TimeoutError, aiohttp.ClientError) as exc:
            sent.release(router, learned=False)
            b.failed(time.monotonic(), f"{type(exc).__name__}: {exc}", health)
            continue
        if resp.status >= 500 or resp.status == 429:
            payload = await resp.read()
            resp.release()
            sent.release(router, learned=False)
            if resp.status >= 500:
                b.failed(time.monotonic(), f"HTTP {resp.status}", health)
            last = Response(payload, status_code=resp.status, headers=_headers(resp.headers))
            continue
        b.succeeded()
        if routed:
            metrics.decided(decision.reason, decision.matched_tokens, prompt_tokens, decision.shared_tokens)
        relay = Relay(resp, sent, router)
        return StreamingResponse(relay.chunks(), status_code=resp.status, headers=_headers(resp.headers),
                                 background=BackgroundTask(relay.close))
    if last is not None:
        return last
    metrics.unavailable += 1
    return error(503, "no KVDrive replica can take this request now; retry later", headers={"Retry-After": "2"})


class ClientGone(Exception):
    pass


async def _until_gone(work: Awaitable[T], gone: Callable[[], Awaitable[bool]], every: float = 0.5) -> T:
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            if await gone():
                task.cancel()
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()


class Sent:
    """One attempt's claims on a replica while it is in flight: a request in its load, the prompt tokens it
    will compute in its pending prefill, and the prompt's pages pinned in the index (the replica cannot list
    them before it has computed them; a repeat meanwhile should still find them there)."""

    def __init__(self, backend: Backend, work: int, pages: list[bytes]) -> None:
        self.backend, self.work, self.pages = backend, work, pages

    def claim(self, router: Router) -> None:
        self.backend.in_flight += 1
        self.backend.pending_tokens += self.work
        router.index.pin(self.backend.url, self.pages)

    def release(self, router: Router, learned: bool) -> None:
        """``learned``: the replica took the prompt (its pages count as learned now); else they are dropped."""
        self.backend.in_flight -= 1
        self.backend.pending_tokens -= self.work
        router.index.unpin(self.backend.url, self.pages, time.monotonic(), learned)


class Relay:
    """One replica's answer passed through chunk by chunk. ``close`` is idempotent and runs both when the
    stream ends and after the response (a client that left before the first chunk never starts it)."""

    def __init__(self, resp: aiohttp.ClientResponse, sent: Sent, router: Router) -> None:
        self.resp, self.sent, self.router = resp, sent, router
        self.complete = self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.content.iter_any():
                yield chunk
            self.complete = True
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.sent.backend.failed(time.monotonic(), f"mid-stream: {type(exc).__name__}: {exc}",
                                     self.router.pool.health)
            raise
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.complete:
            self.resp.release()
        else:
            self.resp.close()  # the replica sees its client gone and stops the request
        self.sent.release(self.router, learned=self.resp.status == 200)
