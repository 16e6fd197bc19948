"""The router's Prometheus metrics: decisions by reason, prefix tokens matched (and of those, fetched from the
fleet's shared tier), pages known in the shared tier, retries, and per replica its in-flight requests, queue,
errors, whether it is in service, how many pages the index holds and whether its KV events are followed."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvdrive.router.core import Router
from kvdrive.router.selection import REASONS


class RouterMetrics(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.decisions = dict.fromkeys(REASONS, 0)
        self.matched_tokens = 0  # prompt tokens the chosen replica already held (or could fetch from the shared tier)
        self.shared_tokens = 0  # of those, the tokens only the fleet's shared tier held
        self.prompt_tokens = 0  # prompt tokens of the requests routed with a readable prompt
        self.retries = 0  # attempts moved to another replica before anything was streamed
        self.unavailable = 0  # requests answered 503: no replica could take them
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def decided(self, reason: str, matched_tokens: int, prompt_tokens: int, shared_tokens: int = 0) -> None:
        self.decisions[reason] += 1
        self.matched_tokens += matched_tokens
        self.shared_tokens += shared_tokens
        self.prompt_tokens += prompt_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        d = CounterMetricFamily("kvdrive_router_decisions", "requests routed, by why that replica",
                                labels=["reason"])
        for reason, n in self.decisions.items():
            d.add_metric([reason], n)
        yield d
        yield CounterMetricFamily("kvdrive_router_prefix_tokens_matched", "prompt tokens the chosen replica "
                                  "already held or could fetch from the shared tier", value=self.matched_tokens)
        yield CounterMetricFamily("kvdrive_router_prefix_tokens_shared", "of the prefix tokens matched, those only "
                                  "the fleet's shared tier held", value=self.shared_tokens)
        yield GaugeMetricFamily("kvdrive_router_shared_pages", "pages the index knows in the fleet's shared tier",
                                value=self.router.index.shared())
        yield CounterMetricFamily("kvdrive_router_prompt_tokens", "prompt tokens of the requests routed",
                                  value=self.prompt_tokens)
        yield CounterMetricFamily("kvdrive_router_retries", "attempts moved to another replica (nothing streamed)",
                                  value=self.retries)
        yield CounterMetricFamily("kvdrive_router_unavailable", "requests answered 503: no replica could take them",
                                  value=self.unavailable)
        now = time.monotonic()
        families = {
            "in_flight": GaugeMetricFamily("kvdrive_router_backend_in_flight", "requests sent and not finished",
                                           labels=["backend"]),
            "waiting": GaugeMetricFamily("kvdrive_router_backend_waiting", "the replica's own queue",
                                         labels=["backend"]),
            "load": GaugeMetricFamily("kvdrive_router_backend_load", "the load routing weighs: requests it runs or "
                                      "queues (this router's count, or the replica's report when higher)",
                                      labels=["backend"]),
            "up": GaugeMetricFamily("kvdrive_router_backend_up", "1 when the replica is in service",
                                    labels=["backend"]),
            "pages": GaugeMetricFamily("kvdrive_router_backend_index_pages", "pages the index says it holds",
                                       labels=["backend"]),
            "events": GaugeMetricFamily("kvdrive_router_backend_kv_events_live", "1 while its KV events are heard "
                                        "and in step (its page list is not polled)", labels=["backend"]),
        }
        batches = CounterMetricFamily("kvdrive_router_backend_kv_event_batches", "KV-event batches applied",
                                      labels=["backend"])
        errors = CounterMetricFamily("kvdrive_router_backend_errors", "failed requests and polls",
                                     labels=["backend"])
        for b in list(self.router.pool.backends.values()):
            families["in_flight"].add_metric([b.url], b.in_flight)
            families["waiting"].add_metric([b.url], b.waiting)
            families["load"].add_metric([b.url], b.load)
            families["up"].add_metric([b.url], 1 if b.usable(now) else 0)
            families["pages"].add_metric([b.url], self.router.index.pages(b.url))
            families["events"].add_metric([b.url], 1 if self.router.feed.live(b.url, now) else 0)
            batches.add_metric([b.url], self.router.feed.batches(b.url))
            errors.add_metric([b.url], b.errors)
        yield from families.values()
        yield errors
        yield batches
