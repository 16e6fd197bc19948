"""Pydantic models of the ``KVDriveDeployment`` status (the CR's edge, as the operator writes it).

Owns the shape of every status field: the reconciler's replicas and conditions, the live loop's per-pod
budgets, right-sizing recommendations, autoscaling decision and the router's pods. The reconciler
validates what it writes against ``KVDriveStatus`` (a field that drifted from the CRD fails there, not at
the API server).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvdrive.operator.api.specbase import Model


class Condition(Model):
    type: Literal["Ready", "Progressing", "Degraded", "RouterReady"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str
    observed_generation: int | None = None


class TierRecommendation(Model):
    """A right-sizing hint for one ``tiers.*`` size of the CR (quantities); the operator changes nothing."""

    tier: Literal["dram", "ssd"]
    field: str
    current: str
    recommended: str
    reason: str = Field(default="", max_length=1024)


class PodStatus(Model):
    """One pod as the live tuner last saw it (budgets in bytes, as the pod reported them)."""

    name: str
    metrics: Literal["ok", "missing"]
    last_scrape_time: str
    scrape_error: str | None = None
    gpu_bytes: int | None = None
    dram_bytes: int | None = None
    ssd_bytes: int | None = None
    max_running: int | None = None
    hot_bytes: int | None = None
    reserve_bytes: int | None = None
    recommendations: list[TierRecommendation] = Field(default_factory=list)
    last_change_time: str | None = None
    last_change: str | None = None


class BudgetSummary(Model):
    """Per-tier budgets across the pods, for ``kubectl get`` (``12Mi``, or ``8Mi-12Mi`` when pods differ)."""

    gpu: str = ""
    dram: str = ""
    ssd: str = ""


class AutoscalingStatus(Model):
    mode: Literal["operator", "external", "none"]
    desired_replicas: int | None = None
    recommendation: int | None = None
    last_scale_time: str | None = None
    last_decision: str | None = None


class RouterStatus(Model):
    """The router's pods (routing mode prefix or inferencepool): how many pass their readiness probe, of how
    many."""

    ready: int = 0
    desired: int = 0


class KVDriveStatus(Model):
    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    selector: str = ""
    endpoint: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    budgets: BudgetSummary | None = None
    max_running: str | None = None  # across the pods, e.g. 16, or 8-16 when the tuner set them apart
    recommendations: list[TierRecommendation] = Field(default_factory=list)  # what every pod agrees on
    pods: list[PodStatus] = Field(default_factory=list)
    autoscaling: AutoscalingStatus | None = None
    router: RouterStatus | None = None
