"""The router on a real kube-apiserver: routing prefix makes the router's six objects (owned by the
CR), the client Service moves to the router's pods once one is ready, the status says why the router
is not ready; routing none deletes them all and moves the clients back. The CRD's own refusals of a
bad ``spec.routing`` come from the server too.

There is no kubelet and no Deployment controller here: router pods are created by the test and their
readiness written as a kubelet would.
"""

from __future__ import annotations

from typing import Any

from crkit import chat_cr, children, condition, ready_cluster, set_ready
from kopfenv import Cluster, eventually, never
from test_crd_server import _dry_run

from kvdrive.operator.act.objects import CHILDREN, CR, PODS

ROUTER = [("ServiceAccount", "chat-router"), ("Role", "chat-router"), ("RoleBinding", "chat-router"),
          ("Service", "chat-router"), ("PodDisruptionBudget", "chat-router"), ("Deployment", "chat-router")]
RUNTIME_PODS = {"app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "chat"}
ROUTER_PODS = {"app.kubernetes.io/name": "kvdrive-router", "app.kubernetes.io/instance": "chat"}


async def _all_router_objects(cluster: Cluster) -> dict[tuple[str, str], dict[str, Any]] | None:
    found = await children(cluster, ROUTER)
    return found if len(found) == len(ROUTER) else None


async def _no_router_objects(cluster: Cluster) -> bool:
    return not await children(cluster, ROUTER)


async def _client_selects(cluster: Cluster, labels: dict[str, str]) -> dict[str, Any] | None:
    service = await cluster.get(CHILDREN["Service"], "chat")
    return service if service and service["spec"].get("selector") == labels else None


def _router_pod(name: str) -> dict[str, Any]:
    labels = {**ROUTER_PODS, "app.kubernetes.io/managed-by": "kvdrive-operator"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "router", "image": "x"}]}}


async def _router_status(cluster: Cluster, ready: int) -> dict[str, Any] | None:
    cr = await cluster.get(CR, "chat")
    status = (cr or {}).get("status") or {}
    return status if (status.get("router") or {}).get("ready") == ready else None


async def test_routing_on_then_off(operator: Cluster) -> None:
    await ready_cluster(operator)
    cr = await operator.create(CR, chat_cr(routing={"mode": "prefix", "replicas": 2}))
    assert cr is not None and cr["spec"]["routing"] == {"mode": "prefix", "replicas": 2,
                                                        "inferencePool": {"failureMode": "FailClose"}}  # defaulted
    found = await eventually(lambda: _all_router_objects(operator), what="the router's objects")
    for (kind, _), obj in found.items():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["uid"] == cr["metadata"]["uid"] and owner["controller"] and owner["blockOwnerDeletion"], kind
    deployment = found["Deployment", "chat-router"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][:1] == ["route"]
    assert found["Role", "chat-router"]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    assert found["RoleBinding", "chat-router"]["subjects"][0]["name"] == "chat-router"

    # no router pod is ready (nor any replica): the status says so, and the clients stay on the replicas
    status = await eventually(lambda: _router_status(operator, 0), what="status.router")
    assert status["router"] == {"ready": 0, "desired": 2}
    router_ready = await condition(operator, "RouterReady")
    assert router_ready is not None and router_ready["status"] == "False"
    assert router_ready["reason"] == "NoReplicaReady" and "0/2 router pods ready" in router_ready["message"]
    assert (await condition(operator, "Ready"))["status"] == "False"
    await never(lambda: _client_selects(operator, ROUTER_PODS), 1.0, "clients sent to a router that cannot serve")
    assert await _client_selects(operator, RUNTIME_PODS)

    # a router pod turns ready: the client Service moves to the router; the headless one stays on the replicas
    await operator.create(PODS, _router_pod("chat-router-a"))
    await set_ready(operator, "chat-router-a", True)
    await eventually(lambda: _client_selects(operator, ROUTER_PODS), what="the client Service on the router")
    headless = await operator.get(CHILDREN["Service"], "chat-headless")
    assert headless["spec"]["selector"] == RUNTIME_PODS
    await eventually(lambda: _router_status(operator, 1), what="status.router.ready 1")
    router_ready = await condition(operator, "RouterReady")
    assert (router_ready["status"], router_ready["reason"]) == ("False", "RouterPodsNotReady")
    # it stays there when the router pod turns unready again (no flapping of the clients' way in)
    await set_ready(operator, "chat-router-a", False)
    await eventually(lambda: _router_status(operator, 0), what="status.router.ready 0 again")
    assert await _client_selects(operator, ROUTER_PODS)

    # routing off: the clients go back to the replicas, every router object is deleted, the status forgets it
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "none"}}})
    await eventually(lambda: _no_router_objects(operator), what="the router's objects deleted")
    assert await _client_selects(operator, RUNTIME_PODS)

    async def forgotten() -> dict[str, Any] | None:
        cr = await operator.get(CR, "chat")
        status = (cr or {}).get("status") or {}
        types = {c["type"] for c in status.get("conditions") or []}
        return status if "router" not in status and "RouterReady" not in types and types else None

    await eventually(forgotten, what="status.router and RouterReady gone")
    await never(lambda: children(operator, ROUTER), 1.0, "router objects re-created with routing off")

    # and on again: they come back
    await operator.patch(CR, "chat", {"spec": {"routing": {"mode": "prefix"}}})
    await eventually(lambda: _all_router_objects(operator), what="the router's objects again")


async def test_routing_off_leaves_an_object_the_cr_does_not_control(operator: Cluster) -> None:
    """A ServiceAccount ``chat-router`` of the user's own (no controller owner): routing off deletes
    only what the CR controls."""
    await ready_cluster(operator)
    await operator.create(CHILDREN["ServiceAccount"], {"apiVersion": "v1", "kind": "ServiceAccount",
                                                       "metadata": {"name": "chat-router"}})
    await operator.create(CR, chat_cr(routing={"mode": "none"}))

    async def reconciled() -> bool:
        degraded = await condition(operator, "Degraded")
        return bool(degraded) and degraded["status"] == "False"

    await eventually(reconciled, what="the first reconcile")  # its status is written after the pruning
    assert await operator.get(CHILDREN["ServiceAccount"], "chat-router") is not None


async def test_the_server_refuses_a_bad_routing_naming_the_field(cluster: Cluster) -> None:
    base = chat_cr()
    bogus = await _dry_run(cluster, {**base, "spec": {**base["spec"], "routing": {"mode": "bogus"}}})
    assert bogus is not None and "spec.routing.mode" in bogus and 'Unsupported value: "bogus"' in bogus
    assert '"none"' in bogus and '"prefix"' in bogus, bogus
    zero = await _dry_run(cluster, {**base, "spec": {**base["spec"], "routing": {"mode": "prefix", "replicas": 0}}})
    assert zero is not None and "spec.routing.replicas" in zero and "greater than or equal to 1" in zero, zero
    many = await _dry_run(cluster, {**base, "spec": {**base["spec"], "routing": {"replicas": 17}}})
    assert many is not None and "spec.routing.replicas" in many and "less than or equal to 16" in many, many
    assert await _dry_run(cluster, {**base, "spec": {**base["spec"], "routing": {"mode": "prefix"}}}) is None
