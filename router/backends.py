"""The replicas behind the router and what it knows of each: ready or out, load, errors, routing info.

A replica is *out* after ``fail_after`` consecutive failures (a refused connection, a 5xx, a failed poll)
and stays out for ``retry_seconds``, doubling on each failed retry up to ``max_retry_seconds``; a poll or
a request that succeeds brings it back. Replicas come and go with discovery (``--backend`` or the
EndpointSlices of a Service); one that leaves takes its index entries with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvdrive.router")


def host_port(url: str, port: int | None = None) -> str:
    """A replica's address as ``host:port`` (``[v6]:port``): its base URL's port, or ``port`` on its host."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if port is None:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class EventSource:
    """Where a replica publishes KV events (``kv_events`` of its routing info)."""

    port: int
    replay_port: int | None
    topic: str

    @classmethod
    def of(cls, raw: Any) -> EventSource | None:
        """From the routing info's ``kv_events`` object; None when it names none."""
        if not isinstance(raw, dict):
            return None
        replay = raw.get("replay_port")
        return cls(int(raw["port"]), None if replay is None else int(replay), str(raw.get("topic", "")))


@dataclass(frozen=True)
class RoutingInfo:
    """What a replica reports at ``/v1/kvdrive/routing``."""

    model: str
    root: bytes
    page_size: int
    instance: str
    kv_events: EventSource | None = None  # where it publishes KV events, if it does


@dataclass(frozen=True)
class Health:
    fail_after: int = 2
    retry_seconds: float = 2.0
    max_retry_seconds: float = 30.0


class Backend:
    """One replica's state in this router (mutated from the event loop only)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0  # requests this router has sent it and not finished
        self.running = 0  # its running batch and its queue, from its /metrics (kvdrive_requests_running and
        self.waiting = 0  # kvdrive_requests_waiting): what other routers and direct clients sent it too
        self.pending_tokens = 0  # prompt tokens to compute of the requests in flight (as routed: uncached)
        self.info: RoutingInfo | None = None
        self.failures = 0  # consecutive
        self.errors = 0  # total
        self.out_until = 0.0
        self.backoff = 0.0

    @property
    def load(self) -> int:
        """Requests it is running or queueing: this router's own count, or the replica's last report when
        that is higher (other routers, direct clients). Never the sum: each request would count twice."""
        return max(self.in_flight, self.running + self.waiting)

    def usable(self, now: float) -> bool:
        return self.info is not None and now >= self.out_until

    def failed(self, now: float, why: str, health: Health) -> bool:
        """Count a failure; True when it takes the replica out (or keeps it out, after a retry)."""
        self.failures += 1
        self.errors += 1
        if self.failures < health.fail_after:
            return False
        self.backoff = min(health.max_retry_seconds, self.backoff * 2 if self.backoff else health.retry_seconds)
        if now >= self.out_until:
            log.warning("replica %s taken out for %.0f s: %s", self.url, self.backoff, why)
        self.out_until = now + self.backoff
        return True

    def succeeded(self) -> None:
        if self.failures >= 1 and self.out_until:
            log.info("replica %s is back", self.url)
        self.failures = 0
        self.backoff = 0.0
        self.out_until = 0.0


class BackendPool:
    def __init__(self, health: Health | None = None) -> None:
        self.health = health or Health()
        self.backends: dict[str, Backend] = {}

    def set_urls(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """The replicas discovery sees now; returns (added, removed)."""
        want = dict.fromkeys(u.rstrip("/") for u in urls)
        removed = [u for u in self.backends if u not in want]
        added = [u for u in want if u not in self.backends]
        for u in removed:
            del self.backends[u]
            log.info("replica %s left", u)
        for u in added:
            self.backends[u] = Backend(u)
            log.info("replica %s joined", u)
        return added, removed

    def usable(self, now: float) -> list[Backend]:
        return [b for b in self.backends.values() if b.usable(now)]
