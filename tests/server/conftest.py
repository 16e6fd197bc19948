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
    for name, secret in (("key", API_KEY), ("admin", ADMIN_TOKEN)):
        (tmp / name).write_text(secret + "\n")
        (tmp / name).chmod(0o600)
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


def make_tiny_model(folder: Path, positions: int) -> Path:
    """A tiny random-weight llama in HF format in ``folder`` (fast generation), with ``positions`` of context."""
    from modelkit import make_hf_model  # tests/kits, on the path from tests/conftest.py

    make_hf_model(folder, arch="llama", max_position_embeddings=positions)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight llama in HF format (fast generation)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), 256)


@pytest.fixture(scope="session")
def tiny_state(tiny_model: Path) -> Iterator[object]:
    """A ServerState over the tiny model with its engine thread running;
    ``create_app(dataclasses.replace(state, config=...))`` makes apps with other settings over it."""
    from kvdrive.runtime.engine import SchedulerConfig
    from kvdrive.runtime.server.serve import ServeOptions, build_state

    d = tiny_model
    state = build_state(ServeOptions(model=str(d), served_model_name="tiny", progress=False,
                                     scheduler=SchedulerConfig(max_waiting=8)))
    state.engine.start()
    yield state
    state.engine.shutdown()
