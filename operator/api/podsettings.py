"""The pod settings a ``KVDriveDeployment`` passes through to its runtime pods (pydantic, the CR's edge):
environment, pull secrets, service account, priority and runtime classes, pod labels and annotations, extra
volumes, the container's security context, the grace period, and the StatefulSet's rollout.

The core/v1 objects whose shape Kubernetes owns (``valueFrom``, ``envFrom`` sources, volume sources, the
security context) are passed as they are; every rendered StatefulSet is validated against the official
schemas in the tests (``kubernetes-validate``). What would break the pods KVDrive manages is refused here and
by the CRD's CEL rules with the same message: a reserved name, a mount of an unknown volume.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from kvdrive.operator.api.specbase import Model, cel, cross, rules

ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
RESERVED_ENV = ("NVIDIA_VISIBLE_DEVICES", "KVDRIVE_POD_IP")  # the operator's: GPU-less pods, the KV-event topic
# the pod's own volumes (manifests.py, sharedtier.py)
RESERVED_VOLUMES = ("kv-ssd", "admin-token", "config", "tmp", "hugepages", "model", "shared-tier-auth", "shared-tier-ca")
RESERVED_LABEL_PREFIX = "app.kubernetes.io/"  # the pods' selector and ownership labels
RESERVED_ANNOTATION_PREFIX = "kvdrive.io/"
HOST_PATH_REFUSED = "hostPath is not allowed: a CR must not give its pods the node's file system"


class EnvVar(Model):
    model_config = ConfigDict(**Model.model_config, json_schema_extra=rules(
        cel("!(has(self.value) && has(self.valueFrom))", "valueFrom must not be set together with value",
            ".valueFrom")))
    name: str = Field(pattern=ENV_NAME, max_length=256, description="The variable's name.")
    value: str | None = Field(default=None, max_length=32768, description="Its value.")
    value_from: dict[str, Any] | None = Field(default=None,
                                              description=("Where its value comes from (a core/v1 "
                                                           "EnvVarSource: secretKeyRef, configMapKeyRef, "
                                                           "fieldRef, resourceFieldRef)."))

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise cross("valueFrom", "must not be set together with value")
        return self


class LocalObjectReference(Model):
    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="The Secret's name.")


class Volume(Model):
    """A core/v1 Volume: its name, and its source as Kubernetes defines it (passed as it is), except a host
    path: a CR must not give its pods the node's file system."""

    model_config = ConfigDict(**{**Model.model_config, "extra": "allow"})
    name: str = Field(pattern=DNS_LABEL, max_length=63, description="The volume's name.")
    host_path: dict[str, Any] | None = Field(default=None,
                                             description=("Not allowed: a CR must not give its pods the "
                                                          "node's file system."),
                                             json_schema_extra=rules(cel("false", HOST_PATH_REFUSED)))

    @model_validator(mode="after")
    def _no_host_path(self) -> Volume:
        if self.host_path is not None:
            raise cross("hostPath", HOST_PATH_REFUSED.removeprefix("hostPath "))
        return self


class SecurityContext(Model):
    """The runtime container's core/v1 SecurityContext, merged over the operator's hardened one. Whoever may
    create a CR must not get privileged pods through it: no privilege, no escalation, no capabilities (the
    operator drops them all)."""

    model_config = ConfigDict(**{**Model.model_config, "extra": "allow"})
    privileged: bool | None = Field(default=None, description="Must not be true.",
                                    json_schema_extra=rules(cel("!self", "privileged must not be true")))
    allow_privilege_escalation: bool | None = Field(
        default=None, description="Must not be true.",
        json_schema_extra=rules(cel("!self", "allowPrivilegeEscalation must not be true")))
    capabilities: dict[str, Any] | None = Field(
        default=None, description="Not allowed: the operator drops every capability.",
        json_schema_extra=rules(cel("false", "capabilities must not be set: the operator drops every capability")))

    @model_validator(mode="after")
    def _unprivileged(self) -> SecurityContext:
        if self.privileged:
            raise cross("privileged", "must not be true")
        if self.allow_privilege_escalation:
            raise cross("allowPrivilegeEscalation", "must not be true")
        if self.capabilities is not None:
            raise cross("capabilities", "must not be set: the operator drops every capability")
        return self


class VolumeMount(Model):
    name: str = Field(pattern=DNS_LABEL, max_length=63, description="A volume of extraVolumes.")
    mount_path: str = Field(pattern=r"^/", max_length=4096, description="An absolute path in the container.")
    read_only: bool | None = Field(default=None, description="Mounted read-only.")
    sub_path: str | None = Field(default=None, max_length=4096,
                                 description="A path inside the volume to mount instead of its root.")


class Rollout(Model):
    """The StatefulSet's rolling update: pods replaced at once, and the ordinal below which pods keep the old
    template (a canary: ``partition: 1`` updates only pods 1 and up)."""

    max_unavailable: int = Field(default=1, ge=1, le=1000,
                                 description=("Pods replaced at once (honoured where the API server's "
                                              "MaxUnavailableStatefulSet feature is on; one at a time "
                                              "otherwise)."))
    partition: int = Field(default=0, ge=0, le=1000,
                           description=("Pods with an ordinal below this keep the old template (a canary: 1 "
                                        "updates pods 1 and up first)."))


def check_pod_settings(env: list[EnvVar], volumes: list[Volume], mounts: list[VolumeMount],
                       labels: dict[str, str], annotations: dict[str, str]) -> None:
    """The cross-field rules (the same as the CRD's CEL rules), raised against the field they name."""
    names = [e.name for e in env]
    if len(set(names)) != len(names):
        raise cross("env", "names must be unique")
    if set(names) & set(RESERVED_ENV):
        raise cross("env", f"must not set {', '.join(RESERVED_ENV)} (the operator sets it)")
    volume_names = [v.name for v in volumes]
    if len(set(volume_names)) != len(volume_names):
        raise cross("extraVolumes", "names must be unique")
    if set(volume_names) & set(RESERVED_VOLUMES):
        raise cross("extraVolumes", f"names must not be the pod's own ({', '.join(RESERVED_VOLUMES)})")
    if any(m.name not in volume_names for m in mounts):
        raise cross("extraVolumeMounts", "must mount volumes of extraVolumes")
    if any(k.startswith(RESERVED_LABEL_PREFIX) for k in labels):
        raise cross("podLabels", f"must not set {RESERVED_LABEL_PREFIX}* labels (the pods' selector)")
    if any(k.startswith(RESERVED_ANNOTATION_PREFIX) for k in annotations):
        raise cross("podAnnotations", f"must not set {RESERVED_ANNOTATION_PREFIX}* annotations")


def spec_rules() -> list[dict[str, str]]:
    """The CRD's CEL rules on the spec object for ``check_pod_settings``' rules across fields."""
    reserved = " && ".join(f"e.name != '{name}'" for name in RESERVED_ENV)
    return [
        cel("!has(self.env) || self.env.all(e, self.env.exists_one(f, f.name == e.name))",
            "spec.env: names must be unique", ".env"),
        cel(f"!has(self.env) || self.env.all(e, {reserved})",
            f"spec.env: must not set {', '.join(RESERVED_ENV)} (the operator sets it)", ".env"),
        cel("!has(self.extraVolumeMounts) || self.extraVolumeMounts.all(m, has(self.extraVolumes) && "
            "self.extraVolumes.exists(v, v.name == m.name))",
            "spec.extraVolumeMounts: must mount volumes of extraVolumes", ".extraVolumeMounts"),
    ]


def extra_volumes_rules() -> dict[str, object]:
    """The CRD's CEL rules on ``spec.extraVolumes``: unique names, none of the pod's own."""
    names = ", ".join(f"'{name}'" for name in RESERVED_VOLUMES)
    return rules(cel("self.all(v, self.exists_one(w, w.name == v.name))", "spec.extraVolumes: names must be unique"),
                 cel(f"self.all(v, !(v.name in [{names}]))",
                     f"spec.extraVolumes: names must not be the pod's own ({', '.join(RESERVED_VOLUMES)})"))


def pod_labels_rules() -> dict[str, object]:
    return rules(cel(f"self.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}'))",
                     f"spec.podLabels: must not set {RESERVED_LABEL_PREFIX}* labels (the pods' selector)"))


def pod_annotations_rules() -> dict[str, object]:
    return rules(cel(f"self.all(k, !k.startsWith('{RESERVED_ANNOTATION_PREFIX}'))",
                     f"spec.podAnnotations: must not set {RESERVED_ANNOTATION_PREFIX}* annotations"))
