"""The real Kopf operator against kmock's KubernetesEmulator over HTTP."""

from __future__ import annotations

import copy
from typing import Any

from crdcheck import load_example
from kopfenv import NAMESPACE, Cluster, eventually, never

from kvdrive.operator.handlers import CHILDREN, CLAIMS, CR, PODS, STATEFULSETS
from kvdrive.operator.kubeapi import Ref

EVENTS = Ref("v1", "events")
CHILD_NAMES = {
    ("ConfigMap", "chat-config"), ("Secret", "chat-admin"), ("Service", "chat"), ("Service", "chat-headless"),
    ("StatefulSet", "chat"), ("PodDisruptionBudget", "chat"),
}


def chat_cr(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(load_example("full.yaml"))
    doc["spec"].update(spec)
    return doc


async def children(cluster: Cluster) -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for kind, name in CHILD_NAMES:
        obj = await cluster.get(CHILDREN[kind], name)
        if obj is not None:
            found[kind, name] = obj
    return found


async def condition(cluster: Cluster, kind: str, name: str = "chat") -> dict[str, Any] | None:
    cr = await cluster.get(CR, name)
    for cond in ((cr or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return None


async def ready_cluster(cluster: Cluster) -> None:
    await cluster.storage_class()
    await cluster.create(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
                                  "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "50Gi"}}}})


async def test_create_makes_all_children_with_the_right_fields(operator: Cluster) -> None:
    await ready_cluster(operator)
    cr = await operator.create(CR, chat_cr())
    found = await eventually(lambda: _all_children(operator), what="all children")
    sts = found["StatefulSet", "chat"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--gpu-budget") + 1] == str(40 << 30)
    assert container["resources"]["limits"]["hugepages-2Mi"] == "64Gi"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "local-nvme"
    assert sts["spec"]["replicas"] == 1  # autoscaling.mode operator: starts at minReplicas
    for obj in found.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    status = await eventually(lambda: _status(operator), what="status")
    assert status["selector"] == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=kvdrive"
    assert status["endpoint"] == f"http://chat.{NAMESPACE}.svc:8000/v1"
    assert status["observedGeneration"] == 1 and status["replicas"] == 1 and status["readyReplicas"] == 0


async def _all_children(cluster: Cluster) -> dict[tuple[str, str], dict[str, Any]] | None:
    found = await children(cluster)
    return found if set(found) == CHILD_NAMES else None


async def _status(cluster: Cluster) -> dict[str, Any] | None:
    cr = await cluster.get(CR, "chat")
    return (cr or {}).get("status", {}).get("selector") and cr["status"]


def _args(sts: dict[str, Any]) -> list[str]:
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


async def test_update_rolls_the_statefulset_template(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    sts = await eventually(lambda: operator.get(STATEFULSETS, "chat"), what="StatefulSet")
    before = sts["spec"]["template"]
    patch = {"metadata": {"generation": 2}, "spec": {"tiers": {"gpu": {"budget": "20Gi"}}, "placement": "lru"}}
    await operator.patch(CR, "chat", patch)

    async def rolled() -> dict[str, Any] | None:
        sts = await operator.get(STATEFULSETS, "chat")
        return sts if sts and sts["spec"]["template"] != before else None

    sts = await eventually(rolled, what="a new pod template")
    args = _args(sts)
    assert args[args.index("--gpu-budget") + 1] == str(20 << 30)
    assert args[args.index("--placement") + 1] == "lru"
    assert sts["spec"]["template"]["metadata"]["annotations"] != before["metadata"]["annotations"]
    status = await eventually(lambda: _generation(operator, 2), what="observedGeneration 2")
    assert status["observedGeneration"] == 2


async def _generation(cluster: Cluster, generation: int) -> dict[str, Any] | None:
    cr = await cluster.get(CR, "chat")
    status = (cr or {}).get("status") or {}
    return status if status.get("observedGeneration") == generation else None


async def test_deleted_and_edited_children_are_repaired(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    found = await eventually(lambda: _all_children(operator), what="all children")
    token = found["Secret", "chat-admin"]["data"]["token"]
    await operator.delete(CHILDREN["Service"], "chat")
    await operator.delete(CHILDREN["ConfigMap"], "chat-config")
    await eventually(lambda: _all_children(operator), what="recreated children")
    # a hand edit of the pod template is reverted
    await operator.patch(STATEFULSETS, "chat", {"spec": {"template": {"spec": {"containers": [
        {"name": "kvdrive", "image": "evil:latest", "args": ["serve", "--model", "demo"]}]}}}})

    async def repaired() -> bool:
        sts = await operator.get(STATEFULSETS, "chat")
        return bool(sts) and sts["spec"]["template"]["spec"]["containers"][0]["image"] == chat_cr()["spec"]["image"]

    await eventually(repaired, what="the StatefulSet repaired")
    assert "--gpu-budget" in _args(await operator.get(STATEFULSETS, "chat"))
    # the admin token survives reconciles
    secret = await operator.get(CHILDREN["Secret"], "chat-admin")
    assert secret["data"]["token"] == token


async def test_deleting_the_cr_stops_management(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    await eventually(lambda: _all_children(operator), what="all children")
    await operator.delete(CR, "chat")

    async def gone() -> bool:
        return await operator.get(CR, "chat") is None

    await eventually(gone, what="the CR deleted")
    # kmock has no garbage collector: the children stay, but nobody repairs them any more
    await operator.delete(STATEFULSETS, "chat")
    await operator.delete(CHILDREN["Service"], "chat")
    await never(lambda: operator.get(STATEFULSETS, "chat"), 1.5, "StatefulSet re-created after the CR was deleted")
    assert await operator.get(CHILDREN["Service"], "chat") is None


def _pod(name: str, ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {
            "app.kubernetes.io/name": "kvdrive", "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/managed-by": "kvdrive-operator"}},
        "spec": {"containers": [{"name": "kvdrive", "image": "x"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


async def _condition_is(cluster: Cluster, kind: str, status: str) -> dict[str, Any] | None:
    cond = await condition(cluster, kind)
    return cond if cond and cond["status"] == status else None


async def test_conditions_follow_pod_readiness(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr(replicas=2, autoscaling={"mode": "none"}))
    await eventually(lambda: _condition_is(operator, "Progressing", "True"), what="Progressing=True")
    ready = await condition(operator, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ReplicasNotReady"
    assert (await condition(operator, "Degraded"))["status"] == "False"
    await operator.create(PODS, _pod("chat-0", ready=False))
    await operator.create(PODS, _pod("chat-1", ready=True))

    async def one_ready() -> bool:
        cr = await operator.get(CR, "chat")
        return cr["status"].get("readyReplicas") == 1

    await eventually(one_ready, what="readyReplicas 1")
    assert (await condition(operator, "Ready"))["status"] == "False"
    await operator.patch(PODS, "chat-0", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    ready = await eventually(lambda: _condition_is(operator, "Ready", "True"), what="Ready=True")
    assert ready["reason"] == "AllReplicasReady" and ready["observedGeneration"] == 1
    assert ready["lastTransitionTime"]
    assert (await condition(operator, "Progressing"))["status"] == "False"
    cr = await operator.get(CR, "chat")
    assert cr["status"]["readyReplicas"] == 2 and cr["status"]["replicas"] == 2
    # a pod turning unready flips Ready back
    await operator.patch(PODS, "chat-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    await eventually(lambda: _condition_is(operator, "Ready", "False"), what="Ready=False again")


async def _events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    items = await cluster.api.list(EVENTS, NAMESPACE, {})
    return [e for e in items if e.get("reason") == reason and e.get("involvedObject", {}).get("name") == "chat"]


async def test_missing_storage_class_degrades_without_children(operator: Cluster) -> None:
    await operator.create(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
                                   "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    await operator.create(CR, chat_cr())
    degraded = await eventually(lambda: _condition_is(operator, "Degraded", "True"), what="Degraded=True")
    assert degraded["reason"] == "StorageClassNotFound"
    assert "spec.tiers.ssd.storageClassName" in degraded["message"] and "local-nvme" in degraded["message"]
    events = await eventually(lambda: _events(operator, "StorageClassNotFound"), what="a Warning event")
    assert events[0]["type"] == "Warning" and "local-nvme" in events[0]["message"]
    assert (await condition(operator, "Ready"))["status"] == "False"
    await never(lambda: children(operator), 1.0, "children of a degraded CR")
    # once the StorageClass exists, the next reconcile (here: a spec update) recovers
    await operator.storage_class()
    await operator.patch(CR, "chat", {"metadata": {"generation": 2}, "spec": {"attention": {"tokenBudget": 4096}}})
    await eventually(lambda: _all_children(operator), what="children after the fix")
    await eventually(lambda: _condition_is(operator, "Degraded", "False"), what="Degraded=False")


async def test_missing_model_claim_degrades_without_children(operator: Cluster) -> None:
    await operator.storage_class()
    await operator.create(CR, chat_cr())
    degraded = await eventually(lambda: _condition_is(operator, "Degraded", "True"), what="Degraded=True")
    assert degraded["reason"] == "ModelClaimNotFound"
    assert "spec.model.source" in degraded["message"] and "'models'" in degraded["message"]
    await eventually(lambda: _events(operator, "ModelClaimNotFound"), what="a Warning event")
    await never(lambda: children(operator), 1.0, "children of a degraded CR")
