"""The one mover of bytes between and within the tiers (``kvcache.mover``).

``Mover`` is the only caller of a tier's ``read``, ``write``, ``discard`` and ``resize``. Every movement runs
as prepare (the store's bookkeeping reserves slots and pins sources, under its lock) -> run (here: bytes move,
no lock held) -> complete (the store publishes or rolls back, under its lock). Where the bytes go is
placement's choice (``Placer``; its rules for a full tier reach the store as ``contract.Eviction``); the store only
keeps the table. The Mover is composed of parts, each over one part of the store:

- ``MoveRunner`` (``runner.py``): running prepared moves, making room (demotions), and discarding freed slots (a
  dropped copy's slot is discarded from its tier, then released, outside the lock);
- ``Mover`` (this module): puts, admissions, promotions and write-back copies (over the store's ``WriteBook``),
  and the parts' operations;
- ``BlockReader`` (``reads.py``): reads (``fetch``) and scrubs;
- ``Resizer`` (``resize.py``): live budget changes;
- the sliding-window snapshots' bytes (``store.tiers.window_files``): ``write_window`` / ``read_window``.

Who calls it, by priority: a step's demand reads and its load phase run in the engine thread
(``kvcache/step_reads.py``, ``kvcache/prefix.py``); prefetch and write-back run on the transfer workers
(``transfer.py``), prefetch first.
"""

from __future__ import annotations

import logging
import time

import torch

from kvdrive.runtime.kvcache.contract import Move
from kvdrive.runtime.kvcache.mover.reads import BlockReader
from kvdrive.runtime.kvcache.mover.resize import Resizer
from kvdrive.runtime.kvcache.mover.runner import MoveRunner
from kvdrive.runtime.kvcache.store.budgets import TierBudgets, TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.layout import CacheFullError
from kvdrive.runtime.kvcache.store.store import BlockStore
from kvdrive.runtime.kvcache.store.tiers.base import TierIOError
from kvdrive.runtime.kvcache.store.tiers.rows import gather_rows
from kvdrive.runtime.kvcache.store.tiers.window_files import WindowFiles

log = logging.getLogger(__name__)


class Mover:
    def __init__(self, store: BlockStore) -> None:
        """The mover of ``store``'s bytes; placement's rules reach it through the store (``contract.Eviction``)."""
        self.store = store
        self.runner = MoveRunner(store.table, store.tiers, store.device)  # moves, room, freed slots
        self.reader = BlockReader(self.runner, store.reads)  # fetch and scrub
        self.resizer = Resizer(self.runner, store.resize)  # live budget changes
        self.writes = store.writes  # puts, admissions and promotions run here, over the store's write bookkeeping
        self.spilled = 0  # new blocks ``put`` stored below the tier asked for (it had no slot to give)

    # --- the parts' operations, as the one mover's contract --------------------------------------
    def fetch(self, keys: list[BlockKey], device: torch.device | None = None,
              count: bool = True) -> tuple[torch.Tensor, list[TierName | None]]:
        """``BlockReader.fetch``: blocks [n, block_bytes] and the tier each was read from (None: a miss)."""
        return self.reader.fetch(keys, device, count)

    def scrub(self, tier: TierName = "ssd", chunk: int = 256) -> int:
        """``BlockReader.scrub``: drop the corrupt copies of ``tier``; returns how many."""
        return self.reader.scrub(tier, chunk)

    def set_budgets(self, hot_bytes: int | None = None, dram_bytes: int | None = None, ssd_bytes: int | None = None,
                    defer: frozenset[TierName] = frozenset()) -> TierBudgets:
        """``Resizer.set_budgets``: apply new budgets live (BudgetError, nothing changed, when impossible)."""
        return self.resizer.set_budgets(hot_bytes, dram_bytes, ssd_bytes, defer)

    def shrink(self, tier: TierName, budget_bytes: int) -> TierBudgets:
        """``Resizer.shrink``: the deferred shrink of one tier (the SSD tier: off the engine thread)."""
        return self.resizer.shrink(tier, budget_bytes)

    def run_moves(self, moves: list[Move]) -> list[bool]:
        """``MoveRunner.run_moves``: copy prepared moves' bytes (any thread)."""
        return self.runner.run_moves(moves)

    def complete_moves(self, moves: list[Move], ok: list[bool]) -> int:
        """``MoveRunner.complete_moves``: publish the moves that arrived; returns how many."""
        return self.runner.complete_moves(moves, ok)

    def prepare_promote(self, keys: list[BlockKey], tier: TierName) -> list[Move]:
        """Plan ``tier`` copies of ``keys`` from their fastest copies: the blocks are pinned (making room
        never evicts what is being promoted), room is made (demotions run now, in this thread), destination
        slots reserved. Run the returned moves with ``run_moves`` (any thread) and ``complete_moves``."""
        want = self.writes.pin_for_promotion(keys, tier)
        if not want:
            return []
        self.runner.make_room(tier, len(want))
        return self.writes.reserve_promotions(want, tier)

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
        placement says its copy must be replaced (``Eviction.replaces``). When ``tier`` cannot take them
        (every evictable block pinned by in-flight transfers: a write-back to a slow disk pins the device
        copies it reads), they go to the nearest tier below that can (``spilled`` counts them), so a step
        never waits for background I/O; only when no tier can, it waits up to ``pin_wait_s`` for the pins."""
        cap = self.store.resize.capacity(tier)
        if len(keys) > cap > 0:  # a batch bigger than the tier: in parts, so later parts can evict earlier
            for i in range(0, len(keys), cap):
                self.put(keys[i : i + cap], blocks[i : i + cap], tier, needed, persistent, pin_wait_s)
            return
        try:
            rows = self.writes.rows_to_write(keys, needed, persistent)
        finally:
            self.runner.settle_freed()
        if not rows:
            return
        todo = [keys[i] for i in rows]
        below = [t for t in self.writes.tiers_below(tier) if self.store.resize.capacity(t) >= len(rows)]
        deadline = time.monotonic() + pin_wait_s
        while True:
            try:
                self._add_copies(todo, blocks, rows, tier, needed, persistent, strict=True)
                return
            except CacheFullError as full:
                for lower in below:
                    try:
                        self._add_copies(todo, blocks, rows, lower, needed, persistent, strict=True)
                    except (CacheFullError, TierIOError):  # full as well, or a disk failing to write
                        continue
                    self.spilled += len(rows)
                    log.info("%d new blocks went to the %s tier: the %s tier had no slot (%s)", len(rows), lower,
                             tier, full)
                    return
                if time.monotonic() > deadline or not self.writes.any_pinned():
                    raise
            time.sleep(0.002)

    def admit(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu",
              src: list[TierName | None] | None = None) -> int:
        """Add a ``tier`` copy of stored blocks from bytes already read (blocks [n, block_bytes], e.g. from
        ``fetch``): inclusive promotion without a second read. Blocks already in ``tier``, gone, or for
        which no slot can be freed are skipped. Returns how many copies were added."""
        rows = self.writes.rows_to_admit(keys, tier)
        if not rows:
            return 0
        added = self._add_copies([keys[i] for i in rows], blocks, rows, tier, True, False, strict=False)
        if src is not None:
            self.writes.count_admitted([src[i] for i in added], tier)
        return len(added)

    def _add_copies(self, keys: list[BlockKey], blocks: torch.Tensor, rows: list[int], tier: TierName,
                    needed: bool, persistent: bool, strict: bool) -> list[int]:
        """Write blocks[rows[i]] as the ``tier`` copy of keys[i]: make room, reserve, write (no lock),
        publish. ``strict``: all or nothing (CacheFullError); else the blocks that got no slot are skipped.
        Returns the rows written."""
        writes = self.writes
        self.runner.make_room(tier, len(keys))
        try:
            todo = writes.reserve_writes(keys, rows, tier, needed, persistent, strict)
        finally:
            self.runner.settle_freed()
        if not todo:
            return []
        src = blocks if [r for r, _, _ in todo] == list(range(blocks.shape[0])) else \
            gather_rows(blocks, [r for r, _, _ in todo])
        try:
            self.store.tiers[tier].write([s for _, _, s in todo], src, [b.key for _, b, _ in todo],
                                         [b.persistent for _, b, _ in todo])
        except TierIOError:
            writes.abort_writes(todo, tier)
            self.runner.settle_freed()
            if strict:
                raise
            return []
        writes.publish_writes(todo, tier)
        return [r for r, _, _ in todo]

    # --- sliding-window snapshots (``kvcache.windows``) -----------------------------------------------
    @staticmethod
    def write_window(files: WindowFiles, name: str, payload: bytes) -> bool:
        """Store a window snapshot's payload (whole or not at all); False when it could not be written."""
        return files.write(name, payload)

    @staticmethod
    def read_window(files: WindowFiles, name: str, payload_bytes: int) -> bytes | None:
        """A window snapshot's payload, only whole and verified (None: absent or corrupt, recompute it)."""
        return files.read(name, payload_bytes)

    @staticmethod
    def discard_window(files: WindowFiles, name: str) -> None:
        files.discard(name)

    def close(self) -> None:
        """Wait for a running scrub (it reads the tiers), then close the store."""
        self.reader.wait_for_scrub()
        self.store.close()
