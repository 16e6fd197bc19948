"""Placement: the one owner of every tier decision (``Placer``), block scores, admission, prefetch accounting.

Pure bookkeeping: it decides, it never moves bytes (``kvcache.mover`` moves them, the tiers store them).
"""

from kvdrive.runtime.kvcache.placement.admission import Admission
from kvdrive.runtime.kvcache.placement.eviction import TierEviction
from kvdrive.runtime.kvcache.placement.placer import Placer, PlacerConfig
from kvdrive.runtime.kvcache.placement.policy import PLACEMENTS, PlacementPolicy, policy_for
from kvdrive.runtime.kvcache.placement.predictor import PrefetchLedger, PrefetchThrottle
from kvdrive.runtime.kvcache.placement.scores import BlockScores, Hotness, HotnessConfig, Recency

__all__ = ["PLACEMENTS", "Admission", "BlockScores", "Hotness", "HotnessConfig", "Placer", "PlacerConfig",
           "PlacementPolicy", "PrefetchLedger", "PrefetchThrottle", "Recency", "policy_for", "TierEviction"]
