"""Placement: page hotness, the tier policy of each mode, and prediction of the next step's pages.

Pure bookkeeping: it decides, it never moves bytes (``kvdrive.runtime.pipeline`` moves them, the
tiers store them).
"""

from kvdrive.runtime.placement.hotness import Hotness
from kvdrive.runtime.placement.policy import PLACEMENTS, PlacementPolicy, policy_for
from kvdrive.runtime.placement.predictor import PrefetchLedger, PrefetchThrottle

__all__ = ["PLACEMENTS", "Hotness", "PlacementPolicy", "PrefetchLedger", "PrefetchThrottle", "policy_for"]
