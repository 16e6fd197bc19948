"""The tier policies: kvdrive and the baselines it is measured against, as switches of one binary.

| mode | pages attended | on a lower-tier hit | prefetch | eviction order |
| --- | --- | --- | --- | --- |
| kvdrive | selected (top-k + sinks + recent) | promote to the device tier | predicted pages, async | coldest by attention hotness |
| lru | selected | promote (LRU cache) | none | least recently used |
| ondemand | selected | read into a step buffer, placement unchanged | none | least recently used |
| fullfetch | all (exact) | read into a step buffer | none | least recently used |
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("kvdrive", "lru", "ondemand", "fullfetch")


@dataclass(frozen=True)
class PlacementPolicy:
    name: str
    sparse: bool  # decode attends to selected pages only
    promote_on_read: bool  # a page read from DRAM/SSD gets a device-tier copy
    prefetch: bool  # predicted pages move up while earlier layers compute
    hotness_eviction: bool  # victims by attention hotness, not recency


def policy_for(name: str, full_attention: bool = False) -> PlacementPolicy:
    """The policy of ``--placement name``; ``--full-attention`` turns page selection off."""
    if name not in PLACEMENTS:
        raise ValueError(f"unknown placement {name!r}; expected one of {', '.join(PLACEMENTS)}")
    sparse = name != "fullfetch" and not full_attention
    return PlacementPolicy(
        name=name,
        sparse=sparse,
        promote_on_read=name in ("kvdrive", "lru"),
        prefetch=name == "kvdrive",
        hotness_eviction=name == "kvdrive",
    )
