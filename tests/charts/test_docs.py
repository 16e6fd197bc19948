"""Generated and hand-written docs that must follow the code: the CR reference, the metrics list."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from scriptkit import load_script

REPO = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    return load_script("gen_cr_reference")


def test_cr_reference_is_generated_from_the_current_crd() -> None:
    crd = yaml.safe_load((REPO / "crds" / "kvdrivedeployment.yaml").read_text())
    page = (REPO / "docs" / "cr-reference.md").read_text()
    assert page == _generator().generate(crd), "docs/cr-reference.md is stale: run `make docs`"


def test_cr_reference_lists_every_field_and_rule() -> None:
    crd = yaml.safe_load((REPO / "crds" / "kvdrivedeployment.yaml").read_text())
    text = _generator().generate(crd)

    def paths(schema: dict, prefix: str) -> list[str]:
        found = [prefix]
        for key, sub in (schema.get("properties") or {}).items():
            found += paths(sub, f"{prefix}.{key}")
        return found

    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path in paths(root["properties"]["spec"], "spec")[1:]:
        assert f"| `{path}` |" in text, path
    assert text.count("x-kubernetes-validations") == 0
    assert "must be a multiple of spec.attention.pageSize" in text


def test_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    module = _generator()
    stale = tmp_path / "cr-reference.md"
    stale.write_text("old\n")
    module.PAGE = stale
    assert module.main(["--check"]) == 1
    module.main([])
    assert module.main(["--check"]) == 0
    ok = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cr_reference.py"), "--check"],
                        cwd="/", capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


_METRIC_CLASSES = {
    "Counter": "counter", "CounterMetricFamily": "counter", "Gauge": "gauge", "GaugeMetricFamily": "gauge",
    "Histogram": "histogram", "HistogramMetricFamily": "histogram", "Summary": "summary",
    "SummaryMetricFamily": "summary", "Info": "info",
}


def _label_names(call: ast.Call) -> list[str]:
    """Label names of a metric constructor: ``labels=[...]`` or prometheus_client's third positional."""
    node = next((kw.value for kw in call.keywords if kw.arg in ("labels", "labelnames")), None)
    if node is None and len(call.args) >= 3:
        node = call.args[2]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [elt.value for elt in node.elts if isinstance(elt, ast.Constant)]
    return []


def runtime_metrics(folder: str = "runtime") -> dict[str, tuple[str, list[str]]]:
    """Exposed name -> (type, labels) of every metric the code under ``folder`` defines."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if func in _METRIC_CLASSES and isinstance(first, ast.Constant) and str(first.value).startswith("kvdrive_"):
                kind, name = _METRIC_CLASSES[func], str(first.value)
                if kind == "counter" and not name.endswith("_total"):
                    name += "_total"
                found[name] = (kind, _label_names(node))
    return found


def _documented(heading: str = "## Runtime metrics") -> dict[str, tuple[str, list[str]]]:
    rows = {}
    section = (REPO / "docs" / "metrics.md").read_text().split(heading)[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`kvdrive_"):
            rows[cells[0].strip("`")] = (cells[1], re.findall(r"`(\w+)`", cells[2]))
    return rows


def test_metrics_reference_lists_exactly_the_runtime_metrics() -> None:
    defined, documented = runtime_metrics(), _documented()
    assert "kvdrive_tier_used_bytes" in defined and "kvdrive_page_reads_total" in defined
    assert sorted(set(defined) - set(documented)) == [], "metrics missing from docs/metrics.md"
    assert sorted(set(documented) - set(defined)) == [], "docs/metrics.md lists metrics the runtime does not define"
    for name, (kind, labels) in defined.items():
        assert documented[name] == (kind, labels), name


def test_metrics_reference_lists_exactly_the_router_metrics() -> None:
    defined, documented = runtime_metrics("router"), _documented("## Router metrics")
    assert "kvdrive_router_decisions_total" in defined
    assert defined == documented


def test_operator_metrics_reference_lists_exactly_the_operator_metrics() -> None:
    defined, documented = runtime_metrics("operator"), _documented("## Operator metrics")
    assert "kvdrive_operator_reconciles_total" in defined
    assert defined == documented


def test_architecture_metrics_are_all_defined() -> None:
    required = re.findall(r"`(kvdrive_[a-z_]+)", (REPO.parent / "shared" / "ARCHITECTURE.md").read_text()) if (
        REPO.parent / "shared" / "ARCHITECTURE.md").exists() else []
    if not required:
        pytest.skip("ARCHITECTURE.md is not checked out beside the repository")
    assert sorted(set(required) - set(runtime_metrics())) == []


def test_install_doc_rbac_table_is_the_chart_cluster_role() -> None:
    from apicalls import granted
    from chartrender import render_chart

    (role,) = [o for o in render_chart({}) if o["kind"] == "ClusterRole"]
    section = (REPO / "docs" / "install.md").read_text().split("### What the operator may do (RBAC)")[1].split("\n## ")[0]
    documented = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("API group", "---"):
            continue
        group = "" if cells[0] == "core" else cells[0].strip("`")
        for resource in cells[1].split(", "):
            for verb in cells[2].split(", "):
                documented.add((group, resource, verb))
    assert documented == granted(role)
