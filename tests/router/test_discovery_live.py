"""Replica discovery from a Service's EndpointSlices on a real kube-apiserver, as the router's pod does it:
with a ServiceAccount that may only get/list/watch EndpointSlices in its namespace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvdrive.router.discovery import EndpointSliceDiscovery


def _slice(name: str, service: str, endpoints: list[tuple[str, bool | None]], port: int = 8000) -> dict[str, Any]:
    eps = []
    for address, ready in endpoints:
        ep: dict[str, Any] = {"addresses": [address]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        eps.append(ep)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}], "endpoints": eps}


def _kubeconfig_for(plane: Any, token: str, path: Path) -> Path:
    own = yaml.safe_load(plane.kubeconfig.read_text())
    cluster = own["clusters"][0]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [cluster],
        "users": [{"name": "router", "user": {"token": token}}],
        "contexts": [{"name": "router", "context": {"cluster": cluster["name"], "user": "router"}}],
        "current-context": "router"}))
    return path


def test_the_router_sees_the_ready_endpoints_of_its_service_only(control_plane: Any, tmp_path: Path) -> None:
    from kubernetes import client

    plane = control_plane
    ns = plane.new_namespace()
    api = plane.client()
    discovery_api = client.DiscoveryV1Api(api)
    discovery_api.create_namespaced_endpoint_slice(ns, _slice("kv-abc", "kv-headless", [
        ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)]))
    discovery_api.create_namespaced_endpoint_slice(ns, _slice("kv-def", "kv-headless", [("10.0.0.4", True)],
                                                              port=9000))
    discovery_api.create_namespaced_endpoint_slice(ns, _slice("other", "other-svc", [("10.0.0.9", True)]))

    # the router's own identity: endpointslices get/list/watch in this namespace, nothing else
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(ns, {"metadata": {"name": "router"}})
    rbac.create_namespaced_role(ns, {"metadata": {"name": "router"}, "rules": [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]})
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": "router"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                    "name": "router"},
        "subjects": [{"kind": "ServiceAccount", "name": "router", "namespace": ns}]})
    kubeconfig = _kubeconfig_for(plane, plane.service_account_token(ns, "router"), tmp_path / "router.kubeconfig")

    found = EndpointSliceDiscovery("kv-headless", ns, 8000, "http", kubeconfig=str(kubeconfig))()
    assert found == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.0.4:9000"]

    discovery_api.delete_namespaced_endpoint_slice("kv-def", ns)  # a replica went away
    assert EndpointSliceDiscovery("kv-headless", ns, 8000, "http", kubeconfig=str(kubeconfig))() == [
        "http://10.0.0.1:8000", "http://10.0.0.3:8000"]
