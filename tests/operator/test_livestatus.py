"""What `kubectl get kvd` and `kubectl describe kvd` show of the live loop (pure shaping)."""

from __future__ import annotations

from kvdrive.operator.livestatus import budget_summary, pod_entry, range_text, scale_event
from kvdrive.operator.podmetrics import Scrape
from kvdrive.operator.tuning import PodHistory

MiB = 1 << 20


def test_budget_columns_show_one_value_or_the_range_across_pods() -> None:
    entries = [{"gpuBytes": 8 * MiB, "dramBytes": 16 * MiB}, {"gpuBytes": 10 * MiB, "dramBytes": 16 * MiB}]
    summary = budget_summary(entries, fallback={"gpu": 1, "dram": 1, "ssd": 256 * MiB})
    assert summary == {"gpu": "8Mi-10Mi", "dram": "16Mi", "ssd": "256Mi"}  # no pod reported SSD: the spec's start
    assert range_text([]) == ""


def test_a_missing_pod_shows_why_and_keeps_the_budgets_it_last_reported() -> None:
    history = PodHistory().changed(1.0, "dram 16Mi -> 20Mi (+4Mi): ssd reads")
    entry = pod_entry("chat-1", Scrape(2.0, None, "GET /metrics: no answer within 5s"), history,
                      {"gpu": 8 * MiB, "dram": 20 * MiB}, "2026-01-01T00:00:02Z", "2026-01-01T00:00:01Z")
    assert entry == {"name": "chat-1", "metrics": "missing", "lastScrapeTime": "2026-01-01T00:00:02Z",
                     "scrapeError": "GET /metrics: no answer within 5s", "gpuBytes": 8 * MiB, "dramBytes": 20 * MiB,
                     "lastChangeTime": "2026-01-01T00:00:01Z", "lastChange": "dram 16Mi -> 20Mi (+4Mi): ssd reads"}


def test_scaling_events_say_which_way_and_why() -> None:
    assert scale_event(2, 3, "queue") == ("ScaledUp", "replicas 2 -> 3: queue")
    assert scale_event(3, 1, "idle")[0] == "ScaledDown"
