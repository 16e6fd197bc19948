"""Generated and hand-written docs that must follow the code: the CR reference, the metrics list."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import yaml

REPO = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_cr_reference", REPO / "scripts" / "gen_cr_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
