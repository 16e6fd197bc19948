"""Pydantic models of the ``KVDriveDeployment`` spec (the CR's edge): the spec as a whole and what its runtime
pods run with (model, image, resources, KV tiers, attention, concurrency, KV events); the live loop's settings
are in ``tuningspec``, the routing's in ``routingspec``, the shared KV tier's in ``sharedtierspec``, the pod
settings passed through in ``podsettings``.

Owns the meaning of those fields, their defaults, constraints and descriptions, and the CEL rules beside
the validators that check the same: ``scripts/gen_crd.py`` generates ``crds/kvdrivedeployment.yaml`` from
them, and tests check both on a shared set of good and bad examples (schema + CEL rules). Cross-field
errors name the field they are about (``cr.parse_cr`` prefixes the path).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from kvdrive.operator.api.podsettings import (
    DNS_SUBDOMAIN,
    EnvVar,
    LocalObjectReference,
    Rollout,
    SecurityContext,
    Volume,
    VolumeMount,
    check_pod_settings,
    extra_volumes_rules,
    pod_annotations_rules,
    pod_labels_rules,
    spec_rules,
)
from kvdrive.operator.api.quantity import QUANTITY_PATTERN, QuantityError, parse_quantity
from kvdrive.operator.api.routingspec import Routing, Service
from kvdrive.operator.api.sharedtierspec import SharedTier
from kvdrive.operator.api.specbase import IntOrString, Model, cel, cross, rules
from kvdrive.operator.api.tuningspec import Autoscaling, Tuning

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


Quantity = Annotated[str, BeforeValidator(_quantity), Field(max_length=32), IntOrString(QUANTITY_PATTERN)]


class ModelSource(Model):
    source: str = Field(pattern=MODEL_SOURCE_PATTERN, max_length=1024,
                        description=("Where the weights come from: demo (the built-in demo model), "
                                     "pvc://CLAIM/PATH (a file or directory on a PersistentVolumeClaim in "
                                     "the same namespace, mounted read-only) or file:///PATH (inside the "
                                     "image)."))
    name: str | None = Field(default=None, max_length=253,
                             description=("The served model id reported by /v1/models (optional; defaults "
                                          "to the runtime's own name for the model)."))


class Resources(Model):
    gpus: int = Field(default=1, ge=0, le=16, description="nvidia.com/gpu limit per pod (0 runs on CPU).")
    cpu: Quantity = Field(default="4", description="CPU request per pod (a Kubernetes quantity).")
    memory: Quantity = Field(default="16Gi",
                             description=("Memory request and limit per pod, not counting the hugepage DRAM "
                                          "tier."))


class GpuTier(Model):
    budget: Quantity = Field(default="4Gi",
                             description="Bytes of GPU memory for KV pages (a quantity, e.g. 40Gi).")


class DramTier(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!has(self.size) || !has(self.hugePageSize) || !isQuantity(string(self.size)) || "
            "quantity(string(self.size)).asInteger() % quantity(self.hugePageSize).asInteger() == 0",
            "spec.tiers.dram.size must be a whole number of hugepages of spec.tiers.dram.hugePageSize", ".size")))
    size: Quantity = Field(default="8Gi",
                           description=("Bytes of hugepage memory per pod (0 disables the tier). A whole "
                                        "number of hugePageSize pages."))
    huge_page_size: Literal["2Mi", "1Gi"] = Field(default="2Mi",
                                                  description="Hugepage size the nodes provide.")

    @model_validator(mode="after")
    def _whole_pages(self) -> DramTier:
        if parse_quantity(self.size) % parse_quantity(self.huge_page_size) != 0:
            raise cross("size", f"must be a whole number of hugePageSize ({self.huge_page_size}) pages")
        return self


class SsdTier(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!has(self.size) || !isQuantity(string(self.size)) || "
            "quantity(string(self.size)).isGreaterThan(quantity('0'))",
            "spec.tiers.ssd.size must be greater than zero", ".size")))
    size: Quantity = Field(default="100Gi",
                           description=("Size of each pod's claim; the runtime's SSD budget is 90% of it "
                                        "(file-system headroom)."))
    storage_class_name: str = Field(default="local-nvme", min_length=1, max_length=253,
                                    description=("StorageClass of local NVMe volumes (WaitForFirstConsumer "
                                                 "binding). Must exist in the cluster."))

    @model_validator(mode="after")
    def _positive(self) -> SsdTier:
        if parse_quantity(self.size) <= 0:
            raise cross("size", "must be greater than zero")
        return self


class Tiers(Model):
    gpu: GpuTier = Field(default=GpuTier(), description="Device (GPU memory) tier.")
    dram: DramTier = Field(default=DramTier(),
                           description=("Host DRAM tier, backed by hugepages (hugepages-2Mi or "
                                        "hugepages-1Gi requests and an emptyDir of medium HugePages)."))
    ssd: SsdTier = Field(default=SsdTier(), description="Local NVMe tier, one PersistentVolumeClaim per pod.")
    shared: SharedTier | None = Field(default=None,
                                      description=("A KV tier every pod of the CR shares, below or beside the SSD "
                                                   "tier: a Valkey or Redis cluster (or single node) that you run "
                                                   "(the operator does not deploy it). Unset: no shared tier. A "
                                                   "slow or unreachable store degrades the tier (its pages are "
                                                   "recomputed), never the serving."))


class Attention(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!has(self.tokenBudget) || !has(self.pageSize) || self.tokenBudget % self.pageSize == 0",
            "spec.attention.tokenBudget must be a multiple of spec.attention.pageSize", ".tokenBudget")))
    token_budget: int = Field(default=2048, ge=16, le=1048576,
                              description="Tokens of KV attended per decode step (--token-budget).")
    page_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV page (--page-size).")

    @model_validator(mode="after")
    def _whole_pages(self) -> Attention:
        if self.token_budget % self.page_size != 0:
            raise cross("tokenBudget", "must be a multiple of pageSize")
        return self


class Concurrency(Model):
    """Sequences each pod runs at once to start with (``kvdrive serve --max-running``)."""

    max_running: int = Field(default=16, ge=1, le=1024,
                             description=("Sequences each pod may run at once to start with (kvdrive serve "
                                          "--max-running). With tuning enabled the operator moves it live "
                                          "within tuning.concurrency; status.pods[].maxRunning shows where "
                                          "it is."))

SERVE_PORT = 8000  # the runtime container's port (`kvdrive serve --port`)


class KVEvents(Model):
    """KV events on vLLM's wire (``kvdrive serve --kv-events-endpoint``), for the router and indexers (llm-d)."""

    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel(f"(!has(self.port) || !has(self.replayPort) || self.port != self.replayPort) && "
            f"(!has(self.port) || self.port != {SERVE_PORT}) && (!has(self.replayPort) || self.replayPort != {SERVE_PORT})",
            f"spec.kvEvents.port: port and replayPort must differ from each other and from {SERVE_PORT} "
            "(the serving port)", ".port")))

    enabled: bool = Field(default=False,
                          description="Publish KV events (kvdrive serve --kv-events-endpoint tcp://*:port).")
    # the PUB socket, bound on the pod
    port: int = Field(default=5557, ge=1024, le=65535,
                      description="The pod's PUB socket (container port kv-events).")
    # the replay (ROUTER) socket
    replay_port: int = Field(default=5558, ge=1024, le=65535,
                             description=("The pod's replay (ROUTER) socket, for subscribers that join late "
                                          "(container port kv-replay)."))
    # a page's name: its digest's low 64 bits (vLLM's default), or all of it
    hashes: Literal["int", "bytes"] = Field(default="int",
                                            description=("How a page is named: int (its digest's low 64 "
                                                         "bits, vLLM's default) or bytes (the whole 16-byte "
                                                         "digest)."))

    @model_validator(mode="after")
    def _distinct_ports(self) -> KVEvents:
        if len({self.port, self.replay_port, SERVE_PORT}) < 3:
            raise cross("port", f"port and replayPort must differ from each other and from {SERVE_PORT} "
                                "(the serving port)")
        return self


class KVDriveSpec(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        *spec_rules(),
        cel("!(has(self.replicas) && self.autoscaling.mode == 'operator')",
            "spec.replicas must not be set when spec.autoscaling.mode is operator", ".replicas",
            reason="FieldValueForbidden"),
        cel("!has(self.tuning) || !has(self.concurrency) || !has(self.tuning.enabled) || !self.tuning.enabled || "
            "!has(self.tuning.concurrency) || !has(self.tuning.concurrency.min) || "
            "!has(self.tuning.concurrency.max) || !has(self.concurrency.maxRunning) || "
            "self.tuning.concurrency.min > self.tuning.concurrency.max || "
            "(self.tuning.concurrency.min <= self.concurrency.maxRunning && "
            "self.concurrency.maxRunning <= self.tuning.concurrency.max)",
            "spec.concurrency.maxRunning must be within spec.tuning.concurrency.min and "
            "spec.tuning.concurrency.max when spec.tuning.enabled is true", ".concurrency.maxRunning")))
    model: ModelSource = Field(description="The model to serve.")
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512,
                       description="Container image of the KVDrive runtime.")
    replicas: int | None = Field(default=None, ge=0, le=1000,
                                 description=("Fixed number of pods (default 1). Must not be set when "
                                              "autoscaling.mode is operator; with mode external an external "
                                              "autoscaler writes it through the scale subresource."))
    placement: Literal["kvdrive", "lru", "ondemand", "fullfetch"] = Field(default="kvdrive",
                                                                          description=("Tier placement "
                                                                                       "policy of the "
                                                                                       "runtime (kvdrive is "
                                                                                       "the default; the "
                                                                                       "others are "
                                                                                       "baselines)."))
    resources: Resources = Field(default=Resources(), description="Compute resources of each pod.")
    tiers: Tiers = Field(default=Tiers(), description=("Sizes of the three KV-cache tiers, per pod, and the tier "
                                                       "all pods share (optional)."))
    attention: Attention = Field(default=Attention(), description="Sparse attention settings of the runtime.")
    concurrency: Concurrency = Field(default=Concurrency(),
                                     description=("How many sequences each pod runs at once. The device "
                                                  "envelope (tiers.gpu.budget) is split between the hot KV "
                                                  "tier and a reserve per running sequence: every sequence "
                                                  "that may run takes its share from the hot tier."))
    tuning: Tuning = Field(default=Tuning(),
                           description=("Live tuning by the operator from the pods' metrics: it moves each "
                                        "pod's max_running (the split of the fixed device envelope between "
                                        "the hot KV tier and running sequences, PUT /admin/tiers). DRAM and "
                                        "SSD are not tuned (hugepages are reserved at pod start, the SSD is "
                                        "a claimed volume): a tier that stays mostly empty gets a "
                                        "right-sizing recommendation in status and an Event instead."))
    autoscaling: Autoscaling = Field(default=Autoscaling(), description="Who sets the number of replicas.")
    service: Service = Field(default=Service(),
                             description="The client Service (OpenAI-compatible endpoint).")
    routing: Routing = Field(default=Routing(),
                             description=("The prefix-aware router (kvdrive route) in front of the "
                                          "replicas: a Deployment, its Service, a PodDisruptionBudget and "
                                          "RBAC to read the namespace's EndpointSlices. With mode prefix or "
                                          "inferencepool the client Service selects the router's pods (once "
                                          "one is ready), so clients need no change."))
    kv_events: KVEvents = Field(default=KVEvents(),
                                description=("KV events on vLLM's kv_events wire (ZMQ PUB, msgpack): each "
                                             "pod publishes every page its tiers gain and lose, with its "
                                             "tokens, for the router (which then follows them instead of "
                                             "polling) and for indexers such as llm-d's. The topic is "
                                             "kv@<pod IP>@<served model>."))
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector of the pods.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list,
                                              description=("Tolerations of the pods (core/v1 Toleration "
                                                           "objects)."),
                                              json_schema_extra={"items": {"description": "A core/v1 Toleration."}})
    affinity: dict[str, Any] = Field(default_factory=dict,
                                     description="Affinity of the pods (a core/v1 Affinity object).")
    # pod settings passed through to the runtime pods (podsettings.py)
    env: list[EnvVar] = Field(default_factory=list, max_length=128,
                              description=("Environment variables of the runtime container (core/v1 "
                                           "EnvVar), after the operator's own; NVIDIA_VISIBLE_DEVICES and "
                                           "KVDRIVE_POD_IP are the operator's."))
    env_from: list[dict[str, Any]] = Field(default_factory=list, max_length=32,
                                           description=("Sources of environment variables of the runtime "
                                                        "container (core/v1 EnvFromSource: a Secret or a "
                                                        "ConfigMap)."),
                                           json_schema_extra={"items": {"description": "A core/v1 EnvFromSource."}})
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16,
                                                           description=("Secrets for pulling the image from "
                                                                        "a private registry."))
    service_account_name: str | None = Field(default=None, pattern=DNS_SUBDOMAIN, max_length=253,
                                             description=("The runtime pods' service account (its token is "
                                                          "then mounted: workload identity, registry "
                                                          "access); none by default, and no token."))
    priority_class_name: str | None = Field(default=None, pattern=DNS_SUBDOMAIN, max_length=253,
                                            description="The runtime pods' PriorityClass.")
    runtime_class_name: str | None = Field(default=None, pattern=DNS_SUBDOMAIN, max_length=253,
                                           description=("The runtime pods' RuntimeClass (for example "
                                                        "nvidia)."))
    pod_labels: dict[str, str] = Field(default_factory=dict,
                                       description=("Extra labels of the runtime pods (a mesh, monitoring); "
                                                    "app.kubernetes.io/* are the operator's."),
                                       json_schema_extra=pod_labels_rules())
    pod_annotations: dict[str, str] = Field(default_factory=dict,
                                            description=("Extra annotations of the runtime pods; "
                                                         "kvdrive.io/* are the operator's."),
                                            json_schema_extra=pod_annotations_rules())
    extra_volumes: list[Volume] = Field(default_factory=list, max_length=32,
                                        description=("Extra volumes of the runtime pods (core/v1 Volume); "
                                                     "the pod's own names (kv-ssd, admin-token, config, "
                                                     "tmp, hugepages, model, shared-tier-auth, shared-tier-ca) "
                                                     "are taken."),
                                        json_schema_extra=extra_volumes_rules())
    extra_volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=32,
                                                   description=("Where the runtime container mounts "
                                                                "extraVolumes."))
    security_context: SecurityContext = Field(default=SecurityContext(),
                                              description=("The runtime container's core/v1 "
                                                           "SecurityContext, merged over the operator's "
                                                           "(non-root, read-only root file system, no "
                                                           "capabilities); never privileged, no privilege "
                                                           "escalation, no capabilities."))
    termination_grace_period_seconds: int = Field(default=120, ge=40, le=3600,
                                                  description=("The runtime (and router) pods' grace "
                                                               "period; the server drains requests for this "
                                                               "less 30 s (5 s preStop, 25 s to flush the "
                                                               "SSD index and exit)."))
    rollout: Rollout = Field(default=Rollout(), description="The StatefulSet's rolling update.")

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
