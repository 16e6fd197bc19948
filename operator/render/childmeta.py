"""What the children of one KVDriveDeployment share: names, labels, selectors and ObjectMeta.

Owns the names of every child, the two pod selectors (the runtime's StatefulSet pods and the
router's Deployment pods, which must never select each other's pods: they differ in
``app.kubernetes.io/name``), the labels every child carries, the controller owner reference, and the
image's contract both pod templates rely on (the port ``kvdrive serve`` listens on, the non-root
user, the probe and security-context shapes). Pure: used by ``manifests`` and ``router_manifests``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdrive.operator.api.cr import API_VERSION, KIND, KVDriveDeployment
from kvdrive.operator.api.spec import SERVE_PORT

MANAGER = "kvdrive-operator"
APP = "kvdrive"  # app.kubernetes.io/name of the runtime pods and their objects
ROUTER_APP = "kvdrive-router"  # ... of the router's pods and objects
CONTAINER_PORT = SERVE_PORT  # `kvdrive serve --port`
RUN_AS_USER = 10001  # the image's non-root user


@dataclass(frozen=True)
class Names:
    """Names of the children of one CR."""

    instance: str

    @property
    def statefulset(self) -> str:
        return self.instance

    @property
    def service(self) -> str:
        return self.instance

    @property
    def headless(self) -> str:
        return f"{self.instance}-headless"

    @property
    def configmap(self) -> str:
        return f"{self.instance}-config"

    @property
    def secret(self) -> str:
        return f"{self.instance}-admin"

    @property
    def pdb(self) -> str:
        return self.instance

    @property
    def pool(self) -> str:
        """The InferencePool (spec.routing.mode inferencepool): named like the CR, the backend a route names."""
        return self.instance

    @property
    def router(self) -> str:
        """Every router object (ServiceAccount, Role, RoleBinding, Service, PDB, Deployment)."""
        return f"{self.instance}-router"


ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"  # Gateway API Inference Extension: metric mapping
ENGINE_TYPE = "kvdrive"


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the runtime pods of one CR (immutable StatefulSet selector)."""
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": name}


def router_selector_labels(name: str) -> dict[str, str]:
    """Labels that select the router pods of one CR (immutable Deployment selector)."""
    return {"app.kubernetes.io/name": ROUTER_APP, "app.kubernetes.io/instance": name}


def common_labels(name: str, component: str, app: str = APP) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvdrive",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def selector_string(name: str) -> str:
    """``status.selector`` for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def endpoint_url(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}/v1"


def object_meta(cr: KVDriveDeployment, name: str, component: str, app: str = APP) -> dict[str, Any]:
    """ObjectMeta of a child: namespace, labels, and the CR as controller owner (when it has a uid)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": cr.metadata.namespace,
        "labels": common_labels(cr.metadata.name, component, app),
    }
    if cr.metadata.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": cr.metadata.name,
                "uid": cr.metadata.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def probe(path: str, period: int, failures: int) -> dict[str, Any]:
    """An HTTP probe on the container port named ``http``."""
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def container_security() -> dict[str, Any]:
    """Non-root, read-only root file system, no privilege escalation, no capabilities."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security(fs_group: bool) -> dict[str, Any]:
    """The pod's security context: the image's user, the runtime's default seccomp profile;
    ``fs_group`` for pods whose volumes that user must write (the runtime's SSD claim)."""
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
    }
    if fs_group:
        context["fsGroup"] = RUN_AS_USER
    context["seccompProfile"] = {"type": "RuntimeDefault"}
    return context


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controlling owner, or None."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None
