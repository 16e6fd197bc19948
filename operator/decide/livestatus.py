"""Pure shaping of what the live loop reports: ``status.pods[]``, ``status.budgets``, ``status.maxRunning``,
``status.recommendations``, ``status.sharedTier`` and its condition ``SharedTierDegraded``, and the messages of
its Events.

Owns how per-pod budgets, envelope splits and decisions read in ``kubectl get kvd`` / ``kubectl describe
kvd``: byte counts per pod, a per-tier summary (``12Mi``, or ``8Mi-12Mi`` when pods differ), the
concurrency limit across the pods (``16``, or ``8-16``), right-sizing recommendations as exact
quantities (per pod, and the ones every pod agrees on), the last change with the numbers behind
it, and which pods report the shared tier degraded; and which of the status' keys and conditions are the
live loop's (it writes them only when they changed). No Kubernetes API, no Kopf.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvdrive.operator.api.podmetrics import TIERS, PodMetrics, Scrape
from kvdrive.operator.api.quantity import exact_quantity, format_bytes
from kvdrive.operator.api.sharedtierspec import SharedTier
from kvdrive.operator.decide.conditions import ConditionValue
from kvdrive.operator.decide.tuning import PodHistory, Recommendation
from kvdrive.operator.render import sharedtier

SHARED_TIER_CONDITION = "SharedTierDegraded"
LIVE_CONDITIONS = (SHARED_TIER_CONDITION,)  # items of status.conditions the live loop owns (the rest: the reconciler's)
# the status keys the live loop writes; sharedTier and conditions only with a shared tier (a key it stops
# writing must go: server-side apply removes what its manager no longer applies)
LIVE_KEYS = ("pods", "recommendations", "budgets", "maxRunning", "autoscaling", "sharedTier", "conditions")


def last_metrics(history: PodHistory) -> PodMetrics | None:
    """The latest good scrape's metrics (a pod that cannot be read keeps what it last showed)."""
    for scrape in reversed(history.scrapes):
        if scrape.metrics is not None:
            return scrape.metrics
    return None


def recommendation_entry(rec: Recommendation) -> dict[str, str]:
    """One item of ``recommendations`` (the CRD's field names; sizes as quantities a CR can take)."""
    return {"tier": rec.tier, "field": rec.field, "current": exact_quantity(rec.current),
            "recommended": exact_quantity(rec.recommended), "reason": rec.reason[:1024]}


def pod_entry(name: str, scrape: Scrape, history: PodHistory, scraped_at: str, changed_at: str | None) -> dict[str, Any]:
    """One item of ``status.pods``: budgets and the envelope's split from the latest good scrape, the
    pod's standing recommendations and its last change."""
    entry: dict[str, Any] = {"name": name, "metrics": "ok" if scrape.ok else "missing", "lastScrapeTime": scraped_at}
    if not scrape.ok:
        entry["scrapeError"] = scrape.error or "unknown"
    metrics = last_metrics(history)
    if metrics is not None:
        budgets = metrics.budgets()
        for tier in TIERS:
            if tier in budgets:
                entry[f"{tier}Bytes"] = int(budgets[tier])
        split = {"maxRunning": metrics.max_running, "hotBytes": metrics.hot_bytes,
                 "reserveBytes": metrics.reserve_bytes}
        entry.update({key: int(value) for key, value in split.items() if value is not None})
        if metrics.shared_tier_degraded is not None:
            entry["sharedTier"] = "degraded" if metrics.shared_tier_degraded else "ok"
    if history.recommendations:
        entry["recommendations"] = [recommendation_entry(rec) for rec in history.recommendations]
    if changed_at and history.last_change:
        entry["lastChangeTime"] = changed_at
        entry["lastChange"] = history.last_change[:1024]
    return entry


def range_text(values: Iterable[int], unit: str = "bytes") -> str:
    found = sorted(set(values))
    if not found:
        return ""
    show = format_bytes if unit == "bytes" else str
    low, high = show(found[0]), show(found[-1])
    return low if low == high else f"{low}-{high}"


def budget_summary(entries: Sequence[Mapping[str, Any]], fallback: Mapping[str, int]) -> dict[str, str]:
    """``status.budgets``: what the pods report; the spec's starting budgets before any pod was read."""
    out = {}
    for tier in TIERS:
        values = [int(e[f"{tier}Bytes"]) for e in entries if f"{tier}Bytes" in e]
        out[tier] = range_text(values) if values else format_bytes(int(fallback.get(tier, 0)))
    return out


def running_summary(entries: Sequence[Mapping[str, Any]], fallback: int) -> str:
    """``status.maxRunning``: the pods' concurrency limits; the spec's start before any pod reported one."""
    values = [int(e["maxRunning"]) for e in entries if "maxRunning" in e]
    return range_text(values, unit="count") if values else str(fallback)


def agreed_recommendations(pods: Sequence[tuple[str, PodHistory]]) -> list[dict[str, str]]:
    """``status.recommendations``: a tier every pod recommends shrinking (one CR size serves them all),
    at the largest size any of them needs."""
    if not pods:
        return []
    out = []
    for tier in sorted({rec.tier for _, history in pods for rec in history.recommendations}):
        found = [(name, rec) for name, history in pods for rec in history.recommendations if rec.tier == tier]
        if len({name for name, _ in found}) < len(pods):
            continue  # a pod that needs the tier (or that was not judged yet) vetoes the shrink
        name, widest = max(found, key=lambda item: item[1].recommended)
        reason = f"every pod ({len(pods)}) recommends it; the largest need, {name}'s: {widest.reason}"
        out.append(recommendation_entry(Recommendation(tier, widest.field, widest.current, widest.recommended, reason)))
    return out


def budget_event(pod: str, summary: str) -> str:
    return f"pod {pod}: {summary}"[:1024]


def recommendation_event(pod: str, rec: Recommendation) -> str:
    return f"pod {pod}: {rec.describe()}"[:1024]


def scale_event(current: int, replicas: int, reason: str) -> tuple[str, str]:
    """(Event reason, message) of a scaling decision."""
    kind = "ScaledUp" if replicas > current else "ScaledDown"
    return kind, f"replicas {current} -> {replicas}: {reason}"[:1024]


def shared_tier_status(shared: SharedTier, namespace: str, entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``status.sharedTier``: where the pods reach the store (``namespace``: the CR's), and the pods (of
    ``status.pods``) that report it degraded."""
    return {"url": sharedtier.url(shared, namespace), "namespace": shared.namespace, "tls": shared.tls.enabled,
            "degradedPods": [str(e["name"]) for e in entries if e.get("sharedTier") == "degraded"]}


def shared_tier_condition(entries: Sequence[Mapping[str, Any]]) -> ConditionValue:
    """``SharedTierDegraded``: True while any ready pod reports the shared tier degraded (naming them), False
    when every pod that reports it reads it, Unknown before any pod reported it."""
    reported = [e for e in entries if e.get("sharedTier") in ("ok", "degraded")]
    degraded = [str(e["name"]) for e in reported if e["sharedTier"] == "degraded"]
    if not reported:
        return ConditionValue(SHARED_TIER_CONDITION, "Unknown", "NotReported",
                              f"no ready pod reports the shared tier yet ({len(entries)} ready)")
    if degraded:
        return ConditionValue(SHARED_TIER_CONDITION, "True", "CircuitOpen",
                              f"{len(degraded)}/{len(reported)} pods report the shared tier degraded (circuit "
                              f"breaker open: their shared-tier reads are misses, recomputed; they keep serving): "
                              f"{', '.join(degraded)}"[:32768])
    return ConditionValue(SHARED_TIER_CONDITION, "False", "Reachable",
                          f"{len(reported)}/{len(reported)} pods reach the shared tier")


def live_view(status: Mapping[str, Any], key: str) -> Any:
    """The live loop's part of ``status[key]``: its own conditions only (None when it has none)."""
    if key != "conditions":
        return status.get(key)
    return [c for c in status.get("conditions") or [] if c.get("type") in LIVE_CONDITIONS] or None


def live_status_differs(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` (the live loop's part) changes the status, a key or condition it no longer writes
    included."""
    return any(live_view(previous, key) != live_view(new, key) for key in LIVE_KEYS)
