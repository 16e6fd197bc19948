"""Tier stores: device (torch pool), DRAM (hugetlbfs / THP, pinned under CUDA), SSD (O_DIRECT slabs, KvikIO)."""

from kvdrive.runtime.kvcache.store.tiers.base import SlotAllocator, Tier, TierIOError
from kvdrive.runtime.kvcache.store.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.store.tiers.dram import DramTier
from kvdrive.runtime.kvcache.store.tiers.ssd import PosixIO, SsdTier

__all__ = ["DeviceTier", "DramTier", "PosixIO", "SlotAllocator", "SsdTier", "Tier", "TierIOError"]
