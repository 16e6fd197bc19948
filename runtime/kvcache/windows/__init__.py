"""Sliding-window layers (Gemma 2/3): their per-sequence rings, outside the tiers (``ring``), and the windows
kept at page boundaries for prefix reuse (``snapshots``)."""

from kvdrive.runtime.kvcache.windows.ring import SlidingWindows
from kvdrive.runtime.kvcache.windows.snapshots import WindowKeeper, WindowSnapshots

__all__ = ["SlidingWindows", "WindowKeeper", "WindowSnapshots"]
