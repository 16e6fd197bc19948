"""Scene 1: a user installs KVDrive with Helm on the one-node cluster, as the README says.

The operator runs as a pod from its own image (built offline from the Dockerfile), under the
chart's ServiceAccount and least-privilege ClusterRole, and logs in to the API server.
"""

from __future__ import annotations

from clusterkit import OPERATOR_NAMESPACE, Cluster, eventually


def test_the_node_is_ready_with_hugepages_and_local_nvme_volumes(cluster: Cluster) -> None:
    node = cluster.get("node", "kvdrive-node")
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert int(node["status"]["allocatable"]["hugepages-2Mi"].removesuffix("Mi").removesuffix("Gi")) > 0
    classes = cluster.get("storageclass", "local-nvme")
    assert classes["volumeBindingMode"] == "WaitForFirstConsumer"
    volumes = cluster.get("pv", "-l", "kvdrive.io/local-volume=true")["items"]
    assert len(volumes) >= 3 and all(v["spec"]["storageClassName"] == "local-nvme" for v in volumes)


def test_helm_install_runs_the_operator_pod_from_its_image_with_the_charts_rbac(operator: Cluster) -> None:
    pods = eventually(lambda: [p for p in operator.get("pods", "-n", OPERATOR_NAMESPACE)["items"]
                               if p["status"].get("phase") == "Running"
                               and all(s["ready"] for s in p["status"].get("containerStatuses", []))],
                      180, what="a Ready operator pod")
    pod = pods[0]
    container = pod["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kvdrive/kvdrive-operator:0.1.0"
    assert container["imagePullPolicy"] == "IfNotPresent"  # the image is the one loaded, never pulled
    account = pod["spec"]["serviceAccountName"]
    assert account == "kvdrive-kvdrive-operator"
    who = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{account}"
    can = lambda *a: operator.kubectl("auth", "can-i", *a, f"--as={who}", check=False).stdout.strip()  # noqa: E731
    assert can("patch", "statefulsets.apps", "-A") == "yes"
    assert can("delete", "nodes") == "no" and can("create", "pods") == "no" and can("delete", "secrets") == "no"

    def logged_in() -> str | None:
        logs = operator.kubectl("-n", OPERATOR_NAMESPACE, "logs", pod["metadata"]["name"]).stdout
        return logs if "Initial authentication has finished" in logs else None

    assert "Traceback" not in eventually(logged_in, 120, what="the operator's login")
