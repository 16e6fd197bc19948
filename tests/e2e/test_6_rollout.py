"""Scene 6: the user changes the spec (a smaller token budget). The StatefulSet rolls its pods one
at a time, the CR's PodDisruptionBudget holds meanwhile (an eviction of the other pod is refused
while one is down), and every pod ends up running the new flags.
"""

from __future__ import annotations

import threading
import time

from clusterkit import NAMESPACE, Cluster, eventually
from kubernetes import client
from kubernetes.client.rest import ApiException


def _ready(pod: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in pod["status"].get("conditions", []))


def test_a_spec_change_rolls_one_pod_at_a_time_under_the_pdb(deployed: Cluster) -> None:
    c = deployed
    eventually(lambda: c.get("sts", "demo", "-n", NAMESPACE)["status"].get("readyReplicas") == 2, 300,
               what="two Ready pods")
    budget = int(c.get("kvd", "demo", "-n", NAMESPACE)["spec"]["attention"]["tokenBudget"])
    new_budget = 1024 if budget != 1024 else 2048
    core = client.CoreV1Api(c.api())
    worst = {"down": 0}
    evictions: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def watch() -> None:  # how many of the two pods are not Ready, twice a second, through the roll
        while not stop.is_set():
            pods = {p.metadata.name: p for p in core.list_namespaced_pod(
                NAMESPACE, label_selector="app.kubernetes.io/name=kvdrive").items}
            ready = {n for n, p in pods.items() if p.metadata.deletion_timestamp is None and any(
                x.type == "Ready" and x.status == "True" for x in (p.status.conditions or []))}
            down = 2 - len(ready & {"demo-0", "demo-1"})
            worst["down"] = max(worst["down"], down)
            if down == 1 and not evictions:  # one pod is being replaced: the PDB must refuse the other
                other = next(iter(ready & {"demo-0", "demo-1"}))
                body = client.V1Eviction(metadata=client.V1ObjectMeta(name=other, namespace=NAMESPACE))
                try:
                    core.create_namespaced_pod_eviction(other, NAMESPACE, body)
                    evictions.append((other, 201, "evicted"))
                except ApiException as exc:
                    evictions.append((other, exc.status, exc.body or ""))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        c.kubectl("patch", "kvd", "demo", "-n", NAMESPACE, "--type=merge",
                  "-p", f'{{"spec": {{"attention": {{"tokenBudget": {new_budget}}}}}}}')

        def rolled() -> bool:
            sts = c.get("sts", "demo", "-n", NAMESPACE)
            st = sts["status"]
            pods = c.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=kvdrive")["items"]
            flags = [p["spec"]["containers"][0]["args"] for p in pods]
            return (st.get("updateRevision") == st.get("currentRevision") and st.get("readyReplicas") == 2
                    and len(pods) == 2 and all(_ready(p) for p in pods)
                    and all(a[a.index("--token-budget") + 1] == str(new_budget) for a in flags))

        eventually(rolled, 600, interval=2, what="both pods rolled to the new token budget")
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert worst["down"] == 1, f"at worst {worst['down']} of 2 pods were down during the roll"
    assert evictions, "the watcher never saw a pod down to try an eviction"
    pod, status, message = evictions[0]
    assert status == 429 and "disruption budget" in message, evictions[0]

    def cr_ready() -> bool:
        cr = c.get("kvd", "demo", "-n", NAMESPACE)
        return any(x["type"] == "Ready" and x["status"] == "True"
                   and x["observedGeneration"] == cr["metadata"]["generation"] for x in cr["status"]["conditions"])

    eventually(cr_ready, 120, what="the CR Ready at its new generation")
    c.record("rolling update of 2 pods after a spec change (s)", round(time.monotonic() - started, 1))
    c.record("eviction during the roll", f"{pod}: HTTP {status} (PodDisruptionBudget)")
