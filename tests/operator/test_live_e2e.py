"""End to end: the real operator tunes and scales two real `kvdrive serve` processes.

Two demo-model servers on loopback ports (CPU, small DRAM and SSD tiers, a device envelope that holds
the workload's pages) play the pods `chat-0` and `chat-1`; Pod objects on a real API server carry
their addresses. The test drives a workload at `chat-0` (prompts over a few shared prefixes, more
concurrent requests than it runs), and checks that the operator, from the servers' own /metrics:
scales the StatefulSet up from the queue, and raises `chat-0`'s max_running through PUT /admin/tiers
(requests queue while decode barely waits for lower tiers), the envelope staying the same size (the
server's GET /admin/tiers and /metrics show the new split, status.pods[] and an Event say why).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from kopfenv import Cluster, eventually
from livekit import create_pod, events, live_cr, pod_status, scaled_earlier, status
from liveservers import Server, all_ready, complete, prompt, start

from kvdrive.operator.act.objects import CHILDREN, CR, STATEFULSETS

TOKEN = "e2e-admin-token"
# an envelope big enough that the hot tier serves decode (the tuner's signal for more concurrency), and
# rows reserved for 8 running sequences of which 2 may run to start with
SERVER_FLAGS = ("--gpu-budget", "64MiB", "--max-running", "2", "--max-sequences", "8", "--max-waiting", "64",
                "--step-tokens", "64")
MiB = 1 << 20

pytestmark = pytest.mark.timeout(600)


@pytest.fixture()
async def servers(tmp_path: Path) -> AsyncIterator[list[Server]]:
    async with all_ready([start(tmp_path / f"chat-{i}", TOKEN, *SERVER_FLAGS) for i in range(2)]) as started:
        yield started


async def workload(server: Server, stop: asyncio.Event, concurrency: int = 5) -> None:
    """Keep ``concurrency`` requests in flight: more than the server runs, so some wait in its queue."""
    async with httpx.AsyncClient() as client:

        async def worker(index: int) -> None:
            round_ = 0
            while not stop.is_set():
                await complete(client, server, prompt(topic=(index + round_) % 3, words=120), max_tokens=24)
                round_ += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def test_the_operator_tunes_and_scales_real_servers_from_their_metrics(
        operator: Cluster, servers: list[Server]) -> None:
    hot, idle = servers
    start = await hot.split()
    assert (start["envelope_bytes"], start["max_running"], start["max_sequences"]) == (64 * MiB, 2, 8)
    await operator.storage_class()
    # the admin Secret exists before the CR: the operator adopts it and keeps its token (the servers' token)
    await operator.create(CHILDREN["Secret"], {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-admin"},
                                               "data": {"token": base64.b64encode(TOKEN.encode()).decode()}})
    cr = live_cr(autoscaling={"mode": "operator", "minReplicas": 1, "maxReplicas": 4, "maxStep": 1,
                              "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 600,
                              "targets": {"queueDepth": 1}})
    cr["spec"]["concurrency"] = {"maxRunning": 2}
    await operator.create(CR, cr)
    await eventually(lambda: operator.get(STATEFULSETS, "chat"), what="the StatefulSet")
    await scaled_earlier(operator, 2)  # the two pods below
    for index, server in enumerate(servers):
        await create_pod(operator, f"chat-{index}", server.port)

    stop = asyncio.Event()
    load = asyncio.create_task(workload(hot, stop))
    try:
        # 1. the queue on chat-0 scales the StatefulSet up (3 waiting of 5 in flight, target 1 per pod)
        await eventually(lambda: _replicas_at_least(operator, 3), timeout=120, what="a scale-up from the queue")
        ups = [e["message"] for e in await eventually(lambda: events(operator, "ScaledUp"), what="a ScaledUp Event")]
        # (the first round may still see the StatefulSet at 1 before the test set it to 2: either way up by 1)
        assert any(re.match(r"replicas (\d) -> (\d): \d+ waiting on 2 pods \(target 1/pod\) -> \d", m) for m in ups), ups

        # 2. requests queue on chat-0 while its hot tier serves decode: the operator raises its max_running
        async def raised() -> dict[str, int] | None:
            split = await hot.split()
            return split if split["max_running"] > 2 else None

        await eventually(raised, timeout=240, what="max_running of chat-0 raised through PUT /admin/tiers")
    finally:
        stop.set()
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    split = await hot.split()
    assert await hot.metric("kvdrive_max_running") == split["max_running"]  # /metrics agrees with the admin API
    # the envelope is fixed: the running sequences' reserve grew out of the hot tier
    assert split["hot_bytes"] + split["reserve_bytes"] == split["envelope_bytes"] == 64 * MiB
    assert split["reserve_bytes"] > start["reserve_bytes"] and split["hot_bytes"] < start["hot_bytes"]
    changes = await eventually(lambda: _changes_of(operator, "chat-0"), what="a ConcurrencyChanged Event for chat-0")
    assert re.match(r"pod chat-0: max_running 2 -> \d+: requests queued", changes[0]), changes

    async def reported() -> dict | None:
        entry = pod_status(await status(operator), "chat-0")
        now = await hot.split()
        return entry if entry and entry.get("maxRunning") == now["max_running"] and entry.get("lastChange") else None

    entry = await eventually(reported, what="status.pods[] of chat-0 showing the server's split")
    assert entry["metrics"] == "ok" and entry["lastChangeTime"]
    assert entry["hotBytes"] + entry["reserveBytes"] == 64 * MiB
    # the idle server was read too, and whatever happened to it stayed within tuning.concurrency
    assert 1 <= (await idle.split())["max_running"] <= 8
    st = await status(operator)
    assert st["autoscaling"]["desiredReplicas"] >= 3 and st["budgets"]["gpu"] and st["maxRunning"]


async def _replicas_at_least(cluster: Cluster, n: int) -> bool:
    sts = await cluster.get(STATEFULSETS, "chat")
    return bool(sts) and sts["spec"]["replicas"] >= n


async def _changes_of(cluster: Cluster, pod: str) -> list[str]:
    return [e["message"] for e in await events(cluster, "ConcurrencyChanged") if e["message"].startswith(f"pod {pod}:")]
