"""Scene 5: a pod dies. The StatefulSet recreates it under the same name on the same claim, and
the long prompt it had answered before is answered again from the prefix pages its SSD tier kept on
the local NVMe volume: `usage.prompt_tokens_details.cached_tokens` > 0 on the first request, none of
them fetched from the shared tier (scene 5b), which the pod looks in only for pages no local tier holds,
and the same greedy text and log-probabilities as the pod gave from those pages before it died (a warm
answer: a cold one differs in float32 noise, which can flip a near-tied token; scene 5b's docstring).
"""

from __future__ import annotations

import time

import httpx
from clusterkit import NAMESPACE, Cluster, eventually, same_completion

DOCUMENT = "\n".join(f"Clause {i}. The lessee shall maintain the premises at lot {i * 13 % 97} in good repair, "
                     f"and report damage within {i % 9 + 2} days." for i in range(60))
PROMPT = f"{DOCUMENT}\n\nQuestion: within how many days must damage at lot 39 be reported?\nAnswer:"


def _complete(c: Cluster, pod: str) -> dict:
    ip = c.get("pod", pod, "-n", NAMESPACE)["status"]["podIP"]
    answer = httpx.post(f"http://{ip}:8000/v1/completions", timeout=300,
                        json={"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                              "logprobs": 1})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _metric(c: Cluster, pod: str, name: str) -> float:
    ip = c.get("pod", pod, "-n", NAMESPACE)["status"]["podIP"]
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=30).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"{name} ")))


def test_a_deleted_pod_comes_back_on_its_claim_with_its_prefix_pages(deployed: Cluster) -> None:
    c = deployed
    eventually(lambda: c.get("sts", "demo", "-n", NAMESPACE)["status"].get("readyReplicas") == 2, 300,
               what="two Ready pods")
    before = _complete(c, "demo-0")
    assert before["usage"]["prompt_tokens"] > 1000
    if before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0:  # cold: the reference is a warm answer
        before = _complete(c, "demo-0")
        assert before["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, before["usage"]
    old = c.get("pod", "demo-0", "-n", NAMESPACE)
    claim = c.get("pvc", "kv-ssd-demo-0", "-n", NAMESPACE)
    started = time.monotonic()
    c.kubectl("delete", "pod", "demo-0", "-n", NAMESPACE, "--wait=false")

    def back() -> dict | None:
        pod = c.get("pod", "demo-0", "-n", NAMESPACE)
        ready = any(x["type"] == "Ready" and x["status"] == "True" for x in pod["status"].get("conditions", []))
        return pod if pod["metadata"]["uid"] != old["metadata"]["uid"] and ready else None

    new = eventually(back, 300, what="demo-0 recreated and Ready")
    back_after = round(time.monotonic() - started, 1)
    # the same claim (not a new one), mounted by the new pod
    assert c.get("pvc", "kv-ssd-demo-0", "-n", NAMESPACE)["metadata"]["uid"] == claim["metadata"]["uid"]
    volumes = {v["name"]: v for v in new["spec"]["volumes"]}
    assert volumes["kv-ssd"]["persistentVolumeClaim"]["claimName"] == "kv-ssd-demo-0"
    after = _complete(c, "demo-0")
    cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_tokens = after["usage"]["prompt_tokens"]
    assert cached > 0, after["usage"]
    assert _metric(c, "demo-0", "kvdrive_shared_tier_prefix_pages_total") == 0  # all of them from its own claim
    same_completion(after, before)  # same greedy answer from reused pages
    c.record("pod deleted -> recreated pod Ready (s)", back_after)
    c.record("after the restart: cached_tokens / prompt_tokens", f"{cached} / {prompt_tokens}")
