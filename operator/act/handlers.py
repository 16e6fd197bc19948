"""The Kopf handlers: which cluster events lead to what, registered on a fresh registry (``build_registry``,
no module state).

Owns the wiring: the login, the startup settings (Kopf's bookkeeping in annotations), the resume/create/update
handlers and the resync timer that call ``Reconciler.reconcile``, the live loop as a daemon per CR
(``live``), the watches on the children and the pods that call for a reconcile (a change that is not one of
the operator's own applies, a router pod's readiness) or a status refresh, and the operator's own
``/metrics`` server (``opmetrics``) started and stopped with it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from kvdrive.operator.act.live import LiveController
from kvdrive.operator.act.objects import AUTOSCALER, CHILDREN, PODS, RECONCILER
from kvdrive.operator.act.reconciler import Reconciler
from kvdrive.operator.api.cr import GROUP, PLURAL, VERSION
from kvdrive.operator.clients.kubeclient import ApiError
from kvdrive.operator.clients.login import login
from kvdrive.operator.clients.opmetrics import MetricsServer, OperatorMetrics
from kvdrive.operator.render.childmeta import MANAGER, ROUTER_APP

MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
INSTANCE_LABEL = "app.kubernetes.io/instance"
NAME_LABEL = "app.kubernetes.io/name"


def last_written_by_us(obj: Mapping[str, Any]) -> bool:
    """True when the newest change to ``obj`` (status subresource left out) is one of the operator's own
    applies: its watch event needs no reconcile (the reconcile that wrote it is the one in flight)."""
    entries = [m for m in obj.get("metadata", {}).get("managedFields") or [] if not m.get("subresource")]
    if not entries:
        return False
    newest = max(str(m.get("time") or "") for m in entries)  # to the second: a tie counts as someone else's
    return all(m.get("manager") in (RECONCILER, AUTOSCALER) and m.get("operation") == "Apply"
               for m in entries if str(m.get("time") or "") == newest)


Connect = Callable[..., "kopf.ConnectionInfo | None | Any"]


def _post_event(cr: dict[str, Any], kind: str, reason: str, message: str) -> None:
    """The live loop's Events, posted by Kopf's event poster (it retries, and logs a failure)."""
    kopf.event(cr, type=kind, reason=reason, message=message)


def build_registry(connect: Connect = login, resync_seconds: float = 60.0,
                   metrics_address: str | None = None, metrics: OperatorMetrics | None = None) -> kopf.OperatorRegistry:
    """A fresh registry with every handler; ``connect`` is the login (tests log in to their own API server);
    ``metrics_address``: where the operator serves its own ``/metrics`` (``opmetrics.py``), None: nowhere."""
    registry = kopf.OperatorRegistry()
    metrics = metrics or OperatorMetrics()
    reconciler = Reconciler(metrics)
    live = LiveController(reconciler.session, metrics.counting(_post_event), metrics=metrics)
    server = MetricsServer(metrics, metrics_address) if metrics_address else None

    @kopf.on.login(registry=registry)
    async def log_in(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = connect(**kwargs)
        if inspect.isawaitable(info):
            info = await info
        if info is not None:
            await reconciler.connect(info)
        return info

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Kopf's bookkeeping in annotations only: the CRD's status schema has no status.kopf, so the
        # API server would prune it, and status belongs to the reconciler and the live loop
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        if server is not None:
            await server.start()

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if server is not None:
            await server.stop()
        await live.close()
        await reconciler.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    async def reconcile(namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        try:
            await reconciler.reconcile(namespace, name, logger)
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=10) from exc

    @kopf.timer(GROUP, VERSION, PLURAL, interval=resync_seconds, initial_delay=resync_seconds, registry=registry)
    async def resync(namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
        await reconciler.reconcile(namespace, name, logger)

    # The metrics loop: a daemon per CR rather than a fixed-interval timer, so that its period follows
    # spec.tuning.intervalSeconds when the spec changes. Async daemons are cancelled when the CR goes.
    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, id="live")
    async def live_loop(namespace: str, name: str, logger: logging.Logger, stopped: Any, **_: Any) -> None:
        try:
            while not stopped:
                try:
                    interval = await live.round(namespace, name, logger)
                except (ApiError, kopf.TemporaryError, OSError, TimeoutError) as exc:
                    logger.warning("live round failed: %s", exc)  # the API server is away: try again later
                    interval = 5.0
                await stopped.wait(interval)
        finally:
            live.forget(namespace, name)

    async def child_changed(type: str | None, body: Mapping[str, Any], logger: logging.Logger, **_: Any) -> None:
        instance = (body.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL)
        if instance and (type == "DELETED" or (type == "MODIFIED" and not last_written_by_us(body))):
            await reconciler.reconcile(body["metadata"]["namespace"], instance, logger)

    async def pod_changed(body: Mapping[str, Any], logger: logging.Logger, **_: Any) -> None:
        labels = body.get("metadata", {}).get("labels") or {}
        instance = labels.get(INSTANCE_LABEL)
        if instance and labels.get(NAME_LABEL) == ROUTER_APP:
            # a router pod's readiness may let the client Service move to the router
            await reconciler.reconcile(body["metadata"]["namespace"], instance, logger)
        elif instance:
            await reconciler.refresh_status(body["metadata"]["namespace"], instance, logger)

    for ref in CHILDREN.values():
        kopf.on.event(ref.api_version, ref.plural, labels=MANAGED, registry=registry, id="child")(child_changed)
    kopf.on.event(PODS.api_version, PODS.plural, labels=MANAGED, registry=registry, id="pod")(pod_changed)
    return registry
