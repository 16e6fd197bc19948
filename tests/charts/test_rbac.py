"""The chart's ClusterRole grants exactly what the operator asks of the API server.

The real Kopf operator runs against kmock's KubernetesEmulator through every code path that
talks to the API (create, repair of each child kind, re-creation of the StatefulSet, pod
readiness, a degraded CR with its Warning Event, deletion); each request it sends is turned into
an RBAC rule (``apicalls``). The ClusterRole rendered by the chart must grant all of them and
nothing else. A static check makes sure the scenario keeps up with the code: every API
resource the operator's modules name, and every kind of call they make, shows up in it.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from apicalls import Rule, granted, rules_of
from chartrender import render_chart
from crdcheck import load_example
from kopfenv import NAMESPACE, Cluster, eventually

from kvdrive.operator.handlers import build_registry
from kvdrive.operator.kubeapi import KubeApi, Ref

REPO = Path(__file__).resolve().parents[2]
TOKEN = "kvdrive-operator-under-test"
EVENTS = Ref("v1", "events")
CR = Ref("kvdrive.io/v1alpha1", "kvdrivedeployments")
PODS = Ref("v1", "pods")
CLAIMS = Ref("v1", "persistentvolumeclaims")
STATEFULSETS = Ref("apps/v1", "statefulsets")
CHILDREN = {
    "ConfigMap": Ref("v1", "configmaps"), "Secret": Ref("v1", "secrets"), "Service": Ref("v1", "services"),
    "StatefulSet": STATEFULSETS, "PodDisruptionBudget": Ref("policy/v1", "poddisruptionbudgets"),
}
KUBEAPI_VERBS = {"get": {"get"}, "list": {"list"}, "create": {"create"}, "patch": {"patch"}, "delete": {"delete"}}


@pytest.fixture()
async def operator(kmock: Any, cluster: Cluster) -> AsyncIterator[Cluster]:
    """The real operator, logged in with its own token so that its requests can be told apart."""
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.watching.reconnect_backoff = 0.1
    settings.batching.idle_timeout = 0.1
    settings.batching.batch_window = 0.02
    settings.posting.level = 0
    info = kopf.ConnectionInfo(server=str(kmock.url), token=TOKEN)
    registry = build_registry(connect=lambda **_: info, resync_seconds=3600)
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


def _pod(name: str, instance: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": instance,
              "app.kubernetes.io/managed-by": "kvdrive-operator"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "kvdrive", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


async def _changed(cluster: Cluster, ref: Ref, name: str, check: Any, what: str) -> None:
    async def done() -> bool:
        obj = await cluster.get(ref, name)
        return obj is not None and bool(check(obj))

    await eventually(done, what=what)


async def _exercise(cluster: Cluster, api: KubeApi) -> None:
    """Every path of the operator that talks to the API server."""
    await cluster.storage_class()
    await cluster.create(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
                                  "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    await cluster.create(CR, copy.deepcopy(load_example("full.yaml")))
    for kind, name in (("StatefulSet", "chat"), ("PodDisruptionBudget", "chat"), ("Secret", "chat-admin")):
        await _changed(cluster, CHILDREN[kind], name, lambda obj: True, f"{kind} created")
    # pods come and go: the status follows them
    await cluster.create(PODS, _pod("chat-0", "chat"))
    await _changed(cluster, CR, "chat", lambda cr: (cr.get("status") or {}).get("readyReplicas") == 1, "readyReplicas")
    # hand edits of each kind of child are patched back (the Secret when it lost its token)
    await cluster.patch(CHILDREN["ConfigMap"], "chat-config", {"data": {"config.yaml": "edited"}})
    await _changed(cluster, CHILDREN["ConfigMap"], "chat-config", lambda o: o["data"]["config.yaml"] != "edited", "ConfigMap")
    await cluster.patch(CHILDREN["Service"], "chat", {"spec": {"type": "NodePort"}})
    await _changed(cluster, CHILDREN["Service"], "chat", lambda o: o["spec"]["type"] == "ClusterIP", "Service")
    await cluster.patch(CHILDREN["PodDisruptionBudget"], "chat", {"spec": {"maxUnavailable": 3}})
    await _changed(cluster, CHILDREN["PodDisruptionBudget"], "chat", lambda o: o["spec"]["maxUnavailable"] == 1, "PDB")
    await cluster.patch(CHILDREN["Secret"], "chat-admin", {"data": {"token": "!"}})
    await _changed(cluster, CHILDREN["Secret"], "chat-admin", lambda o: o["data"]["token"] != "!", "Secret")
    await cluster.patch(STATEFULSETS, "chat", {"spec": {"updateStrategy": {"type": "OnDelete"}}})
    await _changed(cluster, STATEFULSETS, "chat", lambda o: o["spec"]["updateStrategy"]["type"] == "RollingUpdate", "sts")
    # a field a StatefulSet cannot update: deleted (orphaning the pods) and created again
    await cluster.patch(CR, "chat", {"metadata": {"generation": 2}, "spec": {"tiers": {"ssd": {"size": "2Ti"}}}})
    await _changed(cluster, STATEFULSETS, "chat",
                   lambda o: o["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Ti",
                   "StatefulSet re-created")
    # a CR whose StorageClass is missing: Degraded and a Warning Event
    broken = copy.deepcopy(load_example("minimal.yaml"))
    broken["metadata"]["name"] = "broken"
    broken["spec"]["tiers"] = {"ssd": {"storageClassName": "missing"}}
    await cluster.create(CR, broken)

    async def warned() -> bool:
        events = await api.list(EVENTS, NAMESPACE, {})
        return any(e.get("reason") == "StorageClassNotFound" for e in events)

    await eventually(warned, what="a Warning Event")
    await cluster.delete(CR, "broken")
    await cluster.delete(PODS, "chat-0")
    await asyncio.sleep(0.5)  # let the last reactions reach the emulator


def _chart_cluster_role() -> dict[str, Any]:
    (role,) = [o for o in render_chart({}) if o["kind"] == "ClusterRole"]
    return role


async def test_cluster_role_grants_exactly_what_the_operator_uses(kmock: Any, operator: Cluster) -> None:
    await _exercise(operator, operator.api)
    needed = rules_of(list(kmock), TOKEN)
    assert ("kvdrive.io", "kvdrivedeployments", "watch") in needed, sorted(needed)
    _assert_scenario_covers_the_code(needed)
    grants = granted(_chart_cluster_role())
    assert not needed - grants, f"the ClusterRole misses: {sorted(needed - grants)}"
    assert not grants - needed, f"the ClusterRole grants what the operator never uses: {sorted(grants - needed)}"


def _operator_sources() -> list[Path]:
    return sorted((REPO / "operator").glob("*.py"))


def _refs_named_in_code() -> set[tuple[str, str]]:
    """(apiGroup, plural) of every ``Ref`` the operator's modules hold at module level."""
    import importlib

    found = set()
    modules = [importlib.import_module(f"kvdrive.operator.{p.stem}") for p in _operator_sources() if p.stem != "__init__"]
    module_values = [value for module in modules for value in vars(module).values()]
    for value in module_values:
        values = value.values() if isinstance(value, dict) else [value]
        for item in values:
            if isinstance(item, Ref):
                group = item.api_version.rsplit("/", 1)[0] if "/" in item.api_version else ""
                found.add((group, item.plural))
    return found


def _kubeapi_methods_called() -> set[str]:
    """Names of KubeApi methods the operator's modules call (``api.get(...)``, ``self._api().patch(...)``)."""
    methods = {name for name in vars(KubeApi) if not name.startswith("_") and name != "close"}
    called = set()
    for path in _operator_sources():
        if path.name == "kubeapi.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
                receiver = ast.unparse(node.func.value)
                if "api" in receiver.lower():
                    called.add(node.func.attr)
    return called


def _assert_scenario_covers_the_code(rules: set[Rule]) -> None:
    used_resources = {(group, resource.split("/")[0]) for group, resource, _ in rules}
    missing = _refs_named_in_code() - used_resources
    assert not missing, f"the operator's code names {sorted(missing)}: exercise them in _exercise()"
    used_verbs = {verb for _, _, verb in rules}
    for method in _kubeapi_methods_called():
        assert KUBEAPI_VERBS[method] & used_verbs, f"KubeApi.{method} is called but never exercised"
    if any("kopf.event(" in path.read_text() for path in _operator_sources()):
        assert ("", "events", "create") in rules
