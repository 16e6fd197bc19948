"""The InferencePool of ``spec.routing.mode: inferencepool``, as rendered: it selects exactly the runtime pods,
names the router's ext_proc port as its endpoint picker, follows the spec's failure mode, and the Gateway API
Inference Extension's CRD schema and CEL rules accept it (and catch a broken one)."""

from __future__ import annotations

from typing import Any

import pytest
from crdcheck import crd_violations, load_example
from giecrd import load_gie_crd
from test_manifests import _by_kind, _cr

from kvdrive.operator.api.cr import KVDriveDeployment
from kvdrive.operator.render.childmeta import selector_labels
from kvdrive.operator.render.manifests import render


def _pool_cr(**routing: Any) -> KVDriveDeployment:
    doc = load_example("minimal.yaml")
    doc["metadata"]["name"] = "demo"
    return _cr(doc, routing={"mode": "inferencepool", **routing})


def test_the_inference_pool_selects_exactly_the_runtime_pods_and_names_the_router_as_picker() -> None:
    cr = _pool_cr()
    kinds = _by_kind(render(cr, "t"))
    (pool,) = kinds["InferencePool"]
    assert pool == {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "demo", "namespace": "default",
            "labels": {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "demo",
                       "app.kubernetes.io/component": "inference-pool", "app.kubernetes.io/part-of": "kvdrive",
                       "app.kubernetes.io/managed-by": "kvdrive-operator"},
            "ownerReferences": [{"apiVersion": "kvdrive.io/v1alpha1", "kind": "KVDriveDeployment", "name": "demo",
                                 "uid": cr.metadata.uid, "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "demo"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": "demo-router", "port": {"number": 9002},
                                  "failureMode": "FailClose"},
        },
    }
    # the selector is the runtime's own, exactly: what the StatefulSet selects and the headless Service serves
    selector = pool["spec"]["selector"]["matchLabels"]
    (sts,) = kinds["StatefulSet"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    assert selector == selector_labels("demo") == sts["spec"]["selector"]["matchLabels"]
    assert selector == services["demo-headless"]["spec"]["selector"]
    runtime_pod = sts["spec"]["template"]["metadata"]["labels"]
    (router,) = kinds["Deployment"]
    router_pod = router["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= runtime_pod.items() and not selector.items() <= router_pod.items()
    # the target port is where kvdrive serve listens
    (runtime,) = sts["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in runtime["ports"] if p["name"] == "http"] == [8000]
    # the picker: a port of the router's Service (the number GIE dials) onto the router's gRPC container port
    picker = pool["spec"]["endpointPickerRef"]
    (port,) = [p for p in services[picker["name"]]["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    assert port == {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc", "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c"}
    assert services[picker["name"]]["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert {"name": "grpc", "containerPort": 9002, "protocol": "TCP"} in container["ports"]
    args = container["args"]
    assert args[args.index("--policy") + 1] == "prefix"
    assert args[args.index("--ext-proc-port") + 1] == "9002"
    # plain HTTP stays as in mode prefix: its port, its probes, the client Service
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert services["demo"]["spec"]["ports"][0]["targetPort"] == "http"


def test_the_failure_mode_follows_the_spec_and_other_modes_render_no_pool() -> None:
    (pool,) = _by_kind(render(_pool_cr(inferencePool={"failureMode": "FailOpen"}), "t"))["InferencePool"]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert crd_violations(load_gie_crd(), pool) == []
    for mode in ("prefix", "none"):
        kinds = _by_kind(render(_pool_cr(mode=mode), "t"))
        assert "InferencePool" not in kinds
        for router in kinds.get("Deployment", []):  # mode prefix: the same router, without ext_proc
            (container,) = router["spec"]["template"]["spec"]["containers"]
            assert "--ext-proc-port" not in container["args"] and [p["name"] for p in container["ports"]] == ["http"]
            assert container["args"][container["args"].index("--policy") + 1] == "prefix"
        assert all(p["name"] == "http" for s in kinds["Service"] for p in s["spec"]["ports"])


def test_only_the_router_service_of_mode_inferencepool_says_a_pool_may_exist() -> None:
    """What the handlers read before deleting a pool (``pruning``): the rendered router Service of mode
    inferencepool has the port the pool's picker reference names; those of the other modes do not."""
    from kvdrive.operator.render.inferencepool import serves_ext_proc

    def router_service(mode: str) -> dict[str, Any] | None:
        found = [s for s in _by_kind(render(_pool_cr(mode=mode), "t"))["Service"]
                 if s["metadata"]["name"] == "demo-router"]
        return found[0] if found else None

    assert serves_ext_proc(router_service("inferencepool"))
    assert not serves_ext_proc(router_service("prefix")) and not serves_ext_proc(router_service("none"))
    assert router_service("none") is None and not serves_ext_proc({"spec": {}})


@pytest.mark.parametrize(("field", "value", "says"), [
    ("targetPorts", None, "targetPorts"),
    ("targetPorts", [{"number": 8000}, {"number": 8000}], "port number must be unique"),
    ("endpointPickerRef", {"name": "demo-router"}, "port is required"),
    ("selector", {"matchLabels": {}}, "matchLabels"),
    ("targetPort", [{"number": 8000}], "targetPort"),
])
def test_the_gie_schema_catches_a_broken_pool(field: str, value: Any, says: str) -> None:
    """The offline check of the pool can fail: the GIE CRD's required fields, bounds, unknown fields and CEL."""
    (pool,) = _by_kind(render(_pool_cr(), "t"))["InferencePool"]
    if value is None:
        del pool["spec"][field]
    else:
        pool["spec"][field] = value
    violations = crd_violations(load_gie_crd(), pool)
    assert violations and any(says in f"{v.path} {v.message}" for v in violations), violations
