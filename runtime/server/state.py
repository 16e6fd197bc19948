"""What the HTTP routes are given: the server's settings and its handles on the engine, tiers and metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvdrive.runtime.engine import AsyncEngine
from kvdrive.runtime.prompt import Tokenizer
from kvdrive.runtime.protocol.secret_files import ApiKey
from kvdrive.runtime.server.admin_schemas import EnvelopeSplitBody, TiersUpdate, TierUsageBody
from kvdrive.runtime.server.kv_event_publisher import KVEventPublisher
from kvdrive.runtime.server.metrics import ServerMetrics
from kvdrive.runtime.server.routing_api import RoutingSource


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    aliases: tuple[str, ...] = ()
    api_keys: tuple[ApiKey, ...] = ()  # any opens the API (one per tenant); none: open access
    isolate_tenants: bool = False  # each key's requests share prefix pages only among themselves
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
    tiers: Callable[[], list[TierUsageBody]]
    split: Callable[[], EnvelopeSplitBody]
    set_tiers: Callable[[TiersUpdate], Awaitable[None]]
    ready: Callable[[], bool]
    started: int
    health: Callable[[], dict[str, str]] = dict  # degraded tier -> why
    routing: RoutingSource | None = None  # what a router learns from this replica (``routing_api``)
    kv_events: KVEventPublisher | None = None  # its KV-event publisher (``serve`` starts and closes it)
