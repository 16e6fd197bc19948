"""The Kubernetes kinds the operator touches, and pure facts read from Pod objects.

Owns the API addresses (``Ref``) shared by ``handlers`` and ``live`` (every call on them is an
explicit ``KubeApi`` call in those two modules, so that RBAC can be derived from the code), and
what a Pod says about itself: whether it is ready and where its ``kvdrive serve`` listens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdrive.operator.kubeapi import Ref
from kvdrive.operator.manifests import CONTAINER_PORT
from kvdrive.operator.spec import GROUP, PLURAL, VERSION

CR = Ref(f"{GROUP}/{VERSION}", PLURAL)
PODS = Ref("v1", "pods")
CLAIMS = Ref("v1", "persistentvolumeclaims")
STORAGE_CLASSES = Ref("storage.k8s.io/v1", "storageclasses")
STATEFULSETS = Ref("apps/v1", "statefulsets")
SECRETS = Ref("v1", "secrets")
EVENTS = Ref("v1", "events")
CHILDREN = {
    "ConfigMap": Ref("v1", "configmaps"),
    "Secret": SECRETS,
    "Service": Ref("v1", "services"),
    "StatefulSet": STATEFULSETS,
    "PodDisruptionBudget": Ref("policy/v1", "poddisruptionbudgets"),
}


def pod_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_url(pod: Mapping[str, Any]) -> str | None:
    """``http://IP:PORT`` of the pod's server (its container port named ``http``), None without an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = CONTAINER_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("ports") or []:
            if entry.get("name") == "http" and entry.get("containerPort"):
                port = int(entry["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"
