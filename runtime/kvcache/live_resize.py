"""Live budget changes of the tiers: grow, shrink (one eviction pass, then compaction) and the split of that
work between the engine thread and a background one (``shrink``, for the SSD tier's disk I/O).

Works on ``Residency``'s block table with its prepare / run / complete protocol: nothing here does tier
I/O under the store's lock (a memory pool's reallocation when it grows is the exception still: it copies
the pool's rows under the lock). The SSD tier's files are sized outside it and its new slots opened under
it.
"""

from __future__ import annotations

import logging
import time

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName
from kvdrive.runtime.kvcache.residency import Move, Residency
from kvdrive.runtime.kvcache.tiers.dram import DramTier
from kvdrive.runtime.kvcache.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

SHRINK_ROUNDS = 200  # rounds of a shrink's eviction or compaction waiting for busy slots (10 ms apart)


class LiveResize(Residency):
    def _slots_for(self, tier: TierName, budget: int) -> int:
        t = self.tiers[tier]
        if isinstance(t, SsdTier):
            return t.slots_for_budget(budget)
        if isinstance(t, DramTier):
            return DramTier.slots_for_budget(budget, t.slot_bytes, t.hugetlbfs_dir is not None)
        return budget // t.slot_bytes

    def set_budgets(self, gpu_bytes: int | None = None, dram_bytes: int | None = None,
                    ssd_bytes: int | None = None, defer: frozenset[TierName] = frozenset()) -> TierBudgets:
        """Apply new budgets live. Shrinking demotes (or drops blocks nobody needs) in one eviction pass
        per tier and compacts; raises BudgetError, changing nothing, when the needed or pinned blocks
        cannot fit. The shrink of a tier in ``defer`` is left to ``shrink`` (run it off the engine
        thread: the SSD tier's compaction is disk I/O); that tier keeps its old budget until then."""
        new = self.budgets.replace(gpu_bytes=gpu_bytes, dram_bytes=dram_bytes, ssd_bytes=ssd_bytes)
        with self._lock:
            slots = {t: self._slots_for(t, new.of(t)) for t in self.tiers}
            needed = sum(1 for b in self._blocks.values() if b.needed)
            if needed > sum(slots.values()):
                raise BudgetError(f"{needed} pages needed by running sequences do not fit in "
                                  f"{sum(slots.values())} pages of the new budgets")
            for t, n in slots.items():
                pinned = sum(1 for b in self._blocks.values() if b.pins and t in b.copies)
                if pinned > n:
                    raise BudgetError(f"{t} tier: {pinned} pages are pinned (being read) but the new "
                                      f"budget holds {n}; retry when the reads complete")
            grow = {t: n for t, n in slots.items() if n > self.tiers[t].allocator.capacity}
            for t, n in grow.items():  # grow first so that demotions have room
                tier = self.tiers[t]
                if not isinstance(tier, SsdTier):  # a memory pool: reallocated and its rows copied here
                    self._grown(t, n, tier.resize(n))
        for t, n in grow.items():  # the SSD tier's files are sized outside the lock (disk I/O), then opened up
            tier = self.tiers[t]
            if isinstance(tier, SsdTier):
                got = tier.size_files(n)
                with self._lock:
                    tier.allocator.resize(max(got, tier.allocator.capacity))
                self._grown(t, n, got)
        deferred = {t for t in defer if t in slots and slots[t] < self.tiers[t].allocator.capacity}
        for t in TIER_ORDER:
            if t in slots and slots[t] < self.tiers[t].allocator.capacity and t not in deferred:
                self._shrink(t, slots[t])
        with self._lock:
            for t in deferred:
                new = new.replace(**{f"{t}_bytes": self.budgets.of(t)})
            self.budgets = new
        log.info("tier budgets now gpu=%d dram=%d ssd=%d bytes%s", new.gpu_bytes, new.dram_bytes, new.ssd_bytes,
                 f" ({', '.join(sorted(deferred))} shrinking)" if deferred else "")
        return new

    @staticmethod
    def _grown(tier: TierName, want: int, got: int) -> None:
        if got < want:
            log.error("%s tier grew to %d of %d pages only (see the tier's errors)", tier, got, want)

    def shrink(self, tier: TierName, budget_bytes: int) -> TierBudgets:
        """Shrink one tier to ``budget_bytes`` (the half ``set_budgets`` deferred). Safe off the engine thread
        for the SSD tier: the engine keeps reading and writing it meanwhile."""
        n = self._slots_for(tier, budget_bytes)
        if n < self.tiers[tier].allocator.capacity:
            started = time.perf_counter()
            self._shrink(tier, n)
            log.info("%s tier shrink took %.2f s", tier, time.perf_counter() - started)
        with self._lock:
            self.budgets = self.budgets.replace(**{f"{tier}_bytes": budget_bytes})
            return self.budgets

    def _shrink(self, tier: TierName, n: int) -> None:
        """Shrink ``tier`` to ``n`` slots, in linear time: one eviction pass (victims in eviction order,
        one sort) until at most ``n`` slots are used; a ceiling so that nothing is placed at or above ``n``
        any more; survivors above ``n`` copied to free slots below (outside the lock), rounds repeating
        only for blocks that were being read or written meanwhile; then the tier is cut."""
        t = self.tiers[tier]
        alloc = t.allocator
        try:
            for _ in range(SHRINK_ROUNDS):
                with self._lock:
                    used, cap = alloc.used, alloc.capacity
                if used > n and not self._make_room(tier, cap - n, batch=False):
                    raise BudgetError(f"{tier} tier: cannot evict below {alloc.used} pages (all needed or pinned)")
                with self._lock:
                    if alloc.used <= n:  # others may have taken freed slots meanwhile: then evict again
                        alloc.cap(n)
                        break
            else:
                raise BudgetError(f"{tier} tier: other writers keep filling it; retry")
            for _ in range(SHRINK_ROUNDS):
                moves, busy = self._prepare_compaction(tier, n)
                if moves:
                    self._complete_compaction(tier, moves, self._run_moves(moves))
                if not busy:
                    break
                time.sleep(0.01)  # blocks being read or written above n: their transfers finish first
            else:
                raise BudgetError(f"{tier} tier: slots above the new size stay busy (being read or written); retry")
            with self._lock:
                alloc.resize(n)  # nothing at or above n is used or can be allocated
        except BaseException:
            with self._lock:
                alloc.uncap()
            raise
        got = t.resize(n)  # the slabs are cut (or a memory pool reallocated and copied) outside the lock
        log.info("%s tier shrunk to %d pages", tier, got)

    def _prepare_compaction(self, tier: TierName, n: int) -> tuple[list[Move], int]:
        """Moves of the survivors above ``n`` to free slots below (pinned, destinations reserved), and how
        many survivors are busy (being written, or pinned by a reader) and wait for another round."""
        alloc = self.tiers[tier].allocator
        moves: list[Move] = []
        busy = 0
        with self._lock:
            for slot in alloc.used_at_or_above(n):
                key = self._owner[(tier, slot)]
                b = self._blocks[key]
                c = b.copies.get(tier)
                if c is None or c.slot != slot or not c.ready or b.pins:
                    busy += 1
                    continue
                new_slot = alloc.alloc()
                if new_slot is None:  # cannot happen while at most n slots are used; wait and recount
                    busy += 1
                    continue
                self._owner[(tier, new_slot)] = key
                b.pins += 1
                moves.append(Move(b, tier, slot, tier, new_slot, demote=False))
        return moves, busy

    def _complete_compaction(self, tier: TierName, moves: list[Move], ok: list[bool]) -> None:
        t = self.tiers[tier]
        with self._lock:
            for m, good in zip(moves, ok, strict=True):
                b = m.block
                b.pins -= 1
                if good:  # the block now lives at dst_slot; the old slot is freed
                    t.allocator.release(m.src_slot)
                    t.discard(m.src_slot)
                    del self._owner[(tier, m.src_slot)]
                    self._publish(b, tier, m.dst_slot)
                else:
                    t.allocator.release(m.dst_slot)
                    del self._owner[(tier, m.dst_slot)]
                    log.debug("%s tier: %s unreadable while compacting; dropped", tier, b.key)  # the tier logged why
                    self._drop(b, tier)
