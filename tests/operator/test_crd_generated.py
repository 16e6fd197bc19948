"""The CRD is generated from the operator's pydantic types: the committed files are what the types say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import yaml
from crdcheck import CRD_PATH, load_crd, version_schema
from scriptkit import load_script

from kvdrive.operator.api.spec import KVDriveSpec

REPO = Path(__file__).resolve().parents[2]
CHART_CRD = REPO / "charts" / "kvdrive-operator" / "crds" / "kvdrivedeployment.yaml"


def _generator() -> ModuleType:
    return load_script("gen_crd")


def test_the_committed_crd_is_generated_from_the_types() -> None:
    expected = _generator().crd_yaml()
    assert CRD_PATH.read_text(encoding="utf-8") == expected, "crds/kvdrivedeployment.yaml is stale: run `make crds`"
    assert CHART_CRD.read_text(encoding="utf-8") == expected, "the chart's CRD is stale: run `make crds`"


def test_the_generated_yaml_is_the_generated_object() -> None:
    generator = _generator()
    assert yaml.safe_load(generator.crd_yaml()) == generator.crd()


def test_the_check_mode_says_whether_the_committed_files_are_stale() -> None:
    ok = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_crd.py"), "--check"], capture_output=True,
                        text=True, check=False, cwd="/")
    assert ok.returncode == 0, ok.stderr


def test_every_pydantic_validator_rule_has_its_cel_rule_beside_it() -> None:
    """The cross-field rules the models check are the CRD's too: every object that has a model validator
    carries CEL rules (on itself, or for the pod settings on the spec)."""
    rules = version_schema(load_crd())["properties"]["spec"]
    spec_rules = {rule["fieldPath"] for rule in rules["x-kubernetes-validations"]}
    assert {".env", ".extraVolumeMounts", ".replicas", ".concurrency.maxRunning"} <= spec_rules
    for path in (("tiers", "dram"), ("tiers", "ssd"), ("attention",), ("tuning", "concurrency"), ("autoscaling",),
                 ("kvEvents",)):
        node = rules
        for key in path:
            node = node["properties"][key]
        assert node["x-kubernetes-validations"], path
    assert KVDriveSpec.model_fields["tiers"].description == rules["properties"]["tiers"]["description"]
