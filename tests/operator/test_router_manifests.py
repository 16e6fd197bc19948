"""The router's children (``spec.routing.mode: prefix``, and ``inferencepool`` as endpoint picker): valid for Kubernetes, selectors that never
cross the runtime's, least-privilege RBAC, a command line the router accepts, the client Service's
switch, and nothing at all with routing off."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from crdcheck import load_example
from test_manifests import _by_kind, _cr

from kvdrive.operator.api.cr import KVDriveDeployment
from kvdrive.operator.render import manifests, router_manifests
from kvdrive.operator.render.childmeta import selector_labels
from kvdrive.operator.render.manifests import render

ROUTER_KINDS = ["ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget", "Deployment"]


def _routed(example: str = "full.yaml", **routing: Any) -> KVDriveDeployment:
    return _cr(load_example(example), routing={"mode": "prefix", **routing})


def _named(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _router_children(cr: KVDriveDeployment) -> list[dict[str, Any]]:
    return [c for c in render(cr, "t") if c["metadata"]["name"] == "chat-router"]


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_router_children_validate_strictly(version: str) -> None:
    children = render(_routed(), "t")
    assert [c["kind"] for c in children[6:]] == ROUTER_KINDS
    assert [c["metadata"]["name"] for c in children[6:]] == ["chat-router"] * 6
    for child in children:
        kubernetes_validate.validate(child, version, strict=True)


def test_routing_off_renders_no_router_and_the_client_service_selects_the_replicas() -> None:
    for cr in (_cr(load_example("full.yaml")), _cr(load_example("minimal.yaml"), routing={"mode": "none"})):
        children = render(cr, "t")
        assert [c["kind"] for c in children] == [
            "ConfigMap", "Secret", "Service", "Service", "StatefulSet", "PodDisruptionBudget"]
        name = cr.metadata.name
        client = _named(children, "Service", name)
        assert client["spec"]["selector"] == {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": name}
        assert router_manifests.render(cr) == []


def test_the_client_service_selects_the_router_only_when_told() -> None:
    cr = _routed()
    by_default = _named(render(cr, "t"), "Service", "chat")
    held_back = _named(render(cr, "t", clients_to_router=False), "Service", "chat")
    deployment = _named(render(cr, "t"), "Deployment", "chat-router")
    sts = _named(render(cr, "t"), "StatefulSet", "chat")
    router_pod = deployment["spec"]["template"]["metadata"]["labels"]
    runtime_pod = sts["spec"]["template"]["metadata"]["labels"]
    assert _matches(by_default["spec"]["selector"], router_pod) and not _matches(by_default["spec"]["selector"],
                                                                                 runtime_pod)
    assert _matches(held_back["spec"]["selector"], runtime_pod) and not _matches(held_back["spec"]["selector"],
                                                                                 router_pod)
    # the same port either way: targetPort "http" names the router's 8080 and the runtime's 8000
    assert by_default["spec"]["ports"] == held_back["spec"]["ports"]
    assert by_default["spec"]["ports"][0]["targetPort"] == "http"
    for container in (deployment["spec"]["template"]["spec"]["containers"][0],
                      sts["spec"]["template"]["spec"]["containers"][0]):
        assert [p["name"] for p in container["ports"] if p["name"] == "http"] == ["http"]  # (+ kv-events ports)


def test_router_and_runtime_selectors_never_cross() -> None:
    children = render(_routed(), "t")
    deployment = _named(children, "Deployment", "chat-router")
    sts = _named(children, "StatefulSet", "chat")
    router_pod = deployment["spec"]["template"]["metadata"]["labels"]
    runtime_pod = sts["spec"]["template"]["metadata"]["labels"]
    runtime_selectors = {
        "StatefulSet": sts["spec"]["selector"]["matchLabels"],
        "headless Service": _named(children, "Service", "chat-headless")["spec"]["selector"],
        "runtime PDB": _named(children, "PodDisruptionBudget", "chat")["spec"]["selector"]["matchLabels"],
    }
    router_selectors = {
        "Deployment": deployment["spec"]["selector"]["matchLabels"],
        "router Service": _named(children, "Service", "chat-router")["spec"]["selector"],
        "router PDB": _named(children, "PodDisruptionBudget", "chat-router")["spec"]["selector"]["matchLabels"],
        "spread constraint": deployment["spec"]["template"]["spec"]["topologySpreadConstraints"][0][
            "labelSelector"]["matchLabels"],
    }
    for what, selector in runtime_selectors.items():
        assert _matches(selector, runtime_pod) and not _matches(selector, router_pod), what
    for what, selector in router_selectors.items():
        assert _matches(selector, router_pod) and not _matches(selector, runtime_pod), what
    # the status' selector (scale subresource, the live loop's pod list) is the runtime's
    assert selector_labels("chat") == runtime_selectors["StatefulSet"]
    assert router_pod["app.kubernetes.io/component"] == "router"
    assert router_pod["app.kubernetes.io/instance"] == "chat"  # pod events still find their CR


def test_rbac_is_exactly_endpointslices_read_in_the_namespace() -> None:
    cr = _routed()
    kinds = _by_kind(_router_children(cr))
    (role,), (binding,), (account,) = kinds["Role"], kinds["RoleBinding"], kinds["ServiceAccount"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert role["metadata"]["namespace"] == "inference"  # a Role, not a ClusterRole
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "inference"}]
    assert account["automountServiceAccountToken"] is True
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-router" and pod["automountServiceAccountToken"] is True
    # the runtime pods still get no token
    assert _named(render(cr, "t"), "StatefulSet", "chat")["spec"]["template"]["spec"][
        "automountServiceAccountToken"] is False


def test_the_router_runs_kvdrive_route_against_the_headless_service() -> None:
    cr = _routed(replicas=3)
    children = render(cr, "t")
    deployment = _named(children, "Deployment", "chat-router")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == cr.spec.image and container["command"] == ["kvdrive"]
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert args[0] == "route"
    headless = _named(children, "Service", "chat-headless")
    runtime_port = _named(children, "StatefulSet", "chat")["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert flags == {"--host": "0.0.0.0", "--port": "8080", "--service": headless["metadata"]["name"],
                     "--namespace": "inference", "--backend-port": str(runtime_port["containerPort"]),
                     "--policy": "prefix"}
    assert headless["spec"]["ports"][0]["name"] == runtime_port["name"] == "http"  # the slices' port name
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["resources"]["requests"] == {"cpu": "250m", "memory": "512Mi"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and pod["securityContext"]["runAsNonRoot"] is True
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "nodeSelector" not in pod and "tolerations" not in pod  # the GPU pods' placement is not the router's
    runtime_pod = manifests.statefulset(cr)["spec"]["template"]["spec"]  # streams drain through the router
    assert pod["terminationGracePeriodSeconds"] == runtime_pod["terminationGracePeriodSeconds"]
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0
    service = _named(children, "Service", "chat-router")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert _named(children, "PodDisruptionBudget", "chat-router")["spec"]["maxUnavailable"] == 1


def test_the_router_accepts_its_command_line() -> None:
    from kvdrive.runtime.cli import build_parser

    parser = build_parser()
    deployment = _named(render(_routed(), "t"), "Deployment", "chat-router")
    args = parser.parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (args.command, args.service, args.namespace, args.backend_port, args.policy, args.port) == (
        "route", "chat-headless", "inference", 8000, "prefix", 8080)


def test_the_router_accepts_its_command_line_as_endpoint_picker() -> None:
    """Mode inferencepool: the same router, serving Envoy ext_proc on the port the InferencePool's picker
    reference names."""
    from kvdrive.runtime.cli import build_parser

    parser = build_parser()
    deployment = _named(render(_routed(mode="inferencepool"), "t"), "Deployment", "chat-router")
    args = parser.parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    pool = _named(render(_routed(mode="inferencepool"), "t"), "InferencePool", "chat")
    assert (args.command, args.policy, args.port, args.ext_proc_port) == ("route", "prefix", 8080, 9002)
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == args.ext_proc_port


def test_router_children_are_owned_and_labelled() -> None:
    cr = _routed()
    for child in _router_children(cr):
        meta = child["metadata"]
        (owner,) = meta["ownerReferences"]
        assert owner["uid"] == cr.metadata.uid and owner["controller"] and owner["blockOwnerDeletion"]
        assert meta["labels"] == {
            "app.kubernetes.io/name": "kvdrive-router", "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/component": "router", "app.kubernetes.io/part-of": "kvdrive",
            "app.kubernetes.io/managed-by": "kvdrive-operator"}
        assert meta["namespace"] == "inference"


def test_the_service_account_is_created_first() -> None:
    """The handlers delete in the reverse order and read only the ServiceAccount to know whether any
    router object is left: it must come first in creation order."""
    assert router_manifests.KINDS[0] == "ServiceAccount"
    assert [c["kind"] for c in router_manifests.render(_routed())] == list(router_manifests.KINDS)
