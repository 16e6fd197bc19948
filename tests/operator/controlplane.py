"""A real Kubernetes control plane for the test session: etcd + kube-apiserver from
``scripts/control-plane.sh`` (built from source on first use), the CRD installed once, a namespace
per test, ServiceAccount tokens (TokenRequest) and the API server's audit log.

``KVDRIVE_TEST_KUBECONFIG`` points the tests at a cluster of your own instead (it needs rights to
install the CRD and create namespaces; the tests that read the audit log are skipped there).
Without Go and without built binaries, the tests that need the control plane are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "control-plane.sh"
CRD = REPO / "crds" / "kvdrivedeployment.yaml"


@dataclass(frozen=True)
class ControlPlane:
    """Where the API server is and how to reach it as cluster-admin."""

    server: str
    ca_path: str | None
    token: str | None
    kubeconfig: Path
    audit_log: Path | None

    def info(self, token: str | None = None) -> kopf.ConnectionInfo:
        """Kopf's login: as cluster-admin, or with ``token`` (a ServiceAccount's)."""
        return kopf.ConnectionInfo(server=self.server, ca_path=self.ca_path, token=token or self.token)

    def client(self) -> Any:
        """A cluster-admin ``kubernetes.client.ApiClient``."""
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig))

    def dynamic(self) -> Any:
        from kubernetes.dynamic import DynamicClient

        return DynamicClient(self.client())

    def audit(self, since: int = 0) -> list[dict[str, Any]]:
        """Audit events (one per request) from byte offset ``since`` of the log."""
        if self.audit_log is None:
            pytest.skip("the audit log is only available on the test control plane")
        with self.audit_log.open("rb") as handle:
            handle.seek(since)
            return [json.loads(line) for line in handle if line.strip()]

    def audit_offset(self) -> int:
        return 0 if self.audit_log is None else self.audit_log.stat().st_size

    def service_account_token(self, namespace: str, name: str) -> str:
        from kubernetes import client

        api = client.CoreV1Api(self.client())
        request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[],
                                                                                     expiration_seconds=3600))
        return str(api.create_namespaced_service_account_token(name, namespace, request).status.token)

    def new_namespace(self) -> str:
        from kubernetes import client

        name = f"t-{uuid.uuid4().hex[:8]}"
        client.CoreV1Api(self.client()).create_namespace({"metadata": {"name": name}})
        return name


def _from_kubeconfig(path: Path, audit_log: Path | None) -> ControlPlane:
    doc = yaml.safe_load(path.read_text())
    context = next(c["context"] for c in doc["contexts"] if c["name"] == doc["current-context"])
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in doc["users"] if u["name"] == context["user"])
    return ControlPlane(server=cluster["server"], ca_path=cluster.get("certificate-authority"), token=user.get("token"),
                        kubeconfig=path, audit_log=audit_log)


def _install_crd(plane: ControlPlane) -> None:
    api = plane.dynamic()
    crds = api.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    body = yaml.safe_load(CRD.read_text())
    crds.server_side_apply(body=body, name=body["metadata"]["name"], field_manager="kvdrive-tests",
                           force_conflicts=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conditions = crds.get(name=body["metadata"]["name"]).to_dict().get("status", {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        time.sleep(0.2)
    raise AssertionError("the CRD was not established")


def _binaries_or_go() -> bool:
    cache = Path(os.environ.get("KVDRIVE_CP_CACHE", Path.home() / ".cache" / "kvdrive" / "control-plane"))
    built = any((d / "kube-apiserver").exists() and (d / "etcd").exists() for d in cache.glob("k8s-*"))
    return built or shutil.which("go") is not None


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    own = os.environ.get("KVDRIVE_TEST_KUBECONFIG")
    if own:
        plane = _from_kubeconfig(Path(own), audit_log=None)
        _install_crd(plane)
        yield plane
        return
    if not _binaries_or_go():
        pytest.skip("needs Go to build etcd and kube-apiserver (scripts/control-plane.sh build)")
    state = tmp_path_factory.mktemp("control-plane")
    subprocess.run(["bash", str(SCRIPT), "up", str(state)], check=True, timeout=3600)
    try:
        plane = _from_kubeconfig(state / "kubeconfig", audit_log=state / "audit.log")
        _install_crd(plane)
        yield plane
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], check=False, timeout=60)
