"""The live loop of the real operator (Kopf on a real API server) against pods whose metrics the test scripts.

Edge cases that real servers cannot be made to show on demand: a queue while the hot tier serves the
steps, fetch waits with idle slots, a pod that does not answer, a pod that refuses a concurrency change,
an idle tier, a queue of a given depth, external autoscaling, a shared tier whose circuit breaker opens on
one pod.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from kopfenv import Cluster, eventually, never
from livekit import admin_token, create_pod, events, live_cr, pod_status, scaled_earlier, status
from scriptedpod import MiB, ScriptedPod

from kvdrive.operator.act.objects import CR, PODS, STATEFULSETS
from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.decide.tuning import tier_sizes


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


async def test_a_queue_while_the_hot_tier_serves_the_steps_raises_max_running_and_status_and_events_say_why(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    hot, old = pods
    hot.running, hot.waiting = 4, 6  # all 4 slots busy, 6 requests queued for one
    hot.read_rates = {"gpu": 50.0, "dram": 2.0}  # decode finds its pages in the hot tier ...
    hot.wait_per_scrape = 0.0  # ... and never waits for lower tiers
    old.max_running = None  # a runtime that does not report its split: left alone
    old.running, old.waiting = 4, 6
    await deploy(operator, pods)
    await eventually(lambda: _true(hot.puts), timeout=15, what="a PUT /admin/tiers on the hot pod")
    # the limit rises to what runs plus what waits, within tuning.concurrency.max (8)
    assert hot.puts[0] == {"max_running": 8}
    assert old.puts == []

    async def reported() -> dict | None:
        st = await status(operator)
        entry = pod_status(st, "chat-0")
        return st if entry and entry.get("maxRunning") == 8 else None

    st = await eventually(reported, timeout=10, what="status.pods[] with the new limit")
    entry = pod_status(st, "chat-0")
    # the envelope is fixed: 4 more running sequences took 4 x 256Ki from the hot tier
    assert entry["metrics"] == "ok" and entry["gpuBytes"] == 8 * MiB and entry["lastChangeTime"]
    assert (entry["hotBytes"], entry["reserveBytes"]) == (5 * MiB, 3 * MiB)
    # the queue is per second of the operator's clock (rounds are about 1 s apart); the share is exact
    assert re.match(r"max_running 4 -> 8: requests queued \([0-9.]+ on average at least\) while decode waited at "
                    r"most 0% of the time for lower tiers \(hot tier served 96% of needed pages\), over 2 "
                    r"intervals$", entry["lastChange"])
    assert set(pod_status(st, "chat-1")) == {"name", "metrics", "lastScrapeTime", "gpuBytes", "dramBytes", "ssdBytes"}
    assert st["maxRunning"] == "8" and st["budgets"]["gpu"] == "8Mi"
    changed = await eventually(lambda: events(operator, "ConcurrencyChanged"), what="an Event")
    assert changed[0]["type"] == "Normal" and changed[0]["message"].startswith("pod chat-0: max_running 4 -> 8: ")
    # at the ceiling (tuning.concurrency.max and the pod's --max-sequences): the queue asks for nothing more
    await never(lambda: _true(len(hot.puts) > 1), 3.0, "a second change at the ceiling")


async def _true(value: object) -> object:
    return value


async def test_a_pod_that_cannot_be_read_keeps_its_limit_and_blocks_scaling_down(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    busy, silent = pods
    busy.running = 1  # 1 of its 4 slots used, no queue ...
    busy.read_rates = {"gpu": 10.0, "dram": 30.0}
    busy.wait_per_scrape = 0.6  # ... while decode waits for lower-tier reads: the hot tier is too small
    silent.hang = True
    await deploy(operator, pods)
    await set_replicas(operator, 2)

    async def missing() -> dict | None:
        entry = pod_status(await status(operator), "chat-1")
        return entry if entry and entry["metrics"] == "missing" else None

    entry = await eventually(missing, timeout=15, what="chat-1 reported missing")
    assert "no answer within 1s" in entry["scrapeError"]
    # the operator's own /metrics counts the failed reads, per pod
    assert operator.operator_metrics is not None
    text = httpx.get(operator.operator_metrics, timeout=5).text
    failures = {ln.split("{")[1].split("}")[0]: float(ln.split()[-1]) for ln in text.splitlines()
                if ln.startswith("kvdrive_operator_pod_scrape_failures_total{")}
    assert any('pod="chat-1"' in labels and n >= 1 for labels, n in failures.items()), failures
    assert not any('pod="chat-0"' in labels for labels in failures), failures
    await eventually(lambda: _true(busy.puts), timeout=15, what="the readable pod tuned")
    assert busy.puts[0] == {"max_running": 1}  # the unused slots go back to the hot tier
    shrunk = await eventually(lambda: events(operator, "ConcurrencyChanged"), what="an Event")
    assert re.match(r"pod chat-0: max_running 4 -> 1: decode waited at least [0-9]+% of the time for lower-tier reads "
                    r"\(hot tier served 25% of needed pages\) with no queue and at most 1 of 4 sequences running, "
                    r"over 2 intervals: the unused slots go to the hot tier$", shrunk[0]["message"])
    # an empty queue on chat-0 alone would call for 1 replica, but chat-1's load is unknown
    await never(lambda: _replicas_below(operator, 2), 3.0, "a scale-down on missing data")
    assert silent.puts == []
    st = await status(operator)
    assert "1 pod(s) unread, so not below 2" in st["autoscaling"]["lastDecision"]
    silent.hang = False  # it answers again: now the empty queues scale down
    await eventually(lambda: _replicas_below(operator, 2), timeout=15, what="a scale-down")
    down = await eventually(lambda: events(operator, "ScaledDown"), what="a ScaledDown Event")
    assert down[0]["message"].startswith("replicas 2 -> 1: 0 waiting on 2 pods (target 4/pod) -> 0")
    # the StatefulSet controller removes chat-1 (there is none here: the test does): its series goes with it
    assert 'pod="chat-1"' in httpx.get(operator.operator_metrics, timeout=5).text
    await operator.delete(PODS, "chat-1")
    await eventually(lambda: _true('pod="chat-1"' not in httpx.get(operator.operator_metrics, timeout=5).text),
                     timeout=15, what="chat-1's scrape-failure series removed")


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


async def test_a_refused_change_is_a_warning_and_is_not_retried(operator: Cluster, pods: list[ScriptedPod]) -> None:
    pod, _ = pods
    pod.running, pod.waiting = 4, 6
    pod.read_rates = {"gpu": 50.0}
    pod.refuse = "max_running 8: the hot tier would keep 1 page, running sequences need 12"
    await deploy(operator, pods)
    warned = await eventually(lambda: events(operator, "ConcurrencyRefused"), timeout=15, what="a Warning Event")
    assert warned[0]["type"] == "Warning"
    assert warned[0]["message"].startswith("pod chat-0: max_running 4 -> 8: requests queued")
    assert "-- refused (422): max_running 8: the hot tier would keep 1 page" in warned[0]["message"]
    assert pod.puts == [{"max_running": 8}]
    # the limit is capped where it stood: a window later the queue still asks for more, and nothing is tried
    await never(lambda: _true(len(pod.puts) > 1), 4.0, "a retry of a refused growth")
    assert await events(operator, "ConcurrencyChanged") == []
    entry = pod_status(await status(operator), "chat-0")
    assert entry["maxRunning"] == 4 and "refused (422)" in entry["lastChange"]


async def test_a_change_applied_after_its_timeout_is_a_warning_then_confirmed_by_the_pods_metrics(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    """A runtime applies a new limit between two engine steps; under load its answer can come after the
    operator stopped waiting (the e2e cluster saw a 3 s timeout miss one). The Warning says so at once, and
    once the pod's metrics show the new limit a ConcurrencyChanged Event and the status say it took."""
    pod, _ = pods
    pod.running, pod.waiting = 4, 6
    pod.read_rates = {"gpu": 50.0}
    pod.apply_delay = 2.5  # past applyTimeoutSeconds (1 s)
    await deploy(operator, pods, live_cr(applyTimeoutSeconds=1))
    warned = await eventually(lambda: events(operator, "ConcurrencyNotApplied"), timeout=15, what="a Warning Event")
    assert warned[0]["type"] == "Warning"
    assert warned[0]["message"].startswith("pod chat-0: max_running 4 -> 8: requests queued")
    assert "-- not applied: PUT /admin/tiers: no answer within 1s" in warned[0]["message"]
    changed = await eventually(lambda: events(operator, "ConcurrencyChanged"), timeout=15, what="the confirmation")
    assert changed[0]["type"] == "Normal" and changed[0]["message"].startswith("pod chat-0: max_running 4 -> 8: ")
    assert changed[0]["message"].endswith("(applied after its request's timeout)")
    assert pod.max_running == 8 and pod.puts[0] == {"max_running": 8}

    async def confirmed() -> dict | None:
        entry = pod_status(await status(operator), "chat-0")
        return entry if entry and entry.get("maxRunning") == 8 and "not applied" not in entry["lastChange"] else None

    entry = await eventually(confirmed, timeout=10, what="status.pods[] with the confirmed change")
    assert entry["lastChange"].startswith("max_running 4 -> 8: requests queued")


async def test_an_idle_tier_is_recommended_smaller_once_in_status_and_one_event(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    pod, _ = pods
    pod.fill = {"gpu": 0.7, "dram": 0.2, "ssd": 0.1}  # DRAM and SSD mostly empty, round after round
    pod.running = 1
    cr = live_cr()
    await deploy(operator, pods[:1], cr)
    found = await eventually(lambda: _at_least(operator, "TierRightSizing", 2), timeout=20, what="two Events")
    messages = sorted(e["message"] for e in found)
    sizes = tier_sizes(parse_cr(cr).spec)
    assert sizes == {"dram": 64 * MiB, "ssd": 300 * MiB}  # the CR's sizes: what is recommended against
    # peak use x 1.25, whole hugepages (2Mi) for DRAM; for SSD the runtime's 90% share of the claim, whole MiB
    assert messages == [
        "pod chat-0: tiers.dram.size: 64Mi -> recommend 4Mi (at most 20% full (peak 3.2Mi) for 4 intervals; "
        "nothing changed on the pod)",
        "pod chat-0: tiers.ssd.size: 300Mi -> recommend 36Mi (at most 10% full (peak 25.6Mi) for 4 intervals; "
        "nothing changed on the pod)"]
    assert all(e["type"] == "Normal" for e in found)

    async def recommended() -> dict | None:
        st = await status(operator)
        return st if st.get("recommendations") else None

    st = await eventually(recommended, what="status.recommendations")
    shown = [(r["tier"], r["field"], r["current"], r["recommended"]) for r in pod_status(st, "chat-0")["recommendations"]]
    assert shown == [("dram", "tiers.dram.size", "64Mi", "4Mi"), ("ssd", "tiers.ssd.size", "300Mi", "36Mi")]
    # the only pod agrees with itself: the CR-level summary says the same
    assert [(r["tier"], r["recommended"]) for r in st["recommendations"]] == [("dram", "4Mi"), ("ssd", "36Mi")]
    assert st["recommendations"][0]["reason"].startswith("every pod (1) recommends it; the largest need, chat-0's: ")
    # the same recommendation next round is not news: no second Event, and the pod was never told anything
    await never(lambda: _at_least(operator, "TierRightSizing", 3), 3.0, "a re-posted recommendation")
    assert pod.puts == []


async def _at_least(cluster: Cluster, reason: str, count: int) -> list[dict] | None:
    found = await events(cluster, reason)
    return found if len(found) >= count else None


async def test_a_queue_scales_the_statefulset_up_with_an_event(operator: Cluster, pods: list[ScriptedPod]) -> None:
    first, second = pods
    first.waiting, first.running = 15, 4
    await deploy(operator, pods[:1])
    await eventually(lambda: _replicas_at_least(operator, 2), timeout=15, what="a scale-up")
    up = await eventually(lambda: events(operator, "ScaledUp"), what="a ScaledUp Event")
    assert up[0]["message"].startswith("replicas 1 -> 2: 15 waiting on 1 pods (target 4/pod) -> 4")
    assert "maxStep 1" in up[0]["message"]

    async def recorded() -> dict | None:
        # the round applies its status after the scale and the Event: until then the status is an earlier
        # round's (one that had not read the queue yet recommends 1); lastScaleTime marks the scaling round's
        st = await status(operator)
        return st if "lastScaleTime" in st.get("autoscaling", {}) else None

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


def _condition(st: dict, kind: str) -> dict | None:
    return next((c for c in st.get("conditions") or [] if c["type"] == kind), None)


async def test_a_degraded_shared_tier_is_a_condition_naming_the_pod_beside_the_reconcilers_and_goes_with_the_tier(
        operator: Cluster, pods: list[ScriptedPod]) -> None:
    """With tuning and autoscaling off the pods are still read for the shared tier. The live loop owns its
    condition in the map list status.conditions beside the reconciler's (server-side apply keeps both), and
    removes it and status.sharedTier when the CR drops the tier."""
    ok, broken = pods
    ok.shared_tier_degraded, broken.shared_tier_degraded = False, True
    cr = live_cr(autoscaling={"mode": "none"}, enabled=False)
    cr["spec"]["tiers"]["shared"] = {"service": {"name": "valkey"}, "namespace": "fleet"}
    await deploy(operator, pods, cr)

    async def shared_is(value: str) -> dict | None:
        st = await status(operator)
        found = _condition(st, "SharedTierDegraded")
        return st if found and found["status"] == value and _condition(st, "Ready") else None

    st = await eventually(lambda: shared_is("True"), timeout=15, what="SharedTierDegraded True")
    degraded = _condition(st, "SharedTierDegraded")
    assert degraded is not None and degraded["reason"] == "CircuitOpen"
    assert degraded["message"].startswith("1/2 pods report the shared tier degraded") and degraded["message"].endswith(
        ": chat-1")
    assert st["sharedTier"] == {"url": f"valkey://valkey.{operator.namespace}.svc:6379", "namespace": "fleet",
                                "tls": False, "degradedPods": ["chat-1"]}
    assert (pod_status(st, "chat-0") or {})["sharedTier"] == "ok"
    assert {c["type"] for c in st["conditions"]} == {"Ready", "Progressing", "Degraded", "SharedTierDegraded"}
    broken.shared_tier_degraded = False  # the store answers again
    st = await eventually(lambda: shared_is("False"), timeout=15, what="SharedTierDegraded False")
    assert st["sharedTier"]["degradedPods"] == [] and _condition(st, "SharedTierDegraded")["reason"] == "Reachable"
    await operator.patch(CR, "chat", {"spec": {"tiers": {"shared": None}}})

    async def gone() -> dict | None:
        st = await status(operator)
        return st if "sharedTier" not in st and not _condition(st, "SharedTierDegraded") else None

    st = await eventually(gone, timeout=15, what="the shared tier's status gone")
    assert _condition(st, "Ready") is not None  # the reconciler's conditions stay
