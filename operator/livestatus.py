"""Pure shaping of what the live loop reports: ``status.pods[]``, ``status.budgets``, ``status.autoscaling``.

Owns how per-pod budgets and decisions read in ``kubectl get kvd`` / ``kubectl describe kvd``: byte
counts per pod, a per-tier summary (``12Mi``, or ``8Mi-12Mi`` when the tuner set pods apart), and the
last change with the numbers behind it. No Kubernetes API, no Kopf.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvdrive.operator.podmetrics import TIERS, Scrape
from kvdrive.operator.quantity import format_bytes
from kvdrive.operator.tuning import PodHistory


def last_budgets(history: PodHistory) -> dict[str, int]:
    """The budgets of the latest good scrape (a pod that cannot be read keeps what it last showed)."""
    for scrape in reversed(history.scrapes):
        if scrape.metrics is not None:
            return scrape.metrics.budgets()
    return {}


def pod_entry(name: str, scrape: Scrape, history: PodHistory, budgets: Mapping[str, int], scraped_at: str,
              changed_at: str | None) -> dict[str, Any]:
    """One item of ``status.pods`` (the CRD's field names)."""
    entry: dict[str, Any] = {"name": name, "metrics": "ok" if scrape.ok else "missing", "lastScrapeTime": scraped_at}
    if not scrape.ok:
        entry["scrapeError"] = scrape.error or "unknown"
    for tier in TIERS:
        if tier in budgets:
            entry[f"{tier}Bytes"] = int(budgets[tier])
    if changed_at and history.last_change:
        entry["lastChangeTime"] = changed_at
        entry["lastChange"] = history.last_change[:1024]
    return entry


def range_text(values: Iterable[int]) -> str:
    found = sorted(set(values))
    if not found:
        return ""
    low, high = format_bytes(found[0]), format_bytes(found[-1])
    return low if low == high else f"{low}-{high}"


def budget_summary(entries: Sequence[Mapping[str, Any]], fallback: Mapping[str, int]) -> dict[str, str]:
    """``status.budgets``: what the pods report; the spec's starting budgets before any pod was read."""
    out = {}
    for tier in TIERS:
        values = [int(e[f"{tier}Bytes"]) for e in entries if f"{tier}Bytes" in e]
        out[tier] = range_text(values) if values else format_bytes(int(fallback.get(tier, 0)))
    return out


def budget_event(pod: str, summary: str) -> str:
    return f"pod {pod}: {summary}"[:1024]


def scale_event(current: int, replicas: int, reason: str) -> tuple[str, str]:
    """(Event reason, message) of a scaling decision."""
    kind = "ScaledUp" if replicas > current else "ScaledDown"
    return kind, f"replicas {current} -> {replicas}: {reason}"[:1024]
