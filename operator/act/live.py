"""The live loop of one KVDriveDeployment: read every ready pod's metrics, tune, autoscale, report.

Split from ``handlers`` (which registers it as a Kopf daemon per CR, so that its period follows
``spec.tuning.intervalSeconds``). Each round: list the CR's ready pods (explicit ``KubeApi`` calls:
list pods, get the admin Secret, apply the StatefulSet's replicas as the ``AUTOSCALER`` field manager,
apply its part of the CR's status as ``LIVE``), read each pod's ``/metrics`` with a timeout, let
``tuning.decide`` and ``autoscale.decide`` judge, apply each pod's concurrency limit (the split of its
fixed device envelope) through ``PUT /admin/tiers`` and replicas on the StatefulSet, post an Event for
every change and every new right-sizing recommendation with the numbers behind it (a change whose PUT got
no answer in time is a Warning, then a ``ConcurrencyChanged`` once the pod's metrics show it), and write
``status.pods``, ``status.budgets``, ``status.maxRunning``, ``status.recommendations`` and
``status.autoscaling``; with a shared tier also ``status.sharedTier`` and the condition ``SharedTierDegraded``
(the pods are read for it even with tuning and autoscaling off). The memory it keeps (metric histories, past
recommendations) is per controller instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdrive.operator.act.objects import (
    AUTOSCALER,
    CR,
    LIVE,
    PODS,
    RECONCILER,
    SECRETS,
    STATEFULSETS,
    pod_ready,
    pod_url,
)
from kvdrive.operator.api.cr import SpecError, parse_cr
from kvdrive.operator.api.podmetrics import rates
from kvdrive.operator.api.quantity import to_bytes
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.clients.kubeclient import Conflict, KubeApi
from kvdrive.operator.clients.opmetrics import OperatorMetrics
from kvdrive.operator.clients.podclient import PodClient
from kvdrive.operator.decide import autoscale, tuning
from kvdrive.operator.decide.conditions import merge_conditions, now_rfc3339
from kvdrive.operator.decide.livestatus import (
    agreed_recommendations,
    budget_event,
    budget_summary,
    live_status_differs,
    live_view,
    pod_entry,
    recommendation_event,
    running_summary,
    scale_event,
    shared_tier_condition,
    shared_tier_status,
)
from kvdrive.operator.render.childmeta import Names, selector_labels
from kvdrive.operator.render.manifests import admin_token_of, runtime_settings

IDLE_SECONDS = 30.0  # period of a CR that cannot be read or parsed
PostEvent = Callable[[dict[str, Any], str, str, str], None]  # (cr, Normal | Warning, reason, message)
SSD_GRANULE = 1 << 20  # recommended SSD sizes are whole MiB (DRAM: whole hugepages)
Logger = logging.Logger | logging.LoggerAdapter


@dataclass
class _Memory:
    """What the controller remembers of one CR between rounds."""

    pods: dict[str, tuning.PodHistory] = field(default_factory=dict)  # by pod uid
    changed_at: dict[str, str] = field(default_factory=dict)  # pod uid -> wall time of its last change
    scale: tuple[autoscale.Recommendation, ...] = ()
    last_scale_time: str | None = None
    last_decision: str | None = None
    failed_pods: set[str] = field(default_factory=set)  # pods with a scrape-failure series (names)


@dataclass(frozen=True)
class _Pod:
    uid: str
    name: str
    url: str


class LiveController:
    """Runs rounds for any number of CRs; ``session`` gives the Kubernetes API once logged in."""

    def __init__(self, session: Callable[[], KubeApi | None], post_event: PostEvent,
                 clock: Callable[[], float] = time.monotonic, metrics: OperatorMetrics | None = None) -> None:
        """``post_event(cr, type, reason, message)``: a core/v1 Event on the CR (``kubectl describe kvd``
        shows it); handlers passes Kopf's poster, which retries and logs a failure."""
        self._session, self._event, self._clock = session, post_event, clock
        self._metrics = metrics
        self._pods = PodClient()
        self._memory: dict[tuple[str, str], _Memory] = {}

    async def close(self) -> None:
        await self._pods.close()

    def forget(self, namespace: str, name: str) -> None:
        memory = self._memory.pop((namespace, name), None)
        if memory is not None:
            self._drop_series(namespace, memory.failed_pods)

    def _drop_series(self, namespace: str, pods: set[str]) -> None:
        """Pods that are gone take their scrape-failure series with them (no series per pod ever made)."""
        if self._metrics is not None:
            for pod in pods:
                self._metrics.scrape_failures.remove(namespace, pod)

    async def round(self, namespace: str, name: str, logger: Logger) -> float:
        """One round for one CR; returns the seconds to wait before the next."""
        api = self._session()
        if api is None:
            return 1.0
        cr = await api.get(CR, namespace, name)
        if cr is None or cr.get("metadata", {}).get("deletionTimestamp"):
            self.forget(namespace, name)
            return IDLE_SECONDS
        try:
            spec = parse_cr({**cr, "metadata": {**cr["metadata"], "namespace": namespace}}).spec
        except SpecError:
            return IDLE_SECONDS  # the reconciler reports it (Degraded)
        memory = self._memory.setdefault((namespace, name), _Memory())
        status: dict[str, Any] = {"autoscaling": {"mode": spec.autoscaling.mode}}
        if spec.tuning.enabled or spec.autoscaling.mode == "operator" or spec.tiers.shared is not None:
            pods, existing = await self._ready_pods(api, namespace, name)
            gone = memory.failed_pods - existing
            self._drop_series(namespace, gone)
            memory.failed_pods -= gone
            scrapes = await asyncio.gather(*(self._pods.scrape(p.url, spec.tuning.scrape_timeout_seconds) for p in pods))
            keep = tuning.policy_from_spec(spec).history
            for pod, scrape in zip(pods, scrapes, strict=True):
                memory.pods[pod.uid] = memory.pods.get(pod.uid, tuning.PodHistory()).add(scrape, keep=keep)
                if scrape.metrics is None and self._metrics is not None:
                    self._metrics.scrape_failures.labels(namespace, pod.name).inc()
                    memory.failed_pods.add(pod.name)
            for uid in set(memory.pods) - {p.uid for p in pods}:
                memory.pods.pop(uid)
                memory.changed_at.pop(uid, None)
            if spec.tuning.enabled:
                await self._tune(api, cr, spec, pods, memory, logger)
            now = now_rfc3339()
            status["pods"] = [pod_entry(p.name, s, memory.pods[p.uid], now, memory.changed_at.get(p.uid))
                              for p, s in zip(pods, scrapes, strict=True)]
            status["recommendations"] = agreed_recommendations([(p.name, memory.pods[p.uid]) for p in pods])
            if spec.autoscaling.mode == "operator":
                status["autoscaling"] = await self._autoscale(api, cr, spec, pods, memory, logger)
        else:
            status["pods"], status["recommendations"] = [], []
        start = runtime_settings(spec)
        status["budgets"] = budget_summary(status["pods"], {"gpu": start["gpu_budget"], "dram": start["dram_budget"],
                                                            "ssd": start["ssd_budget"]})
        status["maxRunning"] = running_summary(status["pods"], start["max_running"])
        previous = cr.get("status") or {}
        if spec.tiers.shared is not None:
            status["sharedTier"] = shared_tier_status(spec.tiers.shared, namespace, status["pods"])
            status["conditions"] = merge_conditions(live_view(previous, "conditions") or [],
                                                    [shared_tier_condition(status["pods"])],
                                                    cr["metadata"].get("generation"), now_rfc3339())
        if live_status_differs(previous, status):  # an unchanged round writes nothing
            body = {"apiVersion": cr["apiVersion"], "kind": cr["kind"], "metadata": {"name": name}, "status": status}
            await api.apply(CR, namespace, body, LIVE, force=True, subresource="status")
        return float(spec.tuning.interval_seconds)

    async def _ready_pods(self, api: KubeApi, namespace: str, name: str) -> tuple[list[_Pod], set[str]]:
        """The CR's ready pods with an address, and the names of all its pods."""
        found, names = [], set()
        for pod in await api.list(PODS, namespace, selector_labels(name)):
            names.add(pod["metadata"]["name"])
            url = pod_url(pod)
            if pod_ready(pod) and url:
                meta = pod["metadata"]
                found.append(_Pod(uid=str(meta.get("uid") or meta["name"]), name=meta["name"], url=url))
        return sorted(found, key=lambda p: p.name), names

    async def _tune(self, api: KubeApi, cr: dict[str, Any], spec: KVDriveSpec, pods: list[_Pod], memory: _Memory,
                    logger: Logger) -> None:
        """Decide each pod's concurrency limit and apply the changes; report new recommendations."""
        limits, policy = tuning.limits_from_spec(spec), tuning.policy_from_spec(spec)
        sizes, granules = tuning.tier_sizes(spec), {"dram": to_bytes(spec.tiers.dram.huge_page_size), "ssd": SSD_GRANULE}
        self._confirm(cr, pods, memory, logger)
        decisions = {p.uid: tuning.decide(memory.pods[p.uid], limits, policy, sizes, granules) for p in pods}
        for pod in pods:
            await self._recommend(api, cr, pod, decisions[pod.uid], memory, logger)
        changing = [p for p in pods if decisions[p.uid].changed]
        if not changing:
            return
        meta = cr["metadata"]
        token = admin_token_of(await api.get(SECRETS, meta["namespace"], Names(meta["name"]).secret))
        if token is None:
            logger.warning("no admin token in Secret %s: cannot change concurrency", Names(meta["name"]).secret)
            return
        # all at once: each PUT may wait for its pod's next engine step, up to applyTimeoutSeconds
        targets = [(p, n) for p in changing if (n := decisions[p.uid].new_max_running) is not None]
        results = await asyncio.gather(*(self._pods.set_running(p.url, token, n, spec.tuning.apply_timeout_seconds)
                                         for p, n in targets))
        for (pod, _), result in zip(targets, results, strict=True):
            decision = decisions[pod.uid]
            now, history = self._clock(), memory.pods[pod.uid]
            memory.changed_at[pod.uid] = now_rfc3339()
            if result.ok:
                memory.pods[pod.uid] = history.changed(now, decision.summary)
                logger.info("pod %s: %s", pod.name, decision.summary)
                self._event(cr, "Normal", "ConcurrencyChanged", budget_event(pod.name, decision.summary))
                continue
            if result.status == 422:  # the pod cannot: the limit is capped where it stands, and a window passes
                summary = f"{decision.summary} -- refused (422): {result.detail}"
                memory.pods[pod.uid] = history.refused(decision, now, summary)
                reason = "ConcurrencyRefused"
            elif result.status == 0:  # no answer: the pod may apply it later, which its metrics will show
                summary = f"{decision.summary} -- not applied: {result.detail}"
                memory.pods[pod.uid] = history.unanswered(decision, now, summary)
                reason = "ConcurrencyNotApplied"
            else:
                summary = f"{decision.summary} -- not applied (HTTP {result.status}): {result.detail}"
                memory.pods[pod.uid] = history.changed(now, summary)
                reason = "ConcurrencyNotApplied"
            logger.warning("pod %s: %s", pod.name, summary)
            self._event(cr, "Warning", reason, budget_event(pod.name, summary))

    def _confirm(self, cr: dict[str, Any], pods: list[_Pod], memory: _Memory, logger: Logger) -> None:
        """A change that got no answer in time but that the pod's metrics now show took effect: say so."""
        for pod in pods:
            history = memory.pods[pod.uid]
            metrics = history.scrapes[-1].metrics if history.scrapes else None
            if history.unconfirmed is None or metrics is None or metrics.max_running != history.unconfirmed:
                continue
            memory.pods[pod.uid] = history.confirmed()
            summary = f"{history.unconfirmed_change} (applied after its request's timeout)"
            logger.info("pod %s: %s", pod.name, summary)
            self._event(cr, "Normal", "ConcurrencyChanged", budget_event(pod.name, summary))

    async def _recommend(self, api: KubeApi, cr: dict[str, Any], pod: _Pod, decision: tuning.Decision,
                         memory: _Memory, logger: Logger) -> None:
        """Remember the pod's right-sizing recommendations when they change (tier and size); one Normal
        Event per new one. Nothing is changed on the pod."""
        history = memory.pods[pod.uid]
        before = {(rec.tier, rec.recommended) for rec in history.recommendations}
        if {(rec.tier, rec.recommended) for rec in decision.recommendations} == before:
            return
        memory.pods[pod.uid] = history.recommended(decision.recommendations)
        for rec in decision.recommendations:
            if (rec.tier, rec.recommended) not in before:
                logger.info("pod %s: %s", pod.name, rec.describe())
                self._event(cr, "Normal", "TierRightSizing", recommendation_event(pod.name, rec))

    async def _autoscale(self, api: KubeApi, cr: dict[str, Any], spec: KVDriveSpec, pods: list[_Pod],
                         memory: _Memory, logger: Logger) -> dict[str, Any]:
        meta = cr["metadata"]
        namespace, sts_name = meta["namespace"], Names(meta["name"]).statefulset
        sts = await api.get(STATEFULSETS, namespace, sts_name)
        report: dict[str, Any] = {"mode": "operator"}
        if sts is None:
            return report  # the reconciler creates it first
        current = int(sts.get("spec", {}).get("replicas") or 0)
        loads: list[autoscale.PodLoad | None] = []
        for pod in pods:
            scrapes = memory.pods[pod.uid].scrapes
            latest = scrapes[-1]
            rate = rates(scrapes[-2], latest) if len(scrapes) > 1 else None
            loads.append(None if latest.metrics is None else autoscale.load_of(latest.metrics, rate))
        # a replica without a ready pod in this round's list (starting, or created after the list was
        # taken) has an unknown load like an unreadable pod: it blocks scaling down
        loads.extend([None] * max(0, current - len(pods)))
        decision = autoscale.decide(loads, current, autoscale.policy_from_spec(spec), memory.scale, self._clock())
        memory.scale = decision.history
        if decision.changed(current):
            conflict = await self._scale(api, namespace, sts_name, decision.replicas)
            if conflict is not None:
                message = f"replicas {current} -> {decision.replicas} not applied: {conflict}"
                logger.warning("%s", message)
                self._event(cr, "Warning", "ScaleConflict", message)
                report.update(desiredReplicas=decision.replicas, recommendation=decision.recommendation,
                              lastDecision=message[:1024])
                return report
            reason, message = scale_event(current, decision.replicas, decision.reason)
            logger.info("%s", message)
            self._event(cr, "Normal", reason, message)
            memory.last_scale_time, memory.last_decision = now_rfc3339(), message
        report.update(desiredReplicas=decision.replicas, recommendation=decision.recommendation)
        if memory.last_scale_time:
            report["lastScaleTime"] = memory.last_scale_time
        report["lastDecision"] = memory.last_decision or f"replicas {current}: {decision.reason}"[:1024]
        return report

    @staticmethod
    async def _scale(api: KubeApi, namespace: str, name: str, replicas: int) -> str | None:
        """Apply the StatefulSet's replicas as the one writer of that field in mode operator. The
        reconciler's own claim (it created the object) is taken over; any other manager's is reported,
        not forced: the returned text says who holds it."""
        body = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
                "spec": {"replicas": replicas}}
        try:
            await api.apply(STATEFULSETS, namespace, body, AUTOSCALER)
        except Conflict as exc:
            if exc.managers() != {RECONCILER}:
                return "; ".join(str(f) for f in exc.fields)
            await api.apply(STATEFULSETS, namespace, body, AUTOSCALER, force=True)
        return None
