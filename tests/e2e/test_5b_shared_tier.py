"""Scene 5b: the pods share a KV tier (spec.tiers.shared) on the 3-shard Valkey cluster that
scripts/cluster.sh runs on the host, on the pods' gateway.

A long document asked on one pod is answered by the other from the pages the first published there:
`usage.prompt_tokens_details.cached_tokens` > 0 on its first request, the same greedy text and token
log-probabilities as the first pod gives from its own stored pages, and shared-tier hits on its /metrics.
(The reference is the first pod's second, warm answer, not its cold one: under ``--gemm auto`` a cold
prompt's tokens go through bf16 prompt GEMMs, a reused prompt's few tail tokens through the float32 block
kernels, so the first token's log-probability moves by ~0.02 and a near-tied greedy choice may flip;
docs/weights.md. Bit-identical pages give a bit-identical answer; that is what a shared tier must keep.)
A pod replaced on a fresh claim (its claim deleted with it: an empty SSD tier, as after a move to another
node) answers a document asked before from the shared tier too. The CR's status names the tier, and
every pod reaches it.

Each session salts its requests (`cache_salt`) so that pages of an earlier session on a reused
cluster (KVDRIVE_E2E_DIR) cannot answer them: the first pod's request starts cold.
"""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest
from clusterkit import NAMESPACE, Cluster, eventually, same_completion
from test_2_deploy import admin_token, pod_get

PAGE = 16  # demo.yaml's attention.pageSize
DOCUMENT = "\n".join(f"Article {i}. The supplier delivers batch {i * 7 % 89} of part {i * 31 % 113} to dock "
                     f"{i % 11} and invoices it within {i % 5 + 3} weeks." for i in range(90))
PROMPT = f"{DOCUMENT}\n\nQuestion: which dock receives part 62?\nAnswer:"
SALT = f"e2e-shared-{uuid.uuid4().hex[:12]}"


def _complete(c: Cluster, pod: str) -> dict:
    ip = c.get("pod", pod, "-n", NAMESPACE)["status"]["podIP"]
    answer = httpx.post(f"http://{ip}:8000/v1/completions", timeout=300,
                        json={"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                              "ignore_eos": True, "cache_salt": SALT, "logprobs": 1})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _logprobs(answer: dict) -> list[float]:
    return [float(x) for x in answer["choices"][0]["logprobs"]["token_logprobs"]]


def _metric(c: Cluster, pod: str, name: str) -> float:
    """An unlabelled sample of the pod's /metrics."""
    ip = c.get("pod", pod, "-n", NAMESPACE)["status"]["podIP"]
    text = httpx.get(f"http://{ip}:8000/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in {pod}'s /metrics"
    return float(found.group(1))


def _cached(answer: dict) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _ready(pod: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in pod["status"].get("conditions", []))


def _both_ready(c: Cluster) -> bool:
    return c.get("sts", "demo", "-n", NAMESPACE)["status"].get("readyReplicas") == 2


def test_the_status_names_the_shared_tier_and_every_pod_reaches_it(deployed: Cluster) -> None:
    c = deployed
    eventually(lambda: _both_ready(c), 300, what="two Ready pods")
    endpoints = c.shared_tier_endpoints
    assert len(endpoints) == 3  # three shards

    def reached() -> dict | None:
        status = c.get("kvd", "demo", "-n", NAMESPACE)["status"]
        condition = {x["type"]: x for x in status.get("conditions", [])}.get("SharedTierDegraded", {})
        pods = {p["name"]: p.get("sharedTier") for p in status.get("pods", [])}
        return status if condition.get("status") == "False" and pods == {"demo-0": "ok", "demo-1": "ok"} else None

    status = eventually(reached, 120, what="SharedTierDegraded False with both pods reaching the tier")
    assert status["sharedTier"] == {"url": f"valkey://{','.join(endpoints)}", "namespace": "e2e", "tls": False,
                                    "degradedPods": []}
    args = c.get("pod", "demo-0", "-n", NAMESPACE)["spec"]["containers"][0]["args"]
    assert args[args.index("--shared-tier") + 1] == f"valkey://{','.join(endpoints)}"


def test_a_document_asked_on_one_pod_is_answered_by_the_other_from_the_shared_tier(deployed: Cluster) -> None:
    c = deployed
    eventually(lambda: _both_ready(c), 300, what="two Ready pods")
    published = _metric(c, "demo-0", "kvdrive_shared_tier_published_pages_total")
    hits = _metric(c, "demo-1", "kvdrive_shared_tier_hits_total")
    started = time.monotonic()
    a = _complete(c, "demo-0")
    a_seconds = round(time.monotonic() - started, 2)
    prompt_tokens = a["usage"]["prompt_tokens"]
    assert prompt_tokens > 2000 and _cached(a) == 0, a["usage"]  # salted: nothing anywhere holds it yet
    pages = (prompt_tokens - 1) // PAGE  # every full page before the last token
    # pod A publishes its sealed pages in the background: wait until they are all in the store
    eventually(lambda: _metric(c, "demo-0", "kvdrive_shared_tier_published_pages_total") >= published + pages, 120,
               what=f"demo-0 publishing the document's {pages} pages")
    again = _complete(c, "demo-0")  # A from its own stored pages: the answer B must give from the same pages
    assert _cached(again) == pages * PAGE, again["usage"]
    assert _logprobs(again)[0] == pytest.approx(_logprobs(a)[0], abs=0.1)  # warm tail vs cold prompt numerics
    started = time.monotonic()
    b = _complete(c, "demo-1")
    b_seconds = round(time.monotonic() - started, 2)
    same_completion(b, again)  # the same greedy answer from A's pages
    assert _cached(b) > 0, b["usage"]
    assert _cached(b) == pages * PAGE, b["usage"]  # every page A published, fetched and verified by B
    assert _metric(c, "demo-1", "kvdrive_shared_tier_hits_total") - hits >= pages
    c.record("shared tier, pod to pod: cached_tokens / prompt_tokens on the second pod", f"{_cached(b)} / {prompt_tokens}")
    c.record("shared tier, pod to pod: the request on the first pod, cold / on the second (s)", f"{a_seconds} / {b_seconds}")


def test_a_pod_replaced_on_a_fresh_claim_answers_a_document_asked_before_from_the_shared_tier(
        deployed: Cluster) -> None:
    c = deployed
    eventually(lambda: _both_ready(c), 300, what="two Ready pods")
    published = _metric(c, "demo-0", "kvdrive_shared_tier_published_pages_total")
    before = _complete(c, "demo-0")  # asked before (the previous test): answered from demo-0's own tiers
    pages = (before["usage"]["prompt_tokens"] - 1) // PAGE
    if _cached(before) == 0:  # this test alone: demo-0 answered it cold, and publishes its pages now
        eventually(lambda: _metric(c, "demo-0", "kvdrive_shared_tier_published_pages_total") >= published + pages,
                   120, what=f"demo-0 publishing the document's {pages} pages")
    old_pod = c.get("pod", "demo-1", "-n", NAMESPACE)
    old_claim = c.get("pvc", "kv-ssd-demo-1", "-n", NAMESPACE)
    started = time.monotonic()
    # the claim first (held by its pod until the pod is gone), then the pod: the StatefulSet makes both anew
    c.kubectl("delete", "pvc", "kv-ssd-demo-1", "-n", NAMESPACE, "--wait=false")
    c.kubectl("delete", "pod", "demo-1", "-n", NAMESPACE, "--wait=false")

    def replaced() -> dict | None:
        pod = c.get("pod", "demo-1", "-n", NAMESPACE)
        return pod if pod["metadata"]["uid"] != old_pod["metadata"]["uid"] and _ready(pod) else None

    eventually(replaced, 300, what="demo-1 recreated on a new claim and Ready")
    back_after = round(time.monotonic() - started, 1)
    claim = c.get("pvc", "kv-ssd-demo-1", "-n", NAMESPACE)
    assert claim["metadata"]["uid"] != old_claim["metadata"]["uid"]
    assert claim["spec"]["volumeName"] != old_claim["spec"]["volumeName"]  # another local volume, empty
    tiers = {t["tier"]: t for t in pod_get(c, "demo-1", "/admin/tiers", admin_token(c))["tiers"]}
    assert tiers["ssd"]["pages"] == 0, tiers["ssd"]
    after = _complete(c, "demo-1")
    if _cached(before) == 0:  # the reference must come from stored pages too (see the module's docstring)
        before = _complete(c, "demo-0")
    same_completion(after, before)
    assert _cached(after) == pages * PAGE, after["usage"]  # all of it from the shared tier: nothing local had it
    assert _metric(c, "demo-1", "kvdrive_shared_tier_hits_total") >= pages
    c.record("shared tier: pod deleted with its claim -> recreated pod Ready (s)", back_after)
    c.record("shared tier, fresh claim: cached_tokens / prompt_tokens on the first request",
             f"{_cached(after)} / {after['usage']['prompt_tokens']}")
