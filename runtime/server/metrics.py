"""Prometheus metrics of one server (its own registry; names and meanings in docs/metrics.md), rendered from the
engine's stats, the tiers' usage and the KV cache's counters (``CacheCounters``) at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvdrive.runtime.engine import EngineStats
from kvdrive.runtime.kvcache import CacheCounters, EnvelopeSplit
from kvdrive.runtime.kvcache.counters import LATENCY_BOUNDS, SharedCounters
from kvdrive.runtime.server.admin_schemas import TierUsageBody

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)


class _LiveCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], tiers: Callable[[], list[TierUsageBody]],
                 counters: Callable[[], CacheCounters]) -> None:
        self._stats, self._tiers, self._counters = stats, tiers, counters

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        tiers = self._tiers()
        yield from _pool_metrics(s, tiers)
        running = GaugeMetricFamily("kvdrive_requests_running", "requests in the running batch")
        running.add_metric([], s.running)
        waiting = GaugeMetricFamily("kvdrive_requests_waiting", "requests queued for admission")
        waiting.add_metric([], s.waiting)
        generated = CounterMetricFamily("kvdrive_generated_tokens", "tokens generated")
        generated.add_metric([], s.generated_tokens_total)
        prompt = CounterMetricFamily("kvdrive_prompt_tokens", "prompt tokens received")
        prompt.add_metric([], s.prompt_tokens_total)
        preempt = CounterMetricFamily("kvdrive_preemptions", "sequences preempted for lack of KV pages")
        preempt.add_metric([], s.preemptions_total)
        cap = GaugeMetricFamily("kvdrive_tier_capacity_bytes", "KV bytes a tier can hold now",
                                labels=["tier", "backing"])
        budget = GaugeMetricFamily("kvdrive_tier_budget_bytes", "configured KV budget of a tier", labels=["tier"])
        used = GaugeMetricFamily("kvdrive_tier_used_bytes", "KV bytes a tier holds for running sequences",
                                 labels=["tier"])
        cached = GaugeMetricFamily("kvdrive_tier_cached_bytes", "KV bytes of reusable pages no running sequence "
                                   "needs (evictable)", labels=["tier"])
        for t in tiers:
            cap.add_metric([t.tier, t.backing], t.capacity_bytes)
            budget.add_metric([t.tier], t.budget_bytes)
            used.add_metric([t.tier], t.used_bytes)
            cached.add_metric([t.tier], t.cached_bytes)
        c = self._counters()
        reads = CounterMetricFamily("kvdrive_page_reads", "needed pages, by the tier they were found in",
                                    labels=["tier"])
        for tier, n in c.page_reads.items():
            reads.add_metric([tier], n)
        moved = CounterMetricFamily("kvdrive_tier_transfer_bytes", "bytes moved between tiers", labels=["src", "dst"])
        for (src, dst), n in c.transfer_bytes.items():
            moved.add_metric([src, dst], n)
        prefetch = CounterMetricFamily("kvdrive_prefetch", "prefetched pages by outcome", labels=["outcome"])
        for outcome, n in c.prefetch.items():
            prefetch.add_metric([outcome], n)
        wait = CounterMetricFamily("kvdrive_fetch_wait_seconds", "time engine steps waited for KV reads from the tiers")
        wait.add_metric([], c.fetch_wait_seconds)
        steps = CounterMetricFamily("kvdrive_decode_steps", "engine steps that decoded at least one token")
        steps.add_metric([], c.decode_steps)
        hits = CounterMetricFamily("kvdrive_prefix_hit_pages", "prompt pages reused from the tiers, not recomputed")
        hits.add_metric([], c.prefix_hit_pages)
        misses = CounterMetricFamily("kvdrive_page_misses", "needed pages no tier could serve (recomputed)")
        misses.add_metric([], c.misses)
        throttled = CounterMetricFamily("kvdrive_prefetch_throttled_steps", "decode steps that skipped prefetching "
                                        "because recent prefetches were mostly wasted")
        throttled.add_metric([], c.prefetch_throttled)
        spilled = CounterMetricFamily("kvdrive_spilled_blocks", "new KV blocks stored below the tier placement chose "
                                      "(every block there was pinned by a transfer, e.g. a write-back to a slow disk)")
        spilled.add_metric([], c.spilled_blocks)
        rereads = CounterMetricFamily("kvdrive_prompt_rereads", "blocks of a prompt in progress that its later "
                                      "chunks read back from below the memory tiers (its pages had spilled)")
        rereads.add_metric([], c.prompt_rereads)
        kinds = GaugeMetricFamily("kvdrive_kv_bytes", "distinct KV bytes the running sequences hold by layer kind: "
                                  "global (their pages, in whichever tiers) or sliding (a hybrid model's window "
                                  "rings, on the device)", labels=["kind"])
        for kind, n in sorted(c.layer_kind_bytes.items()):
            kinds.add_metric([kind], n)
        faults = CounterMetricFamily("kvdrive_tier_faults", "tier faults by kind: an errno name (EIO, ENOSPC, ...) "
                                     "or crc (a block failed its checksum)", labels=["tier", "kind"])
        for (tier, kind), n in sorted(c.faults.items()):
            faults.add_metric([tier, kind], n)
        degraded = GaugeMetricFamily("kvdrive_tier_degraded", "1 while a tier is unavailable or saw a fault in the "
                                     "last minute (see /readyz for why)", labels=["tier"])
        for t in ("gpu", "dram", "ssd") + (("shared",) if c.shared is not None else ()):
            degraded.add_metric([t], 1.0 if t in c.degraded else 0.0)
        yield from (running, waiting, generated, prompt, preempt, cap, budget, used, cached, reads, moved, prefetch,
                    wait, steps, hits, misses, throttled, spilled, rereads, kinds, faults, degraded)
        queued = CounterMetricFamily("kvdrive_queue_wait_seconds", "requests x seconds spent queued for a running "
                                     "slot (its rate is the mean queue length: what max_running explains)")
        queued.add_metric([], s.queue_wait_seconds)
        yield queued
        if c.split is not None:
            yield from _split_metrics(c.split)
        if c.shared is not None:
            yield from _shared_metrics(c.shared, c.shared_prefix_pages)


def _shared_metrics(c: SharedCounters, prefix_pages: int) -> Iterator[GaugeMetricFamily | CounterMetricFamily
                                                                      | HistogramMetricFamily]:
    """The shared tier's (docs/metrics.md#the-shared-tier)."""
    hits = CounterMetricFamily("kvdrive_shared_tier_hits", "pages fetched from the shared tier and verified")
    hits.add_metric([], c.hits)
    misses = CounterMetricFamily("kvdrive_shared_tier_misses", "pages asked of the shared tier and not served "
                                 "(absent, refused, or their shard failing): recomputed")
    misses.add_metric([], c.misses)
    moved = CounterMetricFamily("kvdrive_shared_tier_bytes", "value bytes read from and written to the shared tier",
                                labels=["direction"])
    moved.add_metric(["read"], c.read_bytes)
    moved.add_metric(["write"], c.written_bytes)
    published = CounterMetricFamily("kvdrive_shared_tier_published_pages", "pages this replica wrote to the shared tier")
    published.add_metric([], c.published)
    prefix = CounterMetricFamily("kvdrive_shared_tier_prefix_pages", "prompt pages fetched from the shared tier "
                                 "ahead of their prefill")
    prefix.add_metric([], prefix_pages)
    errors = CounterMetricFamily("kvdrive_shared_tier_errors", "keys whose shard failed: timeout, connection, "
                                 "refused (its breaker open) or error (a reply naming one)", labels=["kind"])
    for kind in ("timeout", "connection", "refused", "error"):
        errors.add_metric([kind], c.errors.get(kind, 0))
    verify = CounterMetricFamily("kvdrive_shared_tier_verify_failures", "values refused by cause (truncated, magic, "
                                 "version, digest, identity, layout, checksum): each a miss, recomputed",
                                 labels=["cause"])
    for cause, n in c.verify_failures.items():
        verify.add_metric([cause], n)
    latency = HistogramMetricFamily("kvdrive_shared_tier_fetch_seconds", "time of one fetch batch (one round trip "
                                    "per shard, the shards in parallel)")
    latency.add_metric([], [(str(b), n) for b, n in zip(LATENCY_BOUNDS, c.fetch_buckets, strict=True)]
                       + [("+Inf", c.fetches)], c.fetch_seconds)
    degraded = GaugeMetricFamily("kvdrive_shared_tier_degraded", "1 while a shard of the shared tier is failing "
                                 "(its breaker open) or no endpoint answered")
    degraded.add_metric([], 1.0 if c.degraded else 0.0)
    shards = GaugeMetricFamily("kvdrive_shared_tier_shards", "shards of the shared tier, and those failing now",
                               labels=["state"])
    shards.add_metric(["all"], c.shards)
    shards.add_metric(["failing"], c.failing_shards)
    yield from (hits, misses, moved, published, prefix, errors, verify, latency, degraded, shards)


def _pool_metrics(s: EngineStats, tiers: list[TierUsageBody]) -> Iterator[GaugeMetricFamily]:
    """What an inference gateway's endpoint picker reads (the Gateway API Inference Extension's model-server
    protocol, docs/gateway-api-inference-extension.md): KV-cache usage and the cache's shape."""
    usage = GaugeMetricFamily("kvdrive_kv_cache_usage_ratio", "share (0-1) of the KV bytes of all tiers (device, "
                              "DRAM, SSD) held for running requests; pages kept only for reuse are evictable and "
                              "not counted")
    capacity = sum(t.capacity_bytes for t in tiers)
    usage.add_metric([], min(1.0, sum(t.used_bytes for t in tiers) / capacity) if capacity else 0.0)
    yield usage
    info = GaugeMetricFamily("kvdrive_cache_config_info", "the KV cache's shape: tokens a page (block_size) and pages "
                             "the device tier holds (num_gpu_blocks)", labels=["block_size", "num_gpu_blocks"])
    info.add_metric([str(s.page_size), str(s.gpu_pages)], 1.0)
    yield info


def _split_metrics(split: EnvelopeSplit) -> Iterator[GaugeMetricFamily]:
    """The device envelope's split: the hot tier and what running sequences reserve."""
    for family, value in (
        (GaugeMetricFamily("kvdrive_max_running", "sequences the engine may run at once now (PUT /admin/tiers "
                           "max_running)"), split.max_running),
        (GaugeMetricFamily("kvdrive_max_sequences", "the most max_running may be set to (--max-sequences)"),
         split.max_sequences),
        (GaugeMetricFamily("kvdrive_gpu_hot_bytes", "the device envelope's share for the hot KV tier (fetch waits "
                           "are what it explains)"), split.hot_bytes),
        (GaugeMetricFamily("kvdrive_sequence_reserve_bytes", "the device envelope's share kept for running "
                           "sequences (open pages, decode step buffers)"), split.reserve_bytes),
        (GaugeMetricFamily("kvdrive_sequence_reserve_per_sequence_bytes", "what one more running sequence takes "
                           "from the hot tier"), split.per_sequence_bytes),
    ):
        family.add_metric([], value)
        yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], tiers: Callable[[], list[TierUsageBody]],
                 counters: Callable[[], CacheCounters]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_LiveCollector(stats, tiers, counters))
        self.ttft = Histogram("kvdrive_time_to_first_token_seconds", "time from request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.engine_step = Histogram("kvdrive_engine_step_seconds", "one turn of the engine loop that ran a step "
                                     "(commands handled before it included): how long decoders waited",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvdrive_inter_token_latency_seconds", "time between consecutive streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
