"""The router's subscriptions to its replicas' KV events: what each replica's tiers hold, as it changes.

A replica that publishes KV events (``kvdrive serve --kv-events-endpoint tcp://*:PORT``) names the port in
its routing info. ``EventFeed`` keeps one subscription per such replica (a ZMQ SUB socket on the router's event
loop) and applies each batch to the ``PrefixIndex``: a page counts as held while some tier (medium) holds it.

Starting and gaps: the first batch heard, or one whose sequence number does not follow the last, makes the
subscription ask the replica's replay socket for everything from where it stands (from 0 when it starts, so a
replica whose buffer still holds its first batch, ``AllBlocksCleared`` and the pages it held at start, gives the
exact state). When the replay cannot close the gap (no replay socket, or its buffer no longer reaches back),
the subscription asks the router for one poll of ``/v1/kvdrive/prefixes`` (``wants_snapshot``).

Down: a replica sends a batch at least every heartbeat (an empty one when idle). A subscription that heard
nothing for ``stale_seconds`` is not ``live``, and the router polls that replica's page list again as it
did before events, until batches come back (ZMQ reconnects by itself; the gap is replayed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from kvdrive.router.backends import EventSource, host_port
from kvdrive.router.index import PrefixIndex
from kvdrive.runtime.protocol.kv_event_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decoder,
    seq_bytes,
    seq_of,
)

log = logging.getLogger("kvdrive.router")

REPLAY_TIMEOUT_SECONDS = 2.0


def zmq_address(url: str, port: int) -> str:
    """The replica's ``port`` on its host, as ZMQ names a TCP peer."""
    return f"tcp://{host_port(url, port)}"


class _Subscription:
    def __init__(self, url: str, source: EventSource, index: PrefixIndex, ctx: zmq.asyncio.Context) -> None:
        self.url = url
        self.source = source
        self.index = index
        self.ctx = ctx
        self.heard = -1e9  # time.monotonic() of the last batch
        self.last_seq: int | None = None
        self.wants_snapshot = False
        self.batches = 0
        self.task: asyncio.Task[None] | None = None
        self._decode = decoder()

    async def run(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sock.connect(zmq_address(self.url, self.source.port))
        log.info("subscribed to the KV events of %s (port %d)", self.url, self.source.port)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("KV events of %s: a message of %d frames ignored", self.url, len(frames))
                    continue
                await self._take(seq_of(frames[1]), frames[2])
        finally:
            sock.close()

    async def _take(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decode.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("KV events of %s: batch %d unreadable (%s); polling its pages once", self.url, seq, exc)
            self.wants_snapshot = True
            return
        self.heard = time.monotonic()
        if self.last_seq is not None and seq == self.last_seq + 1:
            self._apply(batch)
            self.last_seq = seq
            return
        # the first batch heard, a gap, or a new life of the publisher (its numbers start over)
        start = 0 if self.last_seq is None or seq <= self.last_seq else self.last_seq + 1
        replayed = await self._replay(start)
        if replayed and replayed[0][0] == start:
            if start == 0:
                self.index.events_cleared(self.url)
            for s, b in replayed:
                self._apply(b)
                self.last_seq = s
        else:
            log.info("KV events of %s: batches from %d cannot be replayed; polling its pages once", self.url, start)
            self.wants_snapshot = True
        if self.last_seq is None or seq > self.last_seq:
            self._apply(batch)
            self.last_seq = seq

    async def _replay(self, start: int) -> list[tuple[int, EventBatch]]:
        """Batches ``start``.. from the replica's replay socket, in order; [] when it has none or is away."""
        if self.source.replay_port is None:
            return []
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(zmq_address(self.url, self.source.replay_port))
        out: list[tuple[int, EventBatch]] = []
        try:
            await sock.send_multipart((b"", seq_bytes(start)))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_SECONDS)
                if len(frames) != 3 or frames[1] == END_SEQ:
                    return out
                out.append((seq_of(frames[1]), self._decode.decode(frames[2])))
        except (TimeoutError, msgspec.DecodeError) as exc:
            log.warning("KV events of %s: replay from %d failed (%s)", self.url, start, type(exc).__name__)
            return []
        finally:
            sock.close()

    def _apply(self, batch: EventBatch) -> None:
        self.batches += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.index.events_stored(self.url, ev.block_hashes, ev.medium or "")
            elif isinstance(ev, BlockRemoved):
                self.index.events_removed(self.url, ev.block_hashes, ev.medium or "")
            elif isinstance(ev, AllBlocksCleared):
                self.index.events_cleared(self.url)


class EventFeed:
    """One subscription per replica that publishes KV events (mutated from the event loop only)."""

    def __init__(self, index: PrefixIndex, stale_seconds: float = 3.0) -> None:
        self.index = index
        self.stale_seconds = stale_seconds
        self._ctx: zmq.asyncio.Context | None = None
        self._subs: dict[str, _Subscription] = {}
        self._dropped: set[asyncio.Task[None]] = set()  # cancelled, their sockets not yet closed

    def follow(self, url: str, source: EventSource | None) -> None:
        """Subscribe to ``url``'s events (``source``: where, from its routing info; None: it publishes none)."""
        sub = self._subs.get(url)
        if sub is not None and sub.source == source:
            return
        self.drop(url)
        if source is None:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self._subs[url] = _Subscription(url, source, self.index, self._ctx)
        sub.task = asyncio.create_task(sub.run())

    def drop(self, url: str) -> None:
        sub = self._subs.pop(url, None)
        if sub is not None and sub.task is not None:
            sub.task.cancel()
            self._dropped.add(sub.task)  # until it has closed its socket (``stop`` waits for that)
            sub.task.add_done_callback(self._dropped.discard)

    def live(self, url: str, now: float) -> bool:
        """Whether ``url``'s events are heard and in step (its page list need not be polled)."""
        sub = self._subs.get(url)
        return sub is not None and now - sub.heard <= self.stale_seconds and not sub.wants_snapshot

    def wants_snapshot(self, url: str) -> bool:
        """Whether ``url``'s subscription needs one poll of its page list (a gap it could not replay); asking
        clears the request (the caller polls)."""
        sub = self._subs.get(url)
        if sub is None or not sub.wants_snapshot:
            return False
        sub.wants_snapshot = False
        return True

    def batches(self, url: str) -> int:
        sub = self._subs.get(url)
        return sub.batches if sub is not None else 0

    async def stop(self) -> None:
        tasks = [s.task for s in self._subs.values() if s.task is not None] + list(self._dropped)
        self._subs.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
