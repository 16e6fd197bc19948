"""The KV cache: pages, block tables, tier stores and budgets."""

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.compression import CodecError, IdentityCodec, Int8Codec, measure_error
from kvdrive.runtime.kvcache.keys import BlockKey, prefix_digests, private_digest
from kvdrive.runtime.kvcache.paged import CacheFullError, KVLayout, PagedKVCache, SlotMapping
from kvdrive.runtime.kvcache.store import TieredKVStore

__all__ = [
    "TIER_ORDER", "BlockKey", "BudgetError", "CacheFullError", "CodecError", "IdentityCodec", "Int8Codec",
    "KVLayout", "PagedKVCache", "SlotMapping", "TierBudgets", "TierName", "TierUsage", "TieredKVStore",
    "measure_error", "prefix_digests", "private_digest",
]
