"""The store: the tiers (gpu, dram, ssd), the block table over them, and its read and resize bookkeeping.

It keeps what is stored where and prepares / completes every movement (``kvcache.contract``); it never
moves a byte (``kvcache.mover``) and never chooses a tier (``kvcache.placement``).
"""

from kvdrive.runtime.kvcache.store.block_index import MEMORY_TIERS, BlockIndex
from kvdrive.runtime.kvcache.store.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.store.compression import CodecError, IdentityCodec, Int8Codec, measure_error
from kvdrive.runtime.kvcache.store.keys import DIGEST_BYTES, BlockKey
from kvdrive.runtime.kvcache.store.layout import LAYOUT_VERSION, CacheFullError, KVLayout
from kvdrive.runtime.kvcache.store.store import BlockStore, build_tiers, device_tier

__all__ = [
    "DIGEST_BYTES", "LAYOUT_VERSION", "MEMORY_TIERS", "TIER_ORDER", "BlockIndex", "BlockKey", "BlockStore", "BudgetError",
    "CacheFullError", "CodecError", "IdentityCodec", "Int8Codec", "KVLayout", "TierBudgets", "TierName", "TierUsage",
    "build_tiers", "device_tier", "measure_error",
]
