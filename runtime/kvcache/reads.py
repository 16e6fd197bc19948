"""The bookkeeping of reading blocks: which copy serves each read, and what a failed read drops.

The Mover (``kvdrive.runtime.pipeline``) reads; this half plans and settles, under the store lock:
``plan_reads`` pins each block's fastest ready copy, ``settle_reads`` unpins, counts, and drops a copy
that failed its checksum (the Mover then tries the next copy); a block no tier can serve is a miss
(recompute it), never returned as data. A scrub of a tier is planned and settled here too: its slots are
listed, pinned in parts while the Mover reads them, and the corrupt copies dropped together.
"""

from __future__ import annotations

from kvdrive.runtime.kvcache.budgets import TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.residency import Block, Copy, Residency

ReadPlan = dict[TierName, list[tuple[int, int]]]  # tier -> (key index, slot) of the copies it serves


class BlockReads(Residency):
    page_reads: dict[TierName, int]
    misses: int
    scrubbed: int = 0  # corrupt copies dropped by scrubs

    def plan_reads(self, keys: list[BlockKey], pending: list[int]) -> ReadPlan:
        """The fastest ready copy of each keys[i], i in ``pending``, pinned while it is read."""
        plan: ReadPlan = {}
        with self._lock:
            for i in pending:
                b = self._blocks.get(keys[i])
                t = self._fastest(b) if b else None
                if b is None or t is None:
                    continue
                self._pin(b)
                self._touch(b)
                plan.setdefault(t, []).append((i, b.copies[t].slot))
        return plan

    def settle_reads(self, keys: list[BlockKey], tier: TierName, items: list[tuple[int, int]], ok: list[bool],
                     served: list[TierName | None], count: bool) -> list[int]:
        """Unpin what ``tier`` read; a copy that failed is dropped. Returns the key indexes to try again."""
        retry: list[int] = []
        with self._lock:
            for (i, slot), o in zip(items, ok, strict=True):
                b = self._blocks.get(keys[i])
                if b is None:  # a key asked twice (a page two sequences share) whose only copy failed
                    continue   # and was dropped for its first asker: a miss here too
                self._unpin(b)
                if o:
                    served[i] = tier
                    self.page_reads[tier] += count
                elif b.copies.get(tier, Copy(-1, False)).slot == slot:
                    self._drop(b, tier)
                    retry.append(i)
        return retry

    def count_misses(self, n: int) -> None:
        with self._lock:
            self.misses += n

    # --- scrubs ----------------------------------------------------------------------------------
    def slots_of(self, tier: TierName) -> list[tuple[int, BlockKey]]:
        """(slot, key) of every copy in ``tier``, by slot."""
        with self._lock:
            return sorted((slot, key) for (name, slot), key in self._owner.items() if name == tier)

    def pin_copies(self, tier: TierName, items: list[tuple[int, BlockKey]]) -> list[tuple[int, Block]]:
        """Pin the blocks whose ready ``tier`` copy still sits in the listed slot (nothing moves or frees them
        while they are read)."""
        with self._lock:
            part = [(slot, self._blocks[key]) for slot, key in items
                    if key in self._blocks and tier in self._blocks[key].copies
                    and self._blocks[key].copies[tier].slot == slot and self._blocks[key].copies[tier].ready]
            for _, b in part:
                self._pin(b)
            return part

    def unpin(self, blocks: list[Block]) -> None:
        with self._lock:
            for b in blocks:
                self._unpin(b)

    def settle_scrub(self, tier: TierName, part: list[tuple[int, Block]], ok: list[bool]) -> int:
        """Unpin a scrubbed part and drop its corrupt copies; returns how many were dropped. A block another
        reader holds pinned is left to that reader (it meets the same failure and drops the copy itself)."""
        dropped = 0
        with self._lock:
            for (slot, b), good in zip(part, ok, strict=True):
                self._unpin(b)
                if not good and b.pins == 0 and b.copies.get(tier, Copy(-1, False)).slot == slot:
                    self._drop(b, tier)
                    dropped += 1
            self.scrubbed += dropped
        return dropped
