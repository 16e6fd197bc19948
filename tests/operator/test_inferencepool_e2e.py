"""``spec.routing.mode: inferencepool`` on a real kube-apiserver with the Gateway API Inference Extension's
InferencePool CRD (vendored: data/gateway-api-inference-extension/) installed, or not.

The server itself accepts the InferencePool the operator renders (strict field validation: nothing pruned,
nothing unknown) and refuses a broken one, naming the field or the CRD's CEL rule. The real Kopf operator
creates the pool (owned by the CR, selecting the runtime pods, the router's Service as endpoint picker),
re-creates it when it is deleted, deletes it when the mode goes to prefix or none, and, without the CRD,
reports a Degraded condition naming the CRD, once, without retrying in a loop; installing the CRD heals it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from crkit import chat_cr, condition, condition_is, events_about, ready_cluster
from giecrd import install_gie_crd
from kopfenv import Cluster, eventually, never
from kubernetes.client import ApiException, CustomObjectsApi

from kvdrive.operator.act.objects import CHILDREN, CR, RECONCILER, STATEFULSETS
from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.render import inferencepool

POOLS = CHILDREN["InferencePool"]
RUNTIME_PODS = {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "chat"}
PICKER = {"group": "", "kind": "Service", "name": "chat-router", "port": {"number": 9002}, "failureMode": "FailClose"}


def _rendered_pool(namespace: str) -> dict[str, Any]:
    doc = chat_cr(routing={"mode": "inferencepool"})
    doc["metadata"]["namespace"] = namespace
    return inferencepool.pool(parse_cr(doc))


async def _create_strict(cluster: Cluster, body: dict[str, Any]) -> str | None:
    """None when the server creates ``body`` (as kubectl sends it: an unknown field is an error), else its
    refusal message."""
    def call() -> str | None:
        api = CustomObjectsApi(cluster.dynamic.client)
        try:
            api.create_namespaced_custom_object(inferencepool.GROUP, inferencepool.VERSION, cluster.namespace,
                                                inferencepool.PLURAL, body, field_validation="Strict")
        except ApiException as exc:
            assert exc.status in (400, 422), exc
            return str(json.loads(exc.body)["message"])
        return None
    return await asyncio.to_thread(call)


async def test_the_server_stores_the_rendered_pool_and_refuses_a_broken_one(cluster: Cluster, gie_crd: None) -> None:
    pool = _rendered_pool(cluster.namespace)
    assert await _create_strict(cluster, pool) is None
    stored = await cluster.get(POOLS, "chat")
    assert stored is not None
    assert stored["spec"] == {**pool["spec"], "appProtocol": "http"}  # as rendered, plus the CRD's default
    cases = [
        ("targetPorts", None, "spec.targetPorts: Required value"),
        ("targetPorts", [{"number": 8000}, {"number": 8000}], "port number must be unique"),
        ("targetPorts", [{"number": 0}], "spec.targetPorts[0].number"),
        ("endpointPickerRef", {"name": "chat-router"}, "port is required when kind is 'Service'"),
        ("selector", {"matchLabels": {}}, "spec.selector.matchLabels"),
        ("targetPort", [{"number": 8000}], 'unknown field "spec.targetPort"'),
    ]
    for field, value, says in cases:
        broken = _rendered_pool(cluster.namespace)
        broken["metadata"]["name"] = "broken"
        if value is None:
            del broken["spec"][field]
        else:
            broken["spec"][field] = value
        refusal = await _create_strict(cluster, broken)
        assert refusal is not None and says in refusal, (field, refusal)
    assert await cluster.get(POOLS, "broken") is None


async def _router_service(cluster: Cluster, ext_proc: bool) -> dict[str, Any] | None:
    service = await cluster.get(CHILDREN["Service"], "chat-router")
    deployment = await cluster.get(CHILDREN["Deployment"], "chat-router")
    if service is None or deployment is None:
        return None
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    has = [p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc"]
    return service if bool(has) == ext_proc == ("--ext-proc-port" in args) else None


async def _pool_other_than(cluster: Cluster, uid: str) -> dict[str, Any] | None:
    pool = await cluster.get(POOLS, "chat")
    return pool if pool is not None and pool["metadata"]["uid"] != uid else None


async def _gone(cluster: Cluster, ref: Any, name: str) -> bool:
    return await cluster.get(ref, name) is None


async def test_the_pool_follows_the_routing_mode(gie_crd: None, operator: Cluster) -> None:
    await ready_cluster(operator)
    cr = await operator.create(CR, chat_cr(routing={"mode": "inferencepool"}))
    assert cr is not None
    pool = await eventually(lambda: operator.get(POOLS, "chat"), what="the InferencePool")
    (owner,) = pool["metadata"]["ownerReferences"]
    assert owner["uid"] == cr["metadata"]["uid"] and owner["controller"] and owner["blockOwnerDeletion"]
    assert {m["manager"] for m in pool["metadata"]["managedFields"] if m["operation"] == "Apply"} == {RECONCILER}
    assert pool["spec"]["selector"] == {"matchLabels": RUNTIME_PODS}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == PICKER
    service = await eventually(lambda: _router_service(operator, ext_proc=True), what="the router with ext_proc")
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == PICKER["port"]["number"]]
    assert (grpc["targetPort"], grpc["appProtocol"]) == ("grpc", "kubernetes.io/h2c")

    # deleted by someone: the operator (watching InferencePools) creates it again
    await operator.delete(POOLS, "chat")
    await eventually(lambda: _pool_other_than(operator, pool["metadata"]["uid"]), what="the pool re-created")

    # prefix: the pool goes; the router stays, without its ext_proc port
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "prefix"}}})
    await eventually(lambda: _gone(operator, POOLS, "chat"), what="the InferencePool deleted")
    await eventually(lambda: _router_service(operator, ext_proc=False), what="the router without ext_proc")
    await never(lambda: operator.get(POOLS, "chat"), 1.0, "an InferencePool in mode prefix")

    # inferencepool again (FailOpen), then routing off: the pool goes with the router's objects
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "inferencepool",
                                                           "inferencePool": {"failureMode": "FailOpen"}}}})
    pool = await eventually(lambda: operator.get(POOLS, "chat"), what="the InferencePool again")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "none"}}})
    await eventually(lambda: _gone(operator, POOLS, "chat"), what="the InferencePool deleted with routing off")
    await eventually(lambda: _gone(operator, CHILDREN["ServiceAccount"], "chat-router"), what="the router deleted")
    degraded = await condition(operator, "Degraded")
    assert degraded is not None and degraded["status"] == "False"


async def _reconciles(cluster: Cluster, result: str) -> float:
    assert cluster.operator_metrics is not None
    async with httpx.AsyncClient() as client:
        text = (await client.get(cluster.operator_metrics, timeout=5)).text
    line = f'kvdrive_operator_reconciles_total{{result="{result}"}} '
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line))


async def test_without_the_crd_the_cr_is_degraded_naming_it(no_gie_crd: None, operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr(routing={"mode": "inferencepool"}))
    reason = "InferencePoolCRDNotInstalled"
    degraded = await eventually(lambda: condition_is(operator, "Degraded", "True"), what="Degraded=True")
    assert degraded["reason"] == reason, degraded
    assert "inferencepools.inference.networking.k8s.io" in degraded["message"]
    assert "Gateway API Inference Extension" in degraded["message"] and "spec.routing.mode" in degraded["message"]
    await eventually(lambda: events_about(operator, reason), what="a Warning event")
    # a pre-flight problem: nothing is applied; and no retry loop (one reconcile, no error handed to Kopf)
    assert await operator.get(STATEFULSETS, "chat") is None
    before = await _reconciles(operator, reason)
    await asyncio.sleep(3.0)
    assert await _reconciles(operator, reason) == before >= 1
    assert await _reconciles(operator, "error") == 0

    # mode prefix needs no CRD: reconciled, and the kind nobody serves is never asked for
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "prefix"}}})
    await eventually(lambda: condition_is(operator, "Degraded", "False"), what="Degraded=False in mode prefix")
    assert await operator.get(STATEFULSETS, "chat") is not None
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "inferencepool"}}})
    degraded = await eventually(lambda: condition_is(operator, "Degraded", "True"), what="Degraded=True again")
    assert degraded["reason"] == reason

    # the CRDs installed: the next reconcile (a spec change here, the resync timer in production) creates it
    await asyncio.to_thread(install_gie_crd, operator.plane)
    await operator.patch(CR, "chat", {"spec": {"routing": {"replicas": 3}}})
    pool = await eventually(lambda: operator.get(POOLS, "chat"), what="the InferencePool once the CRD is there")
    assert pool["spec"]["endpointPickerRef"] == PICKER
    await eventually(lambda: condition_is(operator, "Degraded", "False"), what="Degraded=False")
    assert await _reconciles(operator, "error") == 0
