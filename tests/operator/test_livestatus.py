"""What `kubectl get kvd` and `kubectl describe kvd` show of the live loop (pure shaping)."""

from __future__ import annotations

from kvdrive.operator.api.podmetrics import PodMetrics, Scrape, TierState
from kvdrive.operator.api.quantity import exact_quantity
from kvdrive.operator.decide.livestatus import (
    agreed_recommendations,
    budget_summary,
    pod_entry,
    range_text,
    recommendation_event,
    running_summary,
    scale_event,
)
from kvdrive.operator.decide.tuning import PodHistory, Recommendation

MiB = 1 << 20
GiB = 1 << 30


def _metrics(max_running: int | None = 8) -> PodMetrics:
    tiers = {"gpu": TierState(budget=8 * MiB, used=0), "dram": TierState(budget=20 * MiB, used=0)}
    if max_running is None:  # a runtime too old to report its split
        return PodMetrics(tiers=tiers)
    return PodMetrics(tiers=tiers, max_running=max_running, max_sequences=32, hot_bytes=6 * MiB,
                      reserve_bytes=2 * MiB, per_sequence_bytes=256 << 10)


def _dram(recommended: int, reason: str = "at most 20% full (peak 3Gi) for 6 intervals") -> Recommendation:
    return Recommendation("dram", "tiers.dram.size", 16 * GiB, recommended, reason)


def test_budget_columns_show_one_value_or_the_range_across_pods() -> None:
    entries = [{"gpuBytes": 8 * MiB, "dramBytes": 16 * MiB}, {"gpuBytes": 10 * MiB, "dramBytes": 16 * MiB}]
    summary = budget_summary(entries, fallback={"gpu": 1, "dram": 1, "ssd": 256 * MiB})
    assert summary == {"gpu": "8Mi-10Mi", "dram": "16Mi", "ssd": "256Mi"}  # no pod reported SSD: the spec's start
    assert range_text([]) == ""


def test_the_max_running_column_shows_one_value_or_the_range_and_the_spec_before_any_pod_reports() -> None:
    assert running_summary([{"maxRunning": 8}, {"maxRunning": 12}, {}], fallback=16) == "8-12"
    assert running_summary([{"maxRunning": 8}, {"maxRunning": 8}], fallback=16) == "8"
    assert running_summary([{"gpuBytes": 1}], fallback=16) == "16"


def test_a_missing_pod_shows_why_and_keeps_the_budgets_and_split_it_last_reported() -> None:
    history = PodHistory().add(Scrape(1.0, _metrics()), keep=8).changed(1.5, "max_running 4 -> 8: requests queued")
    history = history.add(Scrape(2.0, None, "GET /metrics: no answer within 5s"), keep=8)
    entry = pod_entry("chat-1", history.scrapes[-1], history, "2026-01-01T00:00:02Z", "2026-01-01T00:00:01Z")
    assert entry == {"name": "chat-1", "metrics": "missing", "lastScrapeTime": "2026-01-01T00:00:02Z",
                     "scrapeError": "GET /metrics: no answer within 5s", "gpuBytes": 8 * MiB, "dramBytes": 20 * MiB,
                     "maxRunning": 8, "hotBytes": 6 * MiB, "reserveBytes": 2 * MiB,
                     "lastChangeTime": "2026-01-01T00:00:01Z", "lastChange": "max_running 4 -> 8: requests queued"}


def test_a_pod_that_does_not_report_its_split_shows_only_its_budgets() -> None:
    history = PodHistory().add(Scrape(1.0, _metrics(max_running=None)), keep=8)
    entry = pod_entry("chat-0", history.scrapes[-1], history, "t", None)
    assert entry == {"name": "chat-0", "metrics": "ok", "lastScrapeTime": "t", "gpuBytes": 8 * MiB,
                     "dramBytes": 20 * MiB}


def test_recommendations_show_as_exact_quantities_a_cr_can_take() -> None:
    history = PodHistory().add(Scrape(1.0, _metrics()), keep=8).recommended([_dram(3 * GiB + 200 * MiB)])
    entry = pod_entry("chat-0", history.scrapes[-1], history, "t", None)
    assert entry["recommendations"] == [{"tier": "dram", "field": "tiers.dram.size", "current": "16Gi",
                                         "recommended": "3272Mi",  # 3.2Gi would not be the same size
                                         "reason": "at most 20% full (peak 3Gi) for 6 intervals"}]
    assert recommendation_event("chat-0", _dram(4 * GiB)).startswith(
        "pod chat-0: tiers.dram.size: 16Gi -> recommend 4Gi (at most 20% full")
    assert "nothing changed on the pod" in recommendation_event("chat-0", _dram(4 * GiB))


def test_the_cr_level_recommendation_needs_every_pod_and_takes_the_largest_need() -> None:
    small, large = _dram(2 * GiB), _dram(4 * GiB, "at most 40% full (peak 5Gi) for 6 intervals")
    ssd = Recommendation("ssd", "tiers.ssd.size", 100 * GiB, 10 * GiB, "at most 5% full")
    pods = [("chat-0", PodHistory().recommended([small, ssd])), ("chat-1", PodHistory().recommended([large]))]
    (agreed,) = agreed_recommendations(pods)  # chat-1 does not find the SSD idle: no SSD recommendation
    assert agreed["tier"] == "dram" and agreed["recommended"] == "4Gi" and agreed["current"] == "16Gi"
    assert agreed["reason"] == "every pod (2) recommends it; the largest need, chat-1's: at most 40% full (peak 5Gi) " \
                               "for 6 intervals"
    assert agreed_recommendations([*pods, ("chat-2", PodHistory())]) == []  # a pod not judged yet vetoes
    assert agreed_recommendations([]) == []


def test_exact_quantities() -> None:
    assert [exact_quantity(v) for v in (3 * GiB, 1350 * MiB, 1000, 0, 1536, 1 << 40)] == [
        "3Gi", "1350Mi", "1000", "0", "1536", "1Ti"]


def test_scaling_events_say_which_way_and_why() -> None:
    assert scale_event(2, 3, "queue") == ("ScaledUp", "replicas 2 -> 3: queue")
    assert scale_event(3, 1, "idle")[0] == "ScaledDown"
