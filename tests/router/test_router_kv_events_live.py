"""A router follows a real replica's KV events: it knows a document's pages as soon as the replica stores them.

A replica of the demo model publishes KV events. Its routing info names the ports, so a router subscribes with
no flag of its own. The router's page-list poll is set to once a minute, so only the events can tell it. A
document sent straight to the replica (not through the router) is in the router's index within a second of its
answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from routerkit import API_KEY, Process, free_port, start_replica

from kvdrive.router.core import Router, RouterConfig
from kvdrive.router.discovery import StaticDiscovery

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    tmp = tmp_path_factory.mktemp("kv-events")
    port, replay = free_port(), free_port()
    proc = start_replica(tmp, "r0", "--kv-events-endpoint", f"tcp://*:{port}",
                         "--kv-events-replay-endpoint", f"tcp://*:{replay}", "--kv-events-topic", "kv@r0@demo")
    yield proc
    proc.stop()


def _document(i: int) -> str:
    return " ".join(f"Log {i}.{j}: the keeper counted {j * 3 + i} gulls and {j % 7} boats." for j in range(40))


async def test_the_router_learns_a_documents_pages_from_the_replicas_events(replica: Process) -> None:
    info = httpx.get(replica.url + "/v1/kvdrive/routing", headers=AUTH, timeout=10).json()
    assert info["kv_events"]["topic"] == "kv@r0@demo" and info["kv_events"]["replay_port"]
    router = Router(RouterConfig(api_key=API_KEY, poll_seconds=0.2, index_seconds=60.0),
                    StaticDiscovery((replica.url,)))
    await router.start()
    try:
        deadline = time.monotonic() + 30
        while not (router.ready() and router.feed.live(replica.url, time.monotonic())):
            assert time.monotonic() < deadline, "the router never followed the replica's events"
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
            for i in range(3):
                prompt = _document(i)
                ids = (await client.post(replica.url + "/tokenize", json={"model": "demo", "prompt": prompt})).json()
                digests = router.digests_for(ids["tokens"])
                (ds,) = digests.values()
                assert len(ds) >= 10 and router.index.matched(replica.url, ds) == 0
                r = await client.post(replica.url + "/v1/completions",
                                      json={"model": "demo", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                answered = time.monotonic()
                while router.index.matched(replica.url, ds) < len(ds):
                    assert time.monotonic() - answered < 1.0, (
                        f"{router.index.matched(replica.url, ds)} of {len(ds)} pages known 1 s after the answer")
                    await asyncio.sleep(0.005)
        assert router.feed.batches(replica.url) > 0
    finally:
        await router.stop()
