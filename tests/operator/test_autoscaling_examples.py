"""The external-autoscaling examples: a CR the CRD accepts, and an HPA/KEDA object aimed at its scale subresource."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml
from crdcheck import REPO, crd_violations, load_crd

from kvdrive.operator.api.cr import API_VERSION, KIND, parse_cr
from kvdrive.operator.render.manifests import render

EXAMPLES = REPO / "examples" / "autoscaling"
METRICS_SOURCE = REPO / "runtime" / "server" / "metrics.py"


def _load(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def test_the_external_cr_is_valid_and_its_statefulset_takes_spec_replicas() -> None:
    doc = _load("chat-external.yaml")
    assert crd_violations(load_crd(), doc) == []
    cr = parse_cr(doc)
    assert cr.spec.autoscaling.mode == "external"
    sts = next(c for c in render(cr, "t") if c["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == doc["spec"]["replicas"]  # the count the HPA/KEDA writes


def test_the_hpa_is_a_valid_autoscaling_v2_object_on_the_cr() -> None:
    hpa = _load("hpa.yaml")
    kubernetes_validate.validate(hpa, "1.33", strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": API_VERSION, "kind": KIND, "name": "chat"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] in _runtime_metric_names()


def test_the_keda_object_targets_the_cr_and_a_metric_the_runtime_exports() -> None:
    keda = _load("keda-scaledobject.yaml")
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["kind"] == "ScaledObject"
    assert keda["spec"]["scaleTargetRef"] == {"apiVersion": API_VERSION, "kind": KIND, "name": "chat"}
    query = keda["spec"]["triggers"][0]["metadata"]["query"]
    assert any(name in query for name in _runtime_metric_names())
    crd = load_crd()
    (version,) = crd["spec"]["versions"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def _runtime_metric_names() -> set[str]:
    """Gauge names the runtime's /metrics module defines (read as text: the operator tests never import it)."""
    text = Path(METRICS_SOURCE).read_text()
    return {name for name in ("kvdrive_requests_waiting", "kvdrive_requests_running") if f'"{name}"' in text}
