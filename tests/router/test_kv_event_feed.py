"""The router's KV-event subscription against a real publisher over TCP, with no model behind it.

A replica's publisher announces pages stored and removed; the router's feed applies them to its prefix index
as they come. It joined after the first batches, so it replays them from 0 and knows the pages stored before
it subscribed. When the publisher goes away the feed stops being live after its stale time (the router polls
the page list again then); a new life of the publisher on the same address (its sequence starts over, with
AllBlocksCleared) is followed again, and what the old life announced is forgotten. Pages it announces in the
shared tier count for every replica.
"""

from __future__ import annotations

import asyncio
import time

from routerkit import free_port

from kvdrive.router.backends import EventSource
from kvdrive.router.index import Match, PrefixIndex
from kvdrive.router.kv_event_feed import EventFeed
from kvdrive.runtime.kvcache import PageEvents
from kvdrive.runtime.server.kv_event_publisher import KVEventPublisher, KVEventsConfig

URL = "http://127.0.0.1:1"  # the replica's HTTP address: the feed takes its host


def _publisher(port: int, replay: int, heartbeat: float = 0.1) -> tuple[PageEvents, KVEventPublisher]:
    events = PageEvents()
    pub = KVEventPublisher(events, KVEventsConfig(f"tcp://*:{port}", f"tcp://*:{replay}",
                                                  heartbeat_seconds=heartbeat), 4)
    pub.start()
    return events, pub


async def _until(cond, seconds: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < seconds, "timed out"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def test_the_feed_follows_a_publisher_replays_what_it_missed_and_starts_over_with_a_new_life() -> None:
    port, replay = free_port(), free_port()
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    events, pub = _publisher(port, replay)
    events.describe([(a, None, (1, 2, 3, 4)), (b, a, (5, 6, 7, 8))])
    events.changed(a, "gpu", True)  # announced before the router subscribes
    events.changed(b, "gpu", True)
    await _until(lambda: pub.sequence >= 3)
    index = PrefixIndex()
    feed = EventFeed(index, stale_seconds=0.5)
    try:
        feed.follow(URL, EventSource(port, replay, ""))
        await _until(lambda: feed.live(URL, time.monotonic()))
        await _until(lambda: index.matched(URL, [a, b]) == 2)  # replayed from 0
        events.changed(c, "dram", True)
        lag = await _until(lambda: index.matched(URL, [a, b, c]) == 3)
        assert lag < 0.1, f"a stored page reached the index after {lag * 1000:.0f} ms"
        events.changed(b, "dram", True)
        events.changed(b, "gpu", False)  # still in DRAM: held
        events.changed(a, "gpu", False)  # its last tier: gone
        await _until(lambda: index.matched(URL, [b]) == 1 and index.matched(URL, [a]) == 0)
        assert index.pages(URL) == 2
        pub.close()  # the stream goes down: the feed stops being live (the router polls again)
        await _until(lambda: not feed.live(URL, time.monotonic()), seconds=3)
        assert pub.sequence > 5
        # the replica restarted on the same address; its numbers start over (slowly here: the feed hears a
        # number at or below the last it applied, which is how it tells a new life from a gap)
        events2, pub2 = _publisher(port, replay, heartbeat=1.0)
        try:
            events2.changed(c, "ssd", True)
            await _until(lambda: index.matched(URL, [c]) == 1 and index.matched(URL, [b]) == 0, seconds=10)
            assert feed.live(URL, time.monotonic()) and index.pages(URL) == 1
        finally:
            pub2.close()
    finally:
        await feed.stop()
        pub.close()


async def test_a_page_one_replica_announces_in_the_shared_tier_counts_for_every_replica() -> None:
    """A replica's publisher announces pages published to the shared tier (EXTERNAL on the wire): the router's
    index counts them for another replica it follows no events from, until one is announced gone; dropping the
    announcing replica withdraws what it announced."""
    port, replay = free_port(), free_port()
    a, b = (bytes([i]) * 16 for i in (1, 2))
    other = "http://127.0.0.1:2"  # a replica that publishes no events
    events, pub = _publisher(port, replay)
    index = PrefixIndex()
    feed = EventFeed(index, stale_seconds=0.5)
    try:
        feed.follow(URL, EventSource(port, replay, ""))
        await _until(lambda: feed.live(URL, time.monotonic()))
        events.describe([(a, None, (1, 2, 3, 4)), (b, a, (5, 6, 7, 8))])
        for d in (a, b):
            events.changed(d, "gpu", True)
            events.changed(d, "shared", True)
        await _until(lambda: index.match(other, [a, b]).shared == 2)
        assert index.match(URL, [a, b]) == Match(pages=2, shared=0)  # its own copies count as its own
        events.changed(b, "shared", False)  # it fetched b and missed: the store evicted it
        await _until(lambda: index.match(other, [a, b]).pages == 1)
        assert index.match(URL, [a, b]).pages == 2
        feed.drop(URL)
        index.forget(URL)  # it left: what it announced goes with it
        assert index.match(other, [a, b]).pages == 0
    finally:
        await feed.stop()
        pub.close()
