"""Kopf handlers: the only place that reacts to the cluster and writes to it.

Owns reconciliation of ``KVDriveDeployment`` objects: pre-flight checks of what the schema
cannot see (the StorageClass, the model's PersistentVolumeClaim, children owned by someone
else), then create-or-repair of the children from ``manifests`` and the status from
``conditions``. Everything is idempotent; a CR, a child or a pod event all lead to the same
``Reconciler.reconcile``. ``build_registry`` returns a fresh registry (no module state).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from kvdrive.operator.conditions import (
    Observed,
    Problem,
    build_status,
    degraded_changed,
    now_rfc3339,
    status_differs,
)
from kvdrive.operator.kubeapi import ApiError, KubeApi, Ref
from kvdrive.operator.live import LiveController
from kvdrive.operator.manifests import MANAGER, Names, admin_token_of, render, selector_labels
from kvdrive.operator.objects import CHILDREN, CLAIMS, CR, PODS, STATEFULSETS, STORAGE_CLASSES, pod_ready
from kvdrive.operator.spec import GROUP, PLURAL, VERSION, KVDriveDeployment, SpecError, parse_cr

__all__ = ["CHILDREN", "CLAIMS", "CR", "PODS", "STATEFULSETS", "STORAGE_CLASSES", "Reconciler", "build_registry"]
# StatefulSet spec fields an update may change; the others need the object re-created.
STS_MUTABLE = ("replicas", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy", "minReadySeconds")
MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
INSTANCE_LABEL = "app.kubernetes.io/instance"


def is_subset(desired: Any, actual: Any) -> bool:
    """True when ``actual`` holds everything of ``desired`` (servers add defaults, never remove)."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(k in actual and is_subset(v, actual[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return desired == actual or (isinstance(actual, str) and str(desired) == actual)


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _current_problem(status: Mapping[str, Any]) -> Problem | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Degraded" and condition.get("status") == "True":
            return Problem(str(condition.get("reason", "Degraded")), str(condition.get("message", "")))
    return None


class Reconciler:
    """Reconciles CRs through one API session; one lock per CR serializes its reconciles."""

    def __init__(self) -> None:
        self.api: KubeApi | None = None
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def connect(self, info: kopf.ConnectionInfo) -> None:
        old, self.api = self.api, KubeApi(info)
        if old is not None:
            await old.close()

    async def close(self) -> None:
        if self.api is not None:
            await self.api.close()
            self.api = None

    def _api(self) -> KubeApi:
        if self.api is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
        return self.api

    def session(self) -> KubeApi | None:
        """The API session once Kopf has logged in (None before)."""
        return self.api

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def reconcile(self, namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Bring the children and the status of one CR in line with its spec."""
        async with self._lock(namespace, name):
            cr = await self._api().get(CR, namespace, name)
            if cr is None or cr.get("metadata", {}).get("deletionTimestamp"):
                return  # gone or going: owner references let the garbage collector take the children
            problem, model = None, None
            try:
                model = parse_cr({**cr, "metadata": {**cr["metadata"], "namespace": namespace}})
            except SpecError as exc:
                problem = Problem("InvalidSpec", "; ".join(exc.problems))
            if model is not None:
                problem = await self._preflight(model) or await self._apply(model, logger)
            await self._write_status(cr, problem, logger)

    async def refresh_status(self, namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Recompute only the status (pods changed); a Degraded CR stays Degraded."""
        async with self._lock(namespace, name):
            cr = await self._api().get(CR, namespace, name)
            if cr is None or cr.get("metadata", {}).get("deletionTimestamp"):
                return
            await self._write_status(cr, _current_problem(cr.get("status") or {}), logger)

    async def _preflight(self, model: KVDriveDeployment) -> Problem | None:
        """What the schema cannot check; nothing is created while any of it fails."""
        api, spec, namespace = self._api(), model.spec, model.metadata.namespace
        storage_class = spec.tiers.ssd.storage_class_name
        found = await api.get(STORAGE_CLASSES, None, storage_class)
        if found is None:
            return Problem(
                "StorageClassNotFound",
                f"spec.tiers.ssd.storageClassName: StorageClass {storage_class!r} does not exist",
            )
        if spec.model.source.startswith("pvc://"):
            claim = spec.model.source.removeprefix("pvc://").split("/", 1)[0]
            if await api.get(CLAIMS, namespace, claim) is None:
                return Problem(
                    "ModelClaimNotFound",
                    f"spec.model.source: PersistentVolumeClaim {claim!r} does not exist in namespace {namespace!r}",
                )
        for child in render(model, admin_token="-"):
            kind, child_name = child["kind"], child["metadata"]["name"]
            existing = await api.get(CHILDREN[kind], namespace, child_name)
            owner = None if existing is None else _controller_uid(existing)
            if owner is not None and owner != model.metadata.uid:
                return Problem("ChildConflict", f"{kind} {child_name!r} is controlled by another owner ({owner})")
        return None

    async def _apply(
        self, model: KVDriveDeployment, logger: logging.Logger | logging.LoggerAdapter
    ) -> Problem | None:
        api, namespace, names = self._api(), model.metadata.namespace, Names(model.metadata.name)
        existing_sts = await api.get(STATEFULSETS, namespace, names.statefulset)
        current = (existing_sts or {}).get("spec", {}).get("replicas")
        secret = await api.get(CHILDREN["Secret"], namespace, names.secret)
        token = admin_token_of(secret) or secrets.token_urlsafe(32)
        for child in render(model, token, current):
            ref, child_name = CHILDREN[child["kind"]], child["metadata"]["name"]
            actual = existing_sts if child["kind"] == "StatefulSet" else await api.get(ref, namespace, child_name)
            if actual is None:
                logger.info("creating %s %s", child["kind"], child_name)
                await _create(api, ref, namespace, child)
            elif child["kind"] == "Secret":
                if admin_token_of(actual) is None or not is_subset(child["metadata"], actual["metadata"]):
                    await api.patch(ref, namespace, child_name, child)
            elif child["kind"] == "StatefulSet":
                await _apply_statefulset(api, namespace, child, actual, logger)
            elif not is_subset(child, actual):
                logger.info("repairing %s %s", child["kind"], child_name)
                await api.patch(ref, namespace, child_name, child)
        return None

    async def _write_status(
        self, cr: Mapping[str, Any], problem: Problem | None, logger: logging.Logger | logging.LoggerAdapter
    ) -> None:
        api, meta = self._api(), cr["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        sts = await api.get(STATEFULSETS, namespace, Names(name).statefulset)
        pods = await api.list(PODS, namespace, selector_labels(name))
        observed = Observed(
            generation=meta.get("generation"),
            replicas=int((sts or {}).get("spec", {}).get("replicas") or 0),
            ready=sum(1 for pod in pods if pod_ready(pod)),
        )
        port = int(cr.get("spec", {}).get("service", {}).get("port") or 8000)
        previous = cr.get("status") or {}
        status = build_status(
            name=name, namespace=namespace, port=port, observed=observed, problem=problem, previous=previous,
            now=now_rfc3339(),
        )
        if degraded_changed(previous, problem):
            assert problem is not None
            logger.warning("degraded: %s", problem.message)
            kopf.event(dict(cr), type="Warning", reason=problem.reason, message=problem.message)
        if status_differs(previous, status):
            await api.patch(CR, namespace, name, {"status": status}, subresource="status")


async def _create(api: KubeApi, ref: Ref, namespace: str, body: dict[str, Any]) -> None:
    try:
        await api.create(ref, namespace, body)
    except ApiError as exc:
        if exc.status != 409:  # created meanwhile: the next reconcile compares it
            raise


async def _apply_statefulset(
    api: KubeApi,
    namespace: str,
    desired: dict[str, Any],
    actual: Mapping[str, Any],
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    name = desired["metadata"]["name"]
    immutable = {k: v for k, v in desired["spec"].items() if k not in STS_MUTABLE}
    if not is_subset(immutable, actual.get("spec", {})):
        # selector, claim templates, service name: only a new object can change them. Orphan
        # the pods so that they keep serving until the new StatefulSet rolls them.
        logger.warning("re-creating StatefulSet %s: a field that cannot be updated changed", name)
        await api.delete(STATEFULSETS, namespace, name, propagation="Orphan")
        await _create(api, STATEFULSETS, namespace, desired)
        return
    mutable = {"metadata": desired["metadata"], "spec": {k: v for k, v in desired["spec"].items() if k in STS_MUTABLE}}
    if not is_subset(mutable, actual):
        logger.info("updating StatefulSet %s", name)
        await api.patch(STATEFULSETS, namespace, name, mutable)


Connect = Callable[..., "kopf.ConnectionInfo | None | Any"]


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Production login: the pod's service account, else the local kubeconfig."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def build_registry(connect: Connect = login, resync_seconds: float = 60.0) -> kopf.OperatorRegistry:
    """A fresh registry with every handler; ``connect`` is the login (tests point it at kmock)."""
    registry = kopf.OperatorRegistry()
    reconciler = Reconciler()
    live = LiveController(reconciler.session)

    @kopf.on.login(registry=registry)
    async def log_in(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = connect(**kwargs)
        if inspect.isawaitable(info):
            info = await info
        if info is not None:
            await reconciler.connect(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
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
                except (ApiError, kopf.TemporaryError, aiohttp.ClientError, TimeoutError) as exc:
                    logger.warning("live round failed: %s", exc)  # the API server is away: try again later
                    interval = 5.0
                await stopped.wait(interval)
        finally:
            live.forget(namespace, name)

    async def child_changed(type: str | None, body: Mapping[str, Any], logger: logging.Logger, **_: Any) -> None:
        instance = (body.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL)
        if type in ("DELETED", "MODIFIED") and instance:
            await reconciler.reconcile(body["metadata"]["namespace"], instance, logger)

    async def pod_changed(body: Mapping[str, Any], logger: logging.Logger, **_: Any) -> None:
        instance = (body.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL)
        if instance:
            await reconciler.refresh_status(body["metadata"]["namespace"], instance, logger)

    for ref in CHILDREN.values():
        kopf.on.event(ref.api_version, ref.plural, labels=MANAGED, registry=registry, id="child")(child_changed)
    kopf.on.event(PODS.api_version, PODS.plural, labels=MANAGED, registry=registry, id="pod")(pod_changed)
    return registry
