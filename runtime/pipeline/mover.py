"""The one mover of bytes between and within the tiers (``pipeline`` moves).

``Mover`` is the only caller of a tier's ``read``, ``write``, ``discard`` and ``resize``. Every movement runs
as prepare (the store's bookkeeping reserves slots and pins sources, under its lock) -> run (here: bytes move,
no lock held) -> complete (the store publishes or rolls back, under its lock). Where the bytes go is
placement's choice (``Placer``; the victim rules of a full tier are ``placement.demotion``); the store only
keeps the table. The Mover's halves:

- ``Moves`` (``moves.py``): running prepared moves, making room (demotions), and discarding freed slots (a
  dropped copy's slot is discarded from its tier, then released, outside the lock);
- ``Mover`` (this module): puts, admissions, promotions and write-back copies;
- ``ReadPath`` (``read_path.py``): reads (``fetch``) and scrubs;
- ``Resizer`` (``resize.py``): live budget changes.

Who calls it, by priority: a step's demand reads and its load phase run in the engine thread
(``engine/page_reads.py``, ``engine/prefix_reuse.py``); prefetch and write-back run on the transfer workers
(``transfer.py``), prefetch first.
"""

from __future__ import annotations

import logging
import time

import torch

from kvdrive.runtime.kvcache import BlockKey, CacheFullError, Move, TieredKVStore, TierName, VictimRules
from kvdrive.runtime.kvcache.tiers.base import TierIOError
from kvdrive.runtime.kvcache.tiers.rows import gather_rows
from kvdrive.runtime.pipeline.read_path import ReadPath
from kvdrive.runtime.pipeline.resize import Resizer
from kvdrive.runtime.placement.demotion import KeepHierarchy, replaces_stored_copy

log = logging.getLogger(__name__)


class Mover(ReadPath, Resizer):
    def __init__(self, store: TieredKVStore, rules: VictimRules | None = None) -> None:
        super().__init__(store, rules if rules is not None else KeepHierarchy())

    def prepare_promote(self, keys: list[BlockKey], tier: TierName) -> list[Move]:
        """Plan ``tier`` copies of ``keys`` from their fastest copies: the blocks are pinned (making room
        never evicts what is being promoted), room is made (demotions run now, in this thread), destination
        slots reserved. Run the returned moves with ``run_moves`` (any thread) and ``complete_moves``."""
        want = self.store.pin_for_promotion(keys, tier)
        if not want:
            return []
        self.make_room(tier, len(want))
        return self.store.reserve_promotions(want, tier)

    def promote(self, keys: list[BlockKey], tier: TierName = "gpu") -> int:
        """Give ``keys`` a ``tier`` copy now (prepare, run and complete in this thread); returns how many."""
        moves = self.prepare_promote(keys, tier)
        return self.complete_moves(moves, self.run_moves(moves)) if moves else 0

    def replicate(self, keys: list[BlockKey], tier: TierName) -> int:
        """Write a copy of each block to a lower ``tier`` (e.g. ssd, for persistence), keeping its upper
        copies. Returns how many copies were added."""
        return self.promote(keys, tier) if tier in self.store.tiers else 0

    # --- writing new bytes -----------------------------------------------------------------------
    def put(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu", needed: bool = True,
            persistent: bool = False, pin_wait_s: float = 2.0) -> None:
        """Store blocks [n, block_bytes] uint8 in ``tier``, evicting as needed. Copies become readable when
        their write completed. A persistent (content-addressed) key already stored is only touched, unless
        placement says its copy must be replaced (``replaces_stored_copy``). When every evictable block is
        pinned by in-flight transfers, waits up to ``pin_wait_s`` for them."""
        cap = self.store.capacity(tier)
        if len(keys) > cap > 0:  # a batch bigger than the tier: in parts, so later parts can evict earlier
            for i in range(0, len(keys), cap):
                self.put(keys[i : i + cap], blocks[i : i + cap], tier, needed, persistent, pin_wait_s)
            return
        try:
            rows = self.store.rows_to_write(keys, needed, persistent, replaces_stored_copy)
        finally:
            self.settle_freed()
        if not rows:
            return
        deadline = time.monotonic() + pin_wait_s
        while True:
            try:
                self._add_copies([keys[i] for i in rows], blocks, rows, tier, needed, persistent, strict=True)
                return
            except CacheFullError:
                if time.monotonic() > deadline or not self.store.any_pinned():
                    raise
            time.sleep(0.002)

    def admit(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu",
              src: list[TierName | None] | None = None) -> int:
        """Add a ``tier`` copy of stored blocks from bytes already read (blocks [n, block_bytes], e.g. from
        ``fetch``): inclusive promotion without a second read. Blocks already in ``tier``, gone, or for
        which no slot can be freed are skipped. Returns how many copies were added."""
        rows = self.store.rows_to_admit(keys, tier)
        if not rows:
            return 0
        added = self._add_copies([keys[i] for i in rows], blocks, rows, tier, True, False, strict=False)
        if src is not None:
            self.store.count_admitted([src[i] for i in added], tier)
        return len(added)

    def _add_copies(self, keys: list[BlockKey], blocks: torch.Tensor, rows: list[int], tier: TierName,
                    needed: bool, persistent: bool, strict: bool) -> list[int]:
        """Write blocks[rows[i]] as the ``tier`` copy of keys[i]: make room, reserve, write (no lock),
        publish. ``strict``: all or nothing (CacheFullError); else the blocks that got no slot are skipped.
        Returns the rows written."""
        store = self.store
        self.make_room(tier, len(keys))
        try:
            todo = store.reserve_writes(keys, rows, tier, needed, persistent, strict)
        finally:
            self.settle_freed()
        if not todo:
            return []
        src = blocks if [r for r, _, _ in todo] == list(range(blocks.shape[0])) else \
            gather_rows(blocks, [r for r, _, _ in todo])
        try:
            store.tiers[tier].write([s for _, _, s in todo], src, [b.key for _, b, _ in todo],
                                    [b.persistent for _, b, _ in todo])
        except TierIOError:
            store.abort_writes(todo, tier)
            self.settle_freed()
            if strict:
                raise
            return []
        store.publish_writes(todo, tier)
        return [r for r, _, _ in todo]

    def close(self) -> None:
        """Wait for a running scrub (it reads the tiers), then close the store."""
        self.wait_for_scrub()
        self.store.close()
