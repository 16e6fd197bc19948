"""`/metrics` renders off the event loop: while a scrape waits (here on a tier usage held up, as by the
store's lock during a long eviction), the server keeps answering other requests."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx

from kvdrive.runtime.kvcache import CacheCounters
from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.metrics import ServerMetrics
from kvdrive.runtime.server.state import ServerState


def test_a_slow_scrape_does_not_stall_other_requests(tiny_state: ServerState) -> None:
    release = threading.Event()
    entered = threading.Event()
    real_tiers = tiny_state.tiers

    def held_up_tiers():  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(30), "the scrape was never released"
        return real_tiers()

    counters = CacheCounters(page_reads={"gpu": 0, "dram": 0, "ssd": 0}, transfer_bytes={}, prefetch={})
    metrics = ServerMetrics(tiny_state.engine.engine.stats, held_up_tiers, lambda: counters)
    app = create_app(dataclasses.replace(tiny_state, metrics=metrics))

    async def scenario() -> tuple[int, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            scrape = asyncio.create_task(client.get("/metrics"))
            while not entered.is_set():  # the scrape is now inside the held-up usage
                await asyncio.sleep(0.01)
            health = await asyncio.wait_for(client.get("/healthz"), timeout=10)
            assert health.status_code == 200  # answered while the scrape still waits
            assert not scrape.done()
            release.set()
            done = await asyncio.wait_for(scrape, timeout=30)
            return done.status_code, done.text

    status, text = asyncio.run(scenario())
    assert status == 200 and "kvdrive_tier_capacity_bytes" in text


def test_a_scrape_asks_the_store_for_its_usage_once(tiny_state: ServerState) -> None:
    """A scrape (the router makes one every second per replica) asks the store for its usage once (it asked
    3 times); usage reads counters under the store's lock, never a walk of the blocks
    (tests/kvcache/test_hot_path.py checks the counters)."""
    store = tiny_state.engine.engine.runner.cache.store
    real = store.usage
    walks: list[int] = []

    def counted():  # type: ignore[no-untyped-def]
        walks.append(1)
        return real()

    store.usage = counted  # type: ignore[method-assign]
    try:
        text = tiny_state.metrics.render().decode()
    finally:
        del store.usage
    assert "kvdrive_tier_used_bytes" in text and len(walks) == 1
