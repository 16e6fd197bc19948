"""Scene 3: applications talk to the deployment with the official `openai` client.

Through the CR's Service (its ``status.endpoint``: with routing on it selects the router's pods),
through the router's own Service, and straight to a runtime pod, each streaming and not. Service
ClusterIPs are reachable from the node itself (kube-proxy's iptables rules); there is no cluster
DNS here, so the endpoint's host name is looked up as the Service's ClusterIP.
"""

from __future__ import annotations

import statistics
import time
from urllib.parse import urlparse

import openai
import pytest
from clusterkit import NAMESPACE, Cluster

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _base_urls(c: Cluster) -> dict[str, str]:
    endpoint = urlparse(c.get("kvd", "demo", "-n", NAMESPACE)["status"]["endpoint"])
    service = endpoint.hostname.split(".")[0]  # type: ignore[union-attr]
    assert endpoint.hostname == f"{service}.{NAMESPACE}.svc"
    cluster_ip = lambda name: c.get("svc", name, "-n", NAMESPACE)["spec"]["clusterIP"]  # noqa: E731
    pod_ip = c.get("pod", "demo-1", "-n", NAMESPACE)["status"]["podIP"]
    return {
        "the CR's Service": f"http://{cluster_ip(service)}:{endpoint.port}/v1",
        "the router's Service": f"http://{cluster_ip('demo-router')}:8000/v1",
        "a runtime pod": f"http://{pod_ip}:8000/v1",
    }


@pytest.mark.parametrize("path", ["the CR's Service", "the router's Service", "a runtime pod"])
def test_chat_completions_stream_and_not(deployed: Cluster, path: str) -> None:
    c = deployed
    client = openai.OpenAI(base_url=_base_urls(c)[path], api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=12)
    assert answer.choices[0].message.content.startswith("The capital of France is Paris")
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    ttfts = []
    for _ in range(3):
        started = time.monotonic()
        first = None
        parts = []
        stream = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=12,
                                                stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                parts.append(chunk.choices[0].delta.content)
        assert first is not None
        ttfts.append(first - started)
        assert "".join(parts) == answer.choices[0].message.content
    c.record(f"first-token latency through {path} (s, median of 3)", round(statistics.median(ttfts), 3))


def test_bad_requests_get_a_clear_4xx_through_the_router(deployed: Cluster) -> None:
    client = openai.OpenAI(base_url=_base_urls(deployed)["the CR's Service"], api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="demo", messages=QUESTION, max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)
