"""Placement: the one owner of every tier decision (``Placer``), block scores, admission, prefetch accounting.

Pure bookkeeping: it decides, it never moves bytes (``kvdrive.runtime.pipeline`` moves them, the
tiers store them).
"""

from kvdrive.runtime.placement.admission import Admission
from kvdrive.runtime.placement.demotion import KeepHierarchy, replaces_stored_copy
from kvdrive.runtime.placement.placer import Placer, PlacerConfig
from kvdrive.runtime.placement.policy import PLACEMENTS, PlacementPolicy, policy_for
from kvdrive.runtime.placement.predictor import PrefetchLedger, PrefetchThrottle
from kvdrive.runtime.placement.scores import BlockScores, Hotness, HotnessConfig, Recency

__all__ = ["PLACEMENTS", "Admission", "BlockScores", "Hotness", "HotnessConfig", "KeepHierarchy", "Placer", "PlacerConfig",
           "PlacementPolicy", "PrefetchLedger", "PrefetchThrottle", "Recency", "policy_for", "replaces_stored_copy"]
