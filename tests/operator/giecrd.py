"""The Gateway API Inference Extension's InferencePool CRD (vendored under data/) for the tests: its schema
offline, and installed in (or removed from) the test control plane by the fixtures ``gie_crd`` and
``no_gie_crd``. The control plane is shared by the session, so each test that depends on the CRD being
there, or not, asks for it; on a cluster of your own (``KVDRIVE_TEST_KUBECONFIG``) an InferencePool CRD
already there is left as it is, and the tests that need it absent are skipped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane

from kvdrive.operator.render import inferencepool

__all__ = ["GIE_CRD_PATH", "gie_crd", "install_gie_crd", "load_gie_crd", "no_gie_crd"]

GIE_CRD_PATH = Path(__file__).resolve().parent / "data" / "gateway-api-inference-extension" / (
    "inference.networking.k8s.io_inferencepools.yaml")
CRD_API = ("apiextensions.k8s.io/v1", "CustomResourceDefinition")


def load_gie_crd() -> dict[str, Any]:
    return yaml.safe_load(GIE_CRD_PATH.read_text())


def _crds(plane: ControlPlane) -> Any:
    api = plane.dynamic()
    return api.resources.get(api_version=CRD_API[0], kind=CRD_API[1])


def _exists(plane: ControlPlane) -> bool:
    from kubernetes.dynamic.exceptions import NotFoundError

    try:
        _crds(plane).get(name=inferencepool.CRD_NAME)
    except NotFoundError:
        return False
    return True


def _served(plane: ControlPlane) -> bool:
    """Whether discovery lists the InferencePool's group version."""
    from kubernetes import client

    groups = client.ApisApi(plane.client()).get_api_versions().groups
    return any(v.group_version == inferencepool.API_VERSION for g in groups for v in g.versions)


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def install_gie_crd(plane: ControlPlane) -> None:
    """Install the vendored CRD (a cluster of one's own keeps its own) and wait until it is served."""
    if plane.audit_log is None and _exists(plane):
        return
    body = load_gie_crd()
    crds = _crds(plane)
    crds.server_side_apply(body=body, name=body["metadata"]["name"], field_manager="kvdrive-tests",
                           force_conflicts=True)

    def established() -> bool:
        conditions = crds.get(name=body["metadata"]["name"]).to_dict().get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    _wait(established, "the InferencePool CRD to be established")
    _wait(lambda: _served(plane), "discovery to list inference.networking.k8s.io/v1")


def remove_gie_crd(plane: ControlPlane) -> None:
    """Delete the CRD (every InferencePool goes with it) and wait until discovery no longer lists it."""
    from kubernetes.dynamic.exceptions import NotFoundError

    try:
        _crds(plane).delete(name=inferencepool.CRD_NAME)
    except NotFoundError:
        pass
    _wait(lambda: not _exists(plane), "the InferencePool CRD to be deleted")
    _wait(lambda: not _served(plane), "discovery to drop inference.networking.k8s.io/v1")


@pytest.fixture()
async def gie_crd(control_plane: ControlPlane) -> AsyncIterator[None]:
    await asyncio.to_thread(install_gie_crd, control_plane)
    yield


@pytest.fixture()
async def no_gie_crd(control_plane: ControlPlane) -> AsyncIterator[None]:
    if control_plane.audit_log is None and await asyncio.to_thread(_exists, control_plane):
        pytest.skip("the cluster's own InferencePool CRD is not removed by the tests")
    await asyncio.to_thread(remove_gie_crd, control_plane)
    yield
