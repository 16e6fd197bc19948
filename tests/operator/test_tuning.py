"""Live tier tuning as narrated scenarios: a pod's metrics over time, and what the tuner does to its budgets."""

from __future__ import annotations

import copy

from crdcheck import load_example
from tape import MiB, PodTape

from kvdrive.operator.podmetrics import Scrape
from kvdrive.operator.spec import parse_cr
from kvdrive.operator.tuning import Change, PodHistory, TierLimits, TuningPolicy, decide, limits_from_spec

POLICY = TuningPolicy(window=3, min_step=4 * MiB)
LIMITS = {
    "gpu": TierLimits(floor=4 * MiB, ceiling=32 * MiB),
    "dram": TierLimits(floor=8 * MiB, ceiling=64 * MiB, granule=2 * MiB),
    "ssd": TierLimits(floor=64 * MiB, ceiling=512 * MiB),
}
START = {"gpu": 16 * MiB, "dram": 16 * MiB, "ssd": 256 * MiB}
FULL = {"gpu": 0.98, "dram": 0.97, "ssd": 0.7}


def pod() -> PodTape:
    return PodTape(budgets=dict(START))


def test_a_pod_whose_ssd_reads_dominate_gets_more_dram_and_nothing_else() -> None:
    p = pod()
    ssd_heavy = {"gpu": 50.0, "dram": 1.0, "ssd": 120.0}
    moved: list[list[str]] = []
    for _ in range(4):  # one scrape to start, then three intervals of evidence
        p.step(ssd_heavy, FULL, wait=0.3)
        moved.append(p.tune(LIMITS, POLICY))
    assert moved == [[], [], [], ["dram"]]
    assert p.budgets == {"gpu": 16 * MiB, "dram": 20 * MiB, "ssd": 256 * MiB}  # +max(4Mi, 25%) = +4Mi
    assert "ssd reads 120.0/s = 70% of needed pages while dram was 97%+ full" in p.applied[0]
    assert "decode waited 30% of the time, over 3 intervals" in p.applied[0]
    # the pressure persists: it grows one step per window (evidence restarts at each new budget) up to the bound
    for _ in range(40):
        p.step(ssd_heavy, FULL, wait=0.3)
        p.tune(LIMITS, POLICY)
    assert p.budgets["dram"] == 64 * MiB and p.budgets["gpu"] == 16 * MiB
    assert all(change.startswith("dram ") for change in p.applied)
    assert p.budgets["dram"] % (2 * MiB) == 0


def test_dram_reads_and_late_prefetches_grow_the_gpu_tier() -> None:
    p = pod()
    for _ in range(4):
        p.step({"gpu": 40.0, "dram": 30.0, "ssd": 0.0}, FULL, wait=0.1, late=5.0)
        p.tune(LIMITS, POLICY)
    assert p.budgets["gpu"] == 20 * MiB and p.budgets["dram"] == 16 * MiB
    assert "dram reads + late prefetches 35.0/s" in p.applied[0]


def test_recomputed_pages_grow_a_full_ssd_tier_even_when_nothing_waits_for_reads() -> None:
    p = pod()
    for _ in range(4):
        p.step({"gpu": 40.0, "miss": 10.0}, {"gpu": 0.95, "dram": 0.95, "ssd": 0.99}, wait=0.0)
        p.tune(LIMITS, POLICY)
    assert p.budgets["ssd"] == 320 * MiB  # +25% of 256Mi
    assert "pages recomputed (in no tier)" in p.applied[0]


def test_reads_that_prefetch_hides_buy_nothing() -> None:
    p = pod()
    for _ in range(10):
        p.step({"gpu": 50.0, "dram": 20.0, "ssd": 120.0}, FULL, wait=0.001)  # decode never waited
        p.tune(LIMITS, POLICY)
    assert p.budgets == START and p.applied == []


def test_a_flapping_signal_does_not_flap_the_budgets() -> None:
    p = pod()
    for i in range(60):
        if i % 2:  # every other interval: heavy SSD reads on a full DRAM tier
            p.step({"gpu": 50.0, "ssd": 120.0}, FULL, wait=0.3)
        else:  # ... and in between: quiet, tiers half empty
            p.step({"gpu": 5.0}, {"gpu": 0.3, "dram": 0.3, "ssd": 0.3}, wait=0.0)
        p.tune(LIMITS, POLICY)
    assert p.budgets == START and p.applied == []


def test_a_signal_that_comes_and_goes_in_bursts_moves_only_when_it_holds_a_whole_window() -> None:
    p = pod()
    heavy, quiet = {"gpu": 50.0, "ssd": 120.0}, {"gpu": 50.0}
    for burst in ([heavy] * 2 + [quiet]) * 6 + [heavy] * 3:  # two-interval bursts, then one that lasts
        p.step(burst, FULL, wait=0.3)
        p.tune(LIMITS, POLICY)
    assert len(p.applied) == 1 and p.applied[0].startswith("dram 16Mi -> 20Mi")


def test_missing_metrics_change_nothing() -> None:
    p = pod()
    ssd_heavy = {"gpu": 50.0, "ssd": 120.0}
    for _ in range(3):
        p.step(ssd_heavy, FULL, wait=0.3)
    p.missing("GET /metrics: timed out after 5s")
    decision = decide(p.history, LIMITS, POLICY)
    assert decision.changes == () and decision.budgets == {}  # no budgets to apply: the pod keeps its own
    assert "metrics missing" in decision.note
    # the gap breaks the window: a full window of good intervals is needed again after it
    for _ in range(3):
        p.step(ssd_heavy, FULL, wait=0.3)
        assert p.tune(LIMITS, POLICY) == []
    p.step(ssd_heavy, FULL, wait=0.3)
    assert p.tune(LIMITS, POLICY) == ["dram"]


def test_a_pod_that_restarted_has_no_rates_until_its_counters_run_again() -> None:
    p = pod()
    for _ in range(3):
        p.step({"gpu": 50.0, "ssd": 120.0}, FULL, wait=0.3)
    p.restart()  # counters back to zero: the interval across the restart has no rates
    p.step({"gpu": 50.0, "ssd": 120.0}, FULL, wait=0.3)
    assert p.tune(LIMITS, POLICY) == []


def test_an_idle_tier_gives_bytes_back_until_it_is_no_longer_idle() -> None:
    p = PodTape(budgets={"gpu": 32 * MiB, "dram": 64 * MiB, "ssd": 256 * MiB})
    quiet = {"gpu": 10.0}
    idle_fill = {"gpu": 0.95, "dram": 0.25, "ssd": 0.6}  # DRAM holds 16Mi of its 64Mi
    for i in range(6):
        p.step(quiet, idle_fill)
        assert p.tune(LIMITS, POLICY) == [], i  # idle must last two windows (6 intervals)
    p.step(quiet, idle_fill)
    assert p.tune(LIMITS, POLICY) == ["dram"]
    assert p.budgets["dram"] == 48 * MiB  # one step (25%) per decision
    assert "at most 25% full (peak 16Mi) for 6 intervals" in p.applied[0]
    for _ in range(30):
        p.step(quiet, {"gpu": 0.95, "dram": 16 / (p.budgets["dram"] / MiB), "ssd": 0.6})
        p.tune(LIMITS, POLICY)
    # 48 -> 36 -> 28 (27, rounded up to whole 2Mi pages): 57% full is no longer idle, so it stays there
    assert p.budgets["dram"] == 28 * MiB
    assert [c.split(":")[0] for c in p.applied] == [
        "dram 64Mi -> 48Mi (-16Mi)", "dram 48Mi -> 36Mi (-12Mi)", "dram 36Mi -> 28Mi (-8Mi)"]
    assert p.budgets["gpu"] == 32 * MiB and p.budgets["ssd"] == 256 * MiB  # full or in the band: untouched


def test_an_idle_tier_that_still_sends_reads_below_is_not_shrunk() -> None:
    p = PodTape(budgets={"gpu": 32 * MiB, "dram": 64 * MiB, "ssd": 256 * MiB})
    for _ in range(20):
        p.step({"gpu": 10.0, "ssd": 30.0}, {"gpu": 0.95, "dram": 0.25, "ssd": 0.6})
        p.tune(LIMITS, POLICY)
    assert p.budgets["dram"] == 64 * MiB


def test_bounds_win_over_the_budgets_a_pod_started_with() -> None:
    p = PodTape(budgets={"gpu": 64 * MiB, "dram": 4 * MiB, "ssd": 256 * MiB})
    p.step({"gpu": 10.0}, FULL)
    assert sorted(p.tune(LIMITS, POLICY)) == ["dram", "gpu"]  # at once: bounds need no evidence
    assert p.budgets == {"gpu": 32 * MiB, "dram": 8 * MiB, "ssd": 256 * MiB}
    assert "outside the bounds [4Mi, 32Mi]" in p.applied[0]


def test_steps_below_the_minimum_are_skipped_unless_they_reach_the_bound() -> None:
    policy = TuningPolicy(window=1, min_step=8 * MiB)
    limits = {**LIMITS, "dram": TierLimits(floor=8 * MiB, ceiling=30 * MiB, granule=2 * MiB)}
    p = pod()
    for _ in range(6):
        p.step({"gpu": 50.0, "ssd": 120.0}, FULL, wait=0.3)
        p.tune(limits, policy)
    # 16 -> 24 (min step 8Mi) -> 30 (only 6Mi, but that is the ceiling) -> stays
    assert [c.split(":")[0] for c in p.applied] == ["dram 16Mi -> 24Mi (+8Mi)", "dram 24Mi -> 30Mi (+6Mi)"]


def test_huge_pages_of_1gi_move_dram_in_whole_pages() -> None:
    policy = TuningPolicy(window=1, min_step=1)
    limits = {**LIMITS, "dram": TierLimits(floor=0, ceiling=8 << 30, granule=1 << 30)}
    p = PodTape(budgets={"gpu": 16 * MiB, "dram": 2 << 30, "ssd": 256 * MiB})
    for _ in range(2):
        p.step({"gpu": 50.0, "ssd": 120.0}, FULL, wait=0.3)
        p.tune(limits, policy)
    assert p.budgets["dram"] == 3 << 30  # 2Gi + 25% = 2.5Gi, rounded down to whole 1Gi pages


def test_a_growth_the_pod_refuses_teaches_a_ceiling() -> None:
    p = pod()
    for _ in range(4):
        p.step({"gpu": 40.0, "dram": 30.0}, FULL, wait=0.2)
    decision = decide(p.history, LIMITS, POLICY)
    assert [c.tier for c in decision.changes] == ["gpu"]
    # PUT /admin/tiers answered 422 (the GPU has no room for it): the budgets stay, the pod's ceiling drops
    p.history = p.history.refused(decision.changes, p.now, "refused")
    for _ in range(12):
        p.step({"gpu": 40.0, "dram": 30.0}, FULL, wait=0.2)
        assert p.tune(LIMITS, POLICY) == []
    assert p.history.ceilings == {"gpu": 16 * MiB}


def test_no_history_no_decision() -> None:
    assert decide(PodHistory(), LIMITS, POLICY).changes == ()
    assert decide(PodHistory((Scrape(1.0, None, "connection refused"),)), LIMITS, POLICY).budgets == {}


def test_change_descriptions_carry_the_numbers() -> None:
    assert Change("dram", 16 * MiB, 24 * MiB, "why").describe() == "dram 16Mi -> 24Mi (+8Mi): why"
    assert Change("gpu", 3 << 29, 1 << 30, "idle").describe() == "gpu 1.5Gi -> 1Gi (-512Mi): idle"


def test_limits_from_the_full_example() -> None:
    spec = parse_cr(load_example("full.yaml")).spec
    limits = limits_from_spec(spec)
    assert limits["gpu"] == TierLimits(floor=8 << 30, ceiling=40 << 30)
    assert limits["dram"] == TierLimits(floor=16 << 30, ceiling=64 << 30, granule=2 * MiB)
    assert limits["ssd"].ceiling == 900 << 30 and limits["ssd"].floor == 0  # bound below 90% of the 1Ti claim


def test_without_bounds_tiers_stay_within_what_the_pod_has() -> None:
    doc = copy.deepcopy(load_example("minimal.yaml"))
    limits = limits_from_spec(parse_cr(doc).spec)
    assert limits["gpu"].ceiling == 4 << 30  # the spec's budget: only the runtime knows the GPU's free memory
    assert limits["dram"].ceiling == 8 << 30  # the hugepage allocation
    ssd = 100 * (1 << 30) * 90 // 100
    assert limits["ssd"].ceiling == ssd - ssd % MiB  # the runtime's share of the claim
    assert all(lim.floor == 0 for lim in limits.values())


def test_a_long_idle_tier_shrinks_to_its_peak_use_plus_headroom_but_not_below_the_floor() -> None:
    policy = TuningPolicy(window=1, idle_windows=1, min_step=1, step_fraction=1.0)
    p = PodTape(budgets={"gpu": 32 * MiB, "dram": 64 * MiB, "ssd": 256 * MiB})
    used = {"gpu": 31 * MiB, "dram": 7 * MiB, "ssd": 12 * MiB}
    for _ in range(4):
        p.step({"gpu": 10.0}, {t: used[t] / b for t, b in p.budgets.items()})
        p.tune(LIMITS, policy)
    assert p.budgets["dram"] == 10 * MiB  # 7Mi x 1.25 = 8.75Mi, rounded up to whole 2Mi pages
    assert p.budgets["ssd"] == 64 * MiB  # 15Mi would do, but the floor is 64Mi
    assert p.budgets["gpu"] == 32 * MiB
