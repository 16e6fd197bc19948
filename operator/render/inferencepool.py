"""Pure rendering of the ``InferencePool`` of ``spec.routing.mode: inferencepool``.

Owns the Gateway API Inference Extension side of a KVDriveDeployment: the ``InferencePool``
(``inference.networking.k8s.io/v1``, a CRD of kubernetes-sigs/gateway-api-inference-extension) named
like the CR, whose selector matches exactly the runtime pods (the StatefulSet's selector labels, never
a router pod), whose target port is the runtime's ``kvdrive serve`` port, and whose
``endpointPickerRef`` names the router's Service on its Envoy ``ext_proc`` port: the router is the
pool's endpoint picker and keeps serving plain HTTP as in mode ``prefix``. Also what that port is
called on the router's pods and Service (``router_manifests`` renders them), and how one can tell from
the router's Service that a pool may exist (the handlers prune it without asking an API server that may
not serve the kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdrive.operator.api.cr import KVDriveDeployment
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.render.childmeta import CONTAINER_PORT, Names, object_meta, selector_labels

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
CRD_NAME = f"{PLURAL}.{GROUP}"
COMPONENT = "inference-pool"
EXT_PROC_PORT = 9002  # `kvdrive route --ext-proc-port`: Envoy ext_proc (gRPC) and grpc.health.v1; GIE's default
EXT_PROC_CONTAINER_PORT = "grpc"  # the router container's port name
EXT_PROC_SERVICE_PORT = "grpc-ext-proc"  # the router Service's port name (as GIE's endpoint picker Service)
# gRPC is HTTP/2 without TLS: the Kubernetes-standard application protocol, read by gateways (Istio,
# Envoy Gateway, GKE) to speak h2c to the picker rather than HTTP/1.1
EXT_PROC_APP_PROTOCOL = "kubernetes.io/h2c"


def enabled(spec: KVDriveSpec) -> bool:
    return spec.routing.mode == "inferencepool"


def pool(cr: KVDriveDeployment) -> dict[str, Any]:
    """The InferencePool: the runtime pods on their serving port, picked by the router's ext_proc."""
    names = Names(cr.metadata.name)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": object_meta(cr, names.pool, COMPONENT),
        "spec": {
            "selector": {"matchLabels": selector_labels(cr.metadata.name)},
            # appProtocol left to its default, http (kvdrive serve speaks HTTP/1.1): the field exists from
            # GIE v1.4.0 only, and everything rendered here is in the v1 API since v1.0.0
            "targetPorts": [{"number": CONTAINER_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": names.router,
                "port": {"number": EXT_PROC_PORT},  # the Service's port (GIE: not the target port)
                "failureMode": cr.spec.routing.inference_pool.failure_mode,
            },
        },
    }


def render(cr: KVDriveDeployment) -> list[dict[str, Any]]:
    """The InferencePool in mode inferencepool; nothing otherwise."""
    return [pool(cr)] if enabled(cr.spec) else []


def serves_ext_proc(router_service: Mapping[str, Any] | None) -> bool:
    """Whether the router's Service (as read from the API server) has the ext_proc port: the CR was in mode
    inferencepool when it was last applied, so an InferencePool of it may exist."""
    ports = ((router_service or {}).get("spec") or {}).get("ports") or []
    return any(port.get("name") == EXT_PROC_SERVICE_PORT for port in ports)
