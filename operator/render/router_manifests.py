"""Pure rendering of the prefix-aware router in front of a KVDriveDeployment's replicas.

Owns what the router's children look like when ``spec.routing.mode`` is ``prefix`` or ``inferencepool``:
a Deployment running ``kvdrive route`` from the runtime's image, its own ServiceAccount (the only KVDrive pods
that mount an API token), a Role and RoleBinding that let it read exactly the EndpointSlices of its
namespace (get/list/watch, nothing else: it discovers the replicas through the headless Service's
slices), its ClusterIP Service and its PodDisruptionBudget. Every one is named ``<name>-router`` and
labelled ``app.kubernetes.io/name: kvdrive-router``, so that no runtime selector (StatefulSet,
headless Service, PDB, ServiceMonitor) matches a router pod and the router's selectors match no
runtime pod. With routing off nothing is rendered; ``KINDS`` tells the handlers what to delete then.
In mode ``inferencepool`` the router is also the ``InferencePool``'s endpoint picker (``inferencepool``):
it runs with ``--ext-proc-port`` and its pods and Service get that gRPC port beside plain HTTP; the
balancing policy is ``prefix`` in both modes.
"""

from __future__ import annotations

import copy
from typing import Any

from kvdrive.operator.api.cr import KVDriveDeployment
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.render import inferencepool
from kvdrive.operator.render.childmeta import (
    CONTAINER_PORT,
    ROUTER_APP,
    Names,
    common_labels,
    container_security,
    object_meta,
    pod_security,
    probe,
    router_selector_labels,
)

COMPONENT = "router"
ROUTER_PORT = 8080  # `kvdrive route --port`
POLICY = "prefix"  # `kvdrive route --policy`, in modes prefix and inferencepool alike
# A streamed answer passes through the router for as long as the runtime may take to finish it: the router
# pods get the runtime pods' grace period (spec.terminationGracePeriodSeconds: a preStop sleep plus the
# server's own drain deadline).
PRESTOP_SECONDS = 5  # the Services stop sending new requests to a terminating router first
# Creation order (the ServiceAccount and its rights before the pods that use them). The handlers
# delete in the reverse order, so the ServiceAccount goes last: while any router object is left, the
# ServiceAccount is too, and one read of it tells whether there is anything to delete.
KINDS = ("ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget", "Deployment")
# What the router may do: read the EndpointSlices of its own namespace. The operator must hold the
# same rights to grant them (the API server's RBAC escalation check).
ENDPOINTSLICE_RULE: dict[str, Any] = {
    "apiGroups": ["discovery.k8s.io"],
    "resources": ["endpointslices"],
    "verbs": ["get", "list", "watch"],
}


def enabled(spec: KVDriveSpec) -> bool:
    return spec.routing.mode != "none"


def route_args(cr: KVDriveDeployment) -> list[str]:
    """``kvdrive route`` flags: replicas from the headless Service's EndpointSlices, on the runtime's port;
    in mode inferencepool also the Envoy ext_proc endpoint picker's port."""
    args = [
        "route", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
        "--service", Names(cr.metadata.name).headless, "--namespace", cr.metadata.namespace,
        "--backend-port", str(CONTAINER_PORT), "--policy", POLICY,
    ]
    if inferencepool.enabled(cr.spec):
        args += ["--ext-proc-port", str(inferencepool.EXT_PROC_PORT)]
    return args


def _meta(cr: KVDriveDeployment) -> dict[str, Any]:
    return object_meta(cr, Names(cr.metadata.name).router, COMPONENT, ROUTER_APP)


def service_account(cr: KVDriveDeployment) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cr), "automountServiceAccountToken": True}


def role(cr: KVDriveDeployment) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(cr),
        "rules": [copy.deepcopy(ENDPOINTSLICE_RULE)],
    }


def role_binding(cr: KVDriveDeployment) -> dict[str, Any]:
    name = Names(cr.metadata.name).router
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(cr),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": cr.metadata.namespace}],
    }


def service(cr: KVDriveDeployment) -> dict[str, Any]:
    """The router's own address (same port as the client Service, which selects the same pods); in mode
    inferencepool also its ext_proc port, the one the InferencePool's endpointPickerRef names."""
    ports: list[dict[str, Any]] = [
        {"name": "http", "port": cr.spec.service.port, "targetPort": "http", "protocol": "TCP"}]
    if inferencepool.enabled(cr.spec):
        ports.append({"name": inferencepool.EXT_PROC_SERVICE_PORT, "port": inferencepool.EXT_PROC_PORT,
                      "targetPort": inferencepool.EXT_PROC_CONTAINER_PORT, "protocol": "TCP",
                      "appProtocol": inferencepool.EXT_PROC_APP_PROTOCOL})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cr),
        "spec": {"type": "ClusterIP", "selector": router_selector_labels(cr.metadata.name), "ports": ports},
    }


def pdb(cr: KVDriveDeployment) -> dict[str, Any]:
    # maxUnavailable 1 rather than minAvailable 1: with routing.replicas 1, minAvailable 1 would block
    # every voluntary eviction (a node drain would hang); maxUnavailable 1 never blocks a drain for
    # good and still keeps n-1 >= 1 routers serving whenever there are two or more.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(cr),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector_labels(cr.metadata.name)}},
    }


def container_ports(cr: KVDriveDeployment) -> list[dict[str, Any]]:
    """HTTP; in mode inferencepool also ext_proc (gRPC, with grpc.health.v1 on the same port)."""
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}]
    if inferencepool.enabled(cr.spec):
        ports.append({"name": inferencepool.EXT_PROC_CONTAINER_PORT, "containerPort": inferencepool.EXT_PROC_PORT,
                      "protocol": "TCP"})
    return ports


def deployment(cr: KVDriveDeployment) -> dict[str, Any]:
    name = cr.metadata.name
    container = {
        "name": "router",
        "image": cr.spec.image,
        "command": ["kvdrive"],
        "args": route_args(cr),
        "ports": container_ports(cr),
        # it tokenizes prompts to hash their prefixes: a quarter core and a tokenizer's memory
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "startupProbe": probe("/healthz", 5, 24),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 3),  # 503 until it reaches a ready replica
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "securityContext": container_security(),
    }
    selector = router_selector_labels(name)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": Names(name).router,
        "automountServiceAccountToken": True,  # it lists EndpointSlices with the in-cluster config
        "terminationGracePeriodSeconds": cr.spec.termination_grace_period_seconds,
        "securityContext": pod_security(fs_group=False),
        # spread over nodes where the scheduler can, so that one node's loss leaves a router
        "topologySpreadConstraints": [{
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(selector)},
        }],
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cr),
        "spec": {
            "replicas": cr.spec.routing.replicas,
            "selector": {"matchLabels": selector},
            # a new router is ready before an old one goes: clients always have one
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": common_labels(name, COMPONENT, ROUTER_APP)}, "spec": pod_spec},
        },
    }


def render(cr: KVDriveDeployment) -> list[dict[str, Any]]:
    """The router's children in ``KINDS`` order; none with routing off."""
    if not enabled(cr.spec):
        return []
    return [service_account(cr), role(cr), role_binding(cr), service(cr), pdb(cr), deployment(cr)]
