"""The live loop of the real operator (Kopf on a real API server) against pods whose metrics the test scripts.

Edge cases that real servers cannot be made to show on demand: a pod that does not answer, a pod
that refuses a budget, a queue of a given depth, external autoscaling.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
from kopfenv import Cluster, eventually, never
from livekit import admin_token, create_pod, events, live_cr, pod_status, scaled_earlier, status
from scriptedpod import MiB, ScriptedPod

from kvdrive.operator.handlers import CR, STATEFULSETS


@pytest.fixture()
async def pods() -> AsyncIterator[list[ScriptedPod]]:
    started = [ScriptedPod(), ScriptedPod()]
    for pod in started:
        await pod.start()
    yield started
    for pod in started:
        await pod.stop()


async def deploy(cluster: Cluster, pods: list[ScriptedPod], cr: dict | None = None) -> None:
    await cluster.storage_class()
    await cluster.create(CR, cr or live_cr())
    token = await eventually(lambda: admin_token(cluster), what="the admin Secret")
    for index, pod in enumerate(pods):
        pod.token = token
        await create_pod(cluster, f"chat-{index}", pod.port)


async def set_replicas(cluster: Cluster, n: int) -> None:
    """Replicas ``n`` as an earlier autoscaler decision left them."""
    await scaled_earlier(cluster, n)
    await eventually(lambda: _replicas_at_least(cluster, n), timeout=5, what=f"replicas {n}")


async def test_a_pod_under_ssd_pressure_gets_more_dram_and_the_status_and_events_say_why(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    hot, quiet = pods
    hot.fill = {"gpu": 0.7, "dram": 0.97, "ssd": 0.7}
    hot.read_rates = {"gpu": 20.0, "ssd": 60.0}  # pages per scrape (1 s): SSD reads dominate
    quiet.fill = {"gpu": 0.7, "dram": 0.7, "ssd": 0.2}  # in the dead band: nothing to do
    await deploy(operator, pods)
    await eventually(lambda: _true(hot.puts), timeout=15, what="a PUT /admin/tiers on the hot pod")
    assert hot.puts[0] == {"gpu_bytes": 8 * MiB, "dram_bytes": 20 * MiB, "ssd_bytes": 256 * MiB}
    assert quiet.puts == []

    async def reported() -> dict | None:
        st = await status(operator)
        entry = pod_status(st, "chat-0")
        return st if entry and entry.get("dramBytes") == 20 * MiB else None

    st = await eventually(reported, timeout=10, what="status.pods[] with the new budget")
    entry = pod_status(st, "chat-0")
    assert entry["metrics"] == "ok" and entry["gpuBytes"] == 8 * MiB and entry["lastChangeTime"]
    # the rate is per second of the operator's clock (rounds are about 1 s apart); the share is exact
    assert re.match(r"dram 16Mi -> 20Mi \(\+4Mi\): ssd reads [0-9.]+/s = 75% of needed pages while dram was 97%\+ "
                    r"full, decode waited [0-9]+% of the time, over 2 intervals$", entry["lastChange"])
    assert "lastChange" not in pod_status(st, "chat-1")
    assert st["budgets"]["dram"] == "16Mi-20Mi" and st["budgets"]["gpu"] == "8Mi"
    changed = await eventually(lambda: events(operator, "TierBudgetsChanged"), what="an Event")
    assert changed[0]["type"] == "Normal" and changed[0]["message"].startswith("pod chat-0: dram 16Mi -> 20Mi")


async def _true(value: object) -> object:
    return value


async def test_a_pod_that_cannot_be_read_keeps_its_budgets_and_blocks_scaling_down(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    busy, silent = pods
    busy.fill = {"gpu": 0.7, "dram": 0.97, "ssd": 0.7}
    busy.read_rates = {"gpu": 20.0, "ssd": 60.0}
    silent.hang = True
    await deploy(operator, pods)
    await set_replicas(operator, 2)

    async def missing() -> dict | None:
        entry = pod_status(await status(operator), "chat-1")
        return entry if entry and entry["metrics"] == "missing" else None

    entry = await eventually(missing, timeout=15, what="chat-1 reported missing")
    assert "no answer within 1s" in entry["scrapeError"]
    await eventually(lambda: _true(busy.puts), timeout=15, what="the readable pod tuned")
    # an empty queue on chat-0 alone would call for 1 replica, but chat-1's load is unknown
    await never(lambda: _replicas_below(operator, 2), 3.0, "a scale-down on missing data")
    assert silent.puts == []
    st = await status(operator)
    assert "1 pod(s) unread, so not below 2" in st["autoscaling"]["lastDecision"]
    silent.hang = False  # it answers again: now the empty queues scale down
    await eventually(lambda: _replicas_below(operator, 2), timeout=15, what="a scale-down")
    down = await eventually(lambda: events(operator, "ScaledDown"), what="a ScaledDown Event")
    assert down[0]["message"].startswith("replicas 2 -> 1: 0 waiting on 2 pods (target 4/pod) -> 0")


async def test_a_replica_whose_pod_is_not_ready_blocks_scaling_down(operator: Cluster, pods: list[ScriptedPod]) -> None:
    """Replicas 2, but only chat-0 is ready (chat-1 is starting): chat-0's empty queue alone would call
    for 1 replica; the replica without a ready pod counts as unknown load, as an unreadable pod does."""
    await deploy(operator, pods[:1])
    await create_pod(operator, "chat-1", pods[1].port, ready=False)
    await set_replicas(operator, 2)

    async def decided() -> dict | None:
        st = await status(operator)
        decision = st.get("autoscaling", {}).get("lastDecision", "") if st else ""
        return st if "1 pod(s) unread, so not below 2" in decision else None

    await eventually(decided, timeout=15, what="a decision that waits for the starting pod")
    await never(lambda: _replicas_below(operator, 2), 3.0, "a scale-down while a replica has no ready pod")


async def _replicas_below(cluster: Cluster, n: int) -> bool:
    sts = await cluster.get(STATEFULSETS, "chat")
    return bool(sts) and sts["spec"]["replicas"] < n


async def test_a_refused_budget_is_a_warning_and_is_not_retried(operator: Cluster, pods: list[ScriptedPod]) -> None:
    pod, _ = pods
    pod.fill = {"gpu": 0.99, "dram": 0.6, "ssd": 0.6}
    pod.read_rates = {"gpu": 20.0, "dram": 40.0}  # DRAM reads dominate: the GPU tier should grow
    pod.refuse = "gpu tier: 12582912 bytes exceed the device memory left after the model"
    await deploy(operator, pods)
    warned = await eventually(lambda: events(operator, "TierBudgetsRefused"), timeout=15, what="a Warning Event")
    assert warned[0]["type"] == "Warning"
    assert "gpu 8Mi -> 10Mi (+2Mi)" in warned[0]["message"] and "exceed the device memory" in warned[0]["message"]
    tries = len(pod.puts)
    await never(lambda: _true(len(pod.puts) > tries), 4.0, "a retry of a refused growth")
    entry = pod_status(await status(operator), "chat-0")
    assert entry["gpuBytes"] == 8 * MiB and "refused (422)" in entry["lastChange"]


async def test_a_queue_scales_the_statefulset_up_with_an_event(operator: Cluster, pods: list[ScriptedPod]) -> None:
    first, second = pods
    first.waiting, first.running = 15, 4
    await deploy(operator, pods[:1])
    await eventually(lambda: _replicas_at_least(operator, 2), timeout=15, what="a scale-up")
    up = await eventually(lambda: events(operator, "ScaledUp"), what="a ScaledUp Event")
    assert up[0]["message"].startswith("replicas 1 -> 2: 15 waiting on 1 pods (target 4/pod) -> 4")
    assert "maxStep 1" in up[0]["message"]

    async def recorded() -> dict | None:  # the round applies its status after the scale and the Event
        st = await status(operator)
        return st if "recommendation" in st.get("autoscaling", {}) else None

    st = await eventually(recorded, what="the round's autoscaling status")
    assert st["autoscaling"]["mode"] == "operator" and st["autoscaling"]["recommendation"] == 4


async def _replicas_at_least(cluster: Cluster, n: int) -> bool:
    sts = await cluster.get(STATEFULSETS, "chat")
    return bool(sts) and sts["spec"]["replicas"] >= n


async def test_external_autoscaling_never_writes_replicas(operator: Cluster, pods: list[ScriptedPod]) -> None:
    first, _ = pods
    first.waiting = 100
    cr = live_cr(autoscaling={"mode": "external", "minReplicas": 1, "maxReplicas": 4})
    cr["spec"]["replicas"] = 1
    await deploy(operator, pods[:1], cr)

    async def reported() -> dict | None:
        st = await status(operator)
        return st if pod_status(st, "chat-0") else None

    st = await eventually(reported, timeout=15, what="a metrics round")
    assert st["autoscaling"] == {"mode": "external"}
    await never(lambda: _replicas_at_least(operator, 2), 3.0, "the operator writing replicas in external mode")
