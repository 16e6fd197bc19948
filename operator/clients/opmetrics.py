"""The operator's own Prometheus metrics and the HTTP endpoint that serves them (``--metrics``).

- ``kvdrive_operator_reconciles_total{result}`` and ``kvdrive_operator_reconcile_seconds{result}``: every
  reconcile of a CR, by how it ended: ``ok``, the reason of the problem it reported in the CR's status
  (``InvalidSpec``, ``ChildConflict``, ...), or ``error`` (an exception: the API server away);
- ``kvdrive_operator_decisions_total{reason}``: the live loop's tuning and autoscaling decisions, by the
  reason of the Event it posted on the CR (``ConcurrencyChanged``, ``ScaledUp``, ``ScaleConflict``, ...);
- ``kvdrive_operator_pod_scrape_failures_total{namespace,pod}``: reads of a runtime pod's ``/metrics`` that
  failed (its load is then unknown: it blocks scaling down); a pod's series goes when the pod does.

One ``OperatorMetrics`` per operator (``handlers.build_registry``), on a registry of its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlparse

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

PostEvent = Callable[[dict[str, Any], str, str, str], None]


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter("kvdrive_operator_reconciles", "reconciles of a KVDriveDeployment, by how they "
                                  "ended: ok, the problem reported in its status, or error", ["result"],
                                  registry=self.registry)
        self.reconcile_seconds = Histogram("kvdrive_operator_reconcile_seconds", "time one reconcile took",
                                           ["result"], registry=self.registry,
                                           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.decisions = Counter("kvdrive_operator_decisions", "tuning and autoscaling decisions of the live loop, "
                                 "by the reason of the Event posted on the CR", ["reason"], registry=self.registry)
        self.scrape_failures = Counter("kvdrive_operator_pod_scrape_failures", "failed reads of a runtime pod's "
                                       "/metrics", ["namespace", "pod"], registry=self.registry)

    @asynccontextmanager
    async def reconcile(self) -> AsyncIterator[list[str]]:
        """Times one reconcile; the caller puts its result in the yielded list (``error`` if it raises)."""
        result: list[str] = []
        start = time.perf_counter()
        try:
            yield result
        except BaseException:
            result[:] = ["error"]
            raise
        finally:
            outcome = result[0] if result else "ok"
            self.reconciles.labels(outcome).inc()
            self.reconcile_seconds.labels(outcome).observe(time.perf_counter() - start)

    def counting(self, post_event: PostEvent) -> PostEvent:
        """``post_event`` that also counts each decision by its reason."""
        def post(cr: dict[str, Any], kind: str, reason: str, message: str) -> None:
            self.decisions.labels(reason).inc()
            post_event(cr, kind, reason, message)
        return post

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``GET /metrics`` on ``address`` (``http://HOST:PORT/metrics``), beside Kopf's liveness endpoint."""

    def __init__(self, metrics: OperatorMetrics, address: str) -> None:
        url = urlparse(address)
        self.host, self.port, self.path = url.hostname or "0.0.0.0", url.port or 8081, url.path or "/metrics"
        self._metrics = metrics
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def serve(_: web.Request) -> web.Response:
            return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get(self.path, serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
