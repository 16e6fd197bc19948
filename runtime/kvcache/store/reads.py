"""The bookkeeping of reading blocks (the store's read part, over the shared ``BlockTable``): which copy serves each read, and what a failed read drops.

The Mover (``kvdrive.runtime.kvcache.mover``) reads; this half plans and settles, under the store lock:
``plan_reads`` pins each block's fastest ready copy, ``settle_reads`` unpins, counts, and drops a copy
that failed its checksum (the Mover then tries the next copy); a block no tier can serve is a miss
(recompute it), never returned as data. A scrub of a tier is planned and settled here too: its slots are
listed, pinned in parts while the Mover reads them, and the corrupt copies dropped together.
"""

from __future__ import annotations

from kvdrive.runtime.kvcache.contract import Block, Copy, ReadPlan
from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.table import BlockTable


class ReadBook:
    def __init__(self, table: BlockTable) -> None:
        self.table = table
        self.page_reads: dict[TierName, int] = {t: 0 for t in table.tiers}  # needed pages found per tier
        self.misses = 0  # needed pages no tier could serve
        self.scrubbed = 0  # corrupt copies dropped by scrubs

    def plan_reads(self, keys: list[BlockKey], pending: list[int]) -> ReadPlan:
        """The fastest ready copy of each keys[i], i in ``pending``, pinned while it is read."""
        plan: ReadPlan = {}
        with self.table.lock:
            for i in pending:
                b = self.table.blocks.get(keys[i])
                t = self.table.fastest(b) if b else None
                if b is None or t is None:
                    continue
                self.table.pin(b)
                self.table.touch(b)
                plan.setdefault(t, []).append((i, b.copies[t].slot))
        return plan

    def settle_reads(self, keys: list[BlockKey], tier: TierName, items: list[tuple[int, int]], ok: list[bool],
                     served: list[TierName | None], count: bool) -> list[int]:
        """Unpin what ``tier`` read; a copy that failed is dropped. Returns the key indexes to try again."""
        retry: list[int] = []
        with self.table.lock:
            for (i, slot), o in zip(items, ok, strict=True):
                b = self.table.blocks.get(keys[i])
                if b is None:  # a key asked twice (a page two sequences share) whose only copy failed
                    continue   # and was dropped for its first asker: a miss here too
                self.table.unpin(b)
                if o:
                    served[i] = tier
                    self.page_reads[tier] += count
                elif b.copies.get(tier, Copy(-1, False)).slot == slot:
                    self.table.drop(b, tier)
                    retry.append(i)
        return retry

    def count_misses(self, n: int) -> None:
        with self.table.lock:
            self.misses += n

    # --- scrubs ----------------------------------------------------------------------------------
    def slots_of(self, tier: TierName) -> list[tuple[int, BlockKey]]:
        """(slot, key) of every copy in ``tier``, by slot."""
        with self.table.lock:
            return sorted((slot, key) for (name, slot), key in self.table.owner.items() if name == tier)

    def pin_copies(self, tier: TierName, items: list[tuple[int, BlockKey]]) -> list[tuple[int, Block]]:
        """Pin the blocks whose ready ``tier`` copy still sits in the listed slot (nothing moves or frees them
        while they are read)."""
        with self.table.lock:
            part = [(slot, self.table.blocks[key]) for slot, key in items
                    if key in self.table.blocks and tier in self.table.blocks[key].copies
                    and self.table.blocks[key].copies[tier].slot == slot and self.table.blocks[key].copies[tier].ready]
            for _, b in part:
                self.table.pin(b)
            return part

    def unpin(self, blocks: list[Block]) -> None:
        with self.table.lock:
            for b in blocks:
                self.table.unpin(b)

    def settle_scrub(self, tier: TierName, part: list[tuple[int, Block]], ok: list[bool]) -> int:
        """Unpin a scrubbed part and drop its corrupt copies; returns how many were dropped. A block another
        reader holds pinned is left to that reader (it meets the same failure and drops the copy itself)."""
        dropped = 0
        with self.table.lock:
            for (slot, b), good in zip(part, ok, strict=True):
                self.table.unpin(b)
                if not good and b.pins == 0 and b.copies.get(tier, Copy(-1, False)).slot == slot:
                    self.table.drop(b, tier)
                    dropped += 1
            self.scrubbed += dropped
        return dropped
