"""Pydantic models of the ``KVDriveDeployment`` spec (the CR's edge).

Owns the meaning of every spec field, its default and its constraints. It must agree with
``crds/kvdrivedeployment.yaml``: tests check the same fields, the same defaults and the same
accept/reject verdicts on a shared set of good and bad examples (schema + CEL rules).
Cross-field errors name the field they are about (``cr.parse_cr`` prefixes the path).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from kvdrive.operator.api.podsettings import (
    DNS_SUBDOMAIN,
    EnvVar,
    LocalObjectReference,
    Rollout,
    SecurityContext,
    Volume,
    VolumeMount,
    check_pod_settings,
)
from kvdrive.operator.api.quantity import QuantityError, parse_quantity
from kvdrive.operator.api.specbase import Model, cross

DEFAULT_IMAGE = "ghcr.io/kvdrive/kvdrive-runtime:0.1.0"
MODEL_SOURCE_PATTERN = r"^(demo|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^/].*|file:///.+)$"


def _quantity(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"must be a quantity such as 64Gi, got {value!r}")
    try:
        parse_quantity(value)
    except QuantityError as exc:
        raise ValueError(str(exc)) from exc
    return str(value)


Quantity = Annotated[str, BeforeValidator(_quantity), Field(max_length=32)]


class ModelSource(Model):
    source: str = Field(pattern=MODEL_SOURCE_PATTERN, max_length=1024)
    name: str | None = Field(default=None, max_length=253)


class Resources(Model):
    gpus: int = Field(default=1, ge=0, le=16)
    cpu: Quantity = "4"
    memory: Quantity = "16Gi"


class GpuTier(Model):
    budget: Quantity = "4Gi"


class DramTier(Model):
    size: Quantity = "8Gi"
    huge_page_size: Literal["2Mi", "1Gi"] = "2Mi"

    @model_validator(mode="after")
    def _whole_pages(self) -> DramTier:
        if parse_quantity(self.size) % parse_quantity(self.huge_page_size) != 0:
            raise cross("size", f"must be a whole number of hugePageSize ({self.huge_page_size}) pages")
        return self


class SsdTier(Model):
    size: Quantity = "100Gi"
    storage_class_name: str = Field(default="local-nvme", min_length=1, max_length=253)

    @model_validator(mode="after")
    def _positive(self) -> SsdTier:
        if parse_quantity(self.size) <= 0:
            raise cross("size", "must be greater than zero")
        return self


class Tiers(Model):
    gpu: GpuTier = GpuTier()
    dram: DramTier = DramTier()
    ssd: SsdTier = SsdTier()


class Attention(Model):
    token_budget: int = Field(default=2048, ge=16, le=1048576)
    page_size: int = Field(default=16, ge=1, le=1024)

    @model_validator(mode="after")
    def _whole_pages(self) -> Attention:
        if self.token_budget % self.page_size != 0:
            raise cross("tokenBudget", "must be a multiple of pageSize")
        return self


class Concurrency(Model):
    """Sequences each pod runs at once to start with (``kvdrive serve --max-running``)."""

    max_running: int = Field(default=16, ge=1, le=1024)


class ConcurrencyBounds(Model):
    """Where the live tuner may move each pod's ``max_running`` (the envelope's split)."""

    min: int = Field(default=1, ge=1, le=1024, alias="min")
    max: int = Field(default=32, ge=1, le=1024, alias="max")
    min_step: int = Field(default=1, ge=1, le=1024)

    @model_validator(mode="after")
    def _ordered(self) -> ConcurrencyBounds:
        if self.min > self.max:
            raise cross("min", "must not exceed max")
        return self


class Tuning(Model):
    enabled: bool = True
    interval_seconds: int = Field(default=30, ge=1, le=3600)
    scrape_timeout_seconds: int = Field(default=5, ge=1, le=60)
    apply_timeout_seconds: int = Field(default=30, ge=1, le=300)
    stabilization_intervals: int = Field(default=3, ge=1, le=100)
    concurrency: ConcurrencyBounds = ConcurrencyBounds()


class AutoscalingTargets(Model):
    queue_depth: int = Field(default=8, ge=1, le=10000)
    kv_utilization: float = Field(default=0.8, gt=0, le=1)
    tokens_per_second: float | None = Field(default=None, gt=0, le=1e9)


class Autoscaling(Model):
    mode: Literal["operator", "external", "none"] = "none"
    min_replicas: int = Field(default=1, ge=1, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    targets: AutoscalingTargets = AutoscalingTargets()
    scale_up_stabilization_seconds: int = Field(default=30, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86400)
    max_step: int = Field(default=2, ge=1, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise cross("minReplicas", "must not exceed maxReplicas")
        return self


class Service(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8000, ge=1, le=65535)


class InferencePoolSettings(Model):
    """The ``InferencePool`` of routing mode inferencepool (Gateway API Inference Extension)."""

    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"  # the gateway when the router's ext_proc fails


class Routing(Model):
    """The prefix-aware router (``kvdrive route``) in front of the replicas; in mode inferencepool also the
    endpoint picker (Envoy ext_proc) of an ``InferencePool`` of the replicas."""

    mode: Literal["none", "prefix", "inferencepool"] = "none"
    replicas: int = Field(default=2, ge=1, le=16)
    inference_pool: InferencePoolSettings = InferencePoolSettings()


SERVE_PORT = 8000  # the runtime container's port (`kvdrive serve --port`)


class KVEvents(Model):
    """KV events on vLLM's wire (``kvdrive serve --kv-events-endpoint``), for the router and indexers (llm-d)."""

    enabled: bool = False
    port: int = Field(default=5557, ge=1024, le=65535)  # the PUB socket, bound on the pod
    replay_port: int = Field(default=5558, ge=1024, le=65535)  # the replay (ROUTER) socket
    hashes: Literal["int", "bytes"] = "int"  # a page's name: its digest's low 64 bits (vLLM's default), or all of it

    @model_validator(mode="after")
    def _distinct_ports(self) -> KVEvents:
        if len({self.port, self.replay_port, SERVE_PORT}) < 3:
            raise cross("port", f"port and replayPort must differ from each other and from {SERVE_PORT} "
                                "(the serving port)")
        return self


class KVDriveSpec(Model):
    model: ModelSource
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512)
    replicas: int | None = Field(default=None, ge=0, le=1000)
    placement: Literal["kvdrive", "lru", "ondemand", "fullfetch"] = "kvdrive"
    resources: Resources = Resources()
    tiers: Tiers = Tiers()
    attention: Attention = Attention()
    concurrency: Concurrency = Concurrency()
    tuning: Tuning = Tuning()
    autoscaling: Autoscaling = Autoscaling()
    service: Service = Service()
    routing: Routing = Routing()
    kv_events: KVEvents = KVEvents()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    # pod settings passed through to the runtime pods (podsettings.py)
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    env_from: list[dict[str, Any]] = Field(default_factory=list, max_length=32)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    service_account_name: str | None = Field(default=None, pattern=DNS_SUBDOMAIN, max_length=253)
    priority_class_name: str | None = Field(default=None, pattern=DNS_SUBDOMAIN, max_length=253)
    runtime_class_name: str | None = Field(default=None, pattern=DNS_SUBDOMAIN, max_length=253)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    extra_volumes: list[Volume] = Field(default_factory=list, max_length=32)
    extra_volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=32)
    security_context: SecurityContext = SecurityContext()
    termination_grace_period_seconds: int = Field(default=120, ge=40, le=3600)
    rollout: Rollout = Rollout()

    @model_validator(mode="after")
    def _pod_settings(self) -> KVDriveSpec:
        check_pod_settings(self.env, self.extra_volumes, self.extra_volume_mounts, self.pod_labels,
                           self.pod_annotations)
        return self

    @model_validator(mode="after")
    def _replicas_xor_operator(self) -> KVDriveSpec:
        if self.replicas is not None and self.autoscaling.mode == "operator":
            raise cross("replicas", "must not be set when autoscaling.mode is operator")
        return self

    @model_validator(mode="after")
    def _running_within_tuning(self) -> KVDriveSpec:
        bounds = self.tuning.concurrency
        if self.tuning.enabled and not bounds.min <= self.concurrency.max_running <= bounds.max:
            raise cross("concurrency.maxRunning", f"must be within tuning.concurrency.min and max "
                                                   f"([{bounds.min}, {bounds.max}]) when tuning is enabled")
        return self

    def max_sequences(self) -> int:
        """The most sequences a pod may ever run (``--max-sequences``, rows reserved at start): the tuner's
        ceiling when it may move the limit, else the fixed limit itself."""
        return self.tuning.concurrency.max if self.tuning.enabled else self.concurrency.max_running

    def desired_replicas(self, current: int | None = None) -> int:
        """StatefulSet replicas: spec.replicas unless the operator's autoscaler owns the count."""
        if self.autoscaling.mode != "operator":
            return 1 if self.replicas is None else self.replicas
        low, high = self.autoscaling.min_replicas, self.autoscaling.max_replicas
        return low if current is None else min(max(current, low), high)
