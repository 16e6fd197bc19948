"""The real Kopf operator against the real API server of ``controlplane``: a namespace per test, the
operator watching only that namespace, and a ``Cluster`` handle with which the tests play the user
(create, edit, delete) as cluster-admin."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest
from controlplane import ControlPlane

from kvdrive.operator.act.handlers import build_registry
from kvdrive.operator.act.objects import STORAGE_CLASSES
from kvdrive.operator.clients.kubeclient import ApiError, KubeApi, Ref

__all__ = ["Cluster", "cluster", "eventually", "never", "operator", "run_operator"]


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns a truthy value; fail with the last value after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


async def never(check: Callable[[], Awaitable[Any]], duration: float, what: str) -> None:
    """Assert that ``check`` stays falsy for ``duration`` seconds."""
    deadline = asyncio.get_running_loop().time() + duration
    while asyncio.get_running_loop().time() < deadline:
        value = await check()
        assert not value, f"unexpected {what}: {value!r}"
        await asyncio.sleep(0.1)


@dataclass
class Cluster:
    """The API server as a user sees it, in the test's own namespace."""

    plane: ControlPlane
    api: KubeApi
    namespace: str
    dynamic: Any = field(default=None)
    operator_metrics: str | None = None  # the running operator's own /metrics (run_operator), when it serves one

    async def create(self, ref: Ref, body: dict[str, Any], namespace: str | None = "") -> dict[str, Any] | None:
        namespace = self.namespace if namespace == "" else namespace
        if namespace:
            body.setdefault("metadata", {})["namespace"] = namespace
        return await self.api.create(ref, namespace, body)

    async def get(self, ref: Ref, name: str, namespace: str | None = "") -> dict[str, Any] | None:
        return await self.api.get(ref, self.namespace if namespace == "" else namespace, name)

    async def patch(self, ref: Ref, name: str, body: dict[str, Any], subresource: str | None = None,
                    content_type: str = "application/merge-patch+json", **params: Any) -> dict[str, Any]:
        """A user's edit (``kubectl patch --type merge`` by default), field manager ``kubectl-patch``."""
        def call() -> dict[str, Any]:
            res = self.dynamic.resources.get(api_version=ref.api_version, kind=ref.kind)
            if subresource:
                res = res.subresources[subresource]
            return dict(res.patch(body=body, name=name, namespace=self.namespace, content_type=content_type,
                                  field_manager=params.pop("field_manager", "kubectl-patch"), **params).to_dict())
        return await asyncio.to_thread(call)

    async def delete(self, ref: Ref, name: str, namespace: str | None = "") -> None:
        await self.api.delete(ref, self.namespace if namespace == "" else namespace, name)

    async def storage_class(self, name: str = "local-nvme") -> None:
        """A cluster-wide StorageClass (shared by the tests; created once)."""
        body = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": name},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
        }
        try:
            await self.api.create(STORAGE_CLASSES, None, body)
        except ApiError as exc:
            if exc.status != 409:
                raise


@pytest.fixture()
async def cluster(control_plane: ControlPlane) -> AsyncIterator[Cluster]:
    namespace = await asyncio.to_thread(control_plane.new_namespace)
    api = KubeApi(control_plane.info())
    dynamic = await asyncio.to_thread(control_plane.dynamic)
    try:
        yield Cluster(plane=control_plane, api=api, namespace=namespace, dynamic=dynamic)
    finally:
        await api.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class run_operator:
    """Kopf with our handlers in its own thread and loop, a fresh registry, standalone, watching one
    namespace (or all of them, as the chart's Deployment runs it), logged in with ``token``
    (cluster-admin when None). Kopf cancels every task of its loop
    on exit, which would include pytest-asyncio's teardown task in a shared loop."""

    def __init__(self, cluster: Cluster, token: str | None = None, resync_seconds: float = 3600,
                 clusterwide: bool = False, metrics_address: str | None = None) -> None:
        self.cluster, self.token, self.resync_seconds = cluster, token, resync_seconds
        self.metrics_address = metrics_address
        self.clusterwide = clusterwide
        self.stop, self.ready = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None

    async def __aenter__(self) -> Cluster:
        settings = kopf.OperatorSettings()
        settings.peering.standalone = True
        settings.watching.reconnect_backoff = 0.1
        settings.batching.idle_timeout = 0.1
        settings.batching.batch_window = 0.02
        settings.posting.level = 0
        info = self.cluster.plane.info(self.token)
        registry = build_registry(connect=lambda **_: info, resync_seconds=self.resync_seconds,
                                  metrics_address=self.metrics_address)
        namespaces = [] if self.clusterwide else [self.cluster.namespace]
        coro = kopf.operator(clusterwide=self.clusterwide, namespaces=namespaces, registry=registry,
                             settings=settings, stop_flag=self.stop, ready_flag=self.ready)
        self.cluster.operator_metrics = self.metrics_address
        self.thread = threading.Thread(target=asyncio.run, args=(coro,), name="kopf", daemon=True)
        self.thread.start()
        assert await asyncio.to_thread(self.ready.wait, 30), "the operator did not start"
        return self.cluster

    async def __aexit__(self, *_: Any) -> None:
        self.stop.set()
        assert self.thread is not None
        await asyncio.to_thread(self.thread.join, 30)
        assert not self.thread.is_alive(), "the operator did not stop"


@pytest.fixture()
async def operator(cluster: Cluster) -> AsyncIterator[Cluster]:
    async with run_operator(cluster, metrics_address=f"http://127.0.0.1:{_free_port()}/metrics") as running:
        yield running
