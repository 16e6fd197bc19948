"""The router as the Gateway API Inference Extension's endpoint picker (EPP), over Envoy's ext_proc.

A gateway (Envoy) streams each request's headers and body to ``ExternalProcessor.Process`` and routes it to
the endpoint the picker names (GIE proposal 004). The picker is the same ``Router`` as the HTTP proxy (one
prefix index, one load count, one policy), so the prompt is read and placed exactly as ``kvdrive route``
places it: tokenized with the replicas' tokenizer (``prompt_reading.prompt_tokens``), digested per page and chosen by
``Router.pick``. Phase by phase:

- request headers: kept (path, authorization, content-length); the gateway's subset hint read. In
  ``FULL_DUPLEX_STREAMED`` mode (GIE's, and assumed when Envoy sends no ``protocol_config``) nothing is
  answered yet; in the other body modes the headers are answered at once (Envoy waits for it), and with no
  body coming (end of stream, or body mode ``NONE``) the replica is picked by load at once.
- request body: buffered up to ``max_body_bytes`` (413 past it). At its end the replica is picked, and
  the headers are answered with ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` (the pick, then
  fallbacks in the policy's order) set as a header and as ``envoy.lb`` dynamic metadata; in full-duplex mode
  the body is handed back unchanged in ``streamed_response`` chunks, in buffered mode the body's answer
  carries the destination. The picked replica is claimed as the proxy claims it (``proxy.Sent``): a request
  in its load, its prompt tokens pending, its pages pinned in the index.
- response headers, body, trailers: passed through (body chunks handed back in full-duplex mode). When
  Envoy reports a fallback served the request (``envoy.lb`` ``x-gateway-destination-endpoint-served``) the
  claim moves there. At the response's end, or when the stream ends early, the claim is released, the pages
  counted as learned on a 200, as the proxy does.

Errors end the request with an ``immediate_response`` carrying the router's JSON error: 503 while no
replica is ready (or none of the subset is), 413 for a body over the limit, 400 for a completions or chat
body that is not JSON or not a valid request. The router never sheds load itself (a full replica answers
429 and the gateway may retry a fallback), so the picker sends no 429 of its own.

The gRPC health service answers on the same port, as the reference picker does: ``liveness`` is SERVING
while the process answers; ``readiness``, ``""`` and the ext_proc service are SERVING once the router is
ready (a replica reachable, its tokenizer learned), NOT_SERVING before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdrive.router import extproc_wire as wire
from kvdrive.router.backends import host_port
from kvdrive.router.core import Router
from kvdrive.router.metrics import RouterMetrics
from kvdrive.router.prompt_reading import PROMPTED, bearer, prompt_tokens
from kvdrive.router.proxy import Sent
from kvdrive.router.selection import NoReplicaError

log = logging.getLogger("kvdrive.router")
SERVICE = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
READY_SERVICES = frozenset({"", "readiness", SERVICE})


class Refusal(Exception):
    """A request the picker answers itself (``immediate_response``) instead of naming an endpoint."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after = status, message, kind, retry_after

    def answer(self) -> pb.ProcessingResponse:
        return wire.refused(self.status, self.message, self.kind, self.retry_after)


@dataclass
class Choice:
    """One request's endpoints in order and the claim each would hold; ``held``: the one in force."""

    endpoints: list[str]
    claims: dict[str, Sent]
    held: Sent | None = None

    def move_to(self, endpoint: str, router: Router) -> bool:
        """Envoy served the request from this endpoint: the claim goes there (True when it moved)."""
        target = self.claims.get(endpoint)
        if target is None or target is self.held:
            return False
        if self.held is not None:
            self.held.release(router, learned=False)
        target.claim(router)
        self.held = target
        return True


class Picker:
    """Picks the replicas for one request with the router's own prompt reading and policy."""

    def __init__(self, router: Router, metrics: RouterMetrics) -> None:
        self.router, self.metrics = router, metrics

    def _outside(self, subset: list[str] | None) -> set[str]:
        """The replicas (by URL) the subset hint rules out: those whose ``ip:port``, or bare ip, it omits."""
        if subset is None:
            return set()
        allowed = set(subset)
        return {url for url in self.router.pool.backends if host_port(url) not in allowed
                and (urlsplit(url).hostname or "") not in allowed}

    def _unavailable(self, why: str) -> Refusal:
        self.metrics.unavailable += 1
        return Refusal(503, why, "server_error", retry_after=2)

    async def choose(self, method: str, path: str, headers: dict[str, str], body: bytes | None,
                     subset: list[str] | None) -> Choice:
        """The endpoints for this request, the first claimed; raises Refusal."""
        if not self.router.ready():
            raise self._unavailable("no KVDrive replica is ready; retry later")
        route = path.split("?", 1)[0].removeprefix("/v1/")
        prompted = method == "POST" and route in PROMPTED and body is not None
        prompt = None
        if prompted:
            tenant = bearer(headers.get("authorization")) if self.router.config.isolate_tenants else None
            prompt = await asyncio.to_thread(prompt_tokens, route, body or b"", self.router.tokenizer, tenant)
            if prompt is None:
                raise Refusal(400, _unreadable(body or b""))
        digests = self.router.digests_for(*prompt) if prompt is not None else None
        tokens = len(prompt[0]) if prompt is not None else 0
        exclude = self._outside(subset)
        claims: dict[str, Sent] = {}
        first = None
        for _ in range(self.router.config.attempts):  # the pick, then its fallbacks in the policy's order
            try:
                b, decision, mine = self.router.pick(digests, exclude, tokens)
            except NoReplicaError:
                break
            exclude.add(b.url)
            claims[host_port(b.url)] = Sent(b, max(0, tokens - decision.matched_tokens), mine)
            first = first or decision
        if first is None:
            raise self._unavailable("no KVDrive replica of the gateway's subset is ready" if subset is not None
                                    else "no KVDrive replica can take this request now; retry later")
        if prompted:
            self.metrics.decided(first.reason, first.matched_tokens, tokens, first.shared_tokens)
        choice = Choice(list(claims), claims)
        choice.move_to(choice.endpoints[0], self.router)
        return choice


def _unreadable(body: bytes) -> str:
    try:
        json.loads(body)
    except ValueError:
        return "the request body is not valid JSON"
    return "the request body is not a valid completions or chat request (a prompt or messages are required)"


@dataclass
class Exchange:
    """One HTTP request's ext_proc stream: what has arrived, what was picked, what is claimed."""

    picker: Picker
    request_duplex: bool = True  # FULL_DUPLEX_STREAMED: the picker hands the body back itself
    response_duplex: bool = True
    body_expected: bool = True  # False in request body mode NONE: Envoy sends no body
    method: str = "GET"
    path: str = "/"
    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    choice: Choice | None = None
    status: int | None = None
    released: bool = False

    async def handle(self, req: pb.ProcessingRequest) -> tuple[list[pb.ProcessingResponse], bool]:
        """The answers to one message of Envoy's, and whether the stream is over for the picker."""
        phase = req.WhichOneof("request")
        try:
            if phase == "request_headers":
                return await self._request_headers(req), False
            if phase == "request_body":
                return await self._request_body(req.request_body), False
            if phase == "request_trailers":
                return await self._request_trailers(), False
        except Refusal as refusal:
            log.info("ext_proc %s %s: %d %s", self.method, self.path, refusal.status, refusal.message)
            return [refusal.answer()], True
        if phase == "response_headers":
            return self._response_headers(req), req.response_headers.end_of_stream
        if phase == "response_body":
            chunk = req.response_body
            if chunk.end_of_stream:
                self.release()
            answers = (wire.streamed(chunk.body, chunk.end_of_stream, response=True) if self.response_duplex
                       else [wire.passed("response_body")])
            return answers, chunk.end_of_stream
        if phase == "response_trailers":
            self.release()
            return [wire.passed("response_trailers")], True
        return [], False

    async def _request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            config = req.protocol_config
            self.request_duplex = config.request_body_mode == wire.FULL_DUPLEX
            self.response_duplex = config.response_body_mode == wire.FULL_DUPLEX
            self.body_expected = config.request_body_mode != wire.NO_BODY
        self.headers = wire.headers_of(req.request_headers)
        self.method = self.headers.get(":method", "GET").upper()
        self.path = self.headers.get(":path", "/")
        self.subset = wire.subset_hint(req)
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.picker.router.config.max_body_bytes:
            raise self._too_large()
        if req.request_headers.end_of_stream or not self.body_expected:
            return [wire.picked_headers(await self._choose(None))]
        return [] if self.request_duplex else [wire.passed("request_headers")]

    async def _request_body(self, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.body += chunk.body
        if len(self.body) > self.picker.router.config.max_body_bytes:
            raise self._too_large()
        if not chunk.end_of_stream:
            return [] if self.request_duplex else [wire.passed("request_body")]
        endpoints = await self._choose(bytes(self.body))
        if self.request_duplex:
            return [wire.picked_headers(endpoints), *wire.streamed(bytes(self.body), True)]
        return [wire.picked_body(endpoints)]

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        """Trailers end a body that never said end of stream: pick on it now (full duplex)."""
        answers = []
        if self.request_duplex and self.choice is None:
            endpoints = await self._choose(bytes(self.body))
            answers = [wire.picked_headers(endpoints), *wire.streamed(bytes(self.body), False)]
        return [*answers, wire.passed("request_trailers")]

    async def _choose(self, body: bytes | None) -> list[str]:
        self.choice = await self.picker.choose(self.method, self.path, self.headers, body, self.subset)
        return self.choice.endpoints

    def _too_large(self) -> Refusal:
        return Refusal(413, f"request body over {self.picker.router.config.max_body_bytes} bytes")

    def _response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        headers = wire.headers_of(req.response_headers)
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else None
        router = self.picker.router
        served = wire.served_endpoint(req)
        if self.choice is not None and served is not None and self.choice.move_to(served, router):
            self.picker.metrics.retries += 1
        held = self.choice.held if self.choice is not None else None
        if held is not None and self.status is not None:  # the replica's health, as the proxy counts it
            if self.status >= 500:
                held.backend.failed(time.monotonic(), f"HTTP {self.status}", router.pool.health)
            elif self.status != 429:
                held.backend.succeeded()
        if req.response_headers.end_of_stream:
            self.release()
        return [wire.passed("response_headers")]

    def release(self) -> None:
        """The request is over (or its stream ended): the claim goes, its pages learned on a 200."""
        if self.released or self.choice is None or self.choice.held is None:
            return
        self.released = True
        self.choice.held.release(self.picker.router, learned=self.status == 200)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one stream per HTTP request."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for req in request_iterator:
                answers, over = await exchange.handle(req)
                for answer in answers:
                    yield answer
                if over:
                    return
        finally:
            exchange.release()


class PickerHealth(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` for the gateway's and the kubelet's probes."""

    def __init__(self, router: Router, watch_seconds: float = 1.0) -> None:
        self.router, self.watch_seconds = router, watch_seconds

    def status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
        r = health_pb2.HealthCheckResponse
        if service == "liveness":
            return r.SERVING
        if service not in READY_SERVICES:
            return r.SERVICE_UNKNOWN
        return r.SERVING if self.router.ready() else r.NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse],
                    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=self.status(request.service))

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext[health_pb2.HealthListRequest, health_pb2.HealthListResponse],
                   ) -> health_pb2.HealthListResponse:
        names = sorted(READY_SERVICES | {"liveness"})
        return health_pb2.HealthListResponse(
            statuses={n: health_pb2.HealthCheckResponse(status=self.status(n)) for n in names})

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse],
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            now = self.status(request.service)
            if now != last:
                yield health_pb2.HealthCheckResponse(status=now)
                last = now
            await asyncio.sleep(self.watch_seconds)


class ExtProcServer:
    """The picker's gRPC listener (ext_proc and health on one port), run on the router's event loop."""

    def __init__(self, router: Router, host: str, port: int) -> None:
        self.router, self.host, self.port = router, host, port
        self._server: grpc.aio.Server | None = None

    async def start(self, metrics: RouterMetrics) -> None:
        """Listen (``port`` 0: any free port; ``self.port`` is the bound one after)."""
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(Picker(self.router, metrics)), server)
        health_pb2_grpc.add_HealthServicer_to_server(PickerHealth(self.router), server)
        bound = server.add_insecure_port(f"{self.host}:{self.port}")
        await server.start()
        self._server, self.port = server, bound
        log.info("endpoint picker (Envoy ext_proc) on %s:%d", self.host, bound)

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
