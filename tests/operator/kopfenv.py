"""Helpers and fixtures: the real Kopf operator running against kmock's KubernetesEmulator over HTTP."""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import kopf
import pytest

from kvdrive.operator.handlers import CR, build_registry
from kvdrive.operator.kubeapi import KubeApi, Ref

NAMESPACE = "inference"
STORAGE_CLASSES = Ref("storage.k8s.io/v1", "storageclasses")


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns a truthy value; fail with the last value after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


async def never(check: Callable[[], Awaitable[Any]], duration: float, what: str) -> None:
    """Assert that ``check`` stays falsy for ``duration`` seconds."""
    deadline = asyncio.get_running_loop().time() + duration
    while asyncio.get_running_loop().time() < deadline:
        value = await check()
        assert not value, f"unexpected {what}: {value!r}"
        await asyncio.sleep(0.05)


@dataclass
class Cluster:
    """The emulated API server as the tests see it (objects carry uid/resourceVersion/generation)."""

    api: KubeApi
    counter: itertools.count[int]

    def stamp(self, body: dict[str, Any], generation: int = 1) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self.counter))
        meta["generation"] = generation
        return body

    async def create(self, ref: Ref, body: dict[str, Any], namespace: str | None = NAMESPACE) -> dict[str, Any]:
        if namespace:
            body.setdefault("metadata", {})["namespace"] = namespace
        return await self.api.create(ref, namespace, self.stamp(body))

    async def get(self, ref: Ref, name: str, namespace: str | None = NAMESPACE) -> dict[str, Any] | None:
        return await self.api.get(ref, namespace, name)

    async def patch(self, ref: Ref, name: str, body: dict[str, Any], namespace: str | None = NAMESPACE) -> Any:
        body.setdefault("metadata", {})["resourceVersion"] = str(next(self.counter))
        return await self.api.patch(ref, namespace, name, body)

    async def delete(self, ref: Ref, name: str, namespace: str | None = NAMESPACE) -> None:
        await self.api.delete(ref, namespace, name)

    async def storage_class(self, name: str = "local-nvme") -> None:
        body = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": name},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
        }
        await self.create(STORAGE_CLASSES, body, namespace=None)


@pytest.fixture()
async def cluster(kmock: Any) -> AsyncIterator[Cluster]:
    kmock.resources.load_bundled()
    kmock.resources[f"{CR.api_version}/{CR.plural}"] = {
        "namespaced": True,
        "kind": "KVDriveDeployment",
        "singular": "kvdrivedeployment",
        "verbs": ["list", "watch", "get", "create", "patch", "delete", "update"],
        "shortnames": ["kvd"],
        "categories": [],
        "subresources": ["status", "scale"],
    }
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url)))
    try:
        yield Cluster(api=api, counter=itertools.count(1000))
    finally:
        await api.close()


@pytest.fixture()
async def operator(kmock: Any, cluster: Cluster) -> AsyncIterator[Cluster]:
    """Kopf with our handlers, a fresh registry per test, standalone (no peering)."""
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.watching.reconnect_backoff = 0.1
    settings.batching.idle_timeout = 0.1
    settings.batching.batch_window = 0.02
    settings.posting.level = 0
    registry = build_registry(connect=lambda **_: kopf.ConnectionInfo(server=str(kmock.url)), resync_seconds=3600)
    # Kopf runs in its own thread and loop: on exit it cancels every task of its loop that it did not
    # start with, which would include pytest-asyncio's teardown task in a shared loop.
    stop, ready = threading.Event(), threading.Event()
    coro = kopf.operator(clusterwide=True, registry=registry, settings=settings, stop_flag=stop, ready_flag=ready)
    thread = threading.Thread(target=asyncio.run, args=(coro,), name="kopf", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 15), "the operator did not start"
    try:
        yield cluster
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop"
