"""The real Kopf operator against a real kube-apiserver: the CR's status conditions and events.

Ready and Progressing follow the pods' readiness (reported through the status subresource, as a kubelet
would); a cluster that lacks what the CR needs (its StorageClass, its model claim, its shared tier's Secrets) degrades the CR with a
reason, a message naming the field and a Warning event, and makes no children until it is fixed; the
operator's own ``/metrics`` count each reconcile under that reason. Each test has its own namespace.
"""

from __future__ import annotations

from typing import Any

import httpx
from crkit import (
    all_children,
    chat_cr,
    chat_pod,
    children,
    condition,
    condition_is,
    events_about,
    example_secrets,
    ready_cluster,
    set_ready,
)
from kopfenv import Cluster, eventually, never, run_operator
from liveservers import free_port

from kvdrive.operator.act.objects import CLAIMS, CR, PODS, SECRETS


async def test_conditions_follow_pod_readiness(operator: Cluster) -> None:
    await ready_cluster(operator)
    await operator.create(CR, chat_cr(replicas=2, autoscaling={"mode": "none"}))
    await eventually(lambda: condition_is(operator, "Progressing", "True"), what="Progressing=True")
    ready = await condition(operator, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ReplicasNotReady"
    assert (await condition(operator, "Degraded"))["status"] == "False"
    for name, is_ready in (("chat-0", False), ("chat-1", True)):
        await operator.create(PODS, chat_pod(name))
        await set_ready(operator, name, is_ready)

    async def one_ready() -> bool:
        cr = await operator.get(CR, "chat")
        return cr["status"].get("readyReplicas") == 1

    await eventually(one_ready, what="readyReplicas 1")
    assert (await condition(operator, "Ready"))["status"] == "False"
    await set_ready(operator, "chat-0", True)
    ready = await eventually(lambda: condition_is(operator, "Ready", "True"), what="Ready=True")
    assert ready["reason"] == "AllReplicasReady" and ready["observedGeneration"] == 1
    assert ready["lastTransitionTime"]
    assert (await condition(operator, "Progressing"))["status"] == "False"
    cr = await operator.get(CR, "chat")
    assert cr["status"]["readyReplicas"] == 2 and cr["status"]["replicas"] == 2
    # a pod turning unready flips Ready back
    await set_ready(operator, "chat-1", False)
    await eventually(lambda: condition_is(operator, "Ready", "False"), what="Ready=False again")


async def test_missing_storage_class_degrades_without_children(operator: Cluster) -> None:
    storage_class = f"nvme-{operator.namespace}"  # StorageClasses are cluster-wide: one of this test's own
    await operator.create(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
                                   "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    await example_secrets(operator)
    doc = chat_cr()
    doc["spec"]["tiers"]["ssd"]["storageClassName"] = storage_class
    await operator.create(CR, doc)
    degraded = await eventually(lambda: condition_is(operator, "Degraded", "True"), what="Degraded=True")
    assert degraded["reason"] == "StorageClassNotFound"
    assert "spec.tiers.ssd.storageClassName" in degraded["message"] and storage_class in degraded["message"]
    events = await eventually(lambda: events_about(operator, "StorageClassNotFound"), what="a Warning event")
    assert events[0]["type"] == "Warning" and storage_class in events[0]["message"]
    assert (await condition(operator, "Ready"))["status"] == "False"
    await never(lambda: children(operator), 1.0, "children of a degraded CR")
    # once the StorageClass exists, the next reconcile (here: a spec update) recovers
    await operator.storage_class(storage_class)
    await operator.patch(CR, "chat", {"spec": {"attention": {"tokenBudget": 4096}}})
    await eventually(lambda: all_children(operator), what="children after the fix")
    await eventually(lambda: condition_is(operator, "Degraded", "False"), what="Degraded=False")


async def test_missing_model_claim_degrades_without_children(operator: Cluster) -> None:
    await operator.storage_class()
    await operator.create(CR, chat_cr())
    degraded = await eventually(lambda: condition_is(operator, "Degraded", "True"), what="Degraded=True")
    assert degraded["reason"] == "ModelClaimNotFound"
    assert "spec.model.source" in degraded["message"] and "'models'" in degraded["message"]
    await eventually(lambda: events_about(operator, "ModelClaimNotFound"), what="a Warning event")
    await never(lambda: children(operator), 1.0, "children of a degraded CR")


async def test_a_missing_shared_tier_secret_or_key_degrades_without_children(operator: Cluster) -> None:
    """The pods would wait in ContainerCreating on a Secret that is not there: the CR says which one (or which
    key) instead, and nothing is applied until both of its Secrets hold their keys."""
    await ready_cluster(operator)
    doc = chat_cr()
    doc["spec"]["tiers"]["shared"] = {"endpoints": ["valkey-0.valkey:6379"], "authSecretRef": {"name": "valkey-auth"},
                                      "tls": {"enabled": True, "caSecretRef": {"name": "valkey-ca"}}}
    await operator.create(CR, doc)

    async def degraded_saying(text: str) -> dict[str, Any] | None:
        found = await condition_is(operator, "Degraded", "True")
        return found if found is not None and text in found["message"] else None

    degraded = await eventually(lambda: degraded_saying("authSecretRef"), what="Degraded=True for the password")
    assert degraded["reason"] == "SharedTierSecretNotFound"
    assert "Secret 'valkey-auth' does not exist" in degraded["message"]
    await eventually(lambda: events_about(operator, "SharedTierSecretNotFound"), what="a Warning event")
    await never(lambda: children(operator), 1.0, "children of a degraded CR")

    def secret(name: str, **data: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}

    async def touch(budget: int) -> None:  # a spec update: the next reconcile, without waiting for the resync
        await operator.patch(CR, "chat", {"spec": {"attention": {"tokenBudget": budget}}})

    await operator.create(SECRETS, secret("valkey-auth", other="x"))  # the Secret, without the key
    await touch(1024)
    degraded = await eventually(lambda: degraded_saying("has no key 'password'"), what="the missing key named")
    assert degraded["message"].startswith("spec.tiers.shared.authSecretRef.key:")
    await operator.patch(SECRETS, "valkey-auth", {"stringData": {"password": "s3cret"}})
    await touch(1536)
    await eventually(lambda: degraded_saying("tls.caSecretRef: Secret 'valkey-ca' does not exist"),
                     what="the CA bundle's Secret named next")
    await never(lambda: children(operator), 1.0, "children of a degraded CR")
    await operator.create(SECRETS, secret("valkey-ca", **{"ca.crt": "-----BEGIN CERTIFICATE-----"}))
    await touch(3072)
    await eventually(lambda: all_children(operator), what="children once both Secrets hold their keys")
    await eventually(lambda: condition_is(operator, "Degraded", "False"), what="Degraded=False")


async def test_the_operator_serves_its_own_metrics(cluster: Cluster) -> None:
    """``/metrics`` of the operator itself (``--metrics``): a CR that cannot be reconciled yet (its
    StorageClass or model claim is missing) is counted under that problem's reason, then under ok once the
    cluster is ready; each reconcile is timed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    async with run_operator(cluster, metrics_address=url) as running:
        await running.create(CR, chat_cr())

        async def counted(result: str) -> float | None:
            async with httpx.AsyncClient() as client:
                text = (await client.get(url, timeout=5)).text
            line = f'kvdrive_operator_reconciles_total{{result="{result}"}}'
            found = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line + " ")]
            return found[0] if found and found[0] >= 1 else None

        # what is missing first depends on what earlier tests left in the cluster (the StorageClass is
        # cluster-scoped): the count follows the reason the CR's status gives
        async def degraded_now() -> dict[str, Any] | None:
            cond = await condition(running, "Degraded")
            return cond if cond and cond["status"] == "True" else None

        degraded = await eventually(degraded_now, what="a Degraded condition")
        await eventually(lambda: counted(degraded["reason"]), what=f"a reconcile counted as {degraded['reason']}")
        await ready_cluster(running)
        await running.patch(CR, "chat", {"spec": {"placement": "lru"}})  # reconciled again, now with its class
        await eventually(lambda: counted("ok"), what="a reconcile counted as ok")
        async with httpx.AsyncClient() as client:
            text = (await client.get(url, timeout=5)).text
        assert 'kvdrive_operator_reconcile_seconds_count{result="ok"}' in text
