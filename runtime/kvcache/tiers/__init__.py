"""Tier stores: device (torch pool), DRAM (hugetlbfs / THP, pinned under CUDA), SSD (O_DIRECT slabs, KvikIO)."""

from kvdrive.runtime.kvcache.tiers.base import SlotAllocator, Tier, TierIOError
from kvdrive.runtime.kvcache.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.tiers.dram import DramTier
from kvdrive.runtime.kvcache.tiers.ssd import PosixIO, SsdTier

__all__ = ["DeviceTier", "DramTier", "PosixIO", "SlotAllocator", "SsdTier", "Tier", "TierIOError"]
