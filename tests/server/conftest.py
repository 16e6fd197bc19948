"""Fixtures for server tests: a real `kvdrive serve` process with the demo model, and in-process apps."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
KVDRIVE = str(ROOT / ".venv" / "bin" / "kvdrive")
API_KEY = "test-api-key-123"
ADMIN_TOKEN = "test-admin-token-456"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LiveServer:
    url: str
    process: subprocess.Popen  # type: ignore[type-arg]
    log: Path

    def headers(self, token: str = API_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}


def start_server(tmp: Path, *extra: str, wait_s: float = 120.0) -> LiveServer:
    (tmp / "key").write_text(API_KEY + "\n")
    (tmp / "admin").write_text(ADMIN_TOKEN + "\n")
    port = free_port()
    log = tmp / "server.log"
    proc = subprocess.Popen(
        [KVDRIVE, "serve", "--model", "demo", "--port", str(port), "--api-key-file", str(tmp / "key"),
         "--admin-token-file", str(tmp / "admin"), *extra],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return LiveServer(url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not ready in {wait_s}s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("server"), "--gpu-budget", "64MiB")
    yield server
    server.process.terminate()
    server.process.wait(30)
