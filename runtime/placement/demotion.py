"""Placement's rules for the victims of a full tier, and for a put over a stored copy.

The store applies them (``kvcache.residency``: it keeps the table); these functions are where the choices
live:
- a victim may go down to the tiers below its own, nearest first, skipping a tier with no capacity or one
  that is failing (recent I/O faults: its writes fail, and a victim waiting for one would hold its slot);
- a victim with a clean copy right below is dropped (nothing is lost); otherwise it is demoted while a tier
  below has room (the hierarchy gpu -> dram -> ssd is kept even when a deeper clean copy exists); with no
  room below it is dropped if a copy is left deeper, or if no running sequence needs it (recomputed if ever
  asked again); a needed block with nowhere to go stays;
- a put of a content-addressed page already stored only touches it, unless its fastest copy lies in a
  failing tier: that copy is as good as lost, and the fresh bytes replace it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvdrive.runtime.kvcache import TIER_ORDER, Fate, TierName
from kvdrive.runtime.kvcache.tiers.base import Tier


@dataclass(frozen=True)
class KeepHierarchy:
    """The victim rules (``kvcache.residency.VictimRules``) every placement policy uses."""

    def targets(self, tier: TierName, tiers: dict[TierName, Tier]) -> list[TierName]:
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


def replaces_stored_copy(fastest: Tier) -> bool:
    """Whether a put replaces a stored page's copies with its fresh bytes: when its fastest copy lies in a
    failing tier."""
    return fastest.failing()
