"""Pydantic models of the ``KVDriveDeployment`` status (the CR's edge, as the operator writes it).

Owns the shape of every status field: the reconciler's replicas and conditions, the live loop's per-pod
budgets, right-sizing recommendations, autoscaling decision, the shared KV tier as configured and as the pods
report it (and its condition), and the router's pods. The reconciler
validates what it writes against ``KVDriveStatus`` (a field that drifted from the CRD fails there, not at
the API server).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from kvdrive.operator.api.specbase import Model


def _date_time() -> dict[str, str]:
    """The CRD's format of a metav1.Time."""
    return {"format": "date-time"}


def _int64() -> dict[str, str]:
    return {"format": "int64"}


def _map_list(key: str) -> dict[str, object]:
    """A list whose items the API server merges by ``key`` (server-side apply: one owner per item)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


class Condition(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra={"description": "A metav1.Condition."})
    # metav1.Condition types are open in the CRD (maxLength as metav1's); the operator writes only these (the
    # reconciler the first four, the live loop SharedTierDegraded)
    type: Literal["Ready", "Progressing", "Degraded", "RouterReady", "SharedTierDegraded"] = Field(
        description="Condition type.", json_schema_extra={"enum": None, "maxLength": 316})
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    # the CRD checks a reason's length only; the operator's reasons also match the pattern
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024,
                        description="CamelCase reason of the last transition.", json_schema_extra={"pattern": None})
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    last_transition_time: str = Field(description="When the status last changed.", json_schema_extra=_date_time())
    observed_generation: int | None = Field(default=None,
                                            description="The metadata.generation the condition reflects.")


class TierRecommendation(Model):
    """A right-sizing hint for one ``tiers.*`` size of the CR (quantities); the operator changes nothing."""

    model_config = ConfigDict(**Model.model_config, json_schema_extra={
        "description": "A recommended size for one tiers.* field of the CR; nothing was changed on the pods."})

    tier: Literal["dram", "ssd"] = Field(description=("The tier (only DRAM and SSD are sized by "
                                                      "recommendation)."))
    field: str = Field(description="The CR field to change, e.g. tiers.dram.size.")
    current: str = Field(description="What the CR gives the tier now (a quantity).")
    recommended: str = Field(description="The recommended size (a quantity, whole hugepages for DRAM).")
    reason: str = Field(default="", max_length=1024,
                        description="The numbers behind it (peak use, fill, intervals).")


class PodStatus(Model):
    """One pod as the live tuner last saw it (budgets in bytes, as the pod reported them)."""

    model_config = ConfigDict(**Model.model_config, json_schema_extra={
        "description": "One pod's tier budgets, its envelope split and the last change the tuner made."})

    name: str = Field(description="Pod name.")
    metrics: Literal["ok", "missing"] = Field(description=("ok, or missing when its /metrics could not be "
                                                           "read (its budgets are then left alone)."))
    last_scrape_time: str = Field(description="When its /metrics was last read (or tried).",
                                  json_schema_extra=_date_time())
    scrape_error: str | None = Field(default=None, description="Why the last read failed.")
    gpu_bytes: int | None = Field(default=None, description="Device-tier budget in bytes.", json_schema_extra=_int64())
    dram_bytes: int | None = Field(default=None, description="DRAM-tier budget in bytes.", json_schema_extra=_int64())
    ssd_bytes: int | None = Field(default=None, description="SSD-tier budget in bytes.", json_schema_extra=_int64())
    max_running: int | None = Field(default=None,
                                    description=("Sequences the pod may run at once now (the tuner moves it "
                                                 "within spec.tuning.concurrency)."))
    hot_bytes: int | None = Field(default=None,
                                  description="The device envelope's share for the hot KV tier, in bytes.",
                                  json_schema_extra=_int64())
    reserve_bytes: int | None = Field(default=None,
                                      description=("The device envelope's share reserved for running "
                                                   "sequences (open pages, decode step buffers), in bytes."),
                                      json_schema_extra=_int64())
    shared_tier: Literal["ok", "degraded"] | None = Field(default=None,
                                                         description=("The shared tier as the pod reports it "
                                                                      "(kvdrive_shared_tier_degraded): degraded "
                                                                      "while its circuit breaker is open (its "
                                                                      "shared-tier reads are misses, recomputed; "
                                                                      "it keeps serving). Only with "
                                                                      "spec.tiers.shared."))
    recommendations: list[TierRecommendation] = Field(default_factory=list,
                                                      description=("This pod's right-sizing recommendations "
                                                                   "for the CR's DRAM and SSD tiers (while "
                                                                   "they hold)."),
                                                      json_schema_extra=_map_list("tier"))
    last_change_time: str | None = Field(default=None, description="When the tuner last changed its budgets.",
                                         json_schema_extra=_date_time())
    last_change: str | None = Field(default=None,
                                    description="What the tuner last changed and the numbers behind it.")


class BudgetSummary(Model):
    """Per-tier budgets across the pods, for ``kubectl get`` (``12Mi``, or ``8Mi-12Mi`` when pods differ)."""

    gpu: str = Field(default="", description="Device tier.")
    dram: str = Field(default="", description="DRAM tier.")
    ssd: str = Field(default="", description="SSD tier.")


class AutoscalingStatus(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra={"required": None})  # the CRD requires none
    mode: Literal["operator", "external", "none"] = Field(description=("spec.autoscaling.mode when the "
                                                                       "decision was made."))
    desired_replicas: int | None = Field(default=None,
                                         description="Replicas the operator set (mode operator).")
    recommendation: int | None = Field(default=None,
                                       description=("Replicas the latest metrics alone call for (before "
                                                    "stabilization and maxStep)."))
    last_scale_time: str | None = Field(default=None,
                                        description="When the operator last changed the replicas.",
                                        json_schema_extra=_date_time())
    last_decision: str | None = Field(default=None,
                                      description="The last decision and the numbers behind it.")


class RouterStatus(Model):
    """The router's pods (routing mode prefix or inferencepool): how many pass their readiness probe, of how
    many."""

    ready: int = Field(default=0,
                       description=("Router pods that pass their readiness probe (/readyz answers 200 once "
                                    "the router reaches a ready replica)."))
    desired: int = Field(default=0, description="Router pods requested (spec.routing.replicas).")


class SharedTierStatus(Model):
    """``spec.tiers.shared`` as the pods were given it, and which of them report it degraded."""

    url: str = Field(description="The servers as the pods get them (--shared-tier; valkeys:// with TLS).")
    namespace: str = Field(description="The key namespace (keys kvd:<namespace>:<page digest>).")
    tls: bool = Field(description="Whether the pods connect over TLS.")
    degraded_pods: list[str] = Field(default_factory=list,
                                     description=("Ready pods whose last metrics report the shared tier degraded "
                                                  "(circuit breaker open)."))


class KVDriveStatus(Model):
    observed_generation: int | None = Field(default=None,
                                            description="The metadata.generation the status reflects.")
    replicas: int = Field(default=0, description="Replicas of the StatefulSet.")
    ready_replicas: int = Field(default=0, description="Pods that pass their readiness probe.")
    selector: str = Field(default="", description="Label selector of the pods (for the scale subresource).")
    endpoint: str = Field(default="", description="URL of the OpenAI-compatible endpoint inside the cluster.")
    conditions: list[Condition] = Field(default_factory=list,
                                        description=("Ready, Progressing and Degraded conditions, "
                                                     "RouterReady with routing on, and SharedTierDegraded "
                                                     "with a shared tier."),
                                        json_schema_extra=_map_list("type"))
    budgets: BudgetSummary | None = Field(default=None,
                                          description=("Per-tier budgets across the pods (what kubectl get "
                                                       "shows), e.g. 12Mi, or 8Mi-12Mi when pods differ."))
    max_running: str | None = Field(default=None,
                                    description=("Sequences the pods may run at once (what kubectl get "
                                                 "shows), e.g. 16, or 8-16 when the tuner set pods apart."))
    recommendations: list[TierRecommendation] = Field(default_factory=list,
                                                      description=("Right-sizing recommendations every "
                                                                   "ready pod agrees on (the largest size "
                                                                   "any of them needs): a smaller "
                                                                   "tiers.dram.size or tiers.ssd.size for "
                                                                   "the CR."),
                                                      json_schema_extra=_map_list("tier"))
    pods: list[PodStatus] = Field(default_factory=list,
                                  description="Each ready pod as the last metrics round saw it.",
                                  json_schema_extra=_map_list("name"))
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The autoscaler's last decision.")
    shared_tier: SharedTierStatus | None = Field(default=None,
                                                 description=("The shared KV tier (only with spec.tiers.shared): "
                                                              "where the pods reach it, and which report it "
                                                              "degraded (condition SharedTierDegraded)."))
    router: RouterStatus | None = Field(default=None,
                                        description=("The router's pods (only with spec.routing.mode prefix "
                                                     "or inferencepool)."))
