"""The spec's settings of how clients reach the replicas (pydantic, the CR's edge): the client Service, the
prefix-aware router in front of the replicas and, in routing mode inferencepool, the ``InferencePool``.

Owns those fields, their defaults and constraints; ``render.router_manifests`` and ``render.inferencepool``
own what is rendered from them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvdrive.operator.api.specbase import Model


class Service(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP",
                                                                   description="Service type.")
    port: int = Field(default=8000, ge=1, le=65535, description="Service port.")


class InferencePoolSettings(Model):
    """The ``InferencePool`` of routing mode inferencepool (Gateway API Inference Extension)."""

    # the gateway when the router's ext_proc fails
    failure_mode: Literal["FailOpen", "FailClose"] = Field(default="FailClose",
                                                           description=("endpointPickerRef.failureMode of "
                                                                        "the InferencePool: what the "
                                                                        "gateway does when the router's "
                                                                        "ext_proc does not answer. "
                                                                        "FailClose: the request fails; "
                                                                        "FailOpen: the gateway picks a "
                                                                        "replica itself."))


class Routing(Model):
    """The prefix-aware router (``kvdrive route``) in front of the replicas; in mode inferencepool also the
    endpoint picker (Envoy ext_proc) of an ``InferencePool`` of the replicas."""

    mode: Literal["none", "prefix", "inferencepool"] = Field(default="none",
                                                             description=("none: clients reach the replicas "
                                                                          "through the client Service "
                                                                          "directly; prefix: through the "
                                                                          "router, which sends requests "
                                                                          "that share a prompt prefix to "
                                                                          "the replica that already holds "
                                                                          "its KV pages; inferencepool: as "
                                                                          "prefix, and an InferencePool "
                                                                          "(inference.networking.k8s.io/v1, "
                                                                          "named like the CR) selects the "
                                                                          "replicas for a Gateway API "
                                                                          "inference gateway, with the "
                                                                          "router's Service as its endpoint "
                                                                          "picker (Envoy ext_proc over "
                                                                          "gRPC, port 9002). Needs the "
                                                                          "Gateway API Inference Extension "
                                                                          "CRDs (else the CR is Degraded, "
                                                                          "reason "
                                                                          "InferencePoolCRDNotInstalled)."))
    replicas: int = Field(default=2, ge=1, le=16,
                          description=("Router pods (a Deployment; one PodDisruptionBudget lets at most one "
                                       "be evicted at a time)."))
    inference_pool: InferencePoolSettings = Field(default=InferencePoolSettings(),
                                                  description=("The InferencePool of mode inferencepool "
                                                               "(ignored in the other modes)."))
