"""The Helm chart rendered and linted by the real Helm library, every object validated.

Helm (helm-python-sdk) renders the chart for its defaults and for ``ci/all-on-values.yaml``;
each built-in object must pass ``kubernetes-validate`` strict for Kubernetes 1.30 and 1.33,
each ServiceMonitor the Prometheus Operator's own models (unknown fields rejected).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chartrender import CHART, NAMESPACE, RELEASE, render_chart, render_notes

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
ALL_ON = yaml.safe_load((CHART / "ci" / "all-on-values.yaml").read_text())
KUBE_VERSIONS = ("1.30", "1.33")
VALUE_SETS = {"defaults": {}, "all-on": ALL_ON}


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        found.setdefault(obj["kind"], []).append(obj)
    return found


def validate_service_monitor(obj: dict[str, Any]) -> None:
    """Against the Prometheus Operator's ServiceMonitor model: a field it does not know is dropped
    by the round trip, so the round trip must give back the same object."""
    models = pytest.importorskip("cloudcoil.models.prometheus_operator.v1")
    model = models.ServiceMonitor.model_validate(obj)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_every_rendered_object_validates(values: dict[str, Any], kube: str) -> None:
    objects = render_chart(values)
    assert objects
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            validate_service_monitor(obj)
        else:
            kubernetes_validate.validate(obj, kube, strict=True)


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_the_chart_crds_validate(kube: str) -> None:
    with helm_python.Chart.load(CHART) as chart:
        crds = chart.crds
    assert [c["filename"] for c in crds] == ["kvdrive-operator/crds/kvdrivedeployment.yaml"]
    for crd in crds:
        kubernetes_validate.validate(yaml.safe_load(crd["data"]), kube, strict=True)


def test_the_chart_crds_are_the_top_level_crds() -> None:
    top = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == top
    for name in top:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/kvdrive-operator/crds/{name} differs from crds/{name}: run `make sync-crds`"
        )


def test_kinds_for_defaults_and_all_on() -> None:
    default = _by_kind(render_chart({}))
    assert sorted(default) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    full = _by_kind(render_chart(ALL_ON))
    assert sorted(full) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount", "ServiceMonitor"]
    assert len(full["ServiceMonitor"]) == 2


@pytest.mark.parametrize("kube", ["v1.30.0", "v1.33.0"])
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_helm_lint_passes(values: dict[str, Any], kube: str) -> None:
    report = helm_python.lint(CHART, values, strict=True, kube_version=kube)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = _by_kind(objects)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_operator_deployment(values: dict[str, Any]) -> None:
    from kvdrive.operator.cli import build_parser

    objects = render_chart(values)
    (deployment,) = _by_kind(objects)["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(objects)
    merged = {**yaml.safe_load((CHART / "values.yaml").read_text()), **values}
    # the command line is one the operator's own parser accepts, and the probe hits its endpoint
    assert container["command"] == ["kvdrive-operator"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "run" and args.all_namespaces and args.resync_seconds == merged["operator"]["resyncSeconds"]
    port, metrics_port = merged["operator"]["healthPort"], merged["operator"]["metricsPort"]
    assert args.liveness == f"http://0.0.0.0:{port}/healthz"
    assert args.metrics == f"http://0.0.0.0:{metrics_port}/metrics"  # the operator's own metrics
    assert container["ports"] == [{"name": "health", "containerPort": port, "protocol": "TCP"},
                                  {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # non-root, read-only root file system, a writable /tmp, resources set
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] >= 1
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    assert container["resources"] == merged["resources"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    tag = values.get("image", {}).get("tag") or helm_python.Chart.load(CHART).metadata["appVersion"]
    assert container["image"].endswith(f":{tag}")


def test_the_service_account_is_bound_to_the_cluster_role() -> None:
    for values in VALUE_SETS.values():
        kinds = _by_kind(render_chart(values))
        (account,), (binding,), (role,) = kinds["ServiceAccount"], kinds["ClusterRoleBinding"], kinds["ClusterRole"]
        (deployment,) = kinds["Deployment"]
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": NAMESPACE}]


def test_existing_service_account_and_no_rbac() -> None:
    kinds = _by_kind(render_chart({"serviceAccount": {"create": False, "name": "mine"}, "rbac": {"create": False}}))
    assert sorted(kinds) == ["Deployment"]
    assert kinds["Deployment"][0]["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    with pytest.raises(helm_python.HelmError, match="serviceAccount.name is required"):
        render_chart({"serviceAccount": {"create": False}})


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"imge": {"repository": "x"}}, "imge"),
        ({"operator": {"resyncSeconds": 0}}, "/operator/resyncSeconds"),
        ({"operator": {"resyncSeconds": "60"}}, "/operator/resyncSeconds"),
        ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
        ({"operator": {"metricsPort": 80}}, "/operator/metricsPort"),
        ({"runAsUser": 0}, "/runAsUser"),
        ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
        ({"resources": {"limits": {"gpu": 1}}}, "gpu"),
        ({"rbac": {"create": "yes"}}, "/rbac/create"),
        ({"metrics": {"serviceMonitor": {"runtime": {"enabled": True, "interval": "soon"}}}},
         "/metrics/serviceMonitor/runtime/interval"),
        ({"metrics": {"serviceMonitor": {"runtime": {"namespaces": ["Not_A_Namespace"]}}}},
         "/metrics/serviceMonitor/runtime/namespaces/0"),
        ({"metrics": {"serviceMonitor": {"operator": {"path": "metrics"}}}}, "/metrics/serviceMonitor/operator/path"),
        ({"metrics": {"serviceMonitor": {"operator": {"enable": True}}}}, "enable"),
    ],
)
def test_values_that_violate_the_schema_are_rejected(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as info:
        render_chart(values)
    assert where in str(info.value)
    with helm_python.Chart.load(CHART) as chart, pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(chart.merge_values(values))


def test_the_values_schema_is_valid_json_schema_and_accepts_the_defaults() -> None:
    import json

    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    for values in (yaml.safe_load((CHART / "values.yaml").read_text()), ALL_ON):
        with helm_python.Chart.load(CHART) as chart:
            merged = chart.merge_values(values)
        assert list(validator.iter_errors(merged)) == []


def test_notes_say_what_to_do_next() -> None:
    notes = render_notes({})
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{RELEASE}-kvdrive-operator" in notes
    for hint in ("hugepages", "local-nvme", "kind: KVDriveDeployment", "kubectl get kvd", "troubleshooting",
                 "spec.tiers.shared", "valkey-cluster"):  # the shared tier's store: the user's, one way named
        assert hint in notes
    assert "ServiceMonitor" not in notes and "ServiceMonitor" in render_notes(ALL_ON)


@pytest.mark.parametrize("routing", ["none", "prefix", "inferencepool"])
def test_runtime_service_monitor_scrapes_each_runtime_pod_once(routing: str) -> None:
    """Its selector picks the Services the operator renders for a CR; the relabeling keeps one. The
    router's Service is not one of them (with routing on, the client Service selects the router's pods,
    and the headless one still the replicas)."""
    import re

    from crdcheck import load_example

    from kvdrive.operator.api.cr import parse_cr
    from kvdrive.operator.render.manifests import render

    monitors = {m["metadata"]["name"]: m for m in _by_kind(render_chart(ALL_ON))["ServiceMonitor"]}
    spec = monitors["kvdrive-operator-runtime"]["spec"]
    doc = load_example("full.yaml")
    doc["spec"]["routing"] = {"mode": routing}
    children = render(parse_cr(doc), "token")
    services = [c for c in children if c["kind"] == "Service"]
    selected = [s for s in services if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 2  # the client Service and the headless one
    (endpoint,) = spec["endpoints"]
    (keep,) = endpoint["relabelings"]
    assert keep["action"] == "keep" and keep["sourceLabels"] == ["__meta_kubernetes_service_name"]
    kept = [s for s in selected if re.fullmatch(keep["regex"], s["metadata"]["name"])]
    assert [s["spec"].get("clusterIP") for s in kept] == ["None"]
    assert endpoint["port"] in {p["name"] for p in kept[0]["spec"]["ports"]}
    (sts,) = [c for c in children if c["kind"] == "StatefulSet"]
    assert kept[0]["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]  # the replicas, never the router
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"
    assert '@router.get("/metrics"' in (REPO / "runtime" / "server" / "ops_api.py").read_text()
    assert spec["namespaceSelector"] == {"matchNames": ALL_ON["metrics"]["serviceMonitor"]["runtime"]["namespaces"]}
    assert _by_kind(render_chart({"metrics": {"serviceMonitor": {"runtime": {"enabled": True}}}}))[
        "ServiceMonitor"][0]["spec"]["namespaceSelector"] == {"any": True}


def test_operator_service_monitor_scrapes_the_operators_own_metrics_port() -> None:
    """The operator's ServiceMonitor names a port its Service has, which targets a port of the operator's
    container that serves ``--metrics`` (kvdrive-operator run), at the path the operator serves."""
    from urllib.parse import urlparse

    from kvdrive.operator.cli import build_parser

    kinds = _by_kind(render_chart(ALL_ON))
    monitor = next(m for m in kinds["ServiceMonitor"] if not m["metadata"]["name"].endswith("-runtime"))
    (endpoint,) = monitor["spec"]["endpoints"]
    (service,) = kinds["Service"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    container = _container(render_chart(ALL_ON))
    target = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    served = urlparse(build_parser().parse_args(container["args"]).metrics)
    assert served.port == target["containerPort"] and served.path == endpoint["path"] == "/metrics"
