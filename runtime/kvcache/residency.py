"""Which tiers hold a copy of each block, and how a full tier makes room (the store's bookkeeping half).

``Residency`` owns the block table (block -> copies per tier), the slot owners, pins, the ``needed``
flag and eviction. Eviction takes victims in the order of ``victim_order`` (placement's hotness) or
least-recently-used, and frees slots in batches so one sort serves many evictions. A victim is
demoted to the next tier down that has room (the tier hierarchy gpu -> dram -> ssd is kept even when
a deeper clean copy exists), dropped when a clean copy already sits right below, and dropped as
recomputable only when no running sequence needs it. Live budget changes (grow, shrink with
demotion, compaction) live here too. The data half (put/get/moves) is ``TieredKVStore``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.tiers.base import Tier, TierIOError
from kvdrive.runtime.kvcache.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

VictimOrder = Callable[[TierName, list[BlockKey]], list[BlockKey]]
EVICT_BATCH_FRACTION = 8  # a full tier with a tier below frees capacity/8 slots at once (demotions: nothing lost)
LAST_TIER_EVICT_FRACTION = 64  # the last tier drops what it evicts: capacity/64 at once


@dataclass(frozen=True)
class Copy:
    slot: int
    ready: bool


@dataclass
class Block:
    key: BlockKey
    copies: dict[TierName, Copy] = field(default_factory=dict)
    pins: int = 0
    needed: bool = True
    persistent: bool = False
    last_use: int = 0


class Residency:
    tiers: dict[TierName, Tier]
    budgets: TierBudgets
    block_bytes: int
    device: torch.device

    def __init__(self, victim_order: VictimOrder | None) -> None:
        self.victim_order = victim_order
        self._lock = threading.RLock()
        self._blocks: dict[BlockKey, Block] = {}
        self._owner: dict[tuple[TierName, int], BlockKey] = {}
        self._clock = 0
        self.transfer_bytes: dict[tuple[str, str], int] = {}
        self.dropped = 0

    def _fastest(self, b: Block) -> TierName | None:
        return next((t for t in TIER_ORDER if t in b.copies and b.copies[t].ready), None)

    def _touch(self, b: Block) -> None:
        self._clock += 1
        b.last_use = self._clock

    def _lower(self, tier: TierName) -> list[TierName]:
        return [t for t in TIER_ORDER[TIER_ORDER.index(tier) + 1 :] if t in self.tiers]

    # --- slots (lock held) -------------------------------------------------------------------
    def _alloc(self, tier: TierName, key: BlockKey) -> int | None:
        t = self.tiers[tier]
        slot = t.allocator.alloc()
        if slot is None and self._evict(tier, self._evict_batch(tier)):
            slot = t.allocator.alloc()
        if slot is not None:
            self._owner[(tier, slot)] = key
        return slot

    def _evict_batch(self, tier: TierName) -> int:
        """Slots one eviction pass frees: a pass walks and sorts the whole tier, so it frees many slots
        at once where victims are demoted (kept below), few in the last tier where they are dropped."""
        frac = EVICT_BATCH_FRACTION if self._lower(tier) else LAST_TIER_EVICT_FRACTION
        return max(1, self.tiers[tier].allocator.capacity // frac)

    def _drop(self, b: Block, tier: TierName) -> None:
        c = b.copies.pop(tier)
        t = self.tiers[tier]
        t.discard(c.slot)
        t.allocator.release(c.slot)
        del self._owner[(tier, c.slot)]
        if not b.copies:
            del self._blocks[b.key]

    def _candidates(self, tier: TierName) -> list[Block]:
        cap = self.tiers[tier].allocator.capacity
        if cap < len(self._blocks):  # walk the tier's slots, not every block of every tier
            owner, blocks = self._owner, self._blocks
            held = (blocks.get(k) for k in (owner.get((tier, s)) for s in range(cap)) if k is not None)
            cands = [b for b in held if b is not None and b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        else:
            cands = [b for b in self._blocks.values() if b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        cands.sort(key=lambda b: b.last_use)  # LRU; a victim order re-sorts stably (ties stay LRU)
        if self.victim_order is None:
            return cands
        order = self.victim_order(tier, [b.key for b in cands])
        return [self._blocks[k] for k in order if k in self._blocks]

    def _evict(self, tier: TierName, n: int) -> int:
        """Free up to ``n`` slots of ``tier`` (at least one when possible); returns how many were freed."""
        freed = 0
        for b in self._candidates(tier):
            if freed >= n:
                break
            if b.key in self._blocks and tier in b.copies and b.pins == 0 and self._evict_block(b, tier):
                freed += 1
        return freed

    def _evict_one(self, tier: TierName) -> bool:
        return self._evict(tier, 1) > 0

    def _evict_block(self, b: Block, tier: TierName) -> bool:
        lower = [t for t in self._lower(tier) if self.tiers[t].allocator.capacity > 0]
        if lower and lower[0] in b.copies and b.copies[lower[0]].ready:
            self._drop(b, tier)  # a clean copy sits right below
            return True
        b.pins += 1
        try:
            moved = any(self._copy(b, tier, dst) for dst in lower if dst not in b.copies)
        finally:
            b.pins -= 1
        backed = any(t in b.copies and b.copies[t].ready for t in self._lower(tier))
        if moved or backed or not b.needed:
            if not (moved or backed):
                self.dropped += 1
                log.debug("dropped %s from %s (recomputable)", b.key, tier)
            self._drop(b, tier)
            return True
        return False

    def _copy(self, b: Block, src: TierName, dst: TierName) -> bool:
        """Copy b's ready copy in src to a new slot of dst (b pinned by the caller, lock held)."""
        slot = self._alloc(dst, b.key)
        if slot is None:
            return False
        buf = torch.empty((1, self.block_bytes), dtype=torch.uint8, device=self.device)
        ok = self.tiers[src].read([b.copies[src].slot], buf)[0]
        if ok:
            try:
                self.tiers[dst].write([slot], buf, [b.key], [b.persistent])
            except TierIOError:
                ok = False
        if not ok:
            self.tiers[dst].allocator.release(slot)
            del self._owner[(dst, slot)]
            return False
        b.copies[dst] = Copy(slot, True)
        self._count(src, dst, 1)
        return True

    def _count(self, src: str, dst: str, n: int) -> None:
        k = (src, dst)
        self.transfer_bytes[k] = self.transfer_bytes.get(k, 0) + n * self.block_bytes

    # --- live budgets ------------------------------------------------------------------------
    def _slots_for(self, tier: TierName, budget: int) -> int:
        t = self.tiers[tier]
        return t.slots_for_budget(budget) if isinstance(t, SsdTier) else budget // t.slot_bytes

    def set_budgets(self, gpu_bytes: int | None = None, dram_bytes: int | None = None,
                    ssd_bytes: int | None = None) -> TierBudgets:
        """Apply new budgets live. Shrinking demotes (or drops blocks nobody needs) and compacts;
        raises BudgetError, changing nothing, when the needed or pinned blocks cannot fit."""
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
            for t, n in slots.items():  # grow first so that demotions have room
                if n > self.tiers[t].allocator.capacity:
                    got = self.tiers[t].resize(n)
                    if got < n:
                        log.error("%s tier grew to %d of %d pages only (see the tier's errors)", t, got, n)
            for t in TIER_ORDER:
                if t in slots and slots[t] < self.tiers[t].allocator.capacity:
                    self._shrink(t, slots[t])
            self.budgets = new
            log.info("tier budgets now gpu=%d dram=%d ssd=%d bytes", new.gpu_bytes, new.dram_bytes, new.ssd_bytes)
            return new

    def _shrink(self, tier: TierName, n: int) -> None:
        t = self.tiers[tier]
        while t.allocator.used > n:
            if not self._evict_one(tier):
                raise BudgetError(f"{tier} tier: cannot evict below {t.allocator.used} pages (all needed or pinned)")
        for slot in t.allocator.used_at_or_above(n):  # compact: move survivors below n
            key = self._owner[(tier, slot)]
            b = self._blocks[key]
            new_slot = t.allocator.alloc()
            assert new_slot is not None and new_slot < n
            buf = torch.empty((1, self.block_bytes), dtype=torch.uint8, device=self.device)
            ok = t.read([slot], buf)[0]
            if ok:
                try:
                    t.write([new_slot], buf, [key], [b.persistent])
                except TierIOError:
                    ok = False
            if ok:
                t.allocator.release(slot)
                t.discard(slot)
                del self._owner[(tier, slot)]
                self._owner[(tier, new_slot)] = key
                b.copies[tier] = replace(b.copies[tier], slot=new_slot)
            else:
                t.allocator.release(new_slot)
                log.warning("%s tier: %s unreadable while compacting; dropped", tier, key)
                self._drop(b, tier)
        got = t.resize(n)
        log.info("%s tier shrunk to %d pages", tier, got)

