"""Scene 8: the user deletes the KVDriveDeployment. Every child goes with it (owner references,
the garbage collector of the full kube-controller-manager): the StatefulSet and its pods, the
Services, ConfigMap, Secret, PodDisruptionBudgets, the router's Deployment, ServiceAccount, Role
and RoleBinding, the InferencePool, and (the StatefulSet's retention policy) the pods' claims.
"""

from __future__ import annotations

import time

from clusterkit import NAMESPACE, Cluster, eventually

KINDS = ("statefulset,deployment,replicaset,pod,service,configmap,secret,pdb,serviceaccount,role,rolebinding,pvc,"
         "inferencepools.inference.networking.k8s.io")


def _children(c: Cluster) -> list[str]:
    items = c.get(KINDS, "-n", NAMESPACE, "-l", "app.kubernetes.io/instance=demo")["items"]
    items += [p for p in c.get("pvc", "-n", NAMESPACE)["items"] if p["metadata"]["name"].startswith("kv-ssd-demo-")]
    return sorted({f"{i['kind']}/{i['metadata']['name']}" for i in items})


def test_deleting_the_cr_removes_every_child(deployed: Cluster) -> None:
    c = deployed
    present = _children(c)
    kinds = {name.split("/")[0] for name in present}
    assert {"StatefulSet", "Deployment", "Pod", "Service", "ConfigMap", "Secret", "PodDisruptionBudget",
            "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim", "InferencePool"} <= kinds, present
    started = time.monotonic()
    c.kubectl("delete", "kvd", "demo", "-n", NAMESPACE, "--wait=true", "--timeout=300s", timeout=330)
    eventually(lambda: not _children(c), 300, interval=2, what=f"no children left ({_children(c)})")
    c.record("kubectl delete kvd -> every child gone (s)", round(time.monotonic() - started, 1))
