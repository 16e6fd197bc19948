"""Shared pieces of the operator's end-to-end tests against a real kube-apiserver: the example CR, its
children, its status conditions and Warning events, the cluster objects a CR needs before it can
reconcile, and the Pods a kubelet would have made (there is none here) with their readiness."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from crdcheck import load_example
from kopfenv import Cluster
from livekit import EVENTS

from kvdrive.operator.act.objects import CHILDREN, CLAIMS, CR, PODS, SECRETS
from kvdrive.operator.api.sharedtierspec import SharedTier

CHILD_NAMES = {
    ("ConfigMap", "chat-config"), ("Secret", "chat-admin"), ("Service", "chat"), ("Service", "chat-headless"),
    ("StatefulSet", "chat"), ("PodDisruptionBudget", "chat"),
}


def chat_cr(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("full.yaml"))
    doc["spec"].update(spec)
    return doc


async def children(cluster: Cluster, names: Iterable[tuple[str, str]] = CHILD_NAMES,
                   ) -> dict[tuple[str, str], dict[str, Any]]:
    """The objects of ``names`` ((kind, name) pairs; the CR's own children by default) that exist."""
    found = {}
    for kind, name in names:
        obj = await cluster.get(CHILDREN[kind], name)
        if obj is not None:
            found[kind, name] = obj
    return found


async def condition(cluster: Cluster, kind: str, name: str = "chat") -> dict[str, Any] | None:
    cr = await cluster.get(CR, name)
    for cond in ((cr or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return None


async def example_secrets(cluster: Cluster) -> None:
    """The Secrets the example CR's shared tier names (its password and its CA bundle), each with its key."""
    for _, name, key in SharedTier.model_validate(chat_cr()["spec"]["tiers"]["shared"]).secret_refs():
        await cluster.create(SECRETS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                                       "stringData": {key: f"{name} {key}"}})


async def ready_cluster(cluster: Cluster) -> None:
    """What the example CR needs before it can reconcile: its StorageClass, its model claim, its Secrets."""
    await cluster.storage_class()
    await cluster.create(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
                                  "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "50Gi"}}}})
    await example_secrets(cluster)


async def all_children(cluster: Cluster) -> dict[tuple[str, str], dict[str, Any]] | None:
    found = await children(cluster)
    return found if set(found) == CHILD_NAMES else None


def chat_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {
            "app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/managed-by": "kvdrive-operator"}},
        "spec": {"containers": [{"name": "kvdrive", "image": "x"}]},
    }


async def set_ready(cluster: Cluster, name: str, ready: bool) -> None:
    """What the kubelet would report (there is no kubelet here): the pod's status subresource."""
    await cluster.patch(PODS, name, {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": str(ready)}]}}, subresource="status")


async def condition_is(cluster: Cluster, kind: str, status: str) -> dict[str, Any] | None:
    cond = await condition(cluster, kind)
    return cond if cond and cond["status"] == status else None


async def events_about(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    items = await cluster.api.list(EVENTS, cluster.namespace, {})
    return [e for e in items if e.get("reason") == reason and e.get("involvedObject", {}).get("name") == "chat"]
