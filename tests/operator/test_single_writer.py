"""One writer per field, on a real API server: an autoscale decision that lands while a reconcile is
in flight (after the reconciler read the StatefulSet, before it applied) survives the reconcile,
and the spec change that reconcile carries lands too.

The reconciler and the autoscaler run in-process, driven step by step, so the interleaving is exact
rather than left to timing: the reconciler's read of the StatefulSet is the moment the autoscaler
moves replicas.
"""

from __future__ import annotations

import logging
from typing import Any

from crkit import chat_cr, ready_cluster
from kopfenv import Cluster

from kvdrive.operator.act.live import LiveController
from kvdrive.operator.act.objects import AUTOSCALER, CR, RECONCILER, STATEFULSETS
from kvdrive.operator.act.reconciler import Reconciler
from kvdrive.operator.clients.kubeclient import KubeApi, Ref

LOG = logging.getLogger("test")


def _owners_of_replicas(sts: dict[str, Any]) -> set[str]:
    return {m["manager"] for m in sts["metadata"]["managedFields"]
            if "f:replicas" in (m.get("fieldsV1") or {}).get("f:spec", {})}


async def test_an_autoscale_decision_during_a_reconcile_is_not_lost(cluster: Cluster) -> None:
    await ready_cluster(cluster)
    await cluster.create(CR, chat_cr())  # autoscaling mode operator, minReplicas 1
    reconciler, autoscaler = Reconciler(), KubeApi(cluster.plane.info())
    await reconciler.connect(cluster.plane.info())
    try:
        await reconciler.reconcile(cluster.namespace, "chat", LOG)
        sts = await cluster.get(STATEFULSETS, "chat")
        assert sts["spec"]["replicas"] == 1 and _owners_of_replicas(sts) == {RECONCILER}  # created at minReplicas

        await cluster.patch(CR, "chat", {"spec": {"tiers": {"gpu": {"budget": "20Gi"}}}})  # the user's change
        api = reconciler.api
        assert api is not None
        read = api.get
        decided: list[str | None] = []

        async def get_then_autoscale(ref: Ref, namespace: str | None, name: str) -> dict[str, Any] | None:
            found = await read(ref, namespace, name)
            if ref == STATEFULSETS and not decided:  # the reconciler holds replicas 1 in hand now
                decided.append(await LiveController._scale(autoscaler, cluster.namespace, "chat", 3))
            return found

        api.get = get_then_autoscale  # type: ignore[method-assign]
        await reconciler.reconcile(cluster.namespace, "chat", LOG)
        api.get = read  # type: ignore[method-assign]
        assert decided == [None]  # the autoscaler took the field over from the reconciler

        sts = await cluster.get(STATEFULSETS, "chat")
        assert sts["spec"]["replicas"] == 3, "the autoscale decision was overwritten by the reconcile"
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--gpu-budget") + 1] == str(20 << 30), "the spec change was lost"
        assert _owners_of_replicas(sts) == {AUTOSCALER}
        # later reconciles leave the autoscaler's field alone
        await reconciler.reconcile(cluster.namespace, "chat", LOG)
        assert (await cluster.get(STATEFULSETS, "chat"))["spec"]["replicas"] == 3
        status = (await cluster.get(CR, "chat"))["status"]
        assert status["replicas"] == 3 and status["observedGeneration"] == 2
    finally:
        await reconciler.close()
        await autoscaler.close()


async def test_leaving_mode_operator_hands_replicas_back_to_the_reconciler(cluster: Cluster) -> None:
    await ready_cluster(cluster)
    await cluster.create(CR, chat_cr())
    reconciler, autoscaler = Reconciler(), KubeApi(cluster.plane.info())
    await reconciler.connect(cluster.plane.info())
    try:
        await reconciler.reconcile(cluster.namespace, "chat", LOG)
        assert await LiveController._scale(autoscaler, cluster.namespace, "chat", 4) is None
        await cluster.patch(CR, "chat", {"spec": {"replicas": 2, "autoscaling": {"mode": "none"}}})
        await reconciler.reconcile(cluster.namespace, "chat", LOG)
        sts = await cluster.get(STATEFULSETS, "chat")
        assert sts["spec"]["replicas"] == 2 and _owners_of_replicas(sts) == {RECONCILER}
        degraded = next(c for c in (await cluster.get(CR, "chat"))["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "False"
    finally:
        await reconciler.close()
        await autoscaler.close()
