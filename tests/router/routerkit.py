"""Real processes for router tests: ``kvdrive serve`` replicas of the demo model and ``kvdrive route``."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
KVDRIVE = str(ROOT / ".venv" / "bin" / "kvdrive")
API_KEY = "router-test-key-789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Process:
    url: str
    process: subprocess.Popen  # type: ignore[type-arg]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def key_file(tmp: Path) -> Path:
    path = tmp / "api-key"
    path.write_text(API_KEY + "\n")
    path.chmod(0o600)
    return path


def _start(args: list[str], port: int, log: Path, wait_s: float) -> Process:
    proc = subprocess.Popen([KVDRIVE, *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return Process(url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{args[0]} not ready in {wait_s}s: {log.read_text()[-2000:]}")


def start_replica(tmp: Path, name: str, *extra: str, port: int | None = None, wait_s: float = 180.0) -> Process:
    d = tmp / name
    d.mkdir(exist_ok=True)
    port = port or free_port()
    return _start(["serve", "--model", "demo", "--port", str(port), "--api-key-file", str(key_file(tmp)),
                   "--gpu-budget", "56MiB", "--dram-budget", "64MiB", "--ssd-dir", str(d / "ssd"),
                   "--ssd-budget", "512MiB", "--threads", "1", *extra], port, d / "serve.log", wait_s)


def start_router(tmp: Path, backends: list[str], *extra: str, wait_s: float = 60.0) -> Process:
    port = free_port()
    args = ["route", "--port", str(port), "--api-key-file", str(key_file(tmp)), "--poll-seconds", "0.5", *extra]
    for b in backends:
        args += ["--backend", b]
    return _start(args, port, tmp / "router.log", wait_s)


def metric(url: str, name: str, label: str | None = None, headers: dict[str, str] | None = None) -> float:
    """The sum of a metric's samples (those whose labels contain ``label``) in a /metrics page."""
    total = 0.0
    for line in httpx.get(url + "/metrics", headers=headers or {}, timeout=10).text.splitlines():
        if line.startswith(name) and (label is None or label in line):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total
