"""The spec's settings of the operator's live loop (pydantic, the CR's edge): where the tuner may move each
pod's concurrency limit (``tuning``) and how the replicas are scaled (``autoscaling``).

Owns those fields, their defaults, constraints and CEL rules; ``decide.tuning`` and ``decide.autoscale``
own what is done with them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvdrive.operator.api.specbase import Model, cel, cross, rules


class ConcurrencyBounds(Model):
    """Where the live tuner may move each pod's ``max_running`` (the envelope's split)."""

    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!has(self.min) || !has(self.max) || self.min <= self.max",
            "spec.tuning.concurrency.min must not exceed spec.tuning.concurrency.max", ".min")))

    min: int = Field(default=1, ge=1, le=1024, alias="min",
                     description="Fewest sequences the tuner leaves a pod running at once.")
    max: int = Field(default=32, ge=1, le=1024, alias="max",
                     description="Most sequences the tuner lets a pod run at once (--max-sequences).")
    min_step: int = Field(default=1, ge=1, le=1024,
                          description=("Smallest change of max_running worth applying (sequences); smaller "
                                       "moves are skipped."))

    @model_validator(mode="after")
    def _ordered(self) -> ConcurrencyBounds:
        if self.min > self.max:
            raise cross("min", "must not exceed max")
        return self


class Tuning(Model):
    enabled: bool = Field(default=True,
                          description=("Whether the operator moves each pod's concurrency limit live (and "
                                       "recommends tier sizes)."))
    interval_seconds: int = Field(default=30, ge=1, le=3600,
                                  description=("Seconds between rounds that read every ready pod's /metrics "
                                               "(tuning and autoscaling)."))
    scrape_timeout_seconds: int = Field(default=5, ge=1, le=60,
                                        description=("Timeout of one /metrics read; a pod that does not "
                                                     "answer in time counts as missing data."))
    apply_timeout_seconds: int = Field(default=30, ge=1, le=300,
                                       description=("Timeout of one concurrency change (PUT /admin/tiers). "
                                                    "The pod applies it between two engine steps, and under "
                                                    "load one step can take seconds. A change without an "
                                                    "answer in time is a ConcurrencyNotApplied Warning; if "
                                                    "the pod's metrics show it later, a ConcurrencyChanged "
                                                    "Event follows."))
    stabilization_intervals: int = Field(default=3, ge=1, le=100,
                                         description=("Consecutive intervals a signal must hold (measured "
                                                      "at the current limit) before a pod's max_running "
                                                      "moves."))
    concurrency: ConcurrencyBounds = Field(default=ConcurrencyBounds(),
                                           description=("Where the tuner may move max_running. max is also "
                                                        "each pod's --max-sequences: the rows it reserves "
                                                        "at start, so the limit can never grow past it."))


class AutoscalingTargets(Model):
    queue_depth: int = Field(default=8, ge=1, le=10000, description="Waiting requests per pod.")
    kv_utilization: float = Field(default=0.8, gt=0, le=1,
                                  description="Fraction of the KV tiers in use (0 < x <= 1).")
    tokens_per_second: float | None = Field(default=None, gt=0, le=1_000_000_000,
                                            description=("Generated tokens per second per pod (optional; "
                                                         "unset ignores throughput)."))


class Autoscaling(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas", ".minReplicas")))
    mode: Literal["operator", "external", "none"] = Field(default="none",
                                                          description=("operator: the operator scales from "
                                                                       "the pods' metrics; external: an "
                                                                       "external autoscaler writes "
                                                                       "spec.replicas via the scale "
                                                                       "subresource; none: spec.replicas is "
                                                                       "fixed."))
    min_replicas: int = Field(default=1, ge=1, le=1000, description="Fewest replicas in operator mode.")
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Most replicas in operator mode.")
    targets: AutoscalingTargets = Field(default=AutoscalingTargets(),
                                        description="Per-pod targets the operator's autoscaler keeps.")
    scale_up_stabilization_seconds: int = Field(default=30, ge=0, le=3600,
                                                description=("Seconds a higher recommendation must persist "
                                                             "before scaling up."))
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86400,
                                                  description=("Seconds a lower recommendation must persist "
                                                               "before scaling down."))
    max_step: int = Field(default=2, ge=1, le=1000,
                          description="Most replicas added or removed by one scaling decision.")

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise cross("minReplicas", "must not exceed maxReplicas")
        return self
