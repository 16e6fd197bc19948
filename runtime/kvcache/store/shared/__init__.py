"""The shared tier: KV pages a fleet of replicas shares through a Valkey / Redis deployment (``tier``), their
self-verifying value format (``values``), the connection to the shards (``shards``) and a shard's breaker."""

from kvdrive.runtime.kvcache.store.shared.tier import SharedTier
from kvdrive.runtime.kvcache.store.shared.values import CAUSES, BadValue, PageFormat, cache_identity

__all__ = ["CAUSES", "BadValue", "PageFormat", "SharedTier", "cache_identity"]
