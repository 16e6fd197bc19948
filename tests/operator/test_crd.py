"""The CRD: a valid apiextensions object whose schema and CEL rules accept good CRs and reject bad ones."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from crdcheck import apply_defaults, crd_violations, load_crd, load_example, version_schema

from kvdrive.operator.api.cr import SpecError, parse_cr

# Spec fields that deliberately have no default (absence means something).
NO_DEFAULT = {"model.source", "model.name", "replicas", "autoscaling.targets.tokensPerSecond",
              "serviceAccountName", "priorityClassName", "runtimeClassName", "securityContext.privileged",
              "securityContext.allowPrivilegeEscalation", "securityContext.capabilities",  # absent: not set on the pods
              # no shared tier unless asked for; where it is, one of endpoints and service, each Secret only if named
              "tiers.shared", "tiers.shared.endpoints", "tiers.shared.service", "tiers.shared.service.name",
              "tiers.shared.service.namespace", "tiers.shared.user", "tiers.shared.authSecretRef",
              "tiers.shared.authSecretRef.name", "tiers.shared.tls.caSecretRef", "tiers.shared.tls.caSecretRef.name"}
NO_DEFAULT_PARENTS = {"model"}  # required objects


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key, sub in schema.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        out.append((here, sub))
        out += _walk(sub, here)
    if isinstance(schema.get("items"), dict):
        out += _walk(schema["items"], path + "[]")
    return out


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_crd_is_a_valid_apiextensions_object(version: str) -> None:
    kubernetes_validate.validate(load_crd(), version, strict=True)


def test_crd_names_subresources_and_columns() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "kvdrivedeployments.kvdrive.io"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("KVDriveDeployment", "kvdrivedeployments", ["kvd"])
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Replicas"] == ".status.replicas"
    # budgets as the pods report them (the live tuner moves them away from the spec's sizes)
    assert (columns["GPU"], columns["DRAM"], columns["SSD"]) == (
        ".status.budgets.gpu", ".status.budgets.dram", ".status.budgets.ssd")
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_every_field_has_a_description_and_spec_fields_have_defaults() -> None:
    schema = version_schema(load_crd())
    assert schema.get("description")
    for path, sub in _walk(schema):
        # the API server refuses a CRD that says anything but its type about metadata
        assert sub.get("description") or path == "metadata", f"{path} has no description"
        assert "type" in sub or sub.get("x-kubernetes-int-or-string"), f"{path} is not structural"
    for path, sub in _walk(schema["properties"]["spec"]):
        if path in NO_DEFAULT or path in NO_DEFAULT_PARENTS or "[]" in path:
            assert "default" not in sub, path
        else:
            assert "default" in sub, f"spec.{path} has no default"


def test_every_cel_rule_has_a_message() -> None:
    rules = [r for _, sub in _walk(version_schema(load_crd())) for r in sub.get("x-kubernetes-validations", [])]
    rules += version_schema(load_crd())["x-kubernetes-validations"]
    assert len(rules) >= 7
    assert all(r.get("message") for r in rules)


GOOD = ["minimal.yaml", "full.yaml", "fixed-replicas.yaml", "routing.yaml", "inferencepool.yaml"]


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return doc


DELETE = object()

# (base example, field, value): accepted by the CRD and by the pydantic model.
POD_SETTINGS = {
    "model": {"source": "demo"},
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "LOG_LEVEL", "value": "debug"}],
    "envFrom": [{"configMapRef": {"name": "extra-env"}}],
    "imagePullSecrets": [{"name": "registry-creds"}],
    "serviceAccountName": "inference",
    "priorityClassName": "high-priority",
    "runtimeClassName": "nvidia",
    "podLabels": {"sidecar.istio.io/inject": "false", "team": "ml"},
    "podAnnotations": {"prometheus.io/scrape": "true"},
    "extraVolumes": [{"name": "certs", "secret": {"secretName": "ca-bundle"}}],
    "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/certs", "readOnly": True}],
    "securityContext": {"runAsUser": 1234},
    "terminationGracePeriodSeconds": 300,
    "rollout": {"maxUnavailable": 2, "partition": 1},
}
GOOD_VARIANTS = [
    ("minimal.yaml", "spec", POD_SETTINGS),
    ("minimal.yaml", "spec.tiers.dram.size", 0),
    ("minimal.yaml", "spec.tuning", {"intervalSeconds": 1, "stabilizationIntervals": 1,
                                     "concurrency": {"min": 16, "max": 16, "minStep": 4}}),
    ("minimal.yaml", "spec", {"model": {"source": "demo"}, "concurrency": {"maxRunning": 1024},
                              "tuning": {"enabled": False}}),  # with tuning off no tuner bound applies
    ("full.yaml", "spec.concurrency.maxRunning", 64),  # at the tuner's ceiling
    ("full.yaml", "spec.concurrency.maxRunning", 4),  # at its floor
    ("full.yaml", "spec.autoscaling.targets.tokensPerSecond", 250.5),
    ("minimal.yaml", "spec.tiers.dram.size", "0"),
    ("minimal.yaml", "spec.resources.cpu", "500m"),
    ("minimal.yaml", "spec.resources.memory", 17179869184),
    ("minimal.yaml", "spec.resources.gpus", 0),
    ("minimal.yaml", "spec.replicas", 0),
    ("full.yaml", "spec.tiers.dram", {"size": "3Gi", "hugePageSize": "1Gi"}),
    ("full.yaml", "spec.autoscaling", {"mode": "external"}),
    ("fixed-replicas.yaml", "spec.autoscaling", {"mode": "external", "minReplicas": 2, "maxReplicas": 2}),
    ("minimal.yaml", "metadata.name", "a" * 52),
    ("minimal.yaml", "spec.routing", {"mode": "prefix"}),
    ("minimal.yaml", "spec.routing", {"mode": "prefix", "replicas": 16}),
    ("minimal.yaml", "spec.routing", {"mode": "none", "replicas": 1}),
    ("minimal.yaml", "spec.routing", {"mode": "inferencepool"}),
    ("minimal.yaml", "spec.routing", {"mode": "inferencepool", "inferencePool": {"failureMode": "FailOpen"}}),
    ("minimal.yaml", "spec.routing", {"mode": "prefix", "inferencePool": {}}),  # ignored outside inferencepool
    # a shared tier: some nodes of a cluster (or one node), or a Service; a key namespace; auth; TLS
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey-0.valkey-headless:6379"]}),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["10.0.0.5:7000", "10.0.0.6:7000", "Redis.example.com:65535"],
                                           "namespace": "fleet_1.a-B", "timeoutMs": 10}),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey", "namespace": "valkey", "port": 7000},
                                           "user": "kvdrive", "authSecretRef": {"name": "valkey-auth",
                                                                                "key": "valkey-password"},
                                           "tls": {"enabled": True, "caSecretRef": {"name": "valkey-ca"}},
                                           "timeoutMs": 10000}),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "tls": {"enabled": True}}),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "namespace": "a" * 63}),
]

# (base example, field, value, field the rejection must name, "schema" or "cel")
BAD_VARIANTS = [
    ("minimal.yaml", "spec.model.source", "s3://bucket/model", "spec.model.source", "schema"),
    ("minimal.yaml", "spec.model.source", "pvc://models", "spec.model.source", "schema"),
    ("minimal.yaml", "spec.model", DELETE, "spec.model", "schema"),
    ("minimal.yaml", "spec.replicas", -1, "spec.replicas", "schema"),
    ("minimal.yaml", "spec.resources.cpu", "lots", "spec.resources.cpu", "schema"),
    ("minimal.yaml", "spec.resources.gpus", 17, "spec.resources.gpus", "schema"),
    ("minimal.yaml", "spec.tiers.dram.hugePageSize", "4Mi", "spec.tiers.dram.hugePageSize", "schema"),
    ("minimal.yaml", "spec.tiers.ssd.storageClassName", "", "spec.tiers.ssd.storageClassName", "schema"),
    ("minimal.yaml", "spec.service.type", "ExternalName", "spec.service.type", "schema"),
    ("minimal.yaml", "spec.tuning.intervalSeconds", 0, "spec.tuning.intervalSeconds", "schema"),
    ("minimal.yaml", "spec.tuning.scrapeTimeoutSeconds", 0, "spec.tuning.scrapeTimeoutSeconds", "schema"),
    ("minimal.yaml", "spec.tuning.stabilizationIntervals", 0, "spec.tuning.stabilizationIntervals", "schema"),
    ("minimal.yaml", "spec.tuning.minStep", "64Mi", "spec.tuning", "schema"),  # removed fields are unknown
    ("minimal.yaml", "spec.tuning.bounds", {"gpu": {"max": "16Gi"}}, "spec.tuning", "schema"),
    ("minimal.yaml", "spec.concurrency.maxRunning", 0, "spec.concurrency.maxRunning", "schema"),
    ("minimal.yaml", "spec.tuning.concurrency.max", 1025, "spec.tuning.concurrency.max", "schema"),
    ("minimal.yaml", "spec.tuning.concurrency.minStep", 0, "spec.tuning.concurrency.minStep", "schema"),
    ("minimal.yaml", "spec.autoscaling.maxStep", 0, "spec.autoscaling.maxStep", "schema"),
    ("minimal.yaml", "spec.autoscaling.targets.tokensPerSecond", 0, "spec.autoscaling.targets.tokensPerSecond",
     "schema"),
    ("minimal.yaml", "spec.autoscaling.targets.kvUtilization", 0, "spec.autoscaling.targets.kvUtilization", "schema"),
    ("minimal.yaml", "spec.autoscaling.targets.kvUtilization", 1.5, "spec.autoscaling.targets.kvUtilization", "schema"),
    ("minimal.yaml", "spec.nodeSelector", {"zone": 3}, "spec.nodeSelector", "schema"),
    ("minimal.yaml", "spec.bogus", 1, "spec", "schema"),
    ("minimal.yaml", "spec.tiers.gpu.extra", "1Gi", "spec.tiers.gpu", "schema"),
    ("minimal.yaml", "spec.routing.mode", "bogus", "spec.routing.mode", "schema"),
    ("minimal.yaml", "spec.routing.replicas", 0, "spec.routing.replicas", "schema"),
    ("minimal.yaml", "spec.routing.replicas", 17, "spec.routing.replicas", "schema"),
    ("minimal.yaml", "spec.routing.weights", {}, "spec.routing", "schema"),
    ("minimal.yaml", "spec.routing.mode", "InferencePool", "spec.routing.mode", "schema"),
    ("minimal.yaml", "spec.routing.inferencePool", {"failureMode": "FailSometimes"},
     "spec.routing.inferencePool.failureMode", "schema"),
    ("minimal.yaml", "spec.routing.inferencePool", {"name": "other"}, "spec.routing.inferencePool", "schema"),
    ("full.yaml", "spec.replicas", 2, "spec.replicas", "cel"),
    ("minimal.yaml", "spec.tiers.dram.size", "3Mi", "spec.tiers.dram.size", "cel"),
    ("full.yaml", "spec.tiers.dram", {"size": "1536Mi", "hugePageSize": "1Gi"}, "spec.tiers.dram.size", "cel"),
    ("minimal.yaml", "spec.tiers.ssd.size", 0, "spec.tiers.ssd.size", "cel"),
    ("minimal.yaml", "spec.attention", {"tokenBudget": 100, "pageSize": 16}, "spec.attention.tokenBudget", "cel"),
    ("full.yaml", "spec.autoscaling.minReplicas", 9, "spec.autoscaling.minReplicas", "cel"),
    # tuning off: only the bounds' own order is checked
    ("minimal.yaml", "spec.tuning", {"enabled": False, "concurrency": {"min": 9, "max": 8}},
     "spec.tuning.concurrency.min", "cel"),
    ("full.yaml", "spec.concurrency.maxRunning", 65, "spec.concurrency.maxRunning", "cel"),
    ("full.yaml", "spec.concurrency.maxRunning", 3, "spec.concurrency.maxRunning", "cel"),
    ("minimal.yaml", "spec.tuning.concurrency", {"max": 8}, "spec.concurrency.maxRunning", "cel"),  # default 16
    ("minimal.yaml", "metadata.name", "a" * 53, "metadata.name", "cel"),
    # pod settings passed through to the runtime pods
    ("minimal.yaml", "spec.env", [{"name": "A"}, {"name": "A", "value": "2"}], "spec.env", "cel"),
    ("minimal.yaml", "spec.env", [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}], "spec.env", "cel"),
    ("minimal.yaml", "spec.env", [{"name": "KVDRIVE_POD_IP", "value": "1.2.3.4"}], "spec.env", "cel"),
    ("minimal.yaml", "spec.kvEvents", {"enabled": True, "port": 5557, "replayPort": 5557}, "spec.kvEvents.port", "cel"),
    ("minimal.yaml", "spec.kvEvents", {"port": 8000}, "spec.kvEvents.port", "cel"),
    ("minimal.yaml", "spec.kvEvents", {"port": 80}, "spec.kvEvents.port", "schema"),
    ("minimal.yaml", "spec.kvEvents", {"hashes": "sha256"}, "spec.kvEvents.hashes", "schema"),
    ("minimal.yaml", "spec.env", [{"name": "1 bad"}], "spec.env", "schema"),
    ("minimal.yaml", "spec.podLabels", {"app.kubernetes.io/name": "x"}, "spec.podLabels", "cel"),
    ("minimal.yaml", "spec.podAnnotations", {"kvdrive.io/config-hash": "x"}, "spec.podAnnotations", "cel"),
    ("minimal.yaml", "spec.extraVolumes", [{"name": "config", "emptyDir": {}}], "spec.extraVolumes", "cel"),
    ("minimal.yaml", "spec.extraVolumes", [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}],
     "spec.extraVolumes", "cel"),
    ("minimal.yaml", "spec.extraVolumes", [{"emptyDir": {}}], "spec.extraVolumes", "schema"),
    ("minimal.yaml", "spec.extraVolumeMounts", [{"name": "nope", "mountPath": "/x"}], "spec.extraVolumeMounts", "cel"),
    ("minimal.yaml", "spec.extraVolumeMounts", [{"name": "a", "mountPath": "relative"}], "spec.extraVolumeMounts",
     "schema"),
    ("minimal.yaml", "spec.terminationGracePeriodSeconds", 10, "spec.terminationGracePeriodSeconds", "schema"),
    ("minimal.yaml", "spec.rollout.partition", -1, "spec.rollout.partition", "schema"),
    ("minimal.yaml", "spec.rollout.surge", 1, "spec.rollout", "schema"),
    ("minimal.yaml", "spec.serviceAccountName", "Bad_Name", "spec.serviceAccountName", "schema"),
    ("minimal.yaml", "spec.imagePullSecrets", [{}], "spec.imagePullSecrets", "schema"),
    ("minimal.yaml", "spec.securityContext", {"privileged": True}, "spec.securityContext.privileged", "cel"),
    ("minimal.yaml", "spec.securityContext", {"allowPrivilegeEscalation": True},
     "spec.securityContext.allowPrivilegeEscalation", "cel"),
    ("minimal.yaml", "spec.securityContext", {"capabilities": {"add": ["NET_ADMIN"]}},
     "spec.securityContext.capabilities", "cel"),
    ("minimal.yaml", "spec.extraVolumes", [{"name": "root", "hostPath": {"path": "/"}}], "spec.extraVolumes[0].hostPath",
     "cel"),
    ("minimal.yaml", "spec.extraVolumes", [{"name": "shared-tier-auth", "emptyDir": {}}], "spec.extraVolumes", "cel"),
    # the shared tier: where the servers are (exactly one way), each as HOST:PORT, a key namespace without ':'
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey:6379"], "service": {"name": "valkey"}},
     "spec.tiers.shared.service", "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"namespace": "fleet"}, "spec.tiers.shared", "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey-0.valkey"]}, "spec.tiers.shared.endpoints", "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey:6379", "valkey:65536"]}, "spec.tiers.shared.endpoints",
     "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey://valkey:6379"]}, "spec.tiers.shared.endpoints", "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey:06379"]}, "spec.tiers.shared.endpoints", "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": []}, "spec.tiers.shared.endpoints", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"endpoints": ["valkey:6379", "valkey:6379"]}, "spec.tiers.shared.endpoints",
     "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "namespace": "fleet:a"},
     "spec.tiers.shared.namespace", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "namespace": "a" * 64},
     "spec.tiers.shared.namespace", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "namespace": "-fleet"},
     "spec.tiers.shared.namespace", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey.valkey.svc"}}, "spec.tiers.shared.service.name",
     "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey", "port": 0}}, "spec.tiers.shared.service.port",
     "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "tls": {"caSecretRef": {"name": "valkey-ca"}}},
     "spec.tiers.shared.tls.caSecretRef", "cel"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "authSecretRef": {"key": "password"}},
     "spec.tiers.shared.authSecretRef", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "timeoutMs": 9},
     "spec.tiers.shared.timeoutMs", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "timeoutMs": 10001},
     "spec.tiers.shared.timeoutMs", "schema"),
    ("minimal.yaml", "spec.tiers.shared", {"service": {"name": "valkey"}, "password": "hunter2"}, "spec.tiers.shared",
     "schema"),  # a password only from a Secret
]


@pytest.mark.parametrize("name", GOOD)
def test_good_examples_are_accepted(name: str) -> None:
    doc = load_example(name)
    assert crd_violations(load_crd(), doc) == []
    parse_cr(doc)


@pytest.mark.parametrize(("base", "field", "value"), GOOD_VARIANTS)
def test_good_variants_are_accepted(base: str, field: str, value: Any) -> None:
    doc = _set(load_example(base), field, value)
    assert crd_violations(load_crd(), doc) == []
    parse_cr(doc)


@pytest.mark.parametrize(("base", "field", "value", "named", "kind"), BAD_VARIANTS)
def test_bad_variants_are_rejected_by_crd_and_model(base: str, field: str, value: Any, named: str, kind: str) -> None:
    doc = _set(load_example(base), field, value)
    crd = load_crd()
    violations = crd_violations(crd, doc)
    assert violations, f"the CRD accepted {field}={value!r}"
    if kind == "cel":
        # exactly one rule fires; it points at the field (fieldPath) or, at the root, names it
        assert len(violations) == 1, violations
        assert violations[0].path == named or (violations[0].path == "" and named in violations[0].message)
        assert named.split(".")[-1] in violations[0].message
    else:
        # jsonschema reports a missing or unknown field at its parent object
        assert any(v.path and (named.startswith(v.path) or v.path.startswith(named)) for v in violations), violations
    # The model is what `render` uses: it must reject too, naming the field.
    with pytest.raises(SpecError) as info:
        parse_cr(doc)
    assert any(p.startswith(named) for p in info.value.problems), info.value.problems


def test_defaults_fill_a_minimal_cr() -> None:
    defaulted = apply_defaults(version_schema(load_crd()), load_example("minimal.yaml"))
    spec = defaulted["spec"]
    assert spec["tiers"]["dram"] == {"size": "8Gi", "hugePageSize": "2Mi"}
    assert spec["autoscaling"]["mode"] == "none" and "replicas" not in spec
    assert spec["concurrency"] == {"maxRunning": 16}
    assert spec["tuning"]["concurrency"] == {"min": 1, "max": 32, "minStep": 1}
