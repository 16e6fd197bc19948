"""Pure computation of a KVDriveDeployment's status: replicas and metav1-style conditions.

Owns what ``Ready``, ``Progressing``, ``Degraded`` and (with routing on) ``RouterReady`` mean and
when ``lastTransitionTime`` moves (only when a condition's status changes), and the problems that only
the reconciler can see (a field another manager owns, an API server that does not serve
``InferencePool``, a shared tier's Secret that is missing). With routing on, clients reach the
replicas through the router, so ``Ready`` also needs every router pod ready. No Kubernetes API, no Kopf.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdrive.operator.api.status import KVDriveStatus
from kvdrive.operator.render import inferencepool
from kvdrive.operator.render.childmeta import endpoint_url, selector_string

MISSING_POOL_CRD_REASON = "InferencePoolCRDNotInstalled"
MISSING_SECRET_REASON = "SharedTierSecretNotFound"
# the status keys the reconciler writes; `router` only with routing on (a key it stops writing must go)
RECONCILER_KEYS = ("observedGeneration", "replicas", "readyReplicas", "selector", "endpoint", "conditions", "router")
# the items of status.conditions the reconciler owns (a map list: the live loop owns SharedTierDegraded)
RECONCILER_CONDITIONS = ("Ready", "Progressing", "Degraded", "RouterReady")


@dataclass(frozen=True)
class Problem:
    """Why a CR cannot be reconciled (a spec the schema could not catch, a missing dependency)."""

    reason: str  # CamelCase, e.g. StorageClassNotFound
    message: str


def missing_secret_problem(field: str, name: str, key: str, namespace: str,
                           secret: Mapping[str, Any] | None) -> Problem | None:
    """A Secret the pods would mount (``field`` names it) that is missing or lacks ``key``: the kubelet would
    hold the pods in ContainerCreating, so nothing is applied until it is there."""
    if secret is None:
        return Problem(MISSING_SECRET_REASON, f"{field}: Secret {name!r} does not exist in namespace {namespace!r}")
    if key not in (secret.get("data") or {}):
        return Problem(MISSING_SECRET_REASON, f"{field}.key: Secret {name!r} in namespace {namespace!r} has no key "
                                              f"{key!r}")
    return None


@dataclass(frozen=True)
class RouterObserved:
    """The router's pods (routing on)."""

    desired: int  # spec.routing.replicas
    ready: int  # router pods passing their readiness probe (/readyz: they reach a ready replica)


@dataclass(frozen=True)
class Observed:
    """What the cluster shows for one CR."""

    generation: int | None
    replicas: int  # desired replicas of the StatefulSet
    ready: int  # pods passing their readiness probe
    router: RouterObserved | None = None  # None: routing off


@dataclass(frozen=True)
class ConditionValue:
    type: str
    status: str
    reason: str
    message: str


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def router_condition(observed: Observed) -> ConditionValue | None:
    """``RouterReady`` (None with routing off): every router pod ready, else how many and why not."""
    router = observed.router
    if router is None:
        return None
    pods = f"{router.ready}/{router.desired} router pods ready"
    if router.ready >= router.desired:
        return ConditionValue("RouterReady", "True", "AllRouterPodsReady", pods)
    if router.ready == 0 and observed.ready == 0:
        return ConditionValue("RouterReady", "False", "NoReplicaReady",
                              f"{pods}: a router is ready (/readyz) only once it reaches a ready replica, "
                              f"and {observed.ready}/{observed.replicas} replicas are ready")
    return ConditionValue("RouterReady", "False", "RouterPodsNotReady",
                          f"{pods} (Deployment rolling out, or pods not scheduled or failing /readyz)")


def desired_conditions(observed: Observed, problem: Problem | None) -> list[ConditionValue]:
    """The conditions for what is observed (``problem`` set: the CR is Degraded)."""
    routed = router_condition(observed)
    if problem is not None:
        blocked = [ConditionValue("RouterReady", "False", problem.reason, problem.message)] if routed else []
        return [
            ConditionValue("Ready", "False", problem.reason, problem.message),
            ConditionValue("Progressing", "False", "Blocked", "not reconciled until the problem is fixed"),
            ConditionValue("Degraded", "True", problem.reason, problem.message),
            *blocked,
        ]
    pods = f"{observed.ready}/{observed.replicas} pods ready"
    if observed.replicas == 0:
        ready = ConditionValue("Ready", "False", "ScaledToZero", "no replicas requested")
        progressing = ConditionValue("Progressing", "False", "ScaledToZero", "no replicas requested")
    elif observed.ready >= observed.replicas:
        ready = ConditionValue("Ready", "True", "AllReplicasReady", pods)
        progressing = ConditionValue("Progressing", "False", "Available", pods)
    else:
        ready = ConditionValue("Ready", "False", "ReplicasNotReady", pods)
        progressing = ConditionValue("Progressing", "True", "ReplicasStarting", pods)
    if routed is None:
        return [ready, progressing, ConditionValue("Degraded", "False", "AsExpected", "")]
    if ready.status == "True" and routed.status != "True":  # the replicas serve, the clients' way in not yet
        ready = ConditionValue("Ready", "False", "RouterNotReady", f"{pods}; {routed.message}")
        progressing = ConditionValue("Progressing", "True", "RouterStarting", routed.message)
    return [ready, progressing, ConditionValue("Degraded", "False", "AsExpected", ""), routed]


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    wanted: Sequence[ConditionValue],
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """New condition list; lastTransitionTime is kept unless the status flips."""
    old = {c.get("type"): c for c in previous}
    merged: list[dict[str, Any]] = []
    for value in wanted:
        before = old.get(value.type)
        changed = before is None or before.get("status") != value.status
        condition: dict[str, Any] = {
            "type": value.type,
            "status": value.status,
            "reason": value.reason,
            "message": value.message,
            "lastTransitionTime": now if changed or not before else before.get("lastTransitionTime", now),
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        merged.append(condition)
    return merged


def build_status(
    *,
    name: str,
    namespace: str,
    port: int,
    observed: Observed,
    problem: Problem | None,
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """The whole ``status`` (kopf's own bookkeeping under ``status.kopf`` is left alone), in the shape of
    the CRD's status schema (``KVDriveStatus``: a field that drifted from it fails here, not at the API)."""
    conditions = merge_conditions(
        previous.get("conditions") or [], desired_conditions(observed, problem), observed.generation, now
    )
    status: dict[str, Any] = {
        "replicas": observed.replicas,
        "readyReplicas": observed.ready,
        "selector": selector_string(name),
        "endpoint": endpoint_url(name, namespace, port),
        "conditions": conditions,
    }
    if observed.router is not None:
        status["router"] = {"ready": observed.router.ready, "desired": observed.router.desired}
    if observed.generation is not None:
        status["observedGeneration"] = observed.generation
    KVDriveStatus.model_validate(status)
    return status


def _own(status: Mapping[str, Any], key: str) -> Any:
    """The reconciler's part of ``status[key]``: its own conditions only."""
    if key != "conditions":
        return status.get(key)
    return [c for c in status.get("conditions") or [] if c.get("type") in RECONCILER_CONDITIONS]


def status_differs(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` (the reconciler's part) changes the status, a key it no longer writes included; the
    live loop's conditions are not its."""
    return any(_own(previous, key) != _own(new, key) for key in {*new, *RECONCILER_KEYS})


def degraded_changed(previous: Mapping[str, Any], problem: Problem | None) -> bool:
    """True when an Event is due: the CR became Degraded, or degraded for another reason."""
    if problem is None:
        return False
    for condition in previous.get("conditions") or []:
        if condition.get("type") == "Degraded":
            return not (
                condition.get("status") == "True"
                and condition.get("reason") == problem.reason
                and condition.get("message") == problem.message
            )
    return True


def current_problem(status: Mapping[str, Any]) -> Problem | None:
    """The problem a CR's status reports now (its Degraded condition), or None."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Degraded" and condition.get("status") == "True":
            return Problem(str(condition.get("reason", "Degraded")), str(condition.get("message", "")))
    return None


def conflict_problem(kind: str, name: str, fields: Sequence[object]) -> Problem:
    """A child's fields that another manager owns: the operator does not force them."""
    listed = ", ".join(str(f) for f in fields)
    return Problem("FieldConflict", f"{kind} {name!r}: {listed}; the operator does not force fields that another "
                                    "manager owns: remove them there, or let the CR stop setting them")


def missing_pool_crd_problem() -> Problem:
    """The API server does not serve InferencePool: the Gateway API Inference Extension CRDs are missing."""
    return Problem(MISSING_POOL_CRD_REASON, (
        f"spec.routing.mode inferencepool: the API server does not serve {inferencepool.KIND} "
        f"({inferencepool.API_VERSION}); install the Gateway API Inference Extension CRDs "
        f"(CustomResourceDefinition {inferencepool.CRD_NAME}), or set spec.routing.mode to prefix"))
