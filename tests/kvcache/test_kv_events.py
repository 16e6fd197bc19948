"""KV events on vLLM's wire: a subscriber learns what a replica's tiers hold as it changes.

A replica runs with a small device tier and DRAM and no SSD tier. A subscriber connects over TCP, as a router
or llm-d's indexer does. A first document's pages are announced as stored (on the tier they were written to,
with their tokens and parent chain) within 100 ms of the tier publishing them; a second document pushes them out
of DRAM, the last tier, and each is announced removed there. Replaying the announced changes gives exactly
what the tiers hold. A consumer that joins late asks the replay socket for everything from sequence 0 and gets
the batches the subscriber saw, starting with AllBlocksCleared. The messages are msgspec tagged arrays, frame
for frame what vLLM sends and what llm-d's decoder reads.
"""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq
from enginekit import PAGE, run_dry, tiered_engine
from modelkit import random_tokens

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.kvcache.store.page_events import PageEvents, PageInfo
from kvdrive.runtime.model import LoadedModel
from kvdrive.runtime.prompt import page_digests
from kvdrive.runtime.protocol.kv_event_wire import (
    END_SEQ,
    MEDIUM,
    SHARED_MEDIUM,
    BlockRemoved,
    BlockStored,
    EventBatch,
    as_map,
    decoder,
    encoder,
    fold,
    seq_bytes,
    seq_of,
)
from kvdrive.runtime.server.kv_event_publisher import KVEventPublisher, KVEventsConfig, to_events


def _engine(loaded: LoadedModel, gpu_pages: int, dram_pages: int) -> LLMEngine:
    return tiered_engine(loaded, rows=1, hot_pages=gpu_pages, dram_pages=dram_pages, placement="lru",
                         full_attention=True)


class Subscriber:
    """A SUB socket on its own thread, stamping each message's arrival (time.time())."""

    def __init__(self, address: str) -> None:
        self.messages: list[tuple[float, int, EventBatch]] = []
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 50)
        self._sock.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dec = decoder()
        while not self._stop.is_set():
            try:
                topic, seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.messages.append((time.time(), seq_of(seq), dec.decode(payload)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


def _wait(cond, seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _held(batches: list[EventBatch]) -> dict[int | bytes, set[str]]:
    """What a consumer knows after applying the batches: page -> the media holding it."""
    held: dict[bytes, set[str]] = {}
    for batch in batches:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                held.clear()
            elif kind == "BlockStored":
                for h in ev.block_hashes:
                    held.setdefault(h, set()).add(ev.medium)
            else:
                for h in ev.block_hashes:
                    held.get(h, set()).discard(ev.medium)
                    if not held.get(h, True):
                        del held[h]
    return held


def _truth(engine: LLMEngine) -> dict[int | bytes, set[str]]:
    """What the tiers hold: page (named as on the wire: its digest's low 64 bits) -> media."""
    store = engine.runner.cache.store
    with store.table.lock:
        return {fold(k.digest): {MEDIUM[t] for t, c in b.copies.items() if c.ready}
                for k, b in store.table.blocks.items() if k.layer == 0 and any(c.ready for c in b.copies.values())}


def test_a_subscriber_hears_pages_stored_within_100ms_and_removed_from_their_last_tier(tiny: LoadedModel) -> None:
    engine = _engine(tiny, gpu_pages=8, dram_pages=12)
    cache = engine.runner.cache
    events = PageEvents()
    stored_at: dict[int, float] = {}
    changed = events.changed

    def stamped(digest: bytes, tier, stored: bool) -> None:  # type: ignore[no-untyped-def]
        if stored:
            stored_at.setdefault(fold(digest), time.time())
        changed(digest, tier, stored)

    events.changed = stamped  # type: ignore[method-assign]
    cache.watch_pages(events)
    pub = KVEventPublisher(events, KVEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@pod@tiny",
                                                  heartbeat_seconds=0.05), PAGE)
    pub.start()
    sub = Subscriber(pub.address)  # type: ignore[arg-type]
    try:
        _wait(lambda: len(sub.messages) >= 2)  # heartbeats arrive: the subscription is live
        first, second = random_tokens(20 * PAGE, seed=1), random_tokens(20 * PAGE, seed=2)
        engine.add_request(Request("a", first, SamplingParams(max_tokens=2, ignore_eos=True), 0.0))
        run_dry(engine)
        digests = [fold(d) for d in page_digests(cache.root, first, PAGE)]
        _wait(lambda: set(digests) <= set(_held([m[2] for m in sub.messages])))
        # stored: every page, with its tokens and parent chain, within 100 ms of the tier publishing it
        seen: dict[int | bytes, float] = {}
        tokens_of: dict[int | bytes, list[int]] = {}
        parents: dict[int | bytes, int | bytes | None] = {}
        for at, _seq, batch in sub.messages:
            for ev in batch.events:
                if type(ev).__name__ == "BlockStored":
                    assert ev.block_size == PAGE and len(ev.token_ids) == PAGE * len(ev.block_hashes)
                    parent = ev.parent_block_hash
                    for i, h in enumerate(ev.block_hashes):
                        seen.setdefault(h, at)
                        tokens_of.setdefault(h, ev.token_ids[i * PAGE : (i + 1) * PAGE])
                        parents.setdefault(h, parent)
                        parent = h
        lag = [seen[d] - stored_at[d] for d in digests]
        print(f"store -> subscriber: median {sorted(lag)[len(lag) // 2] * 1000:.1f} ms, max {max(lag) * 1000:.1f} ms")
        assert max(lag) < 0.1, f"a page reached the subscriber {max(lag) * 1000:.0f} ms after it was stored"
        assert [tokens_of[d] for d in digests] == [list(first[i * PAGE : (i + 1) * PAGE]) for i in range(20)]
        assert [parents[d] for d in digests] == [None, *digests[:-1]]
        # removed: a second document pushes the first out of DRAM, the last tier
        engine.add_request(Request("b", second, SamplingParams(max_tokens=2, ignore_eos=True), 1.0))
        run_dry(engine)
        _wait(lambda: _held([m[2] for m in sub.messages]) == _truth(engine))
        gone = [d for d in digests if d not in _truth(engine)]
        assert len(gone) >= 10, "the second document should have evicted most of the first"
        removed = {(h, ev.medium) for _at, _s, b in sub.messages for ev in b.events
                   if type(ev).__name__ == "BlockRemoved" for h in ev.block_hashes}
        assert all((d, "CPU") in removed for d in gone)  # each announced gone from DRAM, its last tier
        # a consumer joining late replays from sequence 0: the same batches, AllBlocksCleared first
        seqs = [s for _at, s, _b in sub.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "the subscriber missed a batch"
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(pub.replay_address)  # type: ignore[arg-type]
        dealer.send_multipart((b"", seq_bytes(0)))
        replayed: dict[int, EventBatch] = {}
        while True:
            _empty, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed[seq_of(seq)] = decoder().decode(payload)
        dealer.close(linger=0)
        assert type(replayed[0].events[0]).__name__ == "AllBlocksCleared"
        assert all(replayed[s] == b for _at, s, b in sub.messages)
        assert _held([replayed[s] for s in sorted(replayed)]) == _truth(engine)
    finally:
        sub.close()
        pub.close()
        cache.close()


def test_the_wire_is_vllms_tagged_arrays() -> None:
    """What llm-d's decoder reads: [ts, [event...], rank], each event [tag, fields...] in vLLM's order; pages named
    by their digests' low 64 bits (vLLM's default) or by the whole digests."""
    a, b = bytes(range(16)), bytes(range(16, 32))
    ia, ib = int.from_bytes(a[8:], "big"), int.from_bytes(b[8:], "big")
    for int_hashes, (ha, hb) in ((True, (ia, ib)), (False, (a, b))):
        events = PageEvents()
        events.describe([(a, None, (1, 2, 3, 4)), (b, a, (5, 6, 7, 8))])
        events.changed(a, "gpu", True)
        events.changed(b, "gpu", True)
        events.changed(a, "gpu", False)
        events.changed(a, "ssd", True)
        batch = EventBatch(ts=1.5, events=to_events(events.take(0.0), 4, int_hashes), data_parallel_rank=0)
        assert msgspec.msgpack.decode(encoder().encode(batch)) == [1.5, [
            ["BlockStored", [ha, hb], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None],
            ["BlockRemoved", [ha], "GPU"],
            ["BlockStored", [ha], None, [1, 2, 3, 4], 4, None, "DISK", None],
        ], 0]
        assert fold(ha) == fold(a) == ia
        as_maps = msgspec.msgpack.encode(as_map(batch))  # vLLM's newer form: maps with "type"
        assert msgspec.msgpack.decode(as_maps)["events"][1] == {"type": "BlockRemoved", "block_hashes": [ha],
                                                                "medium": "GPU"}
        assert decoder().decode(as_maps) == batch == decoder().decode(encoder().encode(batch))
    events.changed(a, "ssd", False)  # its last tier: the page and its tokens are forgotten ...
    assert [(c.tier, c.stored) for c in events.take(0.0)] == [("ssd", False)]
    events.changed(a, "dram", True)  # ... so a copy that comes back later is announced without them
    assert [(c.tier, c.stored, c.info) for c in events.take(0.0)] == [("dram", True, None)]


def test_the_shared_tier_is_announced_and_deduplicated_like_any_tier() -> None:
    """The runtime's shared tier tells ``changed(digest, "shared", ...)``: a page published there is announced once
    (with its tokens while a local tier holds it), a removal only for a page announced there, once."""
    a, b, c = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
    events = PageEvents()
    events.describe([(a, None, (1, 2, 3, 4)), (b, a, (5, 6, 7, 8))])
    events.changed(a, "gpu", True)
    events.changed(a, "shared", True)
    events.changed(a, "shared", True)  # published again (or announced twice): one announcement
    events.changed(b, "gpu", True)
    events.changed(c, "shared", False)  # a miss on a page this replica never announced there: nothing
    taken = events.take(0.0)
    a_info = PageInfo(None, (1, 2, 3, 4))
    assert [(ch.digest, ch.tier, ch.stored, ch.info) for ch in taken] == [
        (a, "gpu", True, a_info), (a, "shared", True, a_info), (b, "gpu", True, PageInfo(a, (5, 6, 7, 8)))]
    assert [e.medium for e in to_events(taken, 4)] == ["GPU", SHARED_MEDIUM, "GPU"]
    events.changed(a, "gpu", False)  # off its last local tier: still held in the shared tier, so announced ...
    assert [(ch.tier, ch.stored) for ch in events.take(0.0)] == [("gpu", False)]
    events.changed(a, "dram", True)  # ... but its tokens are not kept alive by the shared tier
    assert [(ch.tier, ch.stored, ch.info) for ch in events.take(0.0)] == [("dram", True, None)]
    events.changed(b, "shared", True)
    events.changed(a, "shared", False)  # learned gone from the store: announced once
    events.changed(a, "shared", False)
    events.changed(b, "gpu", False)  # b keeps its shared copy
    assert [(ch.digest, ch.tier, ch.stored) for ch in events.take(0.0)] == [
        (b, "shared", True), (a, "shared", False), (b, "gpu", False)]
    events.changed(b, "shared", False)  # its last tier: gone
    events.changed(b, "shared", False)
    assert [(ch.digest, ch.tier, ch.stored) for ch in events.take(0.0)] == [(b, "shared", False)]


def test_pages_known_only_in_the_shared_tier_are_bounded_oldest_forgotten_first() -> None:
    """The store evicts without telling anyone, so a replica remembers at most ``shared_pages`` pages it announced
    only there: past them the oldest is forgotten, silently (a removal of it is no longer announced; publishing it
    again is)."""
    pages = [bytes([i]) * 16 for i in range(4)]
    events = PageEvents(shared_pages=2)
    for d in pages[:3]:
        events.changed(d, "shared", True)
    events.changed(pages[3], "gpu", True)  # on a local tier too: not counted against the bound
    events.changed(pages[3], "shared", True)
    assert len(events.take(0.0)) == 5
    for d in pages:
        events.changed(d, "shared", False)
    assert [ch.digest for ch in events.take(0.0)] == pages[1:]  # pages[0], the oldest, was forgotten
    events.changed(pages[0], "shared", True)
    assert [(ch.digest, ch.stored) for ch in events.take(0.0)] == [(pages[0], True)]


def test_the_shared_medium_round_trips_on_the_wire() -> None:
    """A page published to the shared tier is a ``BlockStored`` in the ``EXTERNAL`` medium, and its removal a
    ``BlockRemoved`` there, as tagged arrays and as maps, read back whole by the decoder consumers use."""
    a, b = bytes(range(16)), bytes(range(16, 32))
    ia, ib = int.from_bytes(a[8:], "big"), int.from_bytes(b[8:], "big")
    assert MEDIUM["shared"] == SHARED_MEDIUM == "EXTERNAL"
    events = PageEvents()
    events.describe([(a, None, (1, 2, 3, 4)), (b, a, (5, 6, 7, 8))])
    for d in (a, b):
        events.changed(d, "gpu", True)
    for d in (a, b):
        events.changed(d, "shared", True)
    events.changed(a, "shared", False)
    batch = EventBatch(ts=2.5, events=to_events(events.take(0.0), 4), data_parallel_rank=0)
    assert msgspec.msgpack.decode(encoder().encode(batch))[1][1:] == [
        ["BlockStored", [ia, ib], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "EXTERNAL", None],  # one chain, one event
        ["BlockRemoved", [ia], "EXTERNAL"],
    ]
    for payload in (encoder().encode(batch), msgspec.msgpack.encode(as_map(batch))):
        back = decoder().decode(payload)
        assert back == batch
        stored, removed = back.events[1], back.events[2]
        assert isinstance(stored, BlockStored) and stored.medium == SHARED_MEDIUM
        assert isinstance(removed, BlockRemoved) and removed.medium == SHARED_MEDIUM


def test_an_address_that_cannot_be_bound_fails_at_start() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        pub = KVEventPublisher(PageEvents(), KVEventsConfig(f"tcp://*:{taken.getsockname()[1]}"), PAGE)
        with pytest.raises(RuntimeError, match="KV events: Address already in use"):
            pub.start()
