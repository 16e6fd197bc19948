"""The shared tier: pages every replica of a fleet can read, kept in a Valkey / Redis deployment the user runs.

A page (every layer of it) is one value under ``kvd:<namespace>:<page digest>``: no hash tag, so pages
spread over the shards; the tenant salt and the model fingerprint are already in the digest. The store
evicts (``maxmemory`` with ``allkeys-lru``) and each value is self-contained (``values``), so nothing here
can outlive its data. What this class guarantees:

- **never a wrong page**: a value is used only whole and verified against the page asked for; a bad one
  (flipped bytes, truncated, another page's, another model's or dtype's) is a miss, counted by cause,
  logged, and deleted so that the next publish replaces it;
- **never a stall**: each round trip has a time budget, and a failing shard is skipped by its breaker
  (``breaker``) until a probe finds it answering; its keys are misses, counted as errors;
- **never a 5xx**: nothing raises to the caller; ``degraded`` says why the tier is degraded (``/readyz``).

It moves bytes only when the ``Mover`` asks (``fetch``, ``publish``); which pages to publish and fetch is
placement's choice. Pages it publishes or finds there are announced to the KV-event recorder as held by the
"shared" tier (the wire's ``EXTERNAL`` medium), and announced gone when a fetch finds one missing or bad.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvdrive.runtime.kvcache.config import SharedTierConfig
from kvdrive.runtime.kvcache.counters import LATENCY_BOUNDS, SharedCounters
from kvdrive.runtime.kvcache.store.faults import FaultLog
from kvdrive.runtime.kvcache.store.shared.breaker import Breaker
from kvdrive.runtime.kvcache.store.shared.shards import Endpoint, ShardError, Shards
from kvdrive.runtime.kvcache.store.shared.values import CAUSES, BadValue, PageFormat

if TYPE_CHECKING:
    from kvdrive.runtime.kvcache.store.page_events import PageEvents

log = logging.getLogger(__name__)

PUBLISHED_MEMORY = 1 << 16  # digests this replica remembers publishing (not published again while remembered)


class SharedTier:
    name = "shared"

    def __init__(self, config: SharedTierConfig, fmt: PageFormat, shards: Shards | None = None) -> None:
        self.config, self.format = config, fmt
        self.shards = shards if shards is not None else Shards(config)
        self._prefix = f"kvd:{config.namespace}:".encode()
        self._lock = threading.Lock()
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._events: PageEvents | None = None
        self._hits = self._misses = self._read = self._written = self._npub = self._fetches = 0
        self._fetch_s = 0.0
        self._buckets = [0] * len(LATENCY_BOUNDS)
        self._errors = FaultLog(log, "shared")
        self._bad = FaultLog(log, "shared")
        log.info("shared tier: %s, %s shards, %d-byte pages", config.describe(), self.shards.mode, fmt.value_bytes)

    def key(self, digest: bytes) -> bytes:
        return self._prefix + digest.hex().encode()

    def watch(self, events: PageEvents) -> None:
        """Announce the pages published from now on (and their loss) to ``events``."""
        self._events = events

    # --- the Mover's calls ---------------------------------------------------------------------------
    def fetch(self, digests: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each page's blocks [num_layers, block_bytes] uint8, verified; None where it is a miss."""
        if not digests:
            return []
        t0 = time.perf_counter()
        replies = self.shards.get([self.key(d) for d in digests])
        out: list[torch.Tensor | None] = []
        hits = nbytes = 0
        gone: list[bytes] = []
        bad: list[bytes] = []
        for d, r in zip(digests, replies, strict=True):
            if isinstance(r, ShardError):
                self._errors.record(r.kind, "shared tier: %s (its pages are recomputed)", r.detail, level=logging.WARNING)
                out.append(None)
                continue
            if r is None:
                gone.append(d)
                out.append(None)
                continue
            try:
                out.append(self.format.decode(d, r))
            except BadValue as exc:
                self._bad.record(exc.cause, "shared tier: page %s refused (%s); recomputed", d.hex(), exc,
                                 level=logging.WARNING)
                bad.append(d)
                gone.append(d)
                out.append(None)
                continue
            hits += 1
            nbytes += len(r)
        took = time.perf_counter() - t0
        if bad:  # a bad value is never served again: the next publish of the page writes a good one
            self.shards.delete([self.key(d) for d in bad])
        self._forget(gone)
        if self._events is not None:  # a page found there is announced as held (so its later loss is too)
            for d, g in zip(digests, out, strict=True):
                if g is not None:
                    self._events.changed(d, "shared", True)
        with self._lock:
            self._hits += hits
            self._misses += len(digests) - hits
            self._read += nbytes
            self._fetches += 1
            self._fetch_s += took
            for i, bound in enumerate(LATENCY_BOUNDS):
                if took <= bound:
                    self._buckets[i] += 1
        return out

    def unpublished(self, digests: Sequence[bytes]) -> list[bytes]:
        """The pages of ``digests`` this replica has not published lately."""
        with self._lock:
            return [d for d in digests if d not in self._published]

    def publish(self, pages: Sequence[tuple[bytes, torch.Tensor]]) -> int:
        """Write pages (digest, blocks [num_layers, block_bytes] uint8); returns how many were stored."""
        if not pages:
            return 0
        values = [(self.key(d), self.format.encode(d, blocks)) for d, blocks in pages]
        replies = self.shards.put(values)
        stored: list[bytes] = []
        nbytes = 0
        for (d, _), (_, v), r in zip(pages, values, replies, strict=True):
            if isinstance(r, ShardError):
                self._errors.record(r.kind, "shared tier: publish failed: %s", r.detail, level=logging.WARNING)
                continue
            stored.append(d)
            nbytes += len(v)
        with self._lock:
            self._written += nbytes
            self._npub += len(stored)
            for d in stored:
                self._published[d] = None
                self._published.move_to_end(d)
            while len(self._published) > PUBLISHED_MEMORY:
                self._published.popitem(last=False)
        if self._events is not None:
            for d in stored:
                self._events.changed(d, "shared", True)
        return len(stored)

    def _forget(self, digests: list[bytes]) -> None:
        """Pages found absent or bad: no longer remembered as published, and announced gone from the shared
        tier (the recorder drops the announcement of a page it never announced there)."""
        if not digests:
            return
        with self._lock:
            for d in digests:
                self._published.pop(d, None)
        if self._events is not None:
            for d in digests:
                self._events.changed(d, "shared", False)

    # --- health --------------------------------------------------------------------------------------
    def probe(self) -> None:
        """Try again what is failing: shards whose breaker's cooldown is over, or the topology when no
        endpoint answered yet. Blocking (up to the time budget per shard): called off the event loop."""
        if self.shards.mode == "unknown":
            self.shards.discover()
            return
        for ep, br in self.shards.breakers():
            if br.probe_due() and br.allow():
                if self.shards.ping(ep):
                    log.info("shared tier: %s:%d answers again", *ep)

    def degraded(self) -> str | None:
        """Why the shared tier is degraded now, or None."""
        return self._why(self.shards.failing())

    def _why(self, failing: list[tuple[Endpoint, Breaker]]) -> str | None:
        if self.shards.mode == "unknown":
            return f"shared tier: no endpoint of {self.config.describe()} answered"
        if not failing:
            return None
        names = ", ".join(f"{h}:{p}" for (h, p), _ in failing)
        return f"shared tier: {len(failing)} shard(s) failing ({names}: {failing[0][1].last_error}); their pages are recomputed"

    def counters(self) -> SharedCounters:
        with self._lock:
            counts = SharedCounters(self._hits, self._misses, self._read, self._written, self._npub,
                                    dict(self._errors.counts), {c: self._bad.counts.get(c, 0) for c in CAUSES},
                                    self._fetches, self._fetch_s, tuple(self._buckets))
        failing = self.shards.failing()
        return dataclasses.replace(counts, degraded=self._why(failing), shards=len(self.shards.shards),
                                   failing_shards=len(failing))

    def close(self) -> None:
        self.shards.close()
