"""The chart's RBAC, for real: the operator runs with a token of the chart's ServiceAccount only.

The chart's ServiceAccount, ClusterRole and ClusterRoleBinding are rendered with the real Helm
library and applied to the test control plane; a token is minted for the ServiceAccount
(TokenRequest), and the real Kopf operator logs in with it. It goes through every code path that
talks to the API server (create, a spec change, pod readiness, a live round, a re-created
StatefulSet, the router turned on and off, the InferencePool of routing mode inferencepool created and
deleted (the Gateway API Inference Extension's CRD installed), a degraded CR with its Warning Event,
deletion). The API
server's audit log says what the operator asked for and what it was refused: nothing may be refused
(a permission missing from the chart; creating the router's Role also needs the rights it grants, the
API server's escalation check), and nothing granted may go unused (a permission no code path needs),
except the rights the operator only passes on to the router's Role. A static check
makes sure the scenario keeps up with the code: every API resource the operator's modules name,
and every kind of call they make, shows up in it.
"""

from __future__ import annotations

import ast
import asyncio
import copy
from pathlib import Path
from typing import Any

from apicalls import Rule, granted, rules_of_audit
from chartrender import render_chart
from crdcheck import load_example
from crkit import example_secrets
from kopfenv import Cluster, eventually, run_operator

from kvdrive.operator.act.objects import CHILDREN, CLAIMS, CR, PODS, STATEFULSETS
from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.clients.kubeclient import KubeApi, Ref
from kvdrive.operator.render import router_manifests

REPO = Path(__file__).resolve().parents[2]
EVENTS = Ref("v1", "Event", "events")  # what the operator posts (through kopf), read back here
KUBECLIENT_VERBS = {"get": {"get"}, "list": {"list"}, "create": {"create"}, "apply": {"patch"}, "delete": {"delete"}}
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")


async def _install_chart_rbac(cluster: Cluster) -> tuple[str, str, dict[str, Any]]:
    """Applies the chart's ServiceAccount, ClusterRole and binding; returns (namespace, account, role)."""
    objects = [o for o in render_chart({}, namespace=cluster.namespace) if o["kind"] in RBAC_KINDS]
    assert sorted(o["kind"] for o in objects) == sorted(RBAC_KINDS)

    def apply() -> None:
        for obj in objects:
            res = cluster.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            res.server_side_apply(body=obj, name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace"),
                                  field_manager="helm", force_conflicts=True)

    await asyncio.to_thread(apply)
    account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    return cluster.namespace, account, role


def _pod(name: str, instance: str, app: str = "kvdrive") -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": app, "app.kubernetes.io/instance": instance,
              "app.kubernetes.io/managed-by": "kvdrive-operator"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "kvdrive", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


async def _changed(cluster: Cluster, ref: Ref, name: str, check: Any, what: str, timeout: float = 20) -> None:
    async def done() -> bool:
        obj = await cluster.get(ref, name)
        return obj is not None and bool(check(obj))

    await eventually(done, timeout=timeout, what=what)


async def _exercise(cluster: Cluster) -> None:
    """Every path of the operator that talks to the API server."""
    await cluster.storage_class()
    await cluster.create(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
                                  "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    await example_secrets(cluster)
    doc = copy.deepcopy(load_example("full.yaml"))
    doc["spec"]["tuning"] = {"enabled": True, "intervalSeconds": 1}
    await cluster.create(CR, doc)
    for kind, name in (("StatefulSet", "chat"), ("PodDisruptionBudget", "chat"), ("Secret", "chat-admin")):
        await _changed(cluster, CHILDREN[kind], name, lambda obj: True, f"{kind} created")
    # pods come and go: the status follows them (the live loop lists them and writes its status part)
    await cluster.create(PODS, _pod("chat-0", "chat"))
    await cluster.patch(PODS, "chat-0", {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}}, subresource="status")
    await _changed(cluster, CR, "chat", lambda cr: (cr.get("status") or {}).get("readyReplicas") == 1, "readyReplicas")
    await _changed(cluster, CR, "chat", lambda cr: "pods" in (cr.get("status") or {}), "the live loop's status")
    # the router on (its objects applied; a ready router pod moves the client Service), then off (deleted)
    await cluster.patch(CR, "chat", {"spec": {"routing": {"mode": "prefix"}}})
    await _changed(cluster, CHILDREN["Deployment"], "chat-router", lambda obj: True, "the router's Deployment")
    await cluster.create(PODS, _pod("chat-router-a", "chat", app="kvdrive-router"))
    await cluster.patch(PODS, "chat-router-a", {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}}, subresource="status")
    await _changed(cluster, CHILDREN["Service"], "chat",
                   lambda svc: svc["spec"]["selector"]["app.kubernetes.io/name"] == "kvdrive-router",
                   "the client Service on the router")
    # the InferencePool (routing mode inferencepool) applied, then deleted when the mode goes back to prefix
    await cluster.patch(CR, "chat", {"spec": {"routing": {"mode": "inferencepool"}}})
    await _changed(cluster, CHILDREN["InferencePool"], "chat", lambda obj: True, "the InferencePool")
    await cluster.patch(CR, "chat", {"spec": {"routing": {"mode": "prefix"}}})
    await eventually(lambda: _gone(cluster, CHILDREN["InferencePool"], "chat"), what="the InferencePool deleted")
    await cluster.patch(CR, "chat", {"spec": {"routing": {"mode": "none"}}})
    await eventually(lambda: _gone(cluster, CHILDREN["ServiceAccount"], "chat-router"), what="the router deleted")
    await cluster.delete(PODS, "chat-router-a")
    # a deleted child is created again
    await cluster.delete(CHILDREN["ConfigMap"], "chat-config")
    await _changed(cluster, CHILDREN["ConfigMap"], "chat-config", lambda obj: True, "ConfigMap re-created")
    # a field a StatefulSet cannot update: deleted (orphaning the pods; the garbage collector completes
    # the orphaning) and applied again
    await cluster.patch(CR, "chat", {"spec": {"tiers": {"ssd": {"size": "2Ti"}}}})
    await _changed(cluster, STATEFULSETS, "chat",
                   lambda o: o["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Ti",
                   "StatefulSet re-created", timeout=60)
    # a CR whose StorageClass is missing: Degraded and a Warning Event
    broken = copy.deepcopy(load_example("minimal.yaml"))
    broken["metadata"]["name"] = "broken"
    broken["spec"]["tiers"] = {"ssd": {"storageClassName": f"missing-{cluster.namespace}"}}
    await cluster.create(CR, broken)

    async def warned() -> bool:
        events = await cluster.api.list(EVENTS, cluster.namespace, {})
        return any(e.get("reason") == "StorageClassNotFound" for e in events)

    await eventually(warned, what="a Warning Event")
    await cluster.delete(CR, "broken")
    await eventually(lambda: _gone(cluster, CR, "broken"), what="the CR deleted (Kopf's finalizer released)")
    await cluster.delete(PODS, "chat-0")
    await asyncio.sleep(1.0)  # let the last reactions reach the server


async def _gone(cluster: Cluster, ref: Ref, name: str) -> bool:
    return await cluster.get(ref, name) is None


async def test_cluster_role_grants_exactly_what_the_operator_uses(gie_crd: None, cluster: Cluster) -> None:
    namespace, account, role = await _install_chart_rbac(cluster)
    token = await asyncio.to_thread(cluster.plane.service_account_token, namespace, account)
    offset = cluster.plane.audit_offset()
    async with run_operator(cluster, token=token, clusterwide=True):  # as the chart runs it: --all-namespaces
        await _exercise(cluster)
    user = f"system:serviceaccount:{namespace}:{account}"
    requests = [e for e in cluster.plane.audit(offset) if e["user"]["username"] == user]
    refused = sorted({(e["verb"], e["requestURI"].split("?")[0]) for e in requests if e["responseStatus"]["code"] == 403})
    assert not refused, f"the chart's ClusterRole misses: {refused}"
    needed = rules_of_audit(requests)
    assert ("kvdrive.io", "kvdrivedeployments", "watch") in needed, sorted(needed)
    _assert_scenario_covers_the_code(needed)
    grants = granted(role)
    assert not needed - grants, f"the ClusterRole misses: {sorted(needed - grants)}"
    delegated = _delegated()
    assert delegated <= grants, "the operator cannot create the router's Role without holding its rights"
    assert not delegated & needed, "the operator calls what it only means to pass on"
    unused = grants - needed - delegated
    assert not unused, f"the ClusterRole grants what the operator never uses: {sorted(unused)}"


def _delegated() -> set[Rule]:
    """What the operator holds only to grant it: the rules of the router's Role."""
    doc = copy.deepcopy(load_example("full.yaml"))
    doc["spec"]["routing"] = {"mode": "prefix"}
    return granted({"rules": router_manifests.role(parse_cr(doc))["rules"]})


def _operator_sources() -> list[Path]:
    return sorted((REPO / "operator").rglob("*.py"))


def _refs_named_in_code() -> set[tuple[str, str]]:
    """(apiGroup, plural) of every ``Ref`` the operator's modules hold at module level."""
    import importlib

    found = set()
    modules = [importlib.import_module(".".join(["kvdrive.operator", *p.relative_to(REPO / "operator").with_suffix("").parts]))
               for p in _operator_sources() if p.stem != "__init__"]
    module_values = [value for module in modules for value in vars(module).values()]
    for value in module_values:
        values = value.values() if isinstance(value, dict) else [value]
        for item in values:
            if isinstance(item, Ref):
                group = item.api_version.rsplit("/", 1)[0] if "/" in item.api_version else ""
                found.add((group, item.plural))
    return found


def _kubeapi_methods_called() -> set[str]:
    """Names of KubeApi methods the operator's modules call (``api.get(...)``, ``self._api().apply(...)``)."""
    methods = {name for name in vars(KubeApi) if not name.startswith("_") and name != "close"}
    called = set()
    for path in _operator_sources():
        if path.name == "kubeclient.py":
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
        assert KUBECLIENT_VERBS[method] & used_verbs, f"KubeApi.{method} is called but never exercised"
    if any("kopf.event(" in path.read_text() for path in _operator_sources()):
        assert ("", "events", "create") in rules
