"""Pure rendering of a KVDriveDeployment into its child manifests.

Owns what the children look like: the StatefulSet running ``kvdrive serve`` (GPU limits,
hugepages sized from the DRAM tier, a local-NVMe claim for the SSD tier, probes, security
context), the headless and client Services, the ConfigMap, the admin-token Secret and the
PodDisruptionBudget. No Kubernetes API and no Kopf here: the same function backs
``kvdrive-operator render`` and the reconcile handlers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from kvdrive.operator.quantity import to_bytes
from kvdrive.operator.spec import API_VERSION, KIND, KVDriveDeployment, KVDriveSpec

MANAGER = "kvdrive-operator"
CONTAINER_PORT = 8000
DRAIN_SECONDS = 120  # terminationGracePeriodSeconds of the runtime pods
PRESTOP_SECONDS = 5  # preStop sleep: the Service stops routing to a terminating pod first
SERVER_DRAIN_SECONDS = 90  # the server's own deadline (--drain-seconds) after SIGTERM: 5 + 90 < 120
RUN_AS_USER = 10001
SSD_BUDGET_FRACTION_PERCENT = 90  # leave file-system headroom: the tier never fills the volume
HUGEPAGE_DIR = "/var/lib/kvdrive/hugepages"
SSD_DIR = "/var/lib/kvdrive/ssd"
MODEL_DIR = "/models"
ADMIN_DIR = "/var/run/kvdrive/admin"
CONFIG_DIR = "/etc/kvdrive"
SSD_VOLUME = "kv-ssd"


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


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the pods of one CR (immutable StatefulSet selector)."""
    return {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": name}


def common_labels(name: str, component: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "kvdrive",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def selector_string(name: str) -> str:
    """``status.selector`` for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def endpoint_url(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}/v1"


def _meta(cr: KVDriveDeployment, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": cr.metadata.namespace,
        "labels": common_labels(cr.metadata.name, component),
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


def runtime_settings(spec: KVDriveSpec) -> dict[str, Any]:
    """The runtime's settings derived from the spec (flags and the ConfigMap agree)."""
    source = spec.model.source
    if source.startswith("pvc://"):
        model = f"{MODEL_DIR}/{source.removeprefix('pvc://').split('/', 1)[1]}"
    elif source.startswith("file://"):
        model = source.removeprefix("file://")
    else:
        model = "demo"
    ssd_bytes = to_bytes(spec.tiers.ssd.size) * SSD_BUDGET_FRACTION_PERCENT // 100
    return {
        "model": model,
        "served_model_name": spec.model.name,
        "host": "0.0.0.0",
        "port": CONTAINER_PORT,
        "gpu_budget": to_bytes(spec.tiers.gpu.budget),
        "dram_budget": to_bytes(spec.tiers.dram.size),
        "dram_hugepage_dir": HUGEPAGE_DIR,
        "ssd_dir": SSD_DIR,
        "ssd_budget": ssd_bytes - ssd_bytes % (1 << 20),
        "token_budget": spec.attention.token_budget,
        "page_size": spec.attention.page_size,
        "placement": spec.placement,
        "admin_token_file": f"{ADMIN_DIR}/token",
    }


def serve_args(spec: KVDriveSpec) -> list[str]:
    """``kvdrive serve`` flags (ARCHITECTURE.md §4)."""
    s = runtime_settings(spec)
    args = ["serve", "--model", s["model"], "--host", s["host"], "--port", str(s["port"])]
    args += ["--gpu-budget", str(s["gpu_budget"]), "--dram-budget", str(s["dram_budget"])]
    if s["dram_budget"]:
        args += ["--dram-hugepage-dir", s["dram_hugepage_dir"]]
    args += ["--ssd-dir", s["ssd_dir"], "--ssd-budget", str(s["ssd_budget"])]
    args += ["--token-budget", str(s["token_budget"]), "--page-size", str(s["page_size"])]
    args += ["--placement", s["placement"], "--admin-token-file", s["admin_token_file"]]
    args += ["--drain-seconds", str(SERVER_DRAIN_SECONDS)]
    if spec.model.name:
        args += ["--served-model-name", spec.model.name]
    return args


def configmap(cr: KVDriveDeployment) -> dict[str, Any]:
    settings = {k: v for k, v in runtime_settings(cr.spec).items() if v is not None}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cr, Names(cr.metadata.name).configmap, "config"),
        "data": {"config.yaml": yaml.safe_dump(settings, sort_keys=True)},
    }


def secret(cr: KVDriveDeployment, admin_token: str) -> dict[str, Any]:
    """The admin-token Secret (created once; the handlers never overwrite its data)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(cr, Names(cr.metadata.name).secret, "admin-token"),
        "type": "Opaque",
        "data": {"token": base64.b64encode(admin_token.encode()).decode()},
    }


def admin_token_of(secret: dict[str, Any] | None) -> str | None:
    """The admin token held by a Secret made by ``secret()`` (None when absent or not decodable)."""
    try:
        return base64.b64decode((secret or {}).get("data", {}).get("token", ""), validate=True).decode() or None
    except (binascii.Error, UnicodeDecodeError):
        return None


def _ports() -> list[dict[str, Any]]:
    return [{"name": "http", "port": CONTAINER_PORT, "targetPort": "http", "protocol": "TCP"}]


def headless_service(cr: KVDriveDeployment) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cr, Names(cr.metadata.name).headless, "server"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(cr.metadata.name),
            "ports": _ports(),
        },
    }


def client_service(cr: KVDriveDeployment) -> dict[str, Any]:
    port = {"name": "http", "port": cr.spec.service.port, "targetPort": "http", "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cr, Names(cr.metadata.name).service, "server"),
        "spec": {"type": cr.spec.service.type, "selector": selector_labels(cr.metadata.name), "ports": [port]},
    }


def pdb(cr: KVDriveDeployment) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(cr, Names(cr.metadata.name).pdb, "server"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(cr.metadata.name)}},
    }


def _resources(spec: KVDriveSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    limits: dict[str, Any] = {"memory": spec.resources.memory}
    if to_bytes(spec.tiers.dram.size):
        hugepages = f"hugepages-{spec.tiers.dram.huge_page_size}"
        requests[hugepages] = limits[hugepages] = spec.tiers.dram.size  # hugepages: requests == limits
    if spec.resources.gpus:
        limits["nvidia.com/gpu"] = str(spec.resources.gpus)  # the API server stores quantities as strings
    return {"requests": requests, "limits": limits}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _volumes(cr: KVDriveDeployment) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    names = Names(cr.metadata.name)
    spec = cr.spec
    volumes: list[dict[str, Any]] = [
        {"name": "admin-token", "secret": {"secretName": names.secret, "defaultMode": 0o440}},
        {"name": "config", "configMap": {"name": names.configmap}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "admin-token", "mountPath": ADMIN_DIR, "readOnly": True},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": SSD_VOLUME, "mountPath": SSD_DIR},
    ]
    if to_bytes(spec.tiers.dram.size):
        medium = f"HugePages-{spec.tiers.dram.huge_page_size}"
        volumes.append({"name": "hugepages", "emptyDir": {"medium": medium, "sizeLimit": spec.tiers.dram.size}})
        mounts.append({"name": "hugepages", "mountPath": HUGEPAGE_DIR})
    if spec.model.source.startswith("pvc://"):
        claim = spec.model.source.removeprefix("pvc://").split("/", 1)[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return volumes, mounts


def statefulset(cr: KVDriveDeployment, replicas: int | None = None) -> dict[str, Any]:
    spec = cr.spec
    name = cr.metadata.name
    volumes, mounts = _volumes(cr)
    config_hash = hashlib.sha256(json.dumps(configmap(cr)["data"], sort_keys=True).encode()).hexdigest()
    container = {
        "name": "kvdrive",
        "image": spec.image,
        "command": ["kvdrive"],
        "args": serve_args(spec),
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": _probe("/healthz", 10, 60),
        "livenessProbe": _probe("/healthz", 10, 3),
        "readinessProbe": _probe("/readyz", 5, 3),
        # the endpoints drop the pod before SIGTERM arrives; the server then drains within its
        # --drain-seconds, inside terminationGracePeriodSeconds
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": DRAIN_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    claim = {
        "metadata": {"name": SSD_VOLUME, "labels": selector_labels(name)},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": spec.tiers.ssd.storage_class_name,
            "resources": {"requests": {"storage": spec.tiers.ssd.size}},
        },
    }
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(cr, Names(name).statefulset, "server"),
        "spec": {
            "replicas": replicas,
            "serviceName": Names(name).headless,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(name)},
            "updateStrategy": {"type": "RollingUpdate"},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            "template": {
                "metadata": {
                    "labels": common_labels(name, "server"),
                    "annotations": {"kvdrive.io/config-hash": config_hash},
                },
                "spec": pod_spec,
            },
            "volumeClaimTemplates": [claim],
        },
    }
    if replicas is None:  # another writer owns the count (see handlers.statefulset_replicas)
        del sts["spec"]["replicas"]
    return sts


def render(cr: KVDriveDeployment, admin_token: str,
           replicas: int | None | Literal["initial"] = "initial") -> list[dict[str, Any]]:
    """All children of a CR, in creation order (config and secret before the pods need them).

    ``replicas``: the StatefulSet's count; "initial" for the count a new object starts with, None to
    leave the field out (another writer owns it)."""
    if replicas == "initial":
        replicas = cr.spec.desired_replicas()
    return [
        configmap(cr),
        secret(cr, admin_token),
        headless_service(cr),
        client_service(cr),
        statefulset(cr, replicas),
        pdb(cr),
    ]
