"""The KV cache: pages, block tables, tier stores and budgets."""

from kvdrive.runtime.kvcache.paged import CacheFullError, KVLayout, PagedKVCache, SlotMapping

__all__ = ["CacheFullError", "KVLayout", "PagedKVCache", "SlotMapping"]
