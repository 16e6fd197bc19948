"""End to end: the real operator tunes and scales two real `kvdrive serve` processes.

Two demo-model servers on loopback ports (CPU, small tiers) play the pods `chat-0` and `chat-1`;
Pod objects on a real API server carry their addresses. The test drives a workload at `chat-0` (long
prompts over a few shared prefixes, more concurrent requests than it runs), and checks that the
operator, from the servers' own /metrics: changes `chat-0`'s budgets through PUT /admin/tiers (the
server's GET /admin/tiers and /metrics show the new budgets, status.pods[] and an Event say why),
and scales the StatefulSet up from the queue.
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
from liveservers import Server, complete, prompt, start, wait_ready

from kvdrive.operator.handlers import CHILDREN, CR, STATEFULSETS

TOKEN = "e2e-admin-token"
SERVER_FLAGS = ("--max-running", "2", "--max-waiting", "64", "--step-tokens", "64")
MiB = 1 << 20

pytestmark = pytest.mark.timeout(600)


@pytest.fixture()
async def servers(tmp_path: Path) -> AsyncIterator[list[Server]]:
    started = [start(tmp_path / f"chat-{i}", TOKEN, *SERVER_FLAGS) for i in range(2)]
    try:
        await asyncio.gather(*(wait_ready(s) for s in started))
        yield started
    finally:
        for server in started:
            server.stop()


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
    start_budgets = await hot.tiers()
    assert start_budgets == {"gpu": 8 * MiB, "dram": 16 * MiB, "ssd": 256 * MiB}
    await operator.storage_class()
    # the admin Secret exists before the CR: the operator adopts it and keeps its token (the servers' token)
    await operator.create(CHILDREN["Secret"], {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-admin"},
                                               "data": {"token": base64.b64encode(TOKEN.encode()).decode()}})
    cr = live_cr(autoscaling={"mode": "operator", "minReplicas": 1, "maxReplicas": 4, "maxStep": 1,
                              "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 600,
                              "targets": {"queueDepth": 1}})
    cr["spec"]["tuning"]["bounds"]["ssd"] = {"min": "128Mi"}
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

        # 2. the workload makes chat-0 read pages from below a full tier: the operator grows that tier
        async def grown() -> dict[str, int] | None:
            now = await hot.tiers()
            return now if any(now[t] > start_budgets[t] for t in now) else None

        await eventually(grown, timeout=240, what="a budget of chat-0 grown through PUT /admin/tiers")
    finally:
        stop.set()
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    assert await hot.metric_budgets() == await hot.tiers()  # /metrics agrees with the admin API
    changes = await eventually(lambda: _changes_of(operator, "chat-0"), what="a TierBudgetsChanged Event for chat-0")
    grew = [m for m in changes if "(+" in m]
    assert grew and "reads" in grew[0] and "full" in grew[0], changes

    async def reported() -> dict | None:
        entry = pod_status(await status(operator), "chat-0")
        now = await hot.tiers()
        shown = entry and {"gpu": entry.get("gpuBytes"), "dram": entry.get("dramBytes"), "ssd": entry.get("ssdBytes")}
        return entry if shown == now and entry.get("lastChange") else None

    entry = await eventually(reported, what="status.pods[] of chat-0 showing the server's budgets")
    assert entry["metrics"] == "ok" and entry["lastChangeTime"]
    # the idle server was read too, and whatever happened to it stayed within the spec's bounds
    idle_now = await idle.tiers()
    assert idle_now["gpu"] >= 4 * MiB and idle_now["dram"] >= 8 * MiB and idle_now["ssd"] >= 128 * MiB
    st = await status(operator)
    assert st["autoscaling"]["desiredReplicas"] >= 3 and st["budgets"]["gpu"]


async def _replicas_at_least(cluster: Cluster, n: int) -> bool:
    sts = await cluster.get(STATEFULSETS, "chat")
    return bool(sts) and sts["spec"]["replicas"] >= n


async def _changes_of(cluster: Cluster, pod: str) -> list[str]:
    return [e["message"] for e in await events(cluster, "TierBudgetsChanged") if e["message"].startswith(f"pod {pod}:")]
