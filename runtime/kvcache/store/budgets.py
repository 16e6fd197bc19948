"""Tier names, byte budgets and the usage snapshots every tier reports.

Owns the vocabulary shared by the tier stores, the unified store and whoever exports metrics:
tier names (`gpu`, `dram`, `ssd`, fastest first), a budget triple, and frozen usage snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TierName = Literal["gpu", "dram", "ssd"]
TIER_ORDER: tuple[TierName, ...] = ("gpu", "dram", "ssd")


class BudgetError(ValueError):
    """A budget change that cannot be applied without losing a page a running sequence needs."""


FIELD_OF: dict[TierName, str] = {"gpu": "hot_bytes", "dram": "dram_bytes", "ssd": "ssd_bytes"}


@dataclass(frozen=True)
class TierBudgets:
    """Byte budget per tier; a tier never holds more page bytes than its budget. The device tier's is
    ``hot_bytes``: the hot part of the device envelope (``KVCache`` converts the envelope, ``envelope.py``)."""

    hot_bytes: int
    dram_bytes: int
    ssd_bytes: int

    def __post_init__(self) -> None:
        for name in FIELD_OF.values():
            if getattr(self, name) < 0:
                raise BudgetError(f"{name} must be >= 0, got {getattr(self, name)}")

    def of(self, tier: TierName) -> int:
        return int(getattr(self, FIELD_OF[tier]))

    def replace(self, hot_bytes: int | None = None, dram_bytes: int | None = None,
                ssd_bytes: int | None = None) -> TierBudgets:
        """These budgets with the ones given changed (None: unchanged)."""
        return TierBudgets(self.hot_bytes if hot_bytes is None else hot_bytes,
                           self.dram_bytes if dram_bytes is None else dram_bytes,
                           self.ssd_bytes if ssd_bytes is None else ssd_bytes)

    def with_tier(self, tier: TierName, budget_bytes: int) -> TierBudgets:
        """These budgets with ``tier``'s set to ``budget_bytes``."""
        return self.replace(**{FIELD_OF[tier]: budget_bytes})


@dataclass(frozen=True)
class TierUsage:
    """One tier's accounting at one instant (what /metrics and /admin/tiers report)."""

    tier: TierName
    budget_bytes: int  # the configured budget
    capacity_bytes: int  # slots actually available x bytes per page (<= budget)
    used_bytes: int  # pages stored x bytes per page (<= capacity)
    pages: int
    backing: str  # e.g. "cpu", "cuda:0", "hugetlbfs:/mnt/huge", "anon-thp", "posix-odirect:/nvme"
    page_reads: int  # pages served from this tier
    errors: int  # I/O faults and corrupt pages counted by the tier
    cached_bytes: int = 0  # part of used_bytes held by blocks no running sequence needs (reusable, evictable)
