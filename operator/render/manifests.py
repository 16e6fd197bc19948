"""Pure rendering of a KVDriveDeployment into its child manifests.

Owns what the runtime's children look like: the StatefulSet running ``kvdrive serve`` (GPU limits,
hugepages sized from the DRAM tier, a local-NVMe claim for the SSD tier, the shared tier's flags and files
from ``sharedtier``, probes, security context), the headless and client Services, the ConfigMap, the
admin-token Secret and the PodDisruptionBudget, and ``render``: every child in creation order, the router's
(``router_manifests``) included when ``spec.routing.mode`` is ``prefix`` or ``inferencepool``, and the
``InferencePool`` (``inferencepool``) in mode ``inferencepool``. No Kubernetes API and no
Kopf here: the same function backs ``kvdrive-operator render`` and the reconcile handlers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any, Literal

import yaml

from kvdrive.operator.api.cr import KVDriveDeployment
from kvdrive.operator.api.quantity import to_bytes
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.render import inferencepool, router_manifests, sharedtier
from kvdrive.operator.render.childmeta import (
    CONTAINER_PORT,
    ENGINE_TYPE,
    ENGINE_TYPE_LABEL,
    Names,
    common_labels,
    container_security,
    object_meta,
    pod_security,
    probe,
    router_selector_labels,
    selector_labels,
)

PRESTOP_SECONDS = 5  # preStop sleep: the Service stops routing to a terminating pod first
POD_IP_ENV = "KVDRIVE_POD_IP"  # the pod's IP (downward API), in its KV-event topic (podsettings.RESERVED_ENV)
DRAIN_MARGIN_SECONDS = 25  # left of the grace period after the server's own drain: flushing the SSD index, exit


def server_drain_seconds(spec: KVDriveSpec) -> int:
    """The server's deadline (--drain-seconds) after SIGTERM: within the pods' grace period (default 120 s:
    5 s preStop + 90 s drain + 25 s to flush and exit)."""
    return spec.termination_grace_period_seconds - PRESTOP_SECONDS - DRAIN_MARGIN_SECONDS
SSD_BUDGET_FRACTION_PERCENT = 90  # leave file-system headroom: the tier never fills the volume
HUGEPAGE_DIR = "/var/lib/kvdrive/hugepages"
SSD_DIR = "/var/lib/kvdrive/ssd"
MODEL_DIR = "/models"
ADMIN_DIR = "/var/run/kvdrive/admin"
CONFIG_DIR = "/etc/kvdrive"
SSD_VOLUME = "kv-ssd"


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
        # a pod that reserves GPUs computes on them; one that reserves none on its CPU
        "device": "cuda" if spec.resources.gpus else "cpu",
        "host": "0.0.0.0",
        "port": CONTAINER_PORT,
        "gpu_budget": to_bytes(spec.tiers.gpu.budget),
        "dram_budget": to_bytes(spec.tiers.dram.size),
        "dram_hugepage_dir": HUGEPAGE_DIR,
        "ssd_dir": SSD_DIR,
        "ssd_budget": ssd_bytes - ssd_bytes % (1 << 20),
        "token_budget": spec.attention.token_budget,
        "page_size": spec.attention.page_size,
        "max_running": spec.concurrency.max_running,
        "max_sequences": spec.max_sequences(),
        "placement": spec.placement,
        "admin_token_file": f"{ADMIN_DIR}/token",
    }


def serve_args(spec: KVDriveSpec, namespace: str) -> list[str]:
    """``kvdrive serve`` flags (ARCHITECTURE.md §4); ``namespace``: the CR's (a shared tier's Service in it)."""
    s = runtime_settings(spec)
    args = ["serve", "--model", s["model"], "--device", s["device"], "--host", s["host"], "--port", str(s["port"])]
    args += ["--gpu-budget", str(s["gpu_budget"]), "--dram-budget", str(s["dram_budget"])]
    if s["dram_budget"]:
        args += ["--dram-hugepage-dir", s["dram_hugepage_dir"]]
    args += ["--ssd-dir", s["ssd_dir"], "--ssd-budget", str(s["ssd_budget"])]
    args += ["--token-budget", str(s["token_budget"]), "--page-size", str(s["page_size"])]
    args += ["--max-running", str(s["max_running"]), "--max-sequences", str(s["max_sequences"])]
    args += ["--placement", s["placement"], "--admin-token-file", s["admin_token_file"]]
    args += ["--drain-seconds", str(server_drain_seconds(spec))]
    if spec.model.name:
        args += ["--served-model-name", spec.model.name]
    if spec.kv_events.enabled:
        ev = spec.kv_events
        # llm-d's topic: kv@<pod>@<model> (the pod's IP from the downward API, the model as the server names it)
        args += ["--kv-events-endpoint", f"tcp://*:{ev.port}", "--kv-events-replay-endpoint",
                 f"tcp://*:{ev.replay_port}", "--kv-events-topic", f"kv@$({POD_IP_ENV})@{{model}}",
                 "--kv-events-hashes", ev.hashes]
    return args + sharedtier.args(spec, namespace)


def configmap(cr: KVDriveDeployment) -> dict[str, Any]:
    settings = {k: v for k, v in runtime_settings(cr.spec).items() if v is not None}
    settings.update(sharedtier.settings(cr.spec, cr.metadata.namespace))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(cr, Names(cr.metadata.name).configmap, "config"),
        "data": {"config.yaml": yaml.safe_dump(settings, sort_keys=True)},
    }


def secret(cr: KVDriveDeployment, admin_token: str) -> dict[str, Any]:
    """The admin-token Secret (created once; the handlers never overwrite its data)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(cr, Names(cr.metadata.name).secret, "admin-token"),
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
        "metadata": object_meta(cr, Names(cr.metadata.name).headless, "server"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(cr.metadata.name),
            "ports": _ports(),
        },
    }


def client_service(cr: KVDriveDeployment, to_router: bool | None = None) -> dict[str, Any]:
    """The Service clients use (``status.endpoint``). It selects the router's pods when ``to_router``
    (default: whenever routing is on), else the runtime's; both name their container port ``http``."""
    if to_router is None:
        to_router = router_manifests.enabled(cr.spec)
    name = cr.metadata.name
    port = {"name": "http", "port": cr.spec.service.port, "targetPort": "http", "protocol": "TCP"}
    selector = router_selector_labels(name) if to_router else selector_labels(name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(cr, Names(name).service, "server"),
        "spec": {"type": cr.spec.service.type, "selector": selector, "ports": [port]},
    }


def pdb(cr: KVDriveDeployment) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(cr, Names(cr.metadata.name).pdb, "server"),
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
    shared_volumes, shared_mounts = sharedtier.volumes(spec)
    volumes += shared_volumes
    mounts += shared_mounts
    volumes += [v.model_dump(by_alias=True, exclude_none=True) for v in spec.extra_volumes]
    mounts += [m.model_dump(by_alias=True, exclude_none=True) for m in spec.extra_volume_mounts]
    return volumes, mounts


def _event_ports(spec: KVDriveSpec) -> list[dict[str, Any]]:
    """The KV-event sockets' container ports (spec.kvEvents), none when off."""
    if not spec.kv_events.enabled:
        return []
    return [{"name": "kv-events", "containerPort": spec.kv_events.port, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": spec.kv_events.replay_port, "protocol": "TCP"}]


def statefulset(cr: KVDriveDeployment, replicas: int | None = None) -> dict[str, Any]:
    spec = cr.spec
    name = cr.metadata.name
    volumes, mounts = _volumes(cr)
    config_hash = hashlib.sha256(json.dumps(configmap(cr)["data"], sort_keys=True).encode()).hexdigest()
    container = {
        "name": "kvdrive",
        "image": spec.image,
        "command": ["kvdrive"],
        "args": serve_args(spec, cr.metadata.namespace),
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}, *_event_ports(spec)],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": probe("/healthz", 10, 60),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 3),
        # the endpoints drop the pod before SIGTERM arrives; the server then drains within its
        # --drain-seconds, inside terminationGracePeriodSeconds
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "securityContext": {**container_security(), **spec.security_context.model_dump(by_alias=True,
                                                                                         exclude_none=True)},
    }
    env = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.env]
    if not spec.resources.gpus:
        # the runtime image sets NVIDIA_VISIBLE_DEVICES=all: where the NVIDIA runtime is the node's
        # default, a container without a GPU limit would otherwise be handed every GPU of the node
        env.insert(0, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
    if spec.kv_events.enabled:
        env.insert(0, {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if env:
        container["env"] = env
    if spec.env_from:
        container["envFrom"] = [dict(e) for e in spec.env_from]
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "securityContext": pod_security(fs_group=True),
        # a service account of the user's is there to be used (workload identity, registry access)
        "automountServiceAccountToken": spec.service_account_name is not None,
        "containers": [container],
        "volumes": volumes,
    }
    for key, value in (("serviceAccountName", spec.service_account_name),
                       ("priorityClassName", spec.priority_class_name),
                       ("runtimeClassName", spec.runtime_class_name)):
        if value is not None:
            pod_spec[key] = value
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [r.model_dump(by_alias=True) for r in spec.image_pull_secrets]
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
        "metadata": object_meta(cr, Names(name).statefulset, "server"),
        "spec": {
            "replicas": replicas,
            "serviceName": Names(name).headless,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(name)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxUnavailable": spec.rollout.max_unavailable, "partition": spec.rollout.partition}},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            "template": {
                "metadata": {
                    # the engine-type label tells an inference gateway's endpoint picker which metric names
                    # this pod serves (docs/gateway-api-inference-extension.md)
                    "labels": {**spec.pod_labels, **common_labels(name, "server"), ENGINE_TYPE_LABEL: ENGINE_TYPE},
                    "annotations": {**spec.pod_annotations, "kvdrive.io/config-hash": config_hash},
                },
                "spec": pod_spec,
            },
            "volumeClaimTemplates": [claim],
        },
    }
    if replicas is None:  # another writer owns the count (see handlers.statefulset_replicas)
        del sts["spec"]["replicas"]
    return sts


def render(cr: KVDriveDeployment, admin_token: str, replicas: int | None | Literal["initial"] = "initial",
           clients_to_router: bool | None = None) -> list[dict[str, Any]]:
    """All children of a CR, in creation order (config and secret before the pods need them; the
    router's ServiceAccount and RBAC before its Deployment; the InferencePool after the router's Service).

    ``replicas``: the StatefulSet's count; "initial" for the count a new object starts with, None to
    leave the field out (another writer owns it). ``clients_to_router``: whether the client Service
    selects the router's pods (default: whenever routing is on; the handlers hold it back until a
    router pod is ready)."""
    if replicas == "initial":
        replicas = cr.spec.desired_replicas()
    return [
        configmap(cr),
        secret(cr, admin_token),
        headless_service(cr),
        client_service(cr, clients_to_router),
        statefulset(cr, replicas),
        pdb(cr),
        *router_manifests.render(cr),
        *inferencepool.render(cr),
    ]
