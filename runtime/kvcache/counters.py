"""The KV cache's counters at one instant (what ``/metrics`` and the benchmarks report): plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdrive.runtime.kvcache.config import EnvelopeSplit


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative counters since start, and a few levels now (``degraded``, ``layer_kind_bytes``, ``split``)."""

    page_reads: dict[str, int]  # tier -> needed pages read from it (in place by the decode loop, or by the Mover)
    transfer_bytes: dict[tuple[str, str], int]  # (src, dst) -> bytes moved between tiers
    prefetch: dict[str, int]  # outcome (hit | late | wasted) -> prefetched blocks
    fetch_wait_seconds: float = 0.0  # time steps spent waiting for the Mover's reads of missed pages
    decode_steps: int = 0
    prefix_hit_pages: int = 0  # pages reused from the tiers instead of recomputed
    misses: int = 0  # needed pages no tier could serve (recomputed)
    pages_lost: int = 0  # step reads that met such a page (its sequence is recomputed)
    prefetch_throttled: int = 0  # decode steps that skipped prefetching (recent prefetches mostly wasted)
    faults: dict[tuple[str, str], int] = field(default_factory=dict)  # (tier, kind) -> faults since start
    degraded: frozenset[str] = frozenset()  # tiers degraded now
    prompt_rereads: int = 0  # blocks prompt chunks read back from below the memory tiers
    layer_kind_bytes: dict[str, int] = field(default_factory=dict)  # global | sliding -> bytes held now
    split: EnvelopeSplit | None = None  # the device envelope's split now
