"""Publishing KV events: a replica tells routers and indexers (llm-d, Dynamo, ``kvdrive route``) what its tiers
hold as it changes, on vLLM's ``kv_events`` wire (``kvdrive.runtime.protocol.kv_event_wire``).

``KVEventPublisher`` owns one thread and its two ZMQ sockets (sockets are used only from the thread that made
them): a PUB socket on ``endpoint`` (bound when the address has a wildcard, ``ipc://`` or ``inproc://``, as vLLM
does; otherwise connected, for an indexer that binds), and, with ``replay_endpoint``, a ROUTER socket that
replays buffered batches to a consumer that joined late or saw a gap in the sequence numbers. The thread takes
the tiers' changes from ``PageEvents`` (waiting on its condition, so a page reaches the wire a few
milliseconds after a tier published it), groups them into events (consecutive pages of one chain on one tier
become one ``BlockStored``), and sends one ``EventBatch`` per wake-up. The first batch is ``AllBlocksCleared``
followed by what the tiers hold at start (pages recovered from the SSD tier), so a consumer that knew an
earlier life of this pod starts over. When nothing changed for ``heartbeat_seconds`` it sends an empty batch:
a subscriber that hears nothing for a few heartbeats knows the stream is down, not idle.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvdrive.runtime.kvcache import PageChange, PageEvents
from kvdrive.runtime.protocol.kv_event_wire import (
    END_SEQ,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    ExternalBlockHash,
    as_map,
    encoder,
    fold,
    seq_bytes,
    seq_of,
)

log = logging.getLogger(__name__)

WAIT_SECONDS = 0.02  # the longest a replay request waits for the thread


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str  # e.g. tcp://*:5557 (bind) or tcp://indexer:5557 (connect)
    replay_endpoint: str | None = None  # e.g. tcp://*:5558 (always bound)
    topic: str = ""
    int_hashes: bool = True  # vLLM's default: a page's hash is its digest's low 64 bits, an unsigned int
    maps: bool = False  # batches and events as maps with "type" (vLLM's newer form), not positional arrays
    buffer_batches: int = 10_000  # batches kept for replay
    heartbeat_seconds: float = 1.0
    hwm: int = 100_000


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local address, connect to a named host."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def to_events(changes: list[PageChange], page_size: int, int_hashes: bool = True) -> list[Event]:
    """Tier changes as wire events, in order: runs of stored pages that chain on one tier share an event.
    ``int_hashes``: pages named by their digests' low 64 bits (vLLM's default), else by the whole digests."""
    name: Callable[[bytes], ExternalBlockHash] = fold if int_hashes else bytes
    out: list[Event] = []
    for c in changes:
        medium = MEDIUM[c.tier]
        last = out[-1] if out else None
        h = name(c.digest)
        if c.stored:
            parent = name(c.info.parent) if c.info is not None and c.info.parent is not None else None
            tokens = list(c.info.tokens) if c.info is not None else []
            if (isinstance(last, BlockStored) and last.medium == medium and parent is not None
                    and parent == last.block_hashes[-1] and bool(tokens) == bool(last.token_ids)):
                last.block_hashes.append(h)
                last.token_ids.extend(tokens)
                continue
            out.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens,
                                   block_size=page_size, lora_id=None, medium=medium, lora_name=None))
        elif isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(h)
        else:
            out.append(BlockRemoved(block_hashes=[h], medium=medium))
    return out


class KVEventPublisher:
    def __init__(self, events: PageEvents, config: KVEventsConfig, page_size: int) -> None:
        self.events = events
        self.config = config
        self.page_size = page_size
        self.sequence = 0  # the next batch's number
        self.address: str | None = None  # where the PUB socket is (a bound wildcard port resolved)
        self.replay_address: str | None = None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_batches)
        self._running = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvdrive-kv-events", daemon=True)

    def start(self) -> None:
        """Open the sockets (raises if an endpoint cannot be bound) and start publishing."""
        self._running.set()
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"KV events: {self._error}") from self._error

    def close(self) -> None:
        self._running.clear()
        self.events.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # --- the thread ---------------------------------------------------------------------------------------
    def _sockets(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        cfg = self.config
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(cfg.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if binds(cfg.endpoint):
            pub.bind(cfg.endpoint)
            self.address = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(cfg.endpoint)
            self.address = cfg.endpoint
        replay = None
        if cfg.replay_endpoint:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(cfg.replay_endpoint)
            self.replay_address = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            pub, replay = self._sockets(ctx)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            ctx.term()
            return
        log.info("KV events: publishing on %s%s (topic %r)", self.config.endpoint,
                 f", replay on {self.config.replay_endpoint}" if replay is not None else "", self.config.topic)
        self._ready.set()
        pack, topic = encoder(), self.config.topic.encode()
        pending: list[Event] = [AllBlocksCleared()]  # a new life of this pod: consumers start over
        last_sent = 0.0
        try:
            while self._running.is_set():
                if replay is not None and replay.poll(0):
                    self._replay(replay)
                events = pending + to_events(self.events.take(WAIT_SECONDS), self.page_size,
                                             self.config.int_hashes)
                pending = []
                now = time.monotonic()
                if events or now - last_sent >= self.config.heartbeat_seconds:
                    batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
                    payload = pack.encode(as_map(batch) if self.config.maps else batch)
                    pub.send_multipart((topic, seq_bytes(self.sequence), payload))
                    self._buffer.append((self.sequence, payload))
                    self.sequence += 1
                    last_sent = now
        except Exception:  # the replica keeps serving; consumers fall back to polling
            log.exception("KV events: the publisher stopped")
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            ctx.term()

    def _replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored (want identity, empty, 8-byte seq)",
                        len(frames))
            return
        ident, start = frames[0], seq_of(frames[2])
        for seq, payload in self._buffer:
            if seq >= start:
                replay.send_multipart((ident, b"", seq_bytes(seq), payload))
        replay.send_multipart((ident, b"", END_SEQ, b""))
