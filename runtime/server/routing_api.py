"""What a replica tells a router (``kvdrive route``) so it can send each prompt where its pages are.

- ``GET /v1/kvdrive/routing``: the chain root of this replica's page digests (model fingerprint, KV dtype,
  layout), the page size, the served model and an instance id that changes with every process start;
- ``GET /v1/kvdrive/tokenizer``: the tokenizer and chat template, so the router encodes prompts exactly
  as this replica does (``Tokenizer.spec``);
- ``GET /v1/kvdrive/prefixes``: the digests of every page this replica's tiers hold now, 16 raw bytes
  each (``application/octet-stream``), read between two engine steps.

With KV events on (``--kv-events-endpoint`` bound on a TCP port), the routing info names the ports, so a
router subscribes to the changes (``kvdrive.router.kv_event_feed``) and polls the prefix list only to start over.

They are under ``/v1``: the API key protects them like the rest of the API. What the router learns is a
hint: the runtime still checks every page it reuses, so a stale index costs a prefill, never a wrong token.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvdrive.runtime.prompt import Tokenizer

PREFIXES_MEDIA_TYPE = "application/octet-stream"


class KVEventsInfo(BaseModel):
    port: int = Field(description="TCP port of the replica's KV-event PUB socket (vLLM's kv_events wire)")
    replay_port: int | None = Field(default=None, description="TCP port of its replay (ROUTER) socket")
    topic: str = Field(default="", description="the topic its messages carry")


class RoutingInfoBody(BaseModel):
    model: str
    root: str = Field(description="hex digest that starts this replica's page-digest chain")
    page_size: int = Field(description="tokens per page")
    instance: str = Field(description="changes with every start of the process (its index starts over)")
    kv_events: KVEventsInfo | None = Field(default=None, description="where to subscribe to its KV events")


class TokenizerSpec(BaseModel):
    tokenizer: str = Field(description="the tokenizers library's JSON of this model's tokenizer")
    eos_token_ids: list[int]
    bos_token_id: int | None
    add_bos: bool
    chat_template: str | None


@dataclass(frozen=True)
class RoutingSource:
    model: str
    root: bytes
    page_size: int
    tokenizer: Tokenizer
    prefixes: Callable[[], Awaitable[list[bytes]]]  # digests of the pages held now
    kv_events: KVEventsInfo | None = None
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)


def routing_routes(source: RoutingSource, errors: dict[int | str, dict[str, object]]) -> APIRouter:
    api = APIRouter(prefix="/v1/kvdrive", tags=["routing"])
    spec = TokenizerSpec.model_validate(source.tokenizer.spec())

    @api.get("/routing", response_model=RoutingInfoBody, responses=errors)
    async def routing() -> RoutingInfoBody:
        return RoutingInfoBody(model=source.model, root=source.root.hex(), page_size=source.page_size,
                               instance=source.instance, kv_events=source.kv_events)

    @api.get("/tokenizer", response_model=TokenizerSpec, responses=errors)
    async def tokenizer() -> TokenizerSpec:
        return spec

    @api.get("/prefixes", response_class=Response, responses={
        **errors, 200: {"content": {PREFIXES_MEDIA_TYPE: {}}, "description": "16-byte page digests, concatenated"}})
    async def prefixes() -> Response:
        digests = await source.prefixes()
        return Response(b"".join(digests), media_type=PREFIXES_MEDIA_TYPE,
                        headers={"X-KVDrive-Root": source.root.hex(), "X-KVDrive-Instance": source.instance,
                                 "X-KVDrive-Pages": str(len(digests))})

    return api
