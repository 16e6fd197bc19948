"""Reading a pod's /metrics: the runtime's exposition text, failures and restarts."""

from __future__ import annotations

import pytest

from kvdrive.operator.api.podmetrics import MetricsFormatError, Scrape, parse_metrics, rates

# What `kvdrive serve` exposes (abridged from a real server with --gpu-budget 8MiB --dram-budget 16MiB).
TEXT = """# HELP kvdrive_requests_waiting requests queued for admission
# TYPE kvdrive_requests_waiting gauge
kvdrive_requests_waiting 3.0
kvdrive_requests_running 2.0
# TYPE kvdrive_generated_tokens counter
kvdrive_generated_tokens_total {tokens}
# TYPE kvdrive_tier_capacity_bytes gauge
kvdrive_tier_capacity_bytes{{backing="cpu",tier="gpu"}} 8.380416e+06
kvdrive_tier_capacity_bytes{{backing="anon-thp",tier="dram"}} 1.6760832e+07
kvdrive_tier_budget_bytes{{tier="gpu"}} 8.388608e+06
kvdrive_tier_budget_bytes{{tier="dram"}} 1.6777216e+07
kvdrive_tier_used_bytes{{tier="gpu"}} 1.0e+06
kvdrive_tier_used_bytes{{tier="dram"}} 0.0
kvdrive_tier_cached_bytes{{tier="gpu"}} 6.905856e+06
kvdrive_tier_cached_bytes{{tier="dram"}} 1.6687104e+07
# TYPE kvdrive_page_reads counter
kvdrive_page_reads_total{{tier="gpu"}} {gpu}
kvdrive_page_reads_total{{tier="dram"}} {dram}
kvdrive_page_reads_total{{tier="ssd"}} 10.0
# TYPE kvdrive_prefetch counter
kvdrive_prefetch_total{{outcome="late"}} 4.0
# TYPE kvdrive_fetch_wait_seconds counter
kvdrive_fetch_wait_seconds_total {wait}
# TYPE kvdrive_page_misses counter
kvdrive_page_misses_total 2.0
# TYPE kvdrive_inter_token_latency_seconds histogram
kvdrive_inter_token_latency_seconds_bucket{{le="0.1"}} 3.0
kvdrive_inter_token_latency_seconds_bucket{{le="+Inf"}} 3.0
kvdrive_inter_token_latency_seconds_count 3.0
kvdrive_inter_token_latency_seconds_sum 0.2
"""


def text(gpu: float = 1108, dram: float = 2338, wait: float = 0.5, tokens: float = 100) -> str:
    return TEXT.format(gpu=gpu, dram=dram, wait=wait, tokens=tokens)


def test_a_servers_metrics_become_tiers_counters_and_queue() -> None:
    m = parse_metrics(text())
    assert m.budgets() == {"gpu": 8388608, "dram": 16777216}  # no SSD tier configured: none reported
    gpu = m.tiers["gpu"]
    assert (gpu.used, gpu.cached, gpu.capacity) == (1_000_000, 6_905_856, 8_380_416)
    assert gpu.fill == pytest.approx((1_000_000 + 6_905_856) / 8_380_416)  # running + cached pages
    assert m.page_reads == {"gpu": 1108, "dram": 2338, "ssd": 10, "miss": 2}
    assert (m.requests_waiting, m.requests_running, m.fetch_wait_seconds) == (3, 2, 0.5)


def test_rates_between_two_scrapes() -> None:
    r = rates(Scrape(10.0, parse_metrics(text())), Scrape(12.0, parse_metrics(text(gpu=1208, dram=2538, wait=0.7,
                                                                                     tokens=140))))
    assert r is not None
    assert r.page_reads["gpu"] == 50 and r.page_reads["dram"] == 100 and r.page_reads["ssd"] == 0
    assert r.fetch_wait_fraction == pytest.approx(0.1) and r.tokens_per_second == 20


def test_a_restarted_pod_or_a_missing_scrape_has_no_rates() -> None:
    before = Scrape(10.0, parse_metrics(text()))
    assert rates(before, Scrape(12.0, parse_metrics(text(gpu=5, dram=5, wait=0.0, tokens=1)))) is None
    assert rates(before, Scrape(12.0, None, "timeout")) is None


@pytest.mark.parametrize("body", ["<html>502 Bad Gateway</html>", "", "process_cpu_seconds_total 3\n"])
def test_what_is_not_a_kvdrive_pods_metrics_is_an_error_not_zeros(body: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_metrics(body)
