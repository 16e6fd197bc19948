"""The HTTP gate in front of every route (pure ASGI): who may call what, and how large a body may be,
decided before any route code runs or any body is parsed.

- ``/v1/*`` and vLLM's tokenizer routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``) need an API key
  (``--api-key-file``: one, or one per tenant; the caller's is left in ``request.state.api_key``), ``/admin/*``
  the admin token (``--admin-token-file``).
- ``/metrics``, ``/openapi.json``, ``/docs`` and ``/redoc`` are open by default, so that Prometheus and
  humans can read them without a credential (``/metrics`` names the SSD tier's path in its ``backing``
  label); ``--protect-metadata`` puts them behind the API key too. ``/healthz``, ``/readyz`` and vLLM's
  ``/health`` are always open: kubelet probes and load generators' checks carry no token.
- The ``Bearer`` scheme is matched case-insensitively (RFC 7235).
- A body over the limit is refused with 413, from its ``Content-Length`` before reading it, or while
  reading a chunked one; it is buffered (at most the limit) and replayed to the route.
Refusals have the OpenAI error shape, like every other error of the server.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvdrive.runtime.protocol.secret_files import ApiKey

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
METADATA_PATHS = ("/metrics", "/openapi.json", "/docs", "/redoc")
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


@dataclass(frozen=True)
class GatePolicy:
    api_keys: tuple[ApiKey, ...] = ()  # any of them opens the API (one per tenant); none: open access
    admin_token: str | None = None
    protect_metadata: bool = False
    max_body_bytes: int = 8 << 20


def bearer_key(expected: tuple[str, ...], authorization: str | None) -> int | None:
    """Which of ``expected`` a ``Bearer`` credential is (its index), compared in constant time with each;
    None when it is none of them."""
    scheme, _, credential = (authorization or "").strip().partition(" ")
    given = credential.strip().encode()
    found = None
    for i, secret in enumerate(expected):
        if hmac.compare_digest(given, secret.encode()) and scheme.lower() == "bearer":
            found = i
    return found


def _needed(policy: GatePolicy, path: str) -> tuple[tuple[str, ...], str] | None:
    """(the secrets that open it, what they are) for a path, None when it is open."""
    if path.startswith("/admin/") or path == "/admin":
        return ((policy.admin_token,) if policy.admin_token else ()), "admin token"
    if path.startswith("/v1/") or path in TOKENIZER_PATHS or (policy.protect_metadata and path.startswith(METADATA_PATHS)):
        return tuple(k.key for k in policy.api_keys), "API key"
    return None


async def _refuse(send: Send, status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status, "param": None}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware applying one ``GatePolicy``."""

    def __init__(self, app: ASGIApp, policy: GatePolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        needed = _needed(self.policy, scope["path"])
        if needed is not None and needed[0]:
            which = bearer_key(needed[0], headers.get("authorization"))
            if which is None:
                await _refuse(send, 401, f"missing or invalid {needed[1]} (Authorization: Bearer <{needed[1]}>)",
                              "authentication_error", {"WWW-Authenticate": "Bearer"})
                return
            if needed[1] == "API key":  # the routes read the caller's key (its tenant) from request.state
                scope.setdefault("state", {})["api_key"] = self.policy.api_keys[which]
        limit = self.policy.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await _refuse(send, 400, f"invalid Content-Length {length!r}", "invalid_request_error")
                return
            if int(length) > limit:
                await _refuse(send, 413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes",
                              "invalid_request_error")
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, 413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when the client leaves

        await self.app(scope, replay, send)
