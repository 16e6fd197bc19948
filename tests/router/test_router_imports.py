"""The router's process stays light: ``kvdrive route`` loads no torch, numpy or model code."""

from __future__ import annotations

import subprocess
import sys


def test_the_router_and_its_command_line_import_no_torch() -> None:
    code = ("import sys; import kvdrive.runtime.cli as cli; import kvdrive.router.app, kvdrive.router.cli; "
            "cli.build_parser().parse_args(['route', '--backend', 'http://127.0.0.1:1']); "
            "heavy = sorted(m for m in ('torch', 'numpy', 'gguf', 'kvdrive.runtime.engine', "
            "'kvdrive.runtime.model', 'kvdrive.runtime.kvcache') if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
