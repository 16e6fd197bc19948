"""The distribution: every package folder is installed, console scripts run, CI calls make test."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> set[str]:
    found = set()
    for top, name in (("runtime", "kvdrive.runtime"), ("operator", "kvdrive.operator"), ("router", "kvdrive.router")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_folder_is_listed_for_installation() -> None:
    listed = set(PROJECT["tool"]["setuptools"]["packages"])
    assert _package_folders() - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - _package_folders() == set(), "listed packages without a folder"


def test_console_scripts_run(tmp_path: Path) -> None:
    for script, expected in (("kvdrive", "kvdrive 0.1.0"), ("kvdrive-operator", "kvdrive-operator 0.1.0")):
        proc = subprocess.run([str(ROOT / ".venv" / "bin" / script), "--version"], capture_output=True,
                              text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected


def test_torch_is_pinned_compatibly_and_gpu_extra_has_kvikio() -> None:
    deps = PROJECT["project"]["dependencies"]
    assert "torch>=2.5,<2.15" in deps
    assert any(d.startswith("kvikio") for d in PROJECT["project"]["optional-dependencies"]["gpu"])


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text() and "make serve" in (ROOT / "README.md").read_text()
