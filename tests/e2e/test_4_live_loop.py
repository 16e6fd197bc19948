"""Scene 4: traffic arrives. The operator's live loop reads each pod's real /metrics: it raises a
pod's max_running while requests queue and decode barely waits for lower tiers (status.pods[] and a
ConcurrencyChanged Event say so), scales the StatefulSet up from the queue once the CR's 10 s
scale-up window agrees, and back down to minReplicas once the 40 s scale-down window has seen the
deployment idle.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from clusterkit import NAMESPACE, Cluster, eventually

CLIENTS = 24  # more than two pods at the tuner's ceiling (2 x 8) run at once: a queue remains
DOCUMENT = " ".join(f"Note {i}: the quarterly figures for region {i % 7} were revised upward." for i in range(40))


class Load:
    """CLIENTS concurrent completion requests through the CR's Service until stopped."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.done = self.failed = 0
        self.statuses: dict[int, int] = {}
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self, i: int, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            body = {"model": "demo", "prompt": f"Client {i}. {DOCUMENT}\nSummarize the notes:", "max_tokens": 48,
                    "temperature": 0}
            try:
                answer = await http.post(f"{self.base_url}/v1/completions", json=body)
                self.statuses[answer.status_code] = self.statuses.get(answer.status_code, 0) + 1
                self.done += answer.status_code == 200
            except httpx.HTTPError:
                self.failed += 1
                await asyncio.sleep(0.5)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            await asyncio.gather(*(self._client(i, http) for i in range(CLIENTS)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=330)


def _events(c: Cluster, reason: str) -> list[dict[str, Any]]:
    return [e for e in c.get("events", "-n", NAMESPACE)["items"]
            if e.get("reason") == reason and e["involvedObject"].get("name") == "demo"]


def _since(started: float) -> Callable[[], float]:
    return lambda: round(time.monotonic() - started, 1)


def _untuned(c: Cluster) -> bool:
    pods = c.get("kvd", "demo", "-n", NAMESPACE)["status"].get("pods", [])
    return [p.get("maxRunning") for p in pods] == [2, 2]  # concurrency.maxRunning on both pods


def test_load_tunes_a_pod_then_scales_up_and_idleness_scales_down(deployed: Cluster) -> None:
    c = deployed
    if not _untuned(c):  # a reused cluster (KVDRIVE_E2E_DIR) ran this scene before: start over
        eventually(lambda: c.get("sts", "demo", "-n", NAMESPACE)["spec"]["replicas"] == 2, 300, what="2 replicas")
        c.kubectl("rollout", "restart", "statefulset/demo", "-n", NAMESPACE)
        c.kubectl("rollout", "status", "statefulset/demo", "-n", NAMESPACE, "--timeout=600s", timeout=660)
    eventually(lambda: _untuned(c), 120, what="both pods at maxRunning 2")
    assert c.get("sts", "demo", "-n", NAMESPACE)["spec"]["replicas"] == 2
    service = c.get("svc", "demo", "-n", NAMESPACE)["spec"]["clusterIP"]
    tuned: dict[str, Any] = {}
    scaled: dict[str, Any] = {}
    wanted: dict[str, float] = {}  # when the status first showed a round that wanted 3
    started = time.monotonic()
    elapsed = _since(started)
    with Load(f"http://{service}:8000") as load:
        def progress() -> bool:
            status = c.get("kvd", "demo", "-n", NAMESPACE)["status"]
            if not wanted and (status.get("autoscaling") or {}).get("recommendation", 0) >= 3:
                wanted["at"] = elapsed()
            if not tuned:
                for pod in status.get("pods", []):
                    if pod.get("maxRunning", 2) != 2:
                        tuned.update(pod=pod["name"], max_running=pod["maxRunning"], at=elapsed(),
                                     change=pod.get("lastChange", ""))
            if not scaled and c.get("sts", "demo", "-n", NAMESPACE)["spec"]["replicas"] == 3:
                scaled.update(at=elapsed())
            return bool(tuned and scaled)

        eventually(progress, 300, interval=1, what=f"a tuned pod ({tuned}) and 3 replicas ({scaled})")
    stopped = time.monotonic()  # from here on the deployment is idle
    eventually(lambda: c.get("sts", "demo", "-n", NAMESPACE)["status"].get("readyReplicas") == 3, 300,
               what="the third pod Ready")
    scaled["ready_at"] = elapsed()
    assert load.done > 0 and 500 not in load.statuses, load.statuses
    # the tuning: more concurrency for a queue the hot tier can serve, said in status and an Event
    assert tuned["max_running"] > 2 and "max_running" in tuned["change"]
    concurrency_events = _events(c, "ConcurrencyChanged")
    assert any(tuned["pod"] in e["message"] for e in concurrency_events)
    up = _events(c, "ScaledUp")
    assert up and "replicas 2 -> 3" in up[-1]["message"] and "waiting" in up[-1]["message"]
    # the scale-up waited for the 10 s window: rounds 5 s apart kept wanting 3 until no round that wanted 2
    # was left in it. A round's recommendation is stamped after its scrape, and the last round that did not
    # see the queue may have read the pods up to one interval (5 s) before the load began, so from the
    # load's start the window shows as at least 10 - 5 s (seen: 6.8 s once, 9.3 once, 11-14 s usually). A
    # round that wanted 3 was in the status at least one round (5 s) before the replicas changed; the polls
    # (1 s apart, plus their kubectl calls) blur that by up to 2 s. Without the window the first such round
    # would have scaled at once, and both would show within one poll
    assert scaled["at"] >= 10 - 5
    assert "at" in wanted and scaled["at"] - wanted["at"] >= 5 - 2, (wanted, scaled)
    c.record("tuning: first max_running change after load start (s)", tuned["at"])
    c.record("tuning: the change", f"{tuned['pod']}: {tuned['change']}")
    c.record("scale-up 2 -> 3: StatefulSet replicas set after load start (s)", scaled["at"])
    c.record("scale-up 2 -> 3: third pod Ready after load start (s; the load stopped once replicas were 3)", scaled["ready_at"])
    c.record("requests answered under load (status: count)", dict(load.statuses))

    # idle: back to minReplicas once the 40 s scale-down window agrees, not before: the window holds
    # the highest recommendation of the last 40 s, and the scale-up round recommended 3
    eventually(lambda: c.get("sts", "demo", "-n", NAMESPACE)["spec"]["replicas"] == 2, 240,
               what="scale-down to 2")
    down_after = round(time.monotonic() - stopped, 1)
    assert elapsed() - scaled["at"] >= 40
    down = _events(c, "ScaledDown")
    assert down and "replicas 3 -> 2" in down[-1]["message"]
    eventually(lambda: len(c.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kvdrive")["items"]) == 2,
               240, what="the third pod gone")
    c.record("scale-down 3 -> 2: replicas set after load stop (s)", down_after)
    c.record("scale-down 3 -> 2: third pod gone after load stop (s)", round(time.monotonic() - stopped, 1))
