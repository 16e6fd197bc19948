"""The Kubernetes kinds the operator touches, and pure facts read from Pod objects.

Owns the API addresses (``Ref``) shared by ``reconciler``, ``pruning`` and ``live`` (every call on them is
an explicit ``KubeApi`` call in those modules, so that RBAC can be derived from the code), the
field managers (one per writer, so that each field has exactly one), and
what a Pod says about itself: whether it is ready and where its ``kvdrive serve`` listens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdrive.operator.api.cr import GROUP, KIND, PLURAL, VERSION
from kvdrive.operator.clients.kubeclient import Ref
from kvdrive.operator.render import inferencepool
from kvdrive.operator.render.childmeta import CONTAINER_PORT

CR = Ref(f"{GROUP}/{VERSION}", KIND, PLURAL)
PODS = Ref("v1", "Pod", "pods")
CLAIMS = Ref("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
STORAGE_CLASSES = Ref("storage.k8s.io/v1", "StorageClass", "storageclasses")
STATEFULSETS = Ref("apps/v1", "StatefulSet", "statefulsets")
SECRETS = Ref("v1", "Secret", "secrets")
CHILDREN = {
    "ConfigMap": Ref("v1", "ConfigMap", "configmaps"),
    "Secret": SECRETS,
    "Service": Ref("v1", "Service", "services"),
    "StatefulSet": STATEFULSETS,
    "PodDisruptionBudget": Ref("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    # the router's (spec.routing.mode prefix or inferencepool; router_manifests)
    "Deployment": Ref("apps/v1", "Deployment", "deployments"),
    "ServiceAccount": Ref("v1", "ServiceAccount", "serviceaccounts"),
    "Role": Ref("rbac.authorization.k8s.io/v1", "Role", "roles"),
    "RoleBinding": Ref("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    # a custom resource of the Gateway API Inference Extension (spec.routing.mode inferencepool): the API
    # server serves it only once its CRD is installed
    inferencepool.KIND: Ref(inferencepool.API_VERSION, inferencepool.KIND, inferencepool.PLURAL),
}
# Field managers: the reconciler owns the children and status' conditions; the autoscaler owns the
# StatefulSet's replicas in autoscaling mode operator; the live loop owns status.pods/budgets/autoscaling.
RECONCILER = "kvdrive-operator"
AUTOSCALER = "kvdrive-operator-autoscaler"
LIVE = "kvdrive-operator-live"


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
