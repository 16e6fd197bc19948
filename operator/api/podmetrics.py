"""One pod's runtime metrics as the operator sees them: parsing, scrape records and rates.

Owns the translation of a pod's Prometheus text (``GET /metrics`` of ``kvdrive serve``) into frozen
values, and the per-interval rates between two scrapes of the same pod. A scrape that failed is a
``Scrape`` with ``metrics=None``: missing data, never zeros. An interval whose counters went
backwards (the pod restarted) has no rates either. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TIERS = ("gpu", "dram", "ssd")  # fastest first
READ_SOURCES = (*TIERS, "miss")  # where a needed page came from; miss = recomputed


class MetricsFormatError(ValueError):
    """The text is not Prometheus exposition format or lacks what every KVDrive pod exports."""


@dataclass(frozen=True)
class TierState:
    """One tier of one pod at one instant (bytes)."""

    budget: int
    used: int  # pages of running sequences
    capacity: int | None = None  # slots actually allocated (may be below the budget)
    cached: int = 0  # reusable pages no running sequence holds (prefix cache)

    @property
    def room(self) -> int:
        return self.capacity if self.capacity else self.budget

    @property
    def fill(self) -> float:
        """Share of the tier holding pages, running or cached (0 when it can hold nothing)."""
        return min(1.0, (self.used + self.cached) / self.room) if self.room > 0 else 0.0

    @property
    def held(self) -> int:
        return self.used + self.cached


@dataclass(frozen=True)
class PodMetrics:
    """What one scrape of one pod said. Counters are cumulative since the pod started."""

    tiers: Mapping[str, TierState]
    page_reads: Mapping[str, float] = field(default_factory=dict)  # gpu/dram/ssd/miss -> pages
    prefetch: Mapping[str, float] = field(default_factory=dict)  # hit/late/wasted -> pages
    fetch_wait_seconds: float | None = None
    decode_steps: float | None = None
    generated_tokens: float = 0.0
    requests_running: float = 0.0
    requests_waiting: float = 0.0
    # the device envelope's split (None: a runtime too old to report it)
    max_running: int | None = None  # sequences the engine may run at once now (live)
    max_sequences: int | None = None  # ... at most (rows reserved at start)
    hot_bytes: int | None = None  # the envelope's share for the hot KV tier
    reserve_bytes: int | None = None  # ... reserved for running sequences (open pages, step buffers)
    per_sequence_bytes: int | None = None  # what one more running sequence takes from the hot tier
    queue_wait_seconds: float | None = None  # requests x seconds spent queued for a running slot
    # the shared tier's circuit breaker is open (None: the pod has no shared tier, or does not report it)
    shared_tier_degraded: bool | None = None

    def budgets(self) -> dict[str, int]:
        return {tier: state.budget for tier, state in self.tiers.items()}


@dataclass(frozen=True)
class Scrape:
    """One attempt to read one pod: ``metrics`` is None when it failed (``error`` says why)."""

    time: float  # seconds, monotonic within one operator process
    metrics: PodMetrics | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.metrics is not None


@dataclass(frozen=True)
class Rates:
    """Per-second rates over one interval between two good scrapes of the same pod."""

    seconds: float
    page_reads: Mapping[str, float]  # gpu/dram/ssd/miss -> pages/s
    prefetch: Mapping[str, float]  # hit/late/wasted -> pages/s
    fetch_wait_fraction: float | None  # share of wall time decode steps waited for tier reads
    tokens_per_second: float
    queue_length: float | None = None  # requests queued for a running slot, on average over the interval


def parse_metrics(text: str) -> PodMetrics:
    """Parse a pod's ``/metrics`` text; raise MetricsFormatError when it is not a KVDrive pod's."""
    budgets: dict[str, int] = {}
    capacities: dict[str, int] = {}
    used: dict[str, int] = {}
    cached: dict[str, int] = {}
    reads: dict[str, float] = {}
    prefetch: dict[str, float] = {}
    scalars: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsFormatError(f"not Prometheus text: {exc}") from exc
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            tier = labels.get("tier", "")
            if name == "kvdrive_tier_budget_bytes" and tier in TIERS:
                budgets[tier] = int(value)
            elif name == "kvdrive_tier_capacity_bytes" and tier in TIERS:
                capacities[tier] = capacities.get(tier, 0) + int(value)
            elif name == "kvdrive_tier_used_bytes" and tier in TIERS:
                used[tier] = int(value)
            elif name == "kvdrive_tier_cached_bytes" and tier in TIERS:
                cached[tier] = int(value)
            elif name == "kvdrive_page_reads_total" and tier in READ_SOURCES:
                reads[tier] = value
            elif name == "kvdrive_page_misses_total":
                reads["miss"] = value
            elif name == "kvdrive_prefetch_total" and "outcome" in labels:
                prefetch[labels["outcome"]] = value
            elif name in ("kvdrive_fetch_wait_seconds_total", "kvdrive_decode_steps_total",
                          "kvdrive_generated_tokens_total", "kvdrive_requests_running", "kvdrive_requests_waiting",
                          "kvdrive_max_running", "kvdrive_max_sequences", "kvdrive_gpu_hot_bytes",
                          "kvdrive_sequence_reserve_bytes", "kvdrive_sequence_reserve_per_sequence_bytes",
                          "kvdrive_queue_wait_seconds_total", "kvdrive_shared_tier_degraded"):
                scalars[name] = value
    if "kvdrive_requests_waiting" not in scalars or not (budgets or capacities):
        raise MetricsFormatError("no kvdrive_requests_waiting or tier budgets: not a kvdrive serve /metrics")
    # Older runtimes report only capacity (their budget); newer ones report both.
    tiers = {
        tier: TierState(budget=budgets.get(tier, capacities.get(tier, 0)), used=used.get(tier, 0),
                        capacity=capacities.get(tier), cached=cached.get(tier, 0))
        for tier in TIERS
        if tier in budgets or tier in capacities
    }
    return PodMetrics(
        tiers=tiers,
        page_reads=reads,
        prefetch=prefetch,
        fetch_wait_seconds=scalars.get("kvdrive_fetch_wait_seconds_total"),
        decode_steps=scalars.get("kvdrive_decode_steps_total"),
        generated_tokens=scalars.get("kvdrive_generated_tokens_total", 0.0),
        requests_running=scalars.get("kvdrive_requests_running", 0.0),
        requests_waiting=scalars["kvdrive_requests_waiting"],
        max_running=_int(scalars.get("kvdrive_max_running")),
        max_sequences=_int(scalars.get("kvdrive_max_sequences")),
        hot_bytes=_int(scalars.get("kvdrive_gpu_hot_bytes")),
        reserve_bytes=_int(scalars.get("kvdrive_sequence_reserve_bytes")),
        per_sequence_bytes=_int(scalars.get("kvdrive_sequence_reserve_per_sequence_bytes")),
        queue_wait_seconds=scalars.get("kvdrive_queue_wait_seconds_total"),
        shared_tier_degraded=_flag(scalars.get("kvdrive_shared_tier_degraded")),
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _flag(value: float | None) -> bool | None:
    return None if value is None else value != 0


def _deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float] | None:
    out = {}
    for key in set(before) | set(after):
        delta = after.get(key, 0.0) - before.get(key, 0.0)
        if delta < 0:
            return None
        out[key] = delta
    return out


def rates(before: Scrape, after: Scrape) -> Rates | None:
    """Rates between two scrapes; None when either is missing or a counter went backwards."""
    if before.metrics is None or after.metrics is None or after.time <= before.time:
        return None
    a, b, dt = before.metrics, after.metrics, after.time - before.time
    reads = _deltas(a.page_reads, b.page_reads)
    prefetch = _deltas(a.prefetch, b.prefetch)
    tokens = b.generated_tokens - a.generated_tokens
    if reads is None or prefetch is None or tokens < 0:
        return None
    wait: float | None = None
    if a.fetch_wait_seconds is not None and b.fetch_wait_seconds is not None:
        waited = b.fetch_wait_seconds - a.fetch_wait_seconds
        if waited < 0:
            return None
        wait = min(1.0, waited / dt)
    queue: float | None = None
    if a.queue_wait_seconds is not None and b.queue_wait_seconds is not None:
        queued = b.queue_wait_seconds - a.queue_wait_seconds
        if queued < 0:
            return None
        queue = queued / dt
    return Rates(
        seconds=dt,
        page_reads={k: v / dt for k, v in reads.items()},
        prefetch={k: v / dt for k, v in prefetch.items()},
        fetch_wait_fraction=wait,
        tokens_per_second=tokens / dt,
        queue_length=queue,
    )
