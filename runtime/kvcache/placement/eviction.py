"""Placement's choices for a full tier, and for a put over a stored copy: the ``contract.Eviction`` the store applies.

The store keeps the table and prepares evictions (``store.table``); every choice in them is made here:
- victims are taken least recently used first, re-sorted by ``order`` (the Placer's scores) when placement
  ranks them, and a memory tier that placement ranks from its tensors (``coldest``) gives just the victims
  asked for; an unranked tier frees a batch per pass (one sort serves many evictions): 1/8 of its capacity
  where victims go down (nothing is lost), 1/64 in the last tier, where they are dropped;
- a victim may go down to the tiers below its own, nearest first, skipping a tier with no capacity or one
  that is failing (recent I/O faults: its writes fail, and a victim waiting for one would hold its slot);
- a victim with a clean copy right below is dropped (nothing is lost); otherwise it is demoted while a tier
  below has room (the hierarchy gpu -> dram -> ssd is kept even when a deeper clean copy exists); with no
  room below it is dropped if a copy is left deeper, or if no running sequence needs it (recomputed if ever
  asked again); a needed block with nowhere to go stays;
- a put of a content-addressed page already stored only touches it, unless its fastest copy lies in a
  failing tier: that copy is as good as lost, and the fresh bytes replace it;
- sliding-window snapshots past their byte budget go least recently used first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from kvdrive.runtime.kvcache.contract import Block, Fate
from kvdrive.runtime.kvcache.store.block_index import MEMORY_TIERS
from kvdrive.runtime.kvcache.store.budgets import TIER_ORDER, TierName
from kvdrive.runtime.kvcache.store.tiers.base import Tier

EVICT_BATCH_FRACTION = 8  # a full tier with a tier below frees capacity/8 slots at once (demotions: nothing lost)
LAST_TIER_EVICT_FRACTION = 64  # the last tier drops what it evicts: capacity/64 at once

VictimOrder = Callable[[TierName, list[Block]], list[Block]]  # candidates (LRU first) -> coldest first
ColdestOf = Callable[[TierName, int], list[tuple[int, int]]]  # memory tier, k -> k coldest (page id, layer)


@dataclass(frozen=True)
class TierEviction:
    """The ``contract.Eviction`` every placement policy uses; ``order`` and ``coldest`` are the Placer's
    rankings (``Placer.eviction``); without them victims go least recently used first (a store built alone)."""

    victim_order: VictimOrder | None = None
    coldest_of: ColdestOf | None = None

    def ranks(self, tier: TierName) -> bool:
        return self.coldest_of is not None and tier in MEMORY_TIERS

    def coldest(self, tier: TierName, k: int) -> list[tuple[int, int]]:
        return self.coldest_of(tier, k) if self.coldest_of is not None else []

    def order(self, tier: TierName, cands: list[Block]) -> list[Block]:
        return self.victim_order(tier, cands) if self.victim_order is not None else cands

    def batch(self, tier: TierName, capacity: int, has_below: bool) -> int:
        return max(1, capacity // (EVICT_BATCH_FRACTION if has_below else LAST_TIER_EVICT_FRACTION))

    def targets(self, tier: TierName, tiers: Mapping[TierName, Tier]) -> list[TierName]:
        below = TIER_ORDER[TIER_ORDER.index(tier) + 1 :]
        return [t for t in below if t in tiers and tiers[t].allocator.capacity > 0 and not tiers[t].failing()]

    def fate(self, targets: list[TierName], ready: Collection[TierName], needed: bool, room_below: bool) -> Fate:
        if targets and targets[0] in ready:
            return Fate.DROP
        if targets and room_below:
            return Fate.DEMOTE
        if any(t in ready for t in targets):
            return Fate.DROP
        return Fate.KEEP if needed else Fate.RECOMPUTE

    def replaces(self, fastest: Tier) -> bool:
        return fastest.failing()

    @staticmethod
    def window_victims(sizes: Mapping[str, int], need: int, max_bytes: int) -> list[str]:
        """The sliding-window snapshots to drop, least recently used first (``sizes``: name -> bytes in that
        order), so that ``need`` more bytes fit in ``max_bytes``."""
        held, out = sum(sizes.values()), []
        for name, size in sizes.items():
            if held + need <= max_bytes:
                break
            out.append(name)
            held -= size
        return out
