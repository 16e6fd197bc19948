"""`kvdrive-operator render`: a dry run that validates like the CRD and never shows a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crdcheck import EXAMPLES

CLI = Path(sys.executable).with_name("kvdrive-operator")


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    # cwd outside the repository: the folder operator/ would shadow the standard library there.
    return subprocess.run([str(CLI), *args], input=stdin, capture_output=True, text=True, cwd="/", timeout=60)


@pytest.mark.parametrize("example", ["minimal.yaml", "full.yaml"])
def test_render_prints_valid_children(example: str) -> None:
    result = _run("render", "-f", str(EXAMPLES / example), "--admin-token", "abc")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Secret", "Service", "Service", "StatefulSet", "PodDisruptionBudget"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_render_prints_the_router_when_routing_is_on() -> None:
    result = _run("render", "-f", str(EXAMPLES / "routing.yaml"), "--admin-token", "abc", "--namespace", "team-a")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs[6:]] == [
        (kind, "routed-router") for kind in
        ("ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget", "Deployment")]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    client = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "routed")
    assert client["spec"]["selector"]["app.kubernetes.io/name"] == "kvdrive-router"
    deployment = docs[-1]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "team-a" and args[args.index("--service") + 1] == "routed-headless"


def test_render_reads_stdin_and_several_documents() -> None:
    text = (EXAMPLES / "minimal.yaml").read_text() + "\n---\n" + (EXAMPLES / "fixed-replicas.yaml").read_text()
    result = _run("render", "-f", "-", "--namespace", "team-a", stdin=text)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert len(docs) == 12
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ("  tiers: {dram: {size: 3Mi}}", "spec.tiers.dram.size"),
        ("  replicas: 2\n  autoscaling: {mode: operator}", "spec.replicas"),
        ("  autoscaling: {minReplicas: 5, maxReplicas: 2}", "spec.autoscaling.minReplicas"),
        ("  resources: {cpu: lots}", "spec.resources.cpu"),
        ("  tiers: {ssd: {storageClassName: ''}}", "spec.tiers.ssd.storageClassName"),
        ("  unknownField: 1", "spec.unknownField"),
        ("  routing: {mode: bogus}", "spec.routing.mode"),
        ("  routing: {mode: prefix, replicas: 0}", "spec.routing.replicas"),
    ],
)
def test_render_rejects_an_invalid_cr_naming_the_field(patch: str, field: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "minimal.yaml").read_text() + patch + "\n")
    result = _run("render", "-f", str(bad))
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"{field}:" in result.stderr
    assert "Traceback" not in result.stderr


def test_render_reports_unreadable_input() -> None:
    result = _run("render", "-f", "/nonexistent/cr.yaml")
    assert result.returncode == 2 and "Traceback" not in result.stderr and "/nonexistent/cr.yaml" in result.stderr
    result = _run("render", "-f", "-", stdin="spec: [unclosed")
    assert result.returncode == 2 and "Traceback" not in result.stderr
