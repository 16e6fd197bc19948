"""The bookkeeping of live budget changes (the store's resize part, over the shared ``BlockTable``): what a new budget allows, and a shrink's ceiling and compaction.

The Mover (``kvdrive.runtime.kvcache.mover``) runs a change (``Mover.set_budgets``): it checks it here
(``check_budgets``: BudgetError, nothing changed, when the pages running sequences need or the pinned ones
cannot fit; counted without a walk over the blocks), grows each tier outside the lock and opens its new slots
here, and shrinks a tier by eviction, a ceiling (``cap``: no slot at or above the new size is handed out),
compaction of the survivors above it (``prepare_compaction`` / ``complete_compaction``, the copies run by the
Mover), then ``cut``.
"""

from __future__ import annotations

from kvdrive.runtime.kvcache.contract import Move
from kvdrive.runtime.kvcache.store.budgets import BudgetError, TierBudgets, TierName
from kvdrive.runtime.kvcache.store.table import BlockTable
from kvdrive.runtime.kvcache.store.tiers.dram import DramTier
from kvdrive.runtime.kvcache.store.tiers.ssd import SsdTier


class ResizeBook:
    def __init__(self, table: BlockTable, budgets: TierBudgets) -> None:
        self.table = table
        self.budgets = budgets  # the tiers' byte budgets now (changed here only)

    def slots_for(self, tier: TierName, budget: int) -> int:
        """The slots ``budget`` bytes give ``tier``."""
        t = self.table.tiers[tier]
        if isinstance(t, SsdTier):
            return t.slots_for_budget(budget)
        if isinstance(t, DramTier):
            return DramTier.slots_for_budget(budget, t.slot_bytes, t.hugetlbfs_dir is not None)
        return budget // t.slot_bytes

    def check_budgets(self, hot_bytes: int | None, dram_bytes: int | None,
                      ssd_bytes: int | None) -> tuple[TierBudgets, dict[TierName, int]]:
        """The new budgets and each tier's slots under them; BudgetError when the blocks running sequences need,
        or a tier's pinned blocks, do not fit (counters and the pinned blocks only: no walk over the table)."""
        new = self.budgets.replace(hot_bytes, dram_bytes, ssd_bytes)
        with self.table.lock:
            slots = {t: self.slots_for(t, new.of(t)) for t in self.table.tiers}
            if self.table.needed_blocks > sum(slots.values()):
                raise BudgetError(f"{self.table.needed_blocks} pages needed by running sequences do not fit in "
                                  f"{sum(slots.values())} pages of the new budgets")
            for t, n in slots.items():
                pinned = sum(1 for b in self.table.pinned.values() if t in b.copies)
                if pinned > n:
                    raise BudgetError(f"{t} tier: {pinned} pages are pinned (being read) but the new "
                                      f"budget holds {n}; retry when the reads complete")
        return new, slots

    def capacity(self, tier: TierName) -> int:
        with self.table.lock:
            return self.table.tiers[tier].allocator.capacity

    def used(self, tier: TierName) -> int:
        with self.table.lock:
            return self.table.tiers[tier].allocator.used

    def open_slots(self, tier: TierName, slots: int) -> None:
        """A tier whose files were grown outside the lock hands out ``slots`` slots from now on."""
        with self.table.lock:
            alloc = self.table.tiers[tier].allocator
            alloc.resize(max(slots, alloc.capacity))

    def set_budget(self, tier: TierName, budget_bytes: int) -> TierBudgets:
        with self.table.lock:
            self.budgets = self.budgets.with_tier(tier, budget_bytes)
            return self.budgets

    def set_all_budgets(self, budgets: TierBudgets) -> None:
        with self.table.lock:
            self.budgets = budgets

    # --- a shrink --------------------------------------------------------------------------------
    def cap(self, tier: TierName, n: int) -> bool:
        """When at most ``n`` slots of ``tier`` are used, hand out none at or above ``n`` from now on (True);
        otherwise (others took the slots eviction freed) nothing changes (False)."""
        with self.table.lock:
            alloc = self.table.tiers[tier].allocator
            if alloc.used > n:
                return False
            alloc.cap(n)
            return True

    def uncap(self, tier: TierName) -> None:
        """The shrink was abandoned: every free slot can be handed out again."""
        with self.table.lock:
            self.table.tiers[tier].allocator.uncap()

    def cut(self, tier: TierName, n: int) -> None:
        """The tier has ``n`` slots (nothing at or above ``n`` is used or can be allocated)."""
        with self.table.lock:
            self.table.tiers[tier].allocator.resize(n)

    def prepare_compaction(self, tier: TierName, n: int) -> tuple[list[Move], int]:
        """Moves of the survivors above ``n`` to free slots below (pinned, destinations reserved), and how
        many survivors are busy (being written, pinned by a reader, or freed and not yet discarded) and wait
        for another round."""
        alloc = self.table.tiers[tier].allocator
        moves: list[Move] = []
        busy = 0
        with self.table.lock:
            for slot in alloc.used_at_or_above(n):
                key = self.table.owner.get((tier, slot))
                b = self.table.blocks.get(key) if key is not None else None
                c = b.copies.get(tier) if b is not None else None
                if b is None or c is None or c.slot != slot or not c.ready or b.pins:
                    busy += 1
                    continue
                new_slot = alloc.alloc()
                if new_slot is None:  # cannot happen while at most n slots are used; wait and recount
                    busy += 1
                    continue
                self.table.owner[(tier, new_slot)] = b.key
                self.table.pin(b)
                moves.append(Move(b, tier, slot, tier, new_slot, demote=False))
        return moves, busy

    def complete_compaction(self, tier: TierName, moves: list[Move], ok: list[bool]) -> None:
        """A moved block now lives at its new slot (the old one is freed); one that could not be read is
        dropped (the tier logged why)."""
        with self.table.lock:
            for m, good in zip(moves, ok, strict=True):
                b = m.block
                self.table.unpin(b)
                if good:
                    del self.table.owner[(tier, m.src_slot)]
                    self.table.freed.append((tier, m.src_slot))
                    self.table.publish(b, tier, m.dst_slot)
                else:
                    del self.table.owner[(tier, m.dst_slot)]
                    self.table.freed.append((tier, m.dst_slot))
                    self.table.drop(b, tier)
