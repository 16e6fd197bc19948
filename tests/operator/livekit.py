"""Shared pieces of the live-loop tests: the CR, Pods that point at loopback servers, Events, and
the autoscaler's earlier decisions."""

from __future__ import annotations

import base64
from typing import Any

from kopfenv import Cluster, eventually

from kvdrive.operator.act.objects import AUTOSCALER, CHILDREN, CR, PODS, STATEFULSETS
from kvdrive.operator.clients.kubeclient import Ref

EVENTS = Ref("v1", "Event", "events")  # what the operator posts through kopf.event, read back here

LABELS = {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "chat",
          "app.kubernetes.io/managed-by": "kvdrive-operator"}


def live_cr(autoscaling: dict[str, Any] | None = None, **tuning: Any) -> dict[str, Any]:
    """A demo-model CR with small tiers (as the test servers have), concurrency 4 that the tuner may move
    within [1, 8], and a 1 s metrics interval."""
    return {
        "apiVersion": "kvdrive.io/v1alpha1", "kind": "KVDriveDeployment", "metadata": {"name": "chat"},
        "spec": {
            "model": {"source": "demo"},
            "resources": {"gpus": 0},
            "tiers": {"gpu": {"budget": "8Mi"}, "dram": {"size": "64Mi"}, "ssd": {"size": "300Mi"}},
            "concurrency": {"maxRunning": 4},
            "tuning": {"enabled": True, "intervalSeconds": 1, "scrapeTimeoutSeconds": 1, "stabilizationIntervals": 2,
                       "concurrency": {"min": 1, "max": 8, "minStep": 1}, **tuning},
            "autoscaling": autoscaling or {"mode": "operator", "minReplicas": 1, "maxReplicas": 4,
                                           "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0,
                                           "maxStep": 1, "targets": {"queueDepth": 4}},
        },
    }


def pod_object(name: str, port: int) -> dict[str, Any]:
    """A Pod of the StatefulSet, its server listening on ``port``."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {"containers": [{"name": "kvdrive", "image": "x",
                                 "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}]},
    }


async def create_pod(cluster: Cluster, name: str, port: int, ready: bool = True, ip: str = "127.0.0.1") -> None:
    """The Pod, and its status as the kubelet would report it (there is no kubelet: the test writes
    the status subresource): running on ``ip``, ready or not."""
    await cluster.create(PODS, pod_object(name, port))
    await cluster.patch(PODS, name, {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                                                "conditions": [{"type": "Ready", "status": str(ready)}]}},
                        subresource="status")


async def scaled_earlier(cluster: Cluster, replicas: int) -> None:
    """The StatefulSet's replicas as an earlier decision of the autoscaler left them (its field manager),
    once the reconciler has created the StatefulSet."""
    await eventually(lambda: cluster.get(STATEFULSETS, "chat"), what="the StatefulSet")
    body = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "chat"}, "spec": {"replicas": replicas}}
    await cluster.api.apply(STATEFULSETS, cluster.namespace, body, AUTOSCALER, force=True)


async def admin_token(cluster: Cluster) -> str | None:
    secret = await cluster.get(CHILDREN["Secret"], "chat-admin")
    return base64.b64decode(secret["data"]["token"]).decode() if secret else None


async def events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    items = await cluster.api.list(EVENTS, cluster.namespace, {})
    return [e for e in items if e.get("reason") == reason and e.get("involvedObject", {}).get("name") == "chat"]


async def status(cluster: Cluster) -> dict[str, Any]:
    cr = await cluster.get(CR, "chat")
    return (cr or {}).get("status") or {}


def pod_status(st: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((p for p in st.get("pods") or [] if p["name"] == name), None)
