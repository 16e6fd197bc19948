"""A prompt's prefix from the shared tier, fetched ahead of the prefill that needs it, and sealed pages published.

Split from ``prefix`` (which looks up and reads the pages the local tiers hold). Two jobs, both on the shared
tier's own transfer queue (network round trips never wait behind local write-backs, nor they behind them):

- ``warm`` (when a request arrives): the prompt's leading pages that no local tier holds are fetched from the
  shared tier in batches, verified, up to the first miss, and staged in host memory (at most ``stage_bytes``).
  The scheduler admits the request once its warm-up is done (``PrefixWarmup.done``); the engine thread then
  lands the staged pages in placement's landing tier as ordinary stored pages (``land``: page ids are made
  on the engine thread only, and a memory tier's copies dropped only there, the contract's thread rule), so
  the prefix lookup finds them and ``cached_tokens`` counts them;
- ``publish`` (after a step): the sealed pages placement picks are written to the shared tier.

Nothing here blocks the engine thread on the network, and nothing raises to it: a failed job is a miss.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvdrive.runtime.kvcache.mover.shared import SharedMoves
from kvdrive.runtime.kvcache.mover.transfer import Priority, TransferHandle, TransferQueue
from kvdrive.runtime.kvcache.placement import Placer
from kvdrive.runtime.kvcache.store import BlockStore, CacheFullError, KVLayout
from kvdrive.runtime.prompt.digests import page_digests

log = logging.getLogger(__name__)

FETCH_PAGES = 32  # pages fetched per round trip (a batch: one pipeline per shard)


@dataclass
class PrefixWarmup:
    """One prompt's prefix being fetched from the shared tier."""

    handle: TransferHandle | None = None
    staged: list[tuple[bytes, torch.Tensor]] = field(default_factory=list)  # fetched pages, to be landed

    def done(self) -> bool:
        return self.handle is None or self.handle.done()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the fetch to end (a failed one ends too: the job logged it)."""
        if self.handle is not None:
            with contextlib.suppress(Exception):
                self.handle.wait(timeout)


class SharedPrefix:
    def __init__(self, layout: KVLayout, store: BlockStore, moves: SharedMoves, placer: Placer,
                 queue: TransferQueue, stage_bytes: int) -> None:
        self.layout, self.store, self.moves, self.placer, self.queue = layout, store, moves, placer, queue
        self.stage_pages = max(1, stage_bytes // layout.page_bytes)
        self.warmed_pages = 0  # pages fetched from the shared tier for prompts and landed (engine thread)

    # --- fetching a prompt's prefix ----------------------------------------------------------------
    def warm(self, prompt: Sequence[int], root: bytes) -> PrefixWarmup | None:
        """Start fetching ``prompt``'s leading pages (on the chain from ``root``) that no local tier holds;
        None when the prompt has no full page before its last token."""
        s = self.layout.page_size
        n = (len(prompt) - 1) // s
        if n <= 0:
            return None
        tokens = list(prompt[: n * s])
        warmup = PrefixWarmup()
        warmup.handle = self.queue.submit(lambda: self._warm(tokens, root, warmup), Priority.PREFETCH)
        return warmup

    def _warm(self, tokens: list[int], root: bytes, warmup: PrefixWarmup) -> int:
        t0 = time.perf_counter()
        digests = page_digests(root, tokens, self.layout.page_size)
        first = self._locally_stored(digests)
        todo = digests[first:]
        if not todo:
            return 0
        todo = todo[: self.stage_pages]
        fetched = 0
        for b in range(0, len(todo), FETCH_PAGES):
            batch = todo[b : b + FETCH_PAGES]
            got = self.moves.fetch(batch)
            good = next((i for i, g in enumerate(got) if g is None), len(batch))
            warmup.staged.extend((d, g) for d, g in zip(batch[:good], got[:good], strict=True) if g is not None)
            fetched += good
            if good < len(batch):
                break
        if fetched:
            log.info("shared tier: %d of %d prompt pages fetched (%.1f MB, %.0f ms; %d stored locally)", fetched,
                     len(todo), fetched * self.layout.page_bytes / 1e6, 1e3 * (time.perf_counter() - t0), first)
        return fetched

    def _locally_stored(self, digests: list[bytes]) -> int:
        """How many leading pages of ``digests`` every layer of which some local tier holds."""
        L = self.layout.num_layers
        where = self.store.where_many(self.moves.keys(digests))
        for p in range(len(digests)):
            if any(t is None for t in where[p * L : (p + 1) * L]):
                return p
        return len(digests)

    def land(self, warmup: PrefixWarmup) -> None:
        """Engine thread, before the request's prefix lookup: store the pages its warm-up staged."""
        staged, warmup.staged = warmup.staged, []
        if not staged:
            return
        tier = self.placer.shared_landing_tier(len(staged) * self.layout.num_layers)
        try:
            self.moves.land([d for d, _ in staged], [p for _, p in staged], tier)
            self.warmed_pages += len(staged)
        except CacheFullError:
            log.warning("shared tier: no room in the %s tier for %d fetched pages; they are recomputed", tier,
                        len(staged))

    # --- publishing sealed pages -------------------------------------------------------------------------
    def publish(self, digests: list[bytes]) -> None:
        """Write these sealed pages to the shared tier in the background."""
        if digests:
            moves = self.moves
            self.queue.submit(lambda: moves.publish(digests), Priority.WRITEBACK)
