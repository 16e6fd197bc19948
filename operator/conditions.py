"""Pure computation of a KVDriveDeployment's status: replicas and metav1-style conditions.

Owns what ``Ready``, ``Progressing`` and ``Degraded`` mean and when ``lastTransitionTime``
moves (only when a condition's status changes). No Kubernetes API, no Kopf.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdrive.operator.manifests import endpoint_url, selector_string

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class Problem:
    """Why a CR cannot be reconciled (a spec the schema could not catch, a missing dependency)."""

    reason: str  # CamelCase, e.g. StorageClassNotFound
    message: str


@dataclass(frozen=True)
class Observed:
    """What the cluster shows for one CR."""

    generation: int | None
    replicas: int  # desired replicas of the StatefulSet
    ready: int  # pods passing their readiness probe


@dataclass(frozen=True)
class ConditionValue:
    type: str
    status: str
    reason: str
    message: str


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def desired_conditions(observed: Observed, problem: Problem | None) -> list[ConditionValue]:
    """The three conditions for what is observed (``problem`` set: the CR is Degraded)."""
    if problem is not None:
        return [
            ConditionValue("Ready", "False", problem.reason, problem.message),
            ConditionValue("Progressing", "False", "Blocked", "not reconciled until the problem is fixed"),
            ConditionValue("Degraded", "True", problem.reason, problem.message),
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
    return [ready, progressing, ConditionValue("Degraded", "False", "AsExpected", "")]


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
    """The whole ``status`` (kopf's own bookkeeping under ``status.kopf`` is left alone)."""
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
    if observed.generation is not None:
        status["observedGeneration"] = observed.generation
    return status


def status_differs(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return any(previous.get(key) != value for key, value in new.items())


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
