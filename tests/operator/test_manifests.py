"""Rendered children: valid for Kubernetes 1.30 and 1.33 (strict), the InferencePool for the Gateway API
Inference Extension's CRD schema and CEL rules, and shaped as the issue asks."""

from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crdcheck import EXAMPLES, crd_violations, load_example
from giecrd import load_gie_crd

from kvdrive.operator.act.objects import CHILDREN
from kvdrive.operator.api.cr import KVDriveDeployment, parse_cr
from kvdrive.operator.render.childmeta import selector_string
from kvdrive.operator.render.manifests import render

EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def _cr(doc: dict[str, Any], **spec: Any) -> KVDriveDeployment:
    doc = {**doc, "spec": {**doc["spec"], **spec}}
    doc["metadata"] = {**doc["metadata"], "uid": "0b0c8e2e-1111-2222-3333-444455556666"}
    return parse_cr(doc)


def _by_kind(children: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for child in children:
        out.setdefault(child["kind"], []).append(child)
    return out


def _sts(cr: KVDriveDeployment) -> dict[str, Any]:
    return _by_kind(render(cr, "t0ken"))["StatefulSet"][0]


def validate(child: dict[str, Any], version: str) -> None:
    """Strictly, against the official schemas; the InferencePool (a CRD) against the GIE CRD's schema and rules."""
    if child["kind"] == "InferencePool":
        assert crd_violations(load_gie_crd(), child) == []
    else:
        kubernetes_validate.validate(child, version, strict=True)


@pytest.mark.parametrize("version", ["1.30", "1.33"])
@pytest.mark.parametrize("example", EXAMPLE_FILES)
def test_children_validate_strictly(example: str, version: str) -> None:
    cr = _cr(load_example(example))
    children = render(cr, "t0ken")
    router = ["ServiceAccount", "Role", "RoleBinding", "Service", "PodDisruptionBudget", "Deployment"]
    mode = cr.spec.routing.mode
    assert [c["kind"] for c in children] == [
        "ConfigMap", "Secret", "Service", "Service", "StatefulSet", "PodDisruptionBudget",
        *(router if mode in ("prefix", "inferencepool") else []), *(["InferencePool"] if mode == "inferencepool" else [])]
    for child in children:
        validate(child, version)
    assert "inferencepool" in {_cr(load_example(name)).spec.routing.mode for name in EXAMPLE_FILES}


def test_strict_validation_catches_a_broken_child() -> None:
    sts = _sts(_cr(load_example("minimal.yaml")))
    sts["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, "1.33", strict=True)


def test_statefulset_runs_kvdrive_serve_with_the_tiers_of_the_spec() -> None:
    cr = _cr(load_example("full.yaml"))
    sts = _sts(cr)
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert container["command"] == ["kvdrive"] and args[0] == "serve"
    assert flags["--model"] == "/models/llama-3.1-8b-instruct"
    assert flags["--gpu-budget"] == str(40 << 30)
    assert flags["--dram-budget"] == str(64 << 30)
    assert int(flags["--ssd-budget"]) <= (1 << 40) * 9 // 10
    assert flags["--token-budget"] == "2048" and flags["--page-size"] == "16"
    # the split of the envelope starts at concurrency.maxRunning; rows are reserved for the tuner's ceiling
    assert flags["--max-running"] == "16" and flags["--max-sequences"] == "64"
    assert flags["--placement"] == "kvdrive"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["--ssd-dir"] == mounts["kv-ssd"]
    assert flags["--dram-hugepage-dir"] == mounts["hugepages"]
    assert flags["--admin-token-file"].startswith(mounts["admin-token"] + "/")
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert resources["requests"]["hugepages-2Mi"] == resources["limits"]["hugepages-2Mi"] == "64Gi"
    assert resources["requests"]["cpu"] == "8" and resources["requests"]["memory"] == "64Gi"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hugepages"]["emptyDir"] == {"medium": "HugePages-2Mi", "sizeLimit": "64Gi"}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["admin-token"]["secret"]["secretName"] == "chat-admin"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "kv-ssd"
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "podAntiAffinity" in pod["affinity"]


def test_one_gig_pages_and_file_models() -> None:
    sts = _sts(_cr(load_example("fixed-replicas.yaml")))
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["hugepages-1Gi"] == "16Gi"
    assert "hugepages-2Mi" not in container["resources"]["limits"]
    assert {v["name"]: v for v in pod["volumes"]}["hugepages"]["emptyDir"]["medium"] == "HugePages-1Gi"
    assert container["args"][container["args"].index("--model") + 1] == "/opt/models/smollm2-135m-instruct.gguf"
    assert "model" not in {v["name"] for v in pod["volumes"]}
    assert sts["spec"]["replicas"] == 2


def test_no_dram_tier_and_no_gpu() -> None:
    cr = _cr(load_example("minimal.yaml"), tiers={"dram": {"size": 0}}, resources={"gpus": 0})
    container = _sts(cr)["spec"]["template"]["spec"]["containers"][0]
    assert not any(k.startswith("hugepages-") for k in container["resources"]["requests"])
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "--dram-hugepage-dir" not in container["args"]
    assert container["args"][container["args"].index("--model") + 1] == "demo"


def test_concurrency_flags_follow_tuning_and_agree_with_the_configmap() -> None:
    minimal = load_example("minimal.yaml")
    cases = [
        ({}, ("16", "32")),  # defaults: start at 16, the tuner may go up to 32
        ({"concurrency": {"maxRunning": 4}, "tuning": {"concurrency": {"min": 2, "max": 12}}}, ("4", "12")),
        # no tuning: nothing moves the limit, so no rows beyond it are reserved
        ({"concurrency": {"maxRunning": 48}, "tuning": {"enabled": False}}, ("48", "48")),
    ]
    for spec, (running, sequences) in cases:
        kinds = _by_kind(render(_cr(minimal, **spec), "t"))
        args = kinds["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
        flags = dict(zip(args[1::2], args[2::2], strict=False))
        assert (flags["--max-running"], flags["--max-sequences"]) == (running, sequences), spec
        config = yaml.safe_load(kinds["ConfigMap"][0]["data"]["config.yaml"])
        assert (config["max_running"], config["max_sequences"]) == (int(running), int(sequences)), spec


def test_a_concurrency_change_rolls_the_pods() -> None:
    base = load_example("minimal.yaml")
    before = _sts(_cr(base))["spec"]["template"]
    after = _sts(_cr(base, concurrency={"maxRunning": 8}))["spec"]["template"]
    assert before["metadata"]["annotations"] != after["metadata"]["annotations"]


def test_replicas_follow_the_autoscaling_mode() -> None:
    minimal = load_example("minimal.yaml")
    assert _sts(_cr(minimal))["spec"]["replicas"] == 1
    assert _sts(_cr(minimal, replicas=3))["spec"]["replicas"] == 3
    assert _sts(_cr(minimal, replicas=3, autoscaling={"mode": "external"}))["spec"]["replicas"] == 3
    operator = _cr(minimal, autoscaling={"mode": "operator", "minReplicas": 2, "maxReplicas": 5})
    assert _sts(operator)["spec"]["replicas"] == 2  # a new StatefulSet starts at minReplicas
    assert "replicas" not in _by_kind(render(operator, "t", None))["StatefulSet"][0]["spec"]


def test_children_are_owned_and_labelled() -> None:
    cr = _cr(load_example("full.yaml"))
    children = render(cr, "t0ken")
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == "inference"
        (owner,) = meta["ownerReferences"]
        assert owner["kind"] == "KVDriveDeployment" and owner["uid"] == cr.metadata.uid and owner["controller"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "chat"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvdrive-operator"
    kinds = _by_kind(children)
    selector = kinds["StatefulSet"][0]["spec"]["selector"]["matchLabels"]
    assert selector_string("chat") == ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    assert kinds["PodDisruptionBudget"][0]["spec"]["selector"]["matchLabels"] == selector
    # an inference gateway's endpoint picker reads the engine type to map metric names (GIE model-server protocol)
    pod_labels = kinds["StatefulSet"][0]["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["inference.networking.k8s.io/engine-type"] == "kvdrive"
    for service in kinds["Service"]:
        assert service["spec"]["selector"] == selector
    headless = [s for s in kinds["Service"] if s["spec"].get("clusterIP") == "None"]
    assert [s["metadata"]["name"] for s in headless] == [kinds["StatefulSet"][0]["spec"]["serviceName"]]
    assert base64.b64decode(kinds["Secret"][0]["data"]["token"]) == b"t0ken"
    config = yaml.safe_load(kinds["ConfigMap"][0]["data"]["config.yaml"])
    assert config["served_model_name"] == "llama-3.1-8b-instruct" and config["dram_budget"] == 64 << 30


def test_a_changed_spec_changes_the_pod_template() -> None:
    base = load_example("minimal.yaml")
    before = _sts(_cr(base))["spec"]["template"]
    after = _sts(_cr(base, tiers={"gpu": {"budget": "6Gi"}}))["spec"]["template"]
    assert before != after
    assert before["metadata"]["annotations"] != after["metadata"]["annotations"]
    assert _sts(_cr(base))["spec"]["template"] == before  # deterministic


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_operator_install_manifests_validate(version: str) -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "operator" / "operator.yaml").read_text()))
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_operator_rbac_covers_every_child_kind() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "operator" / "operator.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    allowed = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    children = render(_cr(load_example("full.yaml"), routing={"mode": "inferencepool"}), "t")
    assert {"Deployment", "InferencePool"} <= {c["kind"] for c in children}
    for child in children:
        ref = CHILDREN[child["kind"]]
        assert (ref.api_version, ref.kind) == (child["apiVersion"], child["kind"])
        verbs = {"get", "list", "watch", "create", "patch"}
        if child["metadata"]["name"].endswith("-router") or child["kind"] == "InferencePool":
            verbs.add("delete")  # deleted when routing is turned off, or the mode leaves inferencepool
        assert verbs <= allowed[ref.group, ref.plural], child["kind"]
    # the router's Role grants endpointslices: the operator must hold them to grant them
    assert {"get", "list", "watch"} <= allowed["discovery.k8s.io", "endpointslices"]
    assert {"get", "patch"} <= allowed["kvdrive.io", "kvdrivedeployments/status"]
    assert "delete" not in allowed["", "secrets"]


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_a_pod_computes_on_the_gpus_it_reserves(gpus: int) -> None:
    """A pod that reserves GPUs runs `kvdrive serve --device cuda`; one that reserves none runs on
    its CPU and is not handed the node's GPUs by an image-wide NVIDIA_VISIBLE_DEVICES=all."""
    cr = _cr(load_example("minimal.yaml"), resources={"gpus": gpus})
    kinds = _by_kind(render(cr, "t"))
    container = kinds["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    expected = "cuda" if gpus else "cpu"
    assert args[args.index("--device") + 1] == expected
    assert yaml.safe_load(kinds["ConfigMap"][0]["data"]["config.yaml"])["device"] == expected
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if gpus:
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert "NVIDIA_VISIBLE_DEVICES" not in env  # the device plugin says which GPUs
    else:
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_pod_settings_reach_the_runtime_pods_and_validate_strictly() -> None:
    """Every pod setting of the CR lands in the StatefulSet as Kubernetes spells it (valid for 1.30 and 1.33,
    strict), after the operator's own: its env first, its labels, annotations, volumes and security settings
    kept; the server drains within the grace period given; the router pods get the same grace period."""
    from test_crd import POD_SETTINGS

    cr = _cr(load_example("minimal.yaml"), **{k: v for k, v in POD_SETTINGS.items() if k != "model"},
             resources={"gpus": 0}, routing={"mode": "prefix"})
    children = render(cr, "t0ken")
    for child in children:
        for version in ("1.30", "1.33"):
            kubernetes_validate.validate(child, version, strict=True)
    sts = _by_kind(children)["StatefulSet"][0]
    template = sts["spec"]["template"]
    pod, (container,) = template["spec"], template["spec"]["containers"]
    assert [e["name"] for e in container["env"]] == ["NVIDIA_VISIBLE_DEVICES", "HF_TOKEN", "LOG_LEVEL"]
    assert container["env"][1]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert container["envFrom"] == [{"configMapRef": {"name": "extra-env"}}]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["serviceAccountName"] == "inference" and pod["automountServiceAccountToken"] is True
    assert pod["priorityClassName"] == "high-priority" and pod["runtimeClassName"] == "nvidia"
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    assert set(template["metadata"]["annotations"]) == {"prometheus.io/scrape", "kvdrive.io/config-hash"}
    assert {"name": "certs", "secret": {"secretName": "ca-bundle"}} in pod["volumes"]
    assert {"name": "certs", "mountPath": "/etc/certs", "readOnly": True} in container["volumeMounts"]
    security = container["securityContext"]
    assert security["runAsUser"] == 1234 and security["readOnlyRootFilesystem"] is True  # merged over ours
    assert pod["terminationGracePeriodSeconds"] == 300
    args = container["args"]
    assert int(args[args.index("--drain-seconds") + 1]) == 300 - 30
    assert sts["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 2, "partition": 1}
    router = _by_kind(children)["Deployment"][0]["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] == 300 and "imagePullSecrets" not in router


def test_kv_events_reach_the_runtime_pods_as_kvdrive_serve_reads_them() -> None:
    """spec.kvEvents: the pods publish on their ports (named container ports), with llm-d's topic kv@<pod IP>@<model>
    (the IP from the downward API, the model as the server names it), and kvdrive serve accepts the flags."""
    from kvdrive.runtime.cli import build_parser

    cr = _cr(load_example("minimal.yaml"), kvEvents={"enabled": True, "port": 6000, "replayPort": 6001,
                                                     "hashes": "bytes"})
    sts = _sts(cr)
    for version in ("1.30", "1.33"):
        kubernetes_validate.validate(sts, version, strict=True)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["env"][0] == {"name": "KVDRIVE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert {"name": "kv-events", "containerPort": 6000, "protocol": "TCP"} in container["ports"]
    assert {"name": "kv-replay", "containerPort": 6001, "protocol": "TCP"} in container["ports"]
    args = build_parser().parse_args(container["args"])
    assert (args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_hashes) == (
        "tcp://*:6000", "tcp://*:6001", "bytes")
    assert args.kv_events_topic == "kv@$(KVDRIVE_POD_IP)@{model}"  # the kubelet expands $(...) from env
    off = _sts(_cr(load_example("minimal.yaml")))["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--kv-events") for a in off["args"]) and len(off["ports"]) == 1


def test_without_pod_settings_the_pods_are_as_before() -> None:
    pod = _sts(_cr(load_example("minimal.yaml")))["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["terminationGracePeriodSeconds"] == 120
    assert not {"serviceAccountName", "imagePullSecrets", "priorityClassName", "runtimeClassName"} & set(pod)
