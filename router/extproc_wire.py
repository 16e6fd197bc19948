"""The endpoint picker's wire format: reading Envoy's ext_proc messages and building the picker's answers.

Only what GIE proposal 004 ("endpoint picker protocol") and Envoy's ext_proc API fix, with no routing in it:
the request's headers and subset hint, the answer that names the picked endpoints (a header mutation and
the same string in dynamic metadata), the body handed back in ``streamed_response`` chunks (full-duplex
mode), pass-through answers, and the ``immediate_response`` that ends a request with an error.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict

SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # the gateway's filter metadata that restricts the candidates
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"  # the picker's dynamic metadata, and Envoy's report of the served endpoint
DESTINATION_KEY = "x-gateway-destination-endpoint"  # also the request header the picker sets
SERVED_KEY = "x-gateway-destination-endpoint-served"
CHUNK_BYTES = 62_000  # a streamed body chunk handed back (some Envoy builds cap them at 64 KiB)
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE


def headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    """Header names lower-cased; a value from ``raw_value`` (what Envoy sends) or ``value``; repeats joined."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def _namespace(request: pb.ProcessingRequest, name: str) -> dict[str, object] | None:
    if not request.HasField("metadata_context") or name not in request.metadata_context.filter_metadata:
        return None
    return MessageToDict(request.metadata_context.filter_metadata[name])


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway lets the picker choose from (``ip:port``, or a bare ip: any of its ports);
    None when it set no hint (every endpoint is a candidate). A list, or one comma-separated string (what a
    header-to-metadata filter writes), as the reference picker accepts both."""
    hint = _namespace(request, SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint:
        return None
    raw = hint[SUBSET_KEY]
    items = raw if isinstance(raw, list) else [raw]
    return [e.strip() for item in items if isinstance(item, str) for e in item.split(",") if e.strip()]


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint Envoy reports as having served the response (it may be a fallback of the list)."""
    lb = _namespace(request, DESTINATION_NAMESPACE)
    served = lb.get(SERVED_KEY) if lb is not None else None
    return served if isinstance(served, str) and served else None


def _destination(endpoints: Sequence[str]) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    value = ",".join(endpoints)
    mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_KEY, raw_value=value.encode()))])  # raw_value only: Envoy
    metadata = struct_pb2.Struct()  # answers 500 when ``value`` is set too
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: value}})
    return pb.CommonResponse(header_mutation=mutation, clear_route_cache=True), metadata


def picked_headers(endpoints: Sequence[str]) -> pb.ProcessingResponse:
    """The request-headers answer naming the endpoints, the first preferred, the rest fallbacks in order."""
    common, metadata = _destination(endpoints)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)


def picked_body(endpoints: Sequence[str]) -> pb.ProcessingResponse:
    """The same, on the answer to a buffered body (the headers were answered before the body came)."""
    common, metadata = _destination(endpoints)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def streamed(body: bytes, end_of_stream: bool, response: bool = False) -> list[pb.ProcessingResponse]:
    """A body handed back unchanged in full-duplex mode (Envoy forwards only what the picker returns), in
    chunks of at most ``CHUNK_BYTES``; ``end_of_stream`` on the last. ``response``: the response's body."""
    pieces = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        chunk = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1))
        answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=chunk))
        out.append(pb.ProcessingResponse(response_body=answer) if response else
                   pb.ProcessingResponse(request_body=answer))
    return out


def passed(phase: str) -> pb.ProcessingResponse:
    """CONTINUE, nothing changed, for ``phase`` (a ProcessingRequest/ProcessingResponse oneof field name)."""
    if phase in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{phase: pb.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{phase: pb.BodyResponse()})
    return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})


def refused(status: int, message: str, kind: str = "server_error",
            retry_after: int | None = None) -> pb.ProcessingResponse:
    """An ``immediate_response``: Envoy answers the client with this and sends the request nowhere. The body
    is the router's own JSON error, as its HTTP proxy writes it."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status, "param": None}}).encode()
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                      raw_value=b"application/json"))]
    if retry_after is not None:
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="retry-after", raw_value=str(retry_after).encode())))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers),  # type: ignore[arg-type]
        body=body, details=message))
