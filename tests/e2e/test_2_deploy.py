"""Scene 2: the user applies a KVDriveDeployment: the demo model on the CPU, a 2Mi-hugepage DRAM
tier, the SSD tier on a local NVMe volume, two replicas behind the prefix router, which is also the
endpoint picker of their InferencePool and follows their KV events.

The scheduler places the pods, the kubelet runs them, their claims bind to local volumes, they
become Ready and the CR says so. A pod's own /admin/tiers shows its DRAM tier on the hugetlbfs
volume the kubelet mounted and its SSD tier on its PersistentVolume; the node's hugetlb cgroup
shows the pages really held.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from clusterkit import NAMESPACE, Cluster, eventually


def admin_token(c: Cluster) -> str:
    secret = c.get("secret", "demo-admin", "-n", NAMESPACE)
    return base64.b64decode(secret["data"]["token"]).decode()


def pod_get(c: Cluster, pod: str, path: str, token: str | None = None) -> dict:
    ip = c.get("pod", pod, "-n", NAMESPACE)["status"]["podIP"]
    request = urllib.request.Request(f"http://{ip}:8000{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def test_the_cr_becomes_ready_with_its_pods_scheduled_and_claims_bound(deployed: Cluster) -> None:
    c = deployed
    cr = c.get("kvd", "demo", "-n", NAMESPACE)
    assert cr["status"]["readyReplicas"] == 2 and cr["status"]["replicas"] == 2
    pods = c.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kvdrive")["items"]
    assert len(pods) == 2 and all(p["spec"]["nodeName"] == "kvdrive-node" for p in pods)
    container = pods[0]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--device") + 1] == "cpu"  # gpus: 0
    assert container["resources"]["limits"]["hugepages-2Mi"] == "64Mi"
    claims = c.get("pvc", "-n", NAMESPACE)["items"]
    assert {p["metadata"]["name"] for p in claims} >= {"kv-ssd-demo-0", "kv-ssd-demo-1"}
    assert all(p["status"]["phase"] == "Bound" and p["spec"]["storageClassName"] == "local-nvme" for p in claims)
    router = c.get("deploy", "demo-router", "-n", NAMESPACE)
    assert router["status"].get("readyReplicas") == 1


def test_a_pods_tiers_are_hugetlbfs_dram_and_ssd_on_its_persistent_volume(deployed: Cluster) -> None:
    c = deployed
    tiers = pod_get(c, "demo-0", "/admin/tiers", admin_token(c))
    by_tier = {t["tier"]: t for t in tiers["tiers"]}
    assert by_tier["dram"]["backing"] == "hugetlbfs:/var/lib/kvdrive/hugepages"
    assert by_tier["dram"]["capacity_bytes"] <= 64 << 20 < by_tier["dram"]["capacity_bytes"] + (1 << 20)
    assert by_tier["ssd"]["backing"].startswith("posix-odirect:/var/lib/kvdrive/ssd")
    assert by_tier["gpu"]["backing"] == "cpu"
    # the SSD tier's files are on the local volume the claim bound to (a directory of the node here)
    pvc = c.get("pvc", "kv-ssd-demo-0", "-n", NAMESPACE)
    volume = c.get("pv", pvc["spec"]["volumeName"])
    files = {p.name for p in Path(volume["spec"]["local"]["path"]).iterdir()}
    assert any(name.startswith("slab-") for name in files) and "meta.json" in files
    # the pod's hugetlb cgroup has its 64 MiB of 2 MiB pages reserved by the DRAM pool's mapping
    uid = c.get("pod", "demo-0", "-n", NAMESPACE)["metadata"]["uid"]
    pod_cgroup = list(Path("/sys/fs/cgroup/hugetlb/kubepods").glob(f"*/pod{uid}"))
    assert len(pod_cgroup) == 1, "scripts/cluster.sh mounts the hugetlb hierarchy for the kubelet"
    assert int((pod_cgroup[0] / "hugetlb.2MB.limit_in_bytes").read_text()) == 64 << 20
    assert int((pod_cgroup[0] / "hugetlb.2MB.rsvd.usage_in_bytes").read_text()) == 64 << 20


def test_a_cpu_pod_keeps_the_weights_in_their_blocks_with_the_images_prebuilt_kernels(deployed: Cluster) -> None:
    """The pod has no compiler and a read-only root: `--weights auto` takes int4/int8 only through the
    kernels the image built (Dockerfile, $KVDRIVE_KERNELS), where the node's CPU has AVX-512."""
    import torch

    logs = deployed.kubectl("-n", NAMESPACE, "logs", "demo-0", "--all-containers=true").stdout
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        assert "CPU kernels unavailable (the CPU offers" in logs
        return
    assert "CPU kernels ready" in logs and "compiling instead" not in logs, logs[-3000:]
    assert "weights auto (int4 x " in logs, logs[-3000:]  # the demo's Q4_1 projections stay 4-bit


def test_the_inference_pool_names_the_router_which_answers_grpc_health_and_follows_the_pods_kv_events(
        deployed: Cluster) -> None:
    """Mode inferencepool: the InferencePool (the GIE CRD installed) selects the runtime pods and names the
    router's Service on its ext_proc port; the router pod answers gRPC health there (what a gateway's health
    checks ask); with spec.kvEvents each pod publishes KV events and the router follows both pods' streams."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = deployed
    pool = c.get("inferencepool", "demo", "-n", NAMESPACE)
    assert pool["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvdrive",
                                                       "app.kubernetes.io/instance": "demo"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["kind"], picker["name"], picker["port"]["number"]) == ("Service", "demo-router", 9002)
    service_ports = {p["name"]: p for p in c.get("svc", "demo-router", "-n", NAMESPACE)["spec"]["ports"]}
    assert service_ports["grpc-ext-proc"]["port"] == 9002
    (router,) = c.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kvdrive-router")["items"]
    ip = router["status"]["podIP"]
    with grpc.insecure_channel(f"{ip}:9002") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    pods = {p["status"]["podIP"] for p in c.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kvdrive")["items"]}

    def followed() -> dict[str, float] | None:
        with urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=10) as answer:
            text = answer.read().decode()
        live = {}
        for line in text.splitlines():
            if line.startswith("kvdrive_router_backend_kv_events_live{"):
                backend = line.split('backend="')[1].split('"')[0]
                live[urlparse(backend).hostname or ""] = float(line.rsplit(" ", 1)[1])
        return live if set(live) >= pods and all(live[p] == 1 for p in pods) else None

    eventually(followed, 60, what="the router following every pod's KV events")
