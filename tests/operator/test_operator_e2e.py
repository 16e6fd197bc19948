"""The real Kopf operator against a real kube-apiserver: children, status, server-side apply
(the status conditions and events: ``test_operator_status_e2e.py``).

Each test has its own namespace and operator; the API server assigns uid, resourceVersion and
generation, splits ``/status``, validates and defaults, and tracks field managers; the garbage
collector of kube-controller-manager removes what a deleted CR owned.
"""

from __future__ import annotations

from typing import Any

from crkit import all_children, chat_cr, condition, condition_is, ready_cluster
from kopfenv import Cluster, eventually, never

from kvdrive.operator.act.objects import CHILDREN, CR, RECONCILER, STATEFULSETS
from kvdrive.operator.clients.kubeclient import KindNotServed


async def _status(cluster: Cluster) -> dict[str, Any] | None:
    cr = await cluster.get(CR, "chat")
    return (cr or {}).get("status", {}).get("selector") and cr["status"]


def _args(sts: dict[str, Any]) -> list[str]:
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


def _pod_spec(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]


async def _generation(cluster: Cluster, generation: int) -> dict[str, Any] | None:
    cr = await cluster.get(CR, "chat")
    status = (cr or {}).get("status") or {}
    return status if status.get("observedGeneration") == generation else None


async def test_create_makes_all_children_with_the_right_fields(operator: Cluster) -> None:
    await ready_cluster(operator)
    cr = await operator.create(CR, chat_cr())
    assert cr is not None and cr["metadata"]["generation"] == 1  # the server's, not the test's
    found = await eventually(lambda: all_children(operator), what="all children")
    sts = found["StatefulSet", "chat"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--gpu-budget") + 1] == str(40 << 30)
    assert container["resources"]["limits"]["hugepages-2Mi"] == "64Gi"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "local-nvme"
    assert sts["spec"]["replicas"] == 1  # autoscaling.mode operator: starts at minReplicas
    for obj in found.values():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["uid"] == cr["metadata"]["uid"] and owner["controller"] and owner["blockOwnerDeletion"]
        assert {m["manager"] for m in obj["metadata"]["managedFields"] if m["operation"] == "Apply"} == {RECONCILER}
    status = await eventually(lambda: _status(operator), what="status")
    assert status["selector"] == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=kvdrive"
    assert status["endpoint"] == f"http://chat.{operator.namespace}.svc:8000/v1"
    assert status["observedGeneration"] == 1 and status["replicas"] == 1 and status["readyReplicas"] == 0


async def test_update_rolls_the_statefulset_template(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    sts = await eventually(lambda: operator.get(STATEFULSETS, "chat"), what="StatefulSet")
    before = sts["spec"]["template"]
    await operator.patch(CR, "chat", {"spec": {"tiers": {"gpu": {"budget": "20Gi"}}, "placement": "lru"}})

    async def rolled() -> dict[str, Any] | None:
        sts = await operator.get(STATEFULSETS, "chat")
        return sts if sts and sts["spec"]["template"] != before else None

    sts = await eventually(rolled, what="a new pod template")
    args = _args(sts)
    assert args[args.index("--gpu-budget") + 1] == str(20 << 30)
    assert args[args.index("--placement") + 1] == "lru"
    assert sts["spec"]["template"]["metadata"]["annotations"] != before["metadata"]["annotations"]
    status = await eventually(lambda: _generation(operator, 2), what="observedGeneration 2 (the server's)")
    assert status["observedGeneration"] == 2


async def test_fields_dropped_from_the_cr_leave_the_statefulset(operator: Cluster) -> None:
    """A CR going from gpus 1 to 0, and losing its nodeSelector, tolerations and affinity: the
    StatefulSet loses them too (a merge patch of the rendered children would keep them forever)."""
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    sts = await eventually(lambda: operator.get(STATEFULSETS, "chat"), what="StatefulSet")
    pod = _pod_spec(sts)
    assert pod["nodeSelector"] and pod["tolerations"] and pod["affinity"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    await operator.patch(CR, "chat", {"spec": {"resources": {"gpus": 0}, "nodeSelector": None, "tolerations": None,
                                               "affinity": None}})

    async def dropped() -> dict[str, Any] | None:
        sts = await operator.get(STATEFULSETS, "chat")
        pod = _pod_spec(sts) if sts else {}
        limits = pod.get("containers", [{}])[0].get("resources", {}).get("limits", {})
        gone = not ({"nodeSelector", "tolerations", "affinity"} & set(pod)) and "nvidia.com/gpu" not in limits
        return pod if gone else None

    await eventually(dropped, what="nodeSelector, tolerations, affinity and the GPU limit gone from the pod template")


async def test_pod_settings_come_and_go_with_the_cr(operator: Cluster) -> None:
    """Pod settings given in the CR (env, pull secrets, pod labels, an extra volume and its mount) reach the
    StatefulSet through the real API server; dropped from the CR, they leave it (server-side apply)."""
    await ready_cluster(operator)
    cr = chat_cr()
    cr["spec"] = {**cr["spec"], "env": [{"name": "LOG_LEVEL", "value": "debug"}],
                  "imagePullSecrets": [{"name": "registry-creds"}], "podLabels": {"team": "ml"},
                  "extraVolumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
                  "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/certs"}]}
    await operator.create(CR, cr)
    sts = await eventually(lambda: operator.get(STATEFULSETS, "chat"), what="StatefulSet")
    pod = _pod_spec(sts)
    assert {"name": "LOG_LEVEL", "value": "debug"} in pod["containers"][0]["env"]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert sts["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert any(v["name"] == "certs" for v in pod["volumes"])
    await operator.patch(CR, "chat", {"spec": {"env": None, "imagePullSecrets": None, "podLabels": None,
                                               "extraVolumes": None, "extraVolumeMounts": None}})

    async def dropped() -> dict[str, Any] | None:
        sts = await operator.get(STATEFULSETS, "chat")
        if not sts:
            return None
        pod = _pod_spec(sts)
        env = [e["name"] for e in pod["containers"][0].get("env", [])]
        mounts = [m["name"] for m in pod["containers"][0]["volumeMounts"]]
        gone = ("LOG_LEVEL" not in env and "imagePullSecrets" not in pod and "certs" not in mounts
                and all(v["name"] != "certs" for v in pod["volumes"])
                and "team" not in sts["spec"]["template"]["metadata"]["labels"])
        return pod if gone else None

    await eventually(dropped, what="env, pull secrets, pod labels and the extra volume gone from the pod template")


async def test_a_pod_setting_the_api_server_refuses_is_a_degraded_condition(operator: Cluster) -> None:
    """A core/v1 fragment passed as it is (an env valueFrom naming no source) that the API server refuses in
    the StatefulSet: the CR says so in a Degraded condition, naming the child and the server's reason."""
    await ready_cluster(operator)
    await operator.create(CR, chat_cr(env=[{"name": "TOKEN", "valueFrom": {}}]))

    async def degraded() -> dict[str, Any] | None:
        cond = await condition(operator, "Degraded")
        return cond if cond and cond["status"] == "True" and cond["reason"] == "ChildRejected" else None

    cond = await eventually(degraded, what="a Degraded condition with reason ChildRejected")
    assert "StatefulSet" in cond["message"] and "valueFrom" in cond["message"]


async def test_fields_of_other_managers_are_left_alone(operator: Cluster) -> None:
    """``kubectl rollout restart`` stamps a template annotation, a tool labels the StatefulSet: the
    operator's next applies (here: a spec change) keep both."""
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    await eventually(lambda: operator.get(STATEFULSETS, "chat"), what="StatefulSet")
    await operator.patch(STATEFULSETS, "chat", {
        "metadata": {"labels": {"team": "search"}},
        "spec": {"template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-01T10:00:00Z"}}}},
    }, field_manager="kubectl-rollout")
    await operator.patch(CR, "chat", {"spec": {"placement": "lru"}})

    async def applied() -> dict[str, Any] | None:
        sts = await operator.get(STATEFULSETS, "chat")
        return sts if sts and "lru" in _args(sts) else None

    sts = await eventually(applied, what="the spec change applied")
    assert sts["metadata"]["labels"]["team"] == "search"
    assert sts["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"]


async def test_a_conflict_with_another_manager_is_reported_not_forced(operator: Cluster) -> None:
    """Someone scales the StatefulSet by hand in mode none (where the CR owns the count): the operator
    reports the conflict on the CR and does not overwrite the field."""
    await ready_cluster(operator)
    await operator.create(CR, chat_cr(replicas=2, autoscaling={"mode": "none"}))
    await eventually(lambda: _generation(operator, 1), what="the first reconcile")
    await operator.patch(STATEFULSETS, "chat", {"spec": {"replicas": 5}}, field_manager="someone")
    await operator.patch(CR, "chat", {"spec": {"placement": "lru"}})  # a change: the operator applies again

    async def reported() -> dict[str, Any] | None:
        degraded = await condition(operator, "Degraded")
        return degraded if degraded and degraded["status"] == "True" else None

    degraded = await eventually(reported, what="Degraded=True")
    assert degraded["reason"] == "FieldConflict"
    assert ".spec.replicas" in degraded["message"] and "someone" in degraded["message"]
    assert (await operator.get(STATEFULSETS, "chat"))["spec"]["replicas"] == 5  # not fought over
    # the other manager gives the field back: the next reconcile applies and recovers
    await operator.patch(STATEFULSETS, "chat", {"spec": {"replicas": 2}}, field_manager="someone")
    await operator.patch(CR, "chat", {"spec": {"placement": "kvdrive"}})
    await eventually(lambda: condition_is(operator, "Degraded", "False"), what="Degraded=False")


async def test_the_scale_subresource_moves_the_statefulset(operator: Cluster) -> None:
    """``kubectl scale kvd/chat --replicas=3`` (a merge patch of /scale) and an HPA's read-modify-write
    of /scale (GET, then PUT): both move spec.replicas and reach the StatefulSet."""
    await ready_cluster(operator)
    await operator.create(CR, chat_cr(replicas=1, autoscaling={"mode": "external"}))
    await eventually(lambda: _generation(operator, 1), what="the first reconcile")
    scale = await operator.patch(CR, "chat", {"spec": {"replicas": 3}}, subresource="scale")
    assert scale["spec"]["replicas"] == 3
    await eventually(lambda: _sts_replicas(operator, 3), what="StatefulSet replicas 3")

    def hpa() -> None:
        # An HPA's update carries the resourceVersion it read: a write to the CR in between (the operator's
        # status) makes it a 409, and the HPA reads again and retries, as client-go's RetryOnConflict does.
        from kubernetes.dynamic.exceptions import ConflictError

        res = operator.dynamic.resources.get(api_version=CR.api_version, kind=CR.kind).subresources["scale"]
        for _ in range(10):
            current = res.get(name="chat", namespace=operator.namespace).to_dict()
            assert current["status"]["selector"] == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=kvdrive"
            current["spec"]["replicas"] = 4
            try:
                res.replace(body=current, name="chat", namespace=operator.namespace)
                return
            except ConflictError:
                continue
        raise AssertionError("/scale update conflicted 10 times in a row")

    import asyncio

    await asyncio.to_thread(hpa)
    await eventually(lambda: _sts_replicas(operator, 4), what="StatefulSet replicas 4")
    assert (await operator.get(CR, "chat"))["spec"]["replicas"] == 4


async def _sts_replicas(cluster: Cluster, replicas: int) -> bool:
    sts = await cluster.get(STATEFULSETS, "chat")
    return bool(sts) and sts["spec"].get("replicas") == replicas


async def test_deleted_children_are_recreated(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    found = await eventually(lambda: all_children(operator), what="all children")
    token = found["Secret", "chat-admin"]["data"]["token"]
    await operator.delete(CHILDREN["Service"], "chat")
    await operator.delete(CHILDREN["ConfigMap"], "chat-config")
    await eventually(lambda: all_children(operator), what="recreated children")
    # (a hand edit of a field the operator owns is a conflict: reported, not reverted; see
    # test_a_conflict_with_another_manager_is_reported_not_forced)
    # the admin token survives reconciles
    secret = await operator.get(CHILDREN["Secret"], "chat-admin")
    assert secret["data"]["token"] == token


async def test_deleting_the_cr_lets_the_garbage_collector_take_every_child(operator: Cluster) -> None:
    """The CR goes away (Kopf's finalizer released); kube-controller-manager's garbage collector then
    removes every object the operator made, which it does only for objects that name the CR as their
    owner; and nothing is re-created."""
    await ready_cluster(operator)
    await operator.create(CR, chat_cr())
    await eventually(lambda: all_children(operator), what="all children")
    await operator.delete(CR, "chat")

    async def gone() -> bool:
        return await operator.get(CR, "chat") is None

    await eventually(gone, what="the CR deleted")
    await eventually(lambda: _nothing_left(operator), timeout=60, what="every child collected")
    await never(lambda: operator.get(STATEFULSETS, "chat"), 1.5, "StatefulSet re-created after the CR was deleted")


async def _nothing_left(cluster: Cluster) -> bool:
    managed = {"app.kubernetes.io/managed-by": "kvdrive-operator"}
    for ref in {*CHILDREN.values()}:
        try:
            if await cluster.api.list(ref, cluster.namespace, managed):
                return False
        except KindNotServed:  # an optional kind whose CRD this cluster lacks (InferencePool): none can exist
            continue
    return True
