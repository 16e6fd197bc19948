"""Real `kvdrive serve` processes (demo model, CPU, loopback) that play the pods of the live tests."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
KVDRIVE = str(ROOT / ".venv" / "bin" / "kvdrive")
SMALL_TIERS = ("--gpu-budget", "8MiB", "--dram-budget", "16MiB", "--ssd-budget", "256MiB")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    port: int
    process: subprocess.Popen  # type: ignore[type-arg]
    log: Path
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def tiers(self) -> dict[str, int]:
        """Budgets per tier as GET /admin/tiers reports them."""
        async with httpx.AsyncClient() as client:
            rsp = await client.get(f"{self.url}/admin/tiers", headers=self.admin(), timeout=10)
        rsp.raise_for_status()
        return {t["tier"]: int(t["budget_bytes"]) for t in rsp.json()["tiers"]}

    async def split(self) -> dict[str, int]:
        """The device envelope's split as GET /admin/tiers reports it (max_running, hot_bytes, ...)."""
        async with httpx.AsyncClient() as client:
            rsp = await client.get(f"{self.url}/admin/tiers", headers=self.admin(), timeout=10)
        rsp.raise_for_status()
        return dict(rsp.json()["split"])

    async def metric(self, name: str) -> float | None:
        """One unlabelled sample of /metrics (None when the server does not export it)."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{self.url}/metrics", timeout=10)).text
        found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(found[0]) if found else None

    async def metric_budgets(self) -> dict[str, int]:
        """Budgets per tier as /metrics reports them."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{self.url}/metrics", timeout=10)).text
        found = re.findall(r'^kvdrive_tier_budget_bytes\{tier="(\w+)"\} (\S+)$', text, re.MULTILINE)
        return {tier: int(float(value)) for tier, value in found}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start(tmp: Path, token: str, *extra: str) -> Server:
    """Start one server (returns at once; ``wait_ready`` waits for it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "admin").write_text(token + "\n")
    port, log = free_port(), tmp / "server.log"
    cmd = [KVDRIVE, "serve", "--model", "demo", "--port", str(port), "--admin-token-file", str(tmp / "admin"),
           "--ssd-dir", str(tmp / "ssd"), *SMALL_TIERS, *extra]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp)
    return Server(port, process, log, token)


async def wait_ready(server: Server, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited: {server.log.read_text()[-3000:]}")
            try:
                if (await client.get(f"{server.url}/readyz", timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"server not ready in {timeout}s: {server.log.read_text()[-3000:]}")


@asynccontextmanager
async def all_ready(servers: list[Server]) -> AsyncIterator[list[Server]]:
    """Started servers, once every one is ready; stopped when the block ends (also when one never was)."""
    try:
        await asyncio.gather(*(wait_ready(s) for s in servers))
        yield servers
    finally:
        for s in servers:
            s.stop()


async def complete(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> int:
    """One completion; returns the HTTP status (the workload keeps going through errors)."""
    try:
        rsp = await client.post(f"{server.url}/v1/completions", timeout=300, json={
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        return rsp.status_code
    except httpx.HTTPError:
        return 0


def prompt(topic: int, words: int) -> str:
    """A long prompt; prompts of the same topic share their prefix (pages the tiers can keep)."""
    return f"Document {topic}. " + " ".join(f"t{topic}w{j}" for j in range(words))
