"""The router as the Gateway API Inference Extension's endpoint picker, driven over a real gRPC connection
exactly as Envoy drives it (GIE proposal 004), in front of two real replicas of the demo model.

Narrated: ten documents, each asked once and then again with another question, are picked for the second
time on the replica whose own page list holds them (at least 9 of 10, the issue's acceptance), that replica
first in the ordered endpoint list and the other as its fallback, in the header and the ``envoy.lb``
metadata alike; the replica then reuses the pages. The gateway's subset hint limits the choice (none of it
ready: 503). A body is buffered across chunks and handed back unchanged in full-duplex mode, in chunks of at
most 62,000 bytes; in buffered mode the destination rides on the body's answer. Over-size bodies are 413,
unreadable ones 400, no ready replica 503, each an ``immediate_response`` with the router's JSON error. A
request claims its replica as the HTTP proxy does, the claim follows a fallback Envoy reports having served,
and it is released when the response ends or the stream breaks off. gRPC health follows the router's
readiness; ``kvdrive route --ext-proc-port`` serves all of it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from routerkit import API_KEY, Process, free_port, start_replica, start_router

from kvdrive.router.backends import host_port
from kvdrive.router.core import Router, RouterConfig
from kvdrive.router.discovery import StaticDiscovery
from kvdrive.router.extproc import ExtProcServer
from kvdrive.router.metrics import RouterMetrics
from kvdrive.router.prompt_reading import prompt_tokens

pytestmark = pytest.mark.slow
AUTH = {"authorization": f"Bearer {API_KEY}"}
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
Call = grpc.aio.StreamStreamCall  # type: ignore[type-arg]


def _doc(n: int) -> str:
    """A document of about 300 tokens, its own for every ``n``."""
    return " ".join(f"Log {n}-{i}: keeper {n} saw {i * 7 + n} ships and {(i + n) % 5} storms." for i in range(18))


def _completion(n: int, question: str) -> bytes:
    return json.dumps({"model": "demo", "prompt": f"{_doc(n)}\nQuestion: {question}", "max_tokens": 1,
                       "temperature": 0}).encode()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Process]]:
    tmp = tmp_path_factory.mktemp("extproc")
    started = [start_replica(tmp, "r0"), start_replica(tmp, "r1")]
    yield started
    for r in started:
        r.stop()


@dataclass
class Picker:
    router: Router
    stub: pb_grpc.ExternalProcessorStub
    health: health_pb2_grpc.HealthStub


async def _picker(urls: Sequence[str], max_body_bytes: int = 8 << 20) -> AsyncIterator[Picker]:
    router = Router(RouterConfig(api_key=API_KEY, poll_seconds=0.3, max_body_bytes=max_body_bytes),
                    StaticDiscovery(tuple(urls)))
    await router.start()
    server = ExtProcServer(router, "127.0.0.1", 0)
    await server.start(RouterMetrics(router))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        try:
            yield Picker(router, pb_grpc.ExternalProcessorStub(channel), health_pb2_grpc.HealthStub(channel))
        finally:
            await server.stop(0)
            await router.stop()


@pytest.fixture
async def picker(replicas: list[Process]) -> AsyncIterator[Picker]:
    async for p in _picker([r.url for r in replicas]):
        deadline = time.monotonic() + 60
        while not (p.router.ready() and len(p.router.pool.usable(time.monotonic())) == 2):
            assert time.monotonic() < deadline, "the router never reached both replicas"
            await asyncio.sleep(0.1)
        yield p


# --- Envoy's side of the stream -----------------------------------------------------------------------------
def _headers(pairs: dict[str, str], end_of_stream: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end_of_stream, headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def _metadata(namespace: str, values: dict[str, object]) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update(values)
    return base_pb2.Metadata(filter_metadata={namespace: s})


async def _send(stub: pb_grpc.ExternalProcessorStub, body: bytes | None, *, path: str = "/v1/completions",
                method: str = "POST", chunk: int = 4096, subset: object = None,
                extra: dict[str, str] | None = None) -> Call:
    """Opens a stream and sends a request's headers then its body in chunks, as Envoy does."""
    call = stub.Process()
    req = pb.ProcessingRequest(request_headers=_headers(
        {":method": method, ":path": path, ":authority": "gateway", "content-type": "application/json",
         **AUTH, **(extra or {})}, end_of_stream=body is None))
    if subset is not None:
        req.metadata_context.CopyFrom(_metadata("envoy.lb.subset_hint",
                                                {"x-gateway-destination-endpoint-subset": subset}))
    await call.write(req)
    if body is not None:
        pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
        for i, piece in enumerate(pieces):
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece,
                                                                           end_of_stream=i == len(pieces) - 1)))
    return call


async def _read_request_answers(call: Call, body: bool = True) -> list[pb.ProcessingResponse]:
    """The picker's answers to the request phases: up to the body's end handed back (to the headers' answer
    for a request without a body), or an error."""
    out = []
    while True:
        msg = await asyncio.wait_for(call.read(), 30)
        assert msg is not grpc.aio.EOF, f"the stream ended after {out}"
        out.append(msg)
        if msg.HasField("immediate_response") or (msg.HasField("request_headers") and not body):
            return out
        if msg.HasField("request_body") and msg.request_body.response.body_mutation.streamed_response.end_of_stream:
            return out


def _destination(answers: list[pb.ProcessingResponse]) -> list[str]:
    """The endpoint list the picker named; the header and the metadata must agree."""
    named = [a for a in answers if a.HasField("dynamic_metadata")]
    assert len(named) == 1, answers
    a = named[0]
    common = a.request_headers.response if a.HasField("request_headers") else a.request_body.response
    (option,) = common.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint" and option.header.value == ""  # raw_value only
    header = option.header.raw_value.decode()
    meta = a.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    assert header == meta and common.clear_route_cache
    return header.split(",")


def _handed_back(answers: list[pb.ProcessingResponse]) -> bytes:
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers if a.HasField("request_body")]
    assert all(len(c.body) <= 62_000 for c in chunks) and chunks[-1].end_of_stream
    assert not any(c.end_of_stream for c in chunks[:-1])
    return b"".join(c.body for c in chunks)


async def _respond(call: Call, status: int, body: bytes = b"{}", served: str | None = None) -> None:
    """Envoy's response phases: the replica's headers (and the endpoint that served), then its body."""
    req = pb.ProcessingRequest(response_headers=_headers({":status": str(status), "content-type": "application/json"}))
    if served is not None:
        req.metadata_context.CopyFrom(_metadata("envoy.lb", {"x-gateway-destination-endpoint-served": served}))
    await call.write(req)
    headers_answer = await asyncio.wait_for(call.read(), 30)
    assert headers_answer.HasField("response_headers") and not headers_answer.HasField("immediate_response")
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True)))
    body_answer = await asyncio.wait_for(call.read(), 30)
    echoed = body_answer.response_body.response.body_mutation.streamed_response
    assert echoed.body == body and echoed.end_of_stream  # full duplex: the response comes back unchanged
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF


async def _forward(endpoint: str, body: bytes) -> httpx.Response:
    """What Envoy does with the picked endpoint: send it the request."""
    async with httpx.AsyncClient(timeout=300) as client:
        return await client.post(f"http://{endpoint}/v1/completions", content=body,
                                 headers={**AUTH, "content-type": "application/json"})


async def _exchange(p: Picker, body: bytes, **kw: object) -> tuple[list[str], httpx.Response]:
    call = await _send(p.stub, body, **kw)  # type: ignore[arg-type]
    answers = await _read_request_answers(call)
    endpoints = _destination(answers)
    assert _handed_back(answers) == body
    resp = await _forward(endpoints[0], body)
    await _respond(call, resp.status_code, resp.content)
    return endpoints, resp


def _refusal(answers: list[pb.ProcessingResponse], status: int) -> dict[str, object]:
    (a,) = answers
    assert a.HasField("immediate_response") and a.immediate_response.status.code == status, a
    headers = {h.header.key: h.header.raw_value for h in a.immediate_response.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    err = json.loads(a.immediate_response.body)["error"]
    assert err["code"] == status and err["message"]
    return headers


def _in_flight(p: Picker) -> dict[str, int]:
    return {host_port(b.url): b.in_flight for b in p.router.pool.backends.values()}


# --- the tests ---------------------------------------------------------------------------------------------
async def test_repeated_documents_are_picked_on_the_replica_holding_their_pages(picker: Picker,
                                                                                replicas: list[Process]) -> None:
    p = picker
    endpoints = sorted(host_port(r.url) for r in replicas)
    assert p.router.tokenizer is not None
    hits, reused = 0, 0
    for n in range(10):
        first, resp = await _exchange(p, _completion(n, "How many ships?"))
        assert resp.status_code == 200, resp.text
        assert sorted(first) == endpoints  # the pick, then the other replica as its fallback

        # the replica that holds the document, by its own page list (not by what the router believes)
        prompt = prompt_tokens("completions", _completion(n, "How many storms?"), p.router.tokenizer)
        assert prompt is not None
        (digests,) = p.router.digests_for(*prompt).values()
        held = {}
        async with httpx.AsyncClient(timeout=30) as client:
            for r in replicas:
                listing = (await client.get(r.url + "/v1/kvdrive/prefixes", headers=AUTH)).content
                held[host_port(r.url)] = len(set(digests) & {listing[i : i + 16]
                                                               for i in range(0, len(listing), 16)})
        holder = max(held, key=lambda e: held[e])
        assert held[holder] >= 15 and min(held.values()) == 0, held  # ~18 pages of ~20, on one replica only

        again, resp = await _exchange(p, _completion(n, "How many storms?"))
        assert resp.status_code == 200, resp.text
        hits += again[0] == holder
        reused += resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 15 * 16
        assert sorted(again) == endpoints and again[1] != again[0]
    assert hits >= 9, hits
    assert reused >= 9, reused  # and the replica picked reused the pages
    assert _in_flight(p) == dict.fromkeys(endpoints, 0)  # every claim released at its response's end


async def test_the_subset_hint_limits_the_candidates(picker: Picker, replicas: list[Process]) -> None:
    p = picker
    body = _completion(100, "How many ships?")
    (holder, other), resp = await _exchange(p, body)
    assert resp.status_code == 200
    # the repeat would go to the holder; the gateway allows only the other one: it is the only endpoint
    for subset in ([other], other, f"10.9.9.9:80, {other}"):
        picked, resp = await _exchange(p, _completion(100, "How many storms?"), subset=subset)
        assert picked == [other] and resp.status_code == 200
    picked, _ = await _exchange(p, _completion(100, "Which keeper?"), subset=[holder, other])
    assert picked == [holder, other]
    # a subset naming no ready replica (or an empty one) is a 503, and nothing is claimed
    for subset in (["10.9.9.9:8000"], []):
        call = await _send(p.stub, _completion(100, "Why?"), subset=subset)
        headers = _refusal(await _read_request_answers(call), 503)
        assert headers["retry-after"] == b"2"
    assert set(_in_flight(p).values()) == {0}


async def test_the_claim_follows_the_served_fallback_and_ends_with_the_stream(picker: Picker) -> None:
    p = picker
    body = _completion(200, "How many ships?")
    call = await _send(p.stub, body)
    primary, fallback = _destination(await _read_request_answers(call))
    assert _in_flight(p) == {primary: 1, fallback: 0}  # claimed as the HTTP proxy claims it
    resp = await _forward(fallback, body)  # the gateway had to retry on the fallback
    await _respond(call, resp.status_code, resp.content, served=fallback)
    assert _in_flight(p) == {primary: 0, fallback: 0}
    # the fallback now holds the document (learned from the served response): the repeat goes there
    again, _ = await _exchange(p, _completion(200, "How many storms?"))
    assert again[0] == fallback

    # a stream that breaks off (the client left) releases its claim too
    call = await _send(p.stub, _completion(201, "How many ships?"))
    (picked, _) = _destination(await _read_request_answers(call))
    assert _in_flight(p)[picked] == 1
    call.cancel()
    deadline = time.monotonic() + 5
    while _in_flight(p)[picked] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _in_flight(p)[picked] == 0


async def test_bodies_in_many_chunks_come_back_unchanged_in_62000_byte_chunks(picker: Picker) -> None:
    body = json.dumps({"model": "demo", "prompt": _doc(300) * 400, "max_tokens": 1}).encode()  # ~360 KB
    assert len(body) > 5 * 62_000
    call = await _send(picker.stub, body, chunk=50_000)
    answers = await _read_request_answers(call)
    assert answers[0].HasField("request_headers")  # the headers are answered first, once the body has ended
    assert len(_destination(answers)) == 2 and _handed_back(answers) == body
    call.cancel()


async def test_buffered_mode_and_requests_without_a_body(picker: Picker) -> None:
    p = picker
    body = _completion(400, "How many ships?")
    # no body: picked by load at once (GET /v1/models)
    call = await _send(p.stub, None, path="/v1/models", method="GET")
    (a,) = await _read_request_answers(call, body=False)
    assert len(_destination([a])) == 2
    call.cancel()
    # buffered: Envoy waits for the headers' answer (a plain CONTINUE), then sends the whole body; the
    # destination rides on the body's answer, and the body is not touched
    call = p.stub.Process()
    await call.write(pb.ProcessingRequest(
        request_headers=_headers({":method": "POST", ":path": "/v1/completions", **AUTH}),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED)))
    first = await asyncio.wait_for(call.read(), 30)
    assert first.HasField("request_headers") and first.request_headers.response == pb.CommonResponse()
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    answer = await asyncio.wait_for(call.read(), 30)
    assert answer.HasField("request_body") and not answer.request_body.response.HasField("body_mutation")
    assert len(_destination([answer])) == 2
    call.cancel()


async def test_unreadable_and_oversize_bodies_are_refused(replicas: list[Process]) -> None:
    async for p in _picker([r.url for r in replicas], max_body_bytes=64 << 10):
        deadline = time.monotonic() + 60
        while not p.router.ready():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        for bad in (b"{not json", b'{"model": "demo"}', b'{"model": "demo", "prompt": "x", "max_tokens": -3}'):
            call = await _send(p.stub, bad)
            _refusal(await _read_request_answers(call), 400)
        call = await _send(p.stub, b'{"model": "demo", "prompt": "' + b"x" * (70 << 10) + b'"}', chunk=20 << 10)
        _refusal(await _read_request_answers(call), 413)
        call = await _send(p.stub, b"{}", extra={"content-length": str(65 << 10)})  # declared: refused at once
        _refusal(await _read_request_answers(call), 413)
        call = await _send(p.stub, _completion(500, "x"), chunk=60 << 10)  # under the limit: picked
        assert len(_destination(await _read_request_answers(call))) == 2
        call.cancel()
        r = health_pb2.HealthCheckResponse
        for service in ("", EXT_PROC, "readiness", "liveness"):
            assert (await p.health.Check(health_pb2.HealthCheckRequest(service=service))).status == r.SERVING
        assert (await p.health.Check(health_pb2.HealthCheckRequest(service="nope"))).status == r.SERVICE_UNKNOWN
        await asyncio.sleep(0.5)
        assert set(_in_flight(p).values()) == {0}


async def test_no_ready_replica_is_a_503_and_not_serving() -> None:
    async for p in _picker([f"http://127.0.0.1:{free_port()}"]):  # nothing listens there
        await asyncio.sleep(0.5)
        r = health_pb2.HealthCheckResponse
        for service in ("", EXT_PROC, "readiness"):
            assert (await p.health.Check(health_pb2.HealthCheckRequest(service=service))).status == r.NOT_SERVING
        assert (await p.health.Check(health_pb2.HealthCheckRequest(service="liveness"))).status == r.SERVING
        listed = await p.health.List(health_pb2.HealthListRequest())
        assert listed.statuses[EXT_PROC].status == r.NOT_SERVING
        call = await _send(p.stub, _completion(600, "x"))
        headers = _refusal(await _read_request_answers(call), 503)
        assert headers["retry-after"] == b"2"
        call = await _send(p.stub, None, path="/v1/models", method="GET")
        _refusal(await _read_request_answers(call, body=False), 503)


def test_kvdrive_route_serves_the_picker_on_its_ext_proc_port(replicas: list[Process], tmp_path: Path) -> None:
    port = free_port()
    router = start_router(tmp_path, [r.url for r in replicas], "--ext-proc-port", str(port))

    async def check() -> list[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=EXT_PROC))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            call = await _send(pb_grpc.ExternalProcessorStub(channel), _completion(700, "x"))
            endpoints = _destination(await _read_request_answers(call))
            call.cancel()
            return endpoints

    try:
        assert sorted(asyncio.run(check())) == sorted(host_port(r.url) for r in replicas)
    finally:
        router.stop()
