"""The routing benchmark's processes: demo-model replicas (``kvdrive serve``) and a router (``kvdrive route``)
on local ports, started, killed (SIGKILL) and restarted, and their Prometheus counters summed across
restarts."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvdrive() -> str:
    return str(Path(sys.executable).with_name("kvdrive"))


GPU_BUDGET, DRAM_BUDGET = "56MiB", "64MiB"  # every replica: a small device envelope and DRAM tier

class Proc:
    """A server process on a local port: ``kvdrive <args>`` unless ``program`` names another (a peer server),
    ready once ``ready_path`` answers 200."""

    def __init__(self, args: list[str], port: int, log: Path, program: list[str] | None = None,
                 ready_path: str = "/readyz", env: dict[str, str] | None = None) -> None:
        self.args, self.port, self.log = args, port, log
        self.program, self.ready_path, self.env = program or [_kvdrive()], ready_path, env
        self.url = f"http://127.0.0.1:{port}"
        self.p: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        """``serve`` / ``route`` for kvdrive, the module for a peer (``python -m MODULE``)."""
        return self.program[-1] if len(self.program) > 1 else self.args[0]

    def start(self, wait_s: float = 300) -> None:
        # in the log's folder: ``python -m`` puts the working directory first on sys.path, and a repository
        # checkout there would shadow the standard library's ``operator`` with ours
        with self.log.open("a") as out:
            self.p = subprocess.Popen([*self.program, *self.args], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                      cwd=self.log.parent)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} on {self.port} not ready in {wait_s:.0f} s")

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(30)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def metrics_of(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Counters:
    """Counters of processes that may restart (a reset counter starts over): scraped every second in a
    thread, each process's increases summed, so a killed and restarted replica's work still counts (up to
    its last scrape before the kill)."""

    def __init__(self, procs: list[Proc], prefixes: tuple[str, ...]) -> None:
        self.procs, self.prefixes = procs, prefixes
        self.last: dict[tuple[str, str], float] = {}
        self.total: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def scrape(self) -> None:
        for p in self.procs:
            try:
                m = metrics_of(p.url)
            except httpx.HTTPError:
                continue  # down: its counters resume (from zero) when it is back
            for name, value in m.items():
                if not name.startswith(self.prefixes):
                    continue
                key = (p.url, name)
                prev = self.last.get(key, 0.0)
                self.total[key] = self.total.get(key, 0.0) + (value - prev if value >= prev else value)
                self.last[key] = value

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.scrape()

    def __enter__(self) -> Counters:
        self.scrape()
        self.total.clear()  # counted from here
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.scrape()

    def of(self, proc: Proc, name: str) -> float:
        return self.total.get((proc.url, name), 0.0)

    def labelled(self, proc: Proc, prefix: str, label: str) -> dict[str, float]:
        return {k[1].split(f'{label}="')[1].split('"')[0]: v for k, v in self.total.items()
                if k[0] == proc.url and k[1].startswith(prefix)}


class Fleet:
    def __init__(self, root: Path, replicas: int, policy: str, threads: int, ssd_budget: str = "1GiB",
                 router_args: tuple[str, ...] = (), kv_events: bool = False) -> None:
        """``kv_events``: the replicas publish KV events (the router follows them instead of polling)."""
        root.mkdir(parents=True, exist_ok=True)
        self.replicas = []
        for i in range(replicas):
            d = root / f"replica{i}"
            d.mkdir(exist_ok=True)
            port = free_port()
            events = ["--kv-events-endpoint", f"tcp://*:{free_port()}", "--kv-events-replay-endpoint",
                      f"tcp://*:{free_port()}"] if kv_events else []
            self.replicas.append(Proc(["serve", "--model", "demo", "--port", str(port), "--gpu-budget", GPU_BUDGET,
                                       "--dram-budget", DRAM_BUDGET, "--ssd-dir", str(d / "ssd"), "--ssd-budget",
                                       ssd_budget, "--threads", str(threads), *events], port, d / "serve.log"))
        rport = free_port()
        self.router = Proc(["route", "--port", str(rport), "--policy", policy, "--poll-seconds", "0.5", *router_args,
                            *[a for r in self.replicas for a in ("--backend", r.url)]], rport, root / "router.log")

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        self.router.start()

    def stop(self) -> None:
        self.router.stop()
        for r in self.replicas:
            r.stop()
