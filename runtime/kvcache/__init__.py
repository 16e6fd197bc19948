"""The KV cache: block layout, page ids, tier stores and budgets."""

from kvdrive.runtime.kvcache.block_index import MEMORY_TIERS, BlockIndex
from kvdrive.runtime.kvcache.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.compression import CodecError, IdentityCodec, Int8Codec, measure_error
from kvdrive.runtime.kvcache.keys import DIGEST_BYTES, BlockKey
from kvdrive.runtime.kvcache.layout import LAYOUT_VERSION, CacheFullError, KVLayout
from kvdrive.runtime.kvcache.residency import Block, Fate, Move, VictimRules
from kvdrive.runtime.kvcache.store import TieredKVStore

__all__ = [
    "DIGEST_BYTES", "LAYOUT_VERSION", "MEMORY_TIERS", "TIER_ORDER", "Block", "BlockIndex", "BlockKey", "BudgetError",
    "CacheFullError", "CodecError", "Fate", "IdentityCodec", "Int8Codec", "KVLayout", "Move", "TierBudgets",
    "TierName", "TierUsage", "TieredKVStore", "VictimRules", "measure_error",
]
