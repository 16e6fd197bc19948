"""The reconciler: brings the children and the status' conditions of one ``KVDriveDeployment`` in line with its
spec.

Owns reconciliation of ``KVDriveDeployment`` objects: pre-flight checks of what the schema
cannot see (the StorageClass, the model's PersistentVolumeClaim, the shared tier's Secrets and
their keys, children owned by someone else), then server-side apply of the children from
``manifests`` under the ``RECONCILER`` field manager, and the status' conditions from ``conditions``. A field the CR no longer sets leaves the
child (SSA removes what its manager stops applying); a field another manager owns is left alone;
a conflict is reported on the CR (Degraded, reason FieldConflict), never forced. StatefulSet
``replicas`` have one writer: this reconciler in autoscaling modes none/external, the autoscaler
(``live``) in mode operator. Everything is idempotent; a CR, a child or a pod event all lead to the
same ``Reconciler.reconcile`` (``handlers`` registers them).

The router (``spec.routing.mode: prefix`` or ``inferencepool``): the client Service moves to the
router's pods only once one of them is ready (it would cut the clients off before), and back as soon as
routing is off; then the router's objects that this CR controls are deleted, and the InferencePool when
the mode leaves inferencepool (``pruning``). An API server that does not serve ``InferencePool`` (the
Gateway API Inference Extension CRDs are not installed) is a pre-flight problem of a CR that needs it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import kopf

from kvdrive.operator.act.objects import (
    AUTOSCALER,
    CHILDREN,
    CLAIMS,
    CR,
    PODS,
    RECONCILER,
    SECRETS,
    STATEFULSETS,
    STORAGE_CLASSES,
    pod_ready,
)
from kvdrive.operator.act.pruning import prune_pool, prune_router
from kvdrive.operator.api.cr import KVDriveDeployment, SpecError, parse_cr, routing_of
from kvdrive.operator.clients.kubeclient import ApiError, Conflict, KindNotServed, KubeApi, owns_field
from kvdrive.operator.clients.opmetrics import OperatorMetrics
from kvdrive.operator.decide.conditions import (
    Observed,
    Problem,
    RouterObserved,
    build_status,
    conflict_problem,
    current_problem,
    degraded_changed,
    missing_pool_crd_problem,
    missing_secret_problem,
    now_rfc3339,
    status_differs,
)
from kvdrive.operator.render import inferencepool, router_manifests
from kvdrive.operator.render.childmeta import Names, controller_uid, router_selector_labels, selector_labels
from kvdrive.operator.render.manifests import admin_token_of, render

# the API server's answer when an apply changes a StatefulSet field that only a new object can change
STS_IMMUTABLE = "updates to statefulset spec for fields other than"
Existing = dict[tuple[str, str], dict[str, Any] | None]  # children as they are now, by (kind, name)


def statefulset_replicas(model: KVDriveDeployment, sts: Mapping[str, Any] | None) -> int | None:
    """The replicas this reconciler applies; None leaves the field to the autoscaler.

    Modes none/external: ``spec.replicas``. Mode operator: ``minReplicas`` when the StatefulSet is
    created, then the current count for as long as this manager still owns the field (an SSA manager
    that stops applying a field it alone owns deletes it), and nothing once the autoscaler has taken it.
    """
    spec = model.spec
    if spec.autoscaling.mode != "operator":
        return spec.desired_replicas()
    if sts is None:
        return spec.autoscaling.min_replicas
    if owns_field(dict(sts), RECONCILER, ("spec", "replicas")):
        return int(sts.get("spec", {}).get("replicas") or spec.autoscaling.min_replicas)
    return None


class Reconciler:
    """Reconciles CRs through one API session; one lock per CR serializes its reconciles."""

    def __init__(self, metrics: OperatorMetrics | None = None) -> None:
        self.api: KubeApi | None = None
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.metrics = metrics or OperatorMetrics()

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
        """Bring the children and the status of one CR in line with its spec (counted and timed by result:
        ``opmetrics.py``)."""
        async with self._lock(namespace, name), self.metrics.reconcile() as result:
            cr = await self._api().get(CR, namespace, name)
            if cr is None or cr.get("metadata", {}).get("deletionTimestamp"):
                result.append("gone")
                return  # gone or going: owner references let the garbage collector take the children
            problem, model = None, None
            try:
                model = parse_cr({**cr, "metadata": {**cr["metadata"], "namespace": namespace}})
            except SpecError as exc:
                problem = Problem("InvalidSpec", "; ".join(exc.problems))
            if model is not None:
                problem, existing = await self._preflight(model)
                if problem is None:
                    # first: the router's Service, as read before the apply, says whether a pool may exist
                    await prune_pool(self._api(), model, existing.get(("Service", Names(name).router)), logger)
                    problem = await self._apply(model, existing, logger)
                if problem is None:
                    await prune_router(self._api(), model, logger)
            await self._write_status(cr, problem, logger)
            result.append(problem.reason if problem is not None else "ok")

    async def refresh_status(self, namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Recompute only the status (pods changed); a Degraded CR stays Degraded."""
        async with self._lock(namespace, name):
            cr = await self._api().get(CR, namespace, name)
            if cr is None or cr.get("metadata", {}).get("deletionTimestamp"):
                return
            await self._write_status(cr, current_problem(cr.get("status") or {}), logger)

    async def _preflight(self, model: KVDriveDeployment) -> tuple[Problem | None, Existing]:
        """What the schema cannot check; nothing is applied while any of it fails. Returns the children
        as they are now, by (kind, name)."""
        api, spec, namespace = self._api(), model.spec, model.metadata.namespace
        storage_class = spec.tiers.ssd.storage_class_name
        existing: Existing = {}
        if await api.get(STORAGE_CLASSES, None, storage_class) is None:
            return Problem(
                "StorageClassNotFound",
                f"spec.tiers.ssd.storageClassName: StorageClass {storage_class!r} does not exist",
            ), existing
        if spec.model.source.startswith("pvc://"):
            claim = spec.model.source.removeprefix("pvc://").split("/", 1)[0]
            if await api.get(CLAIMS, namespace, claim) is None:
                return Problem(
                    "ModelClaimNotFound",
                    f"spec.model.source: PersistentVolumeClaim {claim!r} does not exist in namespace {namespace!r}",
                ), existing
        shared = spec.tiers.shared
        for field, secret_name, key in shared.secret_refs() if shared is not None else []:
            secret = await api.get(SECRETS, namespace, secret_name)
            problem = missing_secret_problem(field, secret_name, key, namespace, secret)
            if problem is not None:
                return problem, existing
        for child in render(model, admin_token="-"):
            kind, child_name = child["kind"], child["metadata"]["name"]
            try:
                existing[kind, child_name] = found = await api.get(CHILDREN[kind], namespace, child_name)
            except KindNotServed:  # a custom resource of another project, whose CRD is not installed
                if kind != inferencepool.KIND:
                    raise
                return missing_pool_crd_problem(), existing
            owner = None if found is None else controller_uid(found)
            if owner is not None and owner != model.metadata.uid:
                return Problem("ChildConflict", f"{kind} {child_name!r} is controlled by another owner ({owner})"), existing
        return None, existing

    async def _apply(self, model: KVDriveDeployment, existing: Existing,
                     logger: logging.Logger | logging.LoggerAdapter) -> Problem | None:
        """Server-side apply of every child; the first conflict with another manager is the problem."""
        api, namespace, names = self._api(), model.metadata.namespace, Names(model.metadata.name)
        token = admin_token_of(existing.get(("Secret", names.secret))) or secrets.token_urlsafe(32)
        replicas = statefulset_replicas(model, existing.get(("StatefulSet", names.statefulset)))
        to_router = await self._clients_to_router(model, existing.get(("Service", names.service)))
        for child in render(model, token, replicas, clients_to_router=to_router):
            kind, child_name = child["kind"], child["metadata"]["name"]
            if existing.get((kind, child_name)) is None:
                logger.info("creating %s %s", kind, child_name)
            try:
                if kind == "StatefulSet":
                    await self._apply_statefulset(api, namespace, child, model, logger)
                else:
                    await api.apply(CHILDREN[kind], namespace, child, RECONCILER)
            except Conflict as exc:
                logger.warning("not applied: %s", exc)
                return conflict_problem(kind, child_name, exc.fields)
            except ApiError as exc:
                if exc.status not in (400, 422):
                    raise
                # the API server refused the child as rendered: a pod setting of the spec that neither the
                # schema nor the model can check (a core/v1 fragment passed as it is): say so in the status
                logger.warning("not applied: %s", exc)
                return Problem("ChildRejected", f"{kind} {child_name!r} was refused by the API server: "
                                                f"{exc.message[:900]}")
        return None

    async def _clients_to_router(self, model: KVDriveDeployment, client: Mapping[str, Any] | None) -> bool:
        """Whether the client Service selects the router's pods: routing is on, and it does already or a
        router pod is ready (before that, the clients keep going to the replicas)."""
        if not router_manifests.enabled(model.spec):
            return False
        name = model.metadata.name
        if client is not None and (client.get("spec") or {}).get("selector") == router_selector_labels(name):
            return True
        pods = await self._api().list(PODS, model.metadata.namespace, router_selector_labels(name))
        return any(pod_ready(pod) for pod in pods)

    async def _apply_statefulset(self, api: KubeApi, namespace: str, desired: dict[str, Any], model: KVDriveDeployment,
                                 logger: logging.Logger | logging.LoggerAdapter) -> None:
        name = desired["metadata"]["name"]
        try:
            await api.apply(STATEFULSETS, namespace, desired, RECONCILER)
        except Conflict as exc:
            if exc.managers() != {AUTOSCALER}:
                raise
            # replicas between our own two writers: in mode operator the autoscaler has them, so stop
            # applying them; otherwise the mode left operator and the reconciler takes them back
            if model.spec.autoscaling.mode == "operator":
                desired = copy.deepcopy(desired)
                desired["spec"].pop("replicas", None)
                await api.apply(STATEFULSETS, namespace, desired, RECONCILER)
            else:
                logger.info("StatefulSet %s: replicas back from the autoscaler (mode %s)", name,
                            model.spec.autoscaling.mode)
                await api.apply(STATEFULSETS, namespace, desired, RECONCILER, force=True)
        except ApiError as exc:
            if exc.status != 422 or STS_IMMUTABLE not in exc.message:
                raise
            # selector, claim templates, service name: only a new object can change them. Orphan
            # the pods so that they keep serving until the new StatefulSet rolls them. The garbage
            # collector finishes the orphaning; the StatefulSet's DELETED event reconciles again and
            # that apply creates the new one.
            logger.warning("re-creating StatefulSet %s: a field that cannot be updated changed", name)
            await api.delete(STATEFULSETS, namespace, name, propagation="Orphan")

    async def _write_status(
        self, cr: Mapping[str, Any], problem: Problem | None, logger: logging.Logger | logging.LoggerAdapter
    ) -> None:
        """The reconciler's part of the status (replicas, selector, endpoint, conditions, observedGeneration),
        applied on the status subresource; ``live`` owns the rest."""
        api, meta = self._api(), cr["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        sts = await api.get(STATEFULSETS, namespace, Names(name).statefulset)
        pods = await api.list(PODS, namespace, selector_labels(name))
        routing, router = routing_of(cr.get("spec")), None
        if routing.mode != "none":
            routers = await api.list(PODS, namespace, router_selector_labels(name))
            router = RouterObserved(desired=routing.replicas, ready=sum(1 for pod in routers if pod_ready(pod)))
        observed = Observed(
            generation=meta.get("generation"),
            replicas=int((sts or {}).get("spec", {}).get("replicas") or 0),
            ready=sum(1 for pod in pods if pod_ready(pod)),
            router=router,
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
            body = {"apiVersion": cr["apiVersion"], "kind": cr["kind"], "metadata": {"name": name}, "status": status}
            await api.apply(CR, namespace, body, RECONCILER, force=True, subresource="status")
