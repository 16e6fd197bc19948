"""The router in front of two real replicas of the demo model, as a client sees it.

Narrated: the router becomes ready once it reached the replicas and learned their tokenizer; a document
asked about twice, with different questions, is sent both times to the replica that computed it, which
reuses its pages the second time; the official ``openai`` client works through it, streaming included,
with the same greedy answer as asking a replica directly; client errors come back as the replica's 4xx;
a client that leaves stops its request on the replica; and when the replica holding the document dies, its next question is answered by the other one, the dead
one is taken out within seconds, and it rejoins after a restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from routerkit import API_KEY, Process, metric, start_replica, start_router

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}
DOC = " ".join(f"Entry {i}: the lighthouse keeper logged {i * 7} ships and {i % 5} storms that week."
               for i in range(60))  # about 1,300 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, list[Process], Path]]:
    tmp = tmp_path_factory.mktemp("routing")
    replicas = [start_replica(tmp, "r0"), start_replica(tmp, "r1")]
    router = start_router(tmp, [r.url for r in replicas])
    yield router, replicas, tmp
    router.stop()
    for r in replicas:
        r.stop()


def _ask(url: str, question: str, **extra: object) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": f"{DOC}\n\nQuestion: {question}"}],
            "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)


def _hits(replica: Process) -> float:
    return metric(replica.url, "kvdrive_prefix_hit_pages_total", headers=AUTH)


def test_routing_through_two_replicas(cluster: tuple[Process, list[Process], Path]) -> None:
    router, replicas, tmp = cluster

    # a document asked about twice goes to one replica both times; the second time its pages are reused
    before = [_hits(r) for r in replicas]
    assert _ask(router.url, "How many ships in entry 3?").status_code == 200
    assert _ask(router.url, "How many storms in entry 9?").status_code == 200
    gained = [_hits(r) - b for r, b in zip(replicas, before, strict=True)]
    holder = 0 if gained[0] else 1
    assert gained[holder] >= 60 and gained[1 - holder] == 0, gained  # ~80 pages of the document, one replica
    assert metric(router.url, "kvdrive_router_decisions_total", 'reason="prefix"') >= 1
    assert metric(router.url, "kvdrive_router_prefix_tokens_matched_total") >= 60 * 16

    # a tenant with its own cache_salt reuses nothing of the document (on no replica, and the router's index
    # matches none of its pages); asked again under the same salt, its own pages are reused
    before = [_hits(r) for r in replicas]
    matched = metric(router.url, "kvdrive_router_prefix_tokens_matched_total")
    assert _ask(router.url, "How many ships in entry 3?", cache_salt="tenant-b").status_code == 200
    assert [_hits(r) - b for r, b in zip(replicas, before, strict=True)] == [0, 0]
    assert metric(router.url, "kvdrive_router_prefix_tokens_matched_total") == matched
    assert _ask(router.url, "How many storms in entry 9?", cache_salt="tenant-b").status_code == 200
    assert sum(_hits(r) - b for r, b in zip(replicas, before, strict=True)) >= 60

    # the official client, plain and streaming, through the router: the replica's own greedy answer
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0)
    direct = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key=API_KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Name three colours."}]
    via = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    own = direct.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert via.choices[0].message.content == own.choices[0].message.content
    chunks = list(client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = direct.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert streamed == plain.choices[0].text and len(chunks) >= 2
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]

    # client errors are the replica's 4xx, never a 5xx from the router
    no_key = httpx.post(router.url + "/v1/completions", json={"model": "demo", "prompt": "x"}, timeout=30)
    assert no_key.status_code == 401 and "error" in no_key.json()
    unknown = httpx.post(router.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}, headers=AUTH,
                         timeout=30)
    assert unknown.status_code == 404 and "gpt-9" in unknown.json()["error"]["message"]
    for bad in (b"{not json", b'{"model": "demo", "prompt": "x", "max_tokens": -3}', b'{"model": "demo"}'):
        r = httpx.post(router.url + "/v1/completions", content=bad, headers={**AUTH, "Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.status_code, r.text)
    huge = httpx.post(router.url + "/v1/completions", content=b"x" * (9 << 20), headers=AUTH, timeout=30)
    assert huge.status_code == 413
    assert metric(router.url, "kvdrive_router_backend_errors_total") == 0  # client errors are not replica errors

    # a client that leaves, before the first token or mid-stream, stops its request on the replica too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", headers=AUTH, timeout=1.0, json={
            "model": "demo", "prompt": DOC, "max_tokens": 400, "ignore_eos": True})
    with httpx.stream("POST", router.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "model": "demo", "prompt": "Count: one, two,", "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as streaming:
        next(streaming.iter_lines())
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
            sum(metric(r.url, "kvdrive_requests_running", headers=AUTH) for r in replicas)
            or metric(router.url, "kvdrive_router_backend_in_flight")):
        time.sleep(0.2)
    assert sum(metric(r.url, "kvdrive_requests_running", headers=AUTH) for r in replicas) == 0
    assert metric(router.url, "kvdrive_router_backend_in_flight") == 0

    # the replica holding the document dies: its next question is answered by the other one
    dead = replicas[holder]
    dead.process.kill()
    dead.process.wait(10)
    t0 = time.monotonic()
    r = _ask(router.url, "How many ships in entry 11?")
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while metric(router.url, "kvdrive_router_backend_up", f'backend="{dead.url}"') and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(router.url, "kvdrive_router_backend_up", f'backend="{dead.url}"') == 0
    assert time.monotonic() - t0 < 60
    assert _ask(router.url, "How many storms in entry 2?").status_code == 200  # served while one is out

    # restarted on the same port (its SSD tier still holds the document), it rejoins
    port = int(dead.url.rsplit(":", 1)[1])
    replicas[holder] = start_replica(tmp, f"r{holder}", port=port)
    deadline = time.monotonic() + 20
    while not metric(router.url, "kvdrive_router_backend_up", f'backend="{dead.url}"') and time.monotonic() < deadline:
        time.sleep(0.3)
    assert metric(router.url, "kvdrive_router_backend_up", f'backend="{dead.url}"') == 1
