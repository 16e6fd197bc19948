"""The KV cache's counters at one instant (what ``/metrics`` and the benchmarks report): plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdrive.runtime.kvcache.config import EnvelopeSplit

LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # shared-tier fetch seconds buckets


@dataclass(frozen=True)
class SharedCounters:
    """The shared tier's cumulative counters since start, and its state now."""

    hits: int = 0  # pages fetched and verified
    misses: int = 0  # pages asked for and not served (absent, bad, or their shard failing)
    read_bytes: int = 0
    written_bytes: int = 0
    published: int = 0  # pages written
    errors: dict[str, int] = field(default_factory=dict)  # timeout | connection | refused | error -> keys
    verify_failures: dict[str, int] = field(default_factory=dict)  # cause (values.CAUSES) -> values refused
    fetches: int = 0  # fetch batches
    fetch_seconds: float = 0.0  # their total time
    fetch_buckets: tuple[int, ...] = ()  # cumulative count of fetches <= each LATENCY_BOUNDS bound
    degraded: str | None = None
    shards: int = 0
    failing_shards: int = 0


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
    shared: SharedCounters | None = None  # the shared tier's, when the server has one
    shared_prefix_pages: int = 0  # prompt pages fetched from the shared tier (then reused like stored ones)
    spilled_blocks: int = 0  # new blocks stored below placement's tier (its blocks were all pinned by transfers)
