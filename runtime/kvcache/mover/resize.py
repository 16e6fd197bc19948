"""Live budget changes of the tiers: grow, shrink (eviction, a ceiling, compaction, the cut), run by the Mover.

The store checks a change and keeps its bookkeeping (``store.resize.ResizeBook``); the tiers are resized here,
outside the store's lock. Growth comes first so that a shrink's demotions have room: the SSD tier's slab
files are sized (disk I/O) and then its new slots opened; a memory pool is reallocated and its rows copied,
on the engine thread with no transfer in flight (``KVCache.set_budgets`` drains the transfer workers
first: nothing else writes a memory pool). A shrink evicts in one pass, sets a ceiling so that nothing is
placed at or above the new size any more, copies the survivors above it to free slots below (rounds repeat
only for blocks that were being read or written meanwhile), and cuts the tier. The shrink of a tier in
``defer`` (the SSD tier: its compaction is disk I/O) is left to ``shrink``, off the engine thread.
"""

from __future__ import annotations

import logging
import time

from kvdrive.runtime.kvcache.mover.runner import MoveRunner
from kvdrive.runtime.kvcache.store.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName
from kvdrive.runtime.kvcache.store.resize import ResizeBook
from kvdrive.runtime.kvcache.store.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

SHRINK_ROUNDS = 200  # rounds of a shrink's eviction or compaction waiting for busy slots (10 ms apart)
EVICTION_TRIES = 10  # eviction rounds in a row that leave the tier short before a shrink is refused


class Resizer:
    def __init__(self, runner: MoveRunner, book: ResizeBook) -> None:
        """``runner``: evictions and copies; ``book``: the store's resize bookkeeping (check, cap, compaction)."""
        self.runner = runner
        self.book = book
        self.tiers = runner.tiers

    def set_budgets(self, hot_bytes: int | None = None, dram_bytes: int | None = None,
                    ssd_bytes: int | None = None, defer: frozenset[TierName] = frozenset()) -> TierBudgets:
        """Apply new budgets live. Shrinking demotes (or drops blocks nobody needs) in one eviction pass per
        tier and compacts; raises BudgetError, changing nothing, when the needed or pinned blocks cannot fit.
        The shrink of a tier in ``defer`` is left to ``shrink``; that tier keeps its old budget until then."""
        book = self.book
        new, slots = book.check_budgets(hot_bytes, dram_bytes, ssd_bytes)
        grow = {t: n for t, n in slots.items() if n > book.capacity(t)}
        for t, n in grow.items():
            tier = self.tiers[t]
            if isinstance(tier, SsdTier):  # the files are sized, then the new slots opened
                got = tier.size_files(n)
                book.open_slots(t, got)
            else:
                got = tier.resize(n)
            if got < n:
                log.error("%s tier grew to %d of %d pages only (see the tier's errors)", t, got, n)
        deferred = {t for t in defer if t in slots and slots[t] < book.capacity(t)}
        for t in TIER_ORDER:
            if t in slots and slots[t] < book.capacity(t) and t not in deferred:
                self._shrink(t, slots[t])
        for t in deferred:
            new = new.with_tier(t, book.budgets.of(t))
        book.set_all_budgets(new)
        log.info("tier budgets now gpu=%d dram=%d ssd=%d bytes%s", new.hot_bytes, new.dram_bytes, new.ssd_bytes,
                 f" ({', '.join(sorted(deferred))} shrinking)" if deferred else "")
        return new

    def shrink(self, tier: TierName, budget_bytes: int) -> TierBudgets:
        """Shrink one tier to ``budget_bytes`` (the half ``set_budgets`` deferred). Safe off the engine thread
        for the SSD tier: the engine keeps reading and writing it meanwhile."""
        book = self.book
        n = book.slots_for(tier, budget_bytes)
        if n < book.capacity(tier):
            started = time.perf_counter()
            self._shrink(tier, n)
            log.info("%s tier shrink took %.2f s", tier, time.perf_counter() - started)
        return book.set_budget(tier, budget_bytes)

    def _shrink(self, tier: TierName, n: int) -> None:
        """Shrink ``tier`` to ``n`` slots, in linear time: one eviction pass (victims in eviction order, one
        sort) until at most ``n`` slots are used; a ceiling; the survivors above ``n`` copied below; the cut."""
        book = self.book
        try:
            short = 0  # rounds in a row whose eviction left the tier short
            for _ in range(SHRINK_ROUNDS):
                used, cap = book.used(tier), book.capacity(tier)
                if used > n and not self.runner.make_room(tier, cap - n, batch=False):
                    # every block needed or pinned, or writers beside the shrink took the slots it freed (a put
                    # from the engine thread while the SSD tier shrinks on another): try again, then refuse
                    short += 1
                    if short >= EVICTION_TRIES:
                        raise BudgetError(f"{tier} tier: cannot evict below {book.used(tier)} pages (all needed or "
                                          "pinned)")
                    time.sleep(0.01)
                    continue
                short = 0
                if book.cap(tier, n):  # others may have taken freed slots meanwhile: then evict again
                    break
            else:
                raise BudgetError(f"{tier} tier: other writers keep filling it; retry")
            for _ in range(SHRINK_ROUNDS):
                moves, busy = book.prepare_compaction(tier, n)
                if moves:
                    book.complete_compaction(tier, moves, self.runner.run_moves(moves))
                self.runner.settle_freed()
                if not busy:
                    break
                time.sleep(0.01)  # blocks being read or written above n: their transfers finish first
            else:
                raise BudgetError(f"{tier} tier: slots above the new size stay busy (being read or written); retry")
            book.cut(tier, n)
        except BaseException:
            book.uncap(tier)
            raise
        got = self.tiers[tier].resize(n)  # the slabs are cut (or a memory pool reallocated) outside the lock
        log.info("%s tier shrunk to %d pages", tier, got)
