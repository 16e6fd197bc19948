"""Live tuning as narrated scenarios: a pod's metrics over time, and what the tuner does to its split.

The pod's device envelope is fixed; ``max_running`` decides how much of it running sequences reserve
(2 MiB each on this tape) and how much is the hot tier. DRAM and SSD are never changed, only sized in
recommendations.
"""

from __future__ import annotations

from crdcheck import load_example
from tape import PER_SEQUENCE, MiB, PodTape

from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.decide.tuning import RunningLimits, TuningPolicy, limits_from_spec

POLICY = TuningPolicy(window=3)
LIMITS = RunningLimits(floor=1, ceiling=16, min_step=1)


def test_a_queue_while_the_hot_tier_serves_raises_the_limit_to_what_runs_plus_what_waits() -> None:
    p = PodTape(max_running=4)
    moved = []
    for _ in range(4):  # one scrape to start, then three intervals of evidence
        p.step(wait=0.01, queue=6.0)
        moved.append(p.tune(LIMITS, POLICY).changed)
    assert moved == [False, False, False, True]
    assert p.max_running == 10  # 4 running + 6 queued, in one move
    assert "requests queued (6.0 on average at least) while decode waited at most 1%" in p.applied[0]
    assert "hot tier served 83% of needed pages" in p.applied[0]


def test_the_limit_never_passes_the_ceiling_or_the_pods_max_sequences() -> None:
    p = PodTape(max_running=12, max_sequences=14)
    for _ in range(8):
        p.step(wait=0.0, queue=20.0)
        p.tune(LIMITS, POLICY)
    assert p.max_running == 14
    assert "at its ceiling 14" in p.decide(LIMITS, POLICY).reason


def test_waits_with_no_queue_and_unused_slots_give_the_slots_to_the_hot_tier() -> None:
    """Two long streams run under a limit of 16: decode waits on lower-tier reads a third of the time;
    the fourteen idle slots are 28 MiB the hot tier can use."""
    p = PodTape(max_running=16)
    for _ in range(4):
        p.step(wait=0.33, queue=0.0, running=2, rates={"gpu": 10.0, "dram": 20.0, "ssd": 30.0})
        p.tune(LIMITS, POLICY)
    assert p.max_running == 2
    assert "decode waited at least 33% of the time for lower-tier reads" in p.applied[0]
    assert "at most 2 of 16 sequences running" in p.applied[0]


def test_a_queue_held_back_by_memory_not_by_the_limit_does_not_raise_it() -> None:
    """One of two long prompts waits because the memory tiers cannot take both prompts at once: the
    batch is below its limit, so more slots would not admit it."""
    p = PodTape(max_running=8)
    for _ in range(6):
        p.step(wait=0.0, queue=1.0, running=1)
        p.tune(LIMITS, POLICY)
    assert p.applied == []


def test_when_the_queue_and_the_reads_both_argue_the_split_stays() -> None:
    """Two queued requests would grow a batch of eight by 25%; decode waits on reads 40% of the time."""
    p = PodTape(max_running=8)
    for _ in range(6):
        p.step(wait=0.4, queue=2.0)
        p.tune(LIMITS, POLICY)
    assert p.applied == []
    assert "cannot serve both" in p.decide(LIMITS, POLICY).reason


def test_a_queue_that_would_double_the_batch_wins_over_fetch_waits() -> None:
    """Two long streams still decode (waiting on reads 30% of the time) when fourteen short requests
    arrive under a limit of two: the queue is seven times the batch, so slots win."""
    p = PodTape(max_running=2)
    for _ in range(4):
        p.step(wait=0.3, queue=14.0)
        p.tune(LIMITS, POLICY)
    assert p.max_running == 16
    assert "the queue would grow the batch of 2 by 700%, more than the 30% of the time" in p.applied[0]


def test_a_queue_in_the_dead_band_grows_the_batch_when_it_outweighs_the_waits() -> None:
    """Eleven short requests run and three to five more wait while decode waits on reads 6-8% of the
    time (above wait_low): a batch 27% larger outweighs the waits; the limit takes the longest queue."""
    p = PodTape(max_running=11)
    for i in range(4):
        p.step(wait=(0.06, 0.08, 0.07, 0.06)[i], queue=(4.0, 3.0, 5.0, 3.0)[i])
        p.tune(LIMITS, POLICY)
    assert p.max_running == 16  # 11 running + the window's longest queue (5)
    assert "by 27%, more than the 8% of the time decode waited" in p.applied[0]


def test_the_dead_band_between_low_and_high_waits_moves_nothing() -> None:
    p = PodTape(max_running=8)
    for _ in range(6):  # too many waits (10%) for a queue that grows the batch by 8%
        p.step(wait=0.10, queue=0.6)
        p.tune(LIMITS, POLICY)
    for _ in range(6):  # too few waits to take the six unused slots away
        p.step(wait=0.10, queue=0.0, running=2)
        p.tune(LIMITS, POLICY)
    assert p.applied == []


def test_a_signal_that_comes_and_goes_moves_only_when_it_holds_a_whole_window() -> None:
    p = PodTape(max_running=4)
    for i in range(12):  # a queue in two intervals of every three: never a whole window
        p.step(wait=0.0, queue=4.0 if i % 3 else 0.0)
        p.tune(LIMITS, POLICY)
    assert p.applied == []
    for _ in range(3):
        p.step(wait=0.0, queue=4.0)
        p.tune(LIMITS, POLICY)
    assert p.max_running == 8


def test_evidence_restarts_after_a_change() -> None:
    p = PodTape(max_running=4)
    for _ in range(4):
        p.step(wait=0.0, queue=2.0)
        p.tune(LIMITS, POLICY)
    assert p.max_running == 6
    for _ in range(3):  # three scrapes at the new limit are two intervals measured at it: not a window yet
        p.step(wait=0.0, queue=2.0)
        assert not p.tune(LIMITS, POLICY).changed
    p.step(wait=0.0, queue=2.0)
    assert p.tune(LIMITS, POLICY).changed and p.max_running == 8


def test_missing_metrics_change_nothing() -> None:
    p = PodTape(max_running=4)
    for i in range(9):
        if i % 3 == 2:
            p.missing()
        else:
            p.step(wait=0.0, queue=5.0)
        p.tune(LIMITS, POLICY)
    assert p.applied == []
    assert "metrics missing" in p.decide(LIMITS, POLICY).reason


def test_a_pod_that_restarted_has_no_rates_until_its_counters_run_again() -> None:
    p = PodTape(max_running=4)
    for _ in range(2):
        p.step(wait=0.0, queue=5.0)
    p.restart()
    p.step(wait=0.0, queue=5.0)  # counters went backwards: this interval has no rates
    p.step(wait=0.0, queue=5.0)
    assert not p.tune(LIMITS, POLICY).changed
    for _ in range(2):
        p.step(wait=0.0, queue=5.0)
    assert p.tune(LIMITS, POLICY).changed


def test_a_pod_without_fetch_wait_or_split_metrics_is_left_alone() -> None:
    p = PodTape(max_running=4)
    for _ in range(5):
        p.step(wait=None, queue=5.0)
    assert "does not report fetch waits" in p.decide(LIMITS, POLICY).reason


def test_a_growth_the_pod_refuses_caps_the_limit_where_it_stood() -> None:
    p = PodTape(max_running=4)
    for _ in range(4):
        p.step(wait=0.0, queue=8.0)
        p.tune(LIMITS, POLICY, accept=False)
    assert p.max_running == 4 and p.history.running_ceiling == 4
    for _ in range(6):
        p.step(wait=0.0, queue=8.0)
        assert not p.tune(LIMITS, POLICY, accept=False).changed
    assert "at its ceiling 4" in p.decide(LIMITS, POLICY).reason


def test_a_limit_outside_the_bounds_is_brought_inside_them() -> None:
    p = PodTape(max_running=24, max_sequences=32)
    p.step()
    decision = p.tune(LIMITS, POLICY)
    assert decision.new_max_running == 16 and "outside the bounds [1, 16]" in decision.reason


def test_moves_smaller_than_the_minimum_step_are_skipped() -> None:
    limits = RunningLimits(floor=1, ceiling=16, min_step=4)
    p = PodTape(max_running=4)
    for _ in range(4):
        p.step(wait=0.3, queue=0.0, running=2)  # the limit could fall by 2: below the step
        p.tune(limits, POLICY)
    assert p.applied == []
    for _ in range(4):
        p.step(wait=0.0, queue=1.0)  # a queue of one still moves by the whole step
        p.tune(limits, POLICY)
    assert p.max_running == 8


def test_an_idle_dram_tier_is_recommended_smaller_and_nothing_changes_on_the_pod() -> None:
    """Six intervals with DRAM at most 12% full: the recommendation is peak x 1.25 in whole 2 MiB pages;
    the SSD stays busy, so nothing is said about it; max_running does not move for it."""
    p = PodTape(max_running=4)
    for _ in range(7):
        p.step(wait=0.02, queue=0.0, fill={"dram": 0.12, "ssd": 0.8})
        decision = p.tune(LIMITS, POLICY)
    assert p.applied == [] and p.max_running == 4
    (rec,) = decision.recommendations
    assert rec.tier == "dram" and rec.field == "tiers.dram.size"
    peak = int(64 * MiB * 0.12)
    assert rec.recommended == -(-int(peak * 1.25) // (2 * MiB)) * (2 * MiB) == 10 * MiB
    assert "nothing changed on the pod" in rec.describe() and "64Mi" in rec.describe()


def test_an_idle_ssd_recommendation_accounts_for_the_runtimes_share_of_the_claim() -> None:
    p = PodTape(max_running=4)
    for _ in range(7):
        p.step(wait=0.02, fill={"ssd": 0.1})
        decision = p.tune(LIMITS, POLICY)
    (rec,) = decision.recommendations
    used = int(1024 * MiB * 9 // 10 * 0.1)
    assert rec.tier == "ssd" and rec.recommended == -(-int(used * 1.25 * 100 / 90) // MiB) * MiB


def test_limits_from_the_full_example() -> None:
    spec = parse_cr(load_example("full.yaml")).spec
    assert limits_from_spec(spec) == RunningLimits(floor=4, ceiling=64, min_step=2)


def test_per_sequence_reserve_is_what_the_tape_reports() -> None:
    p = PodTape(max_running=3)
    p.step()
    m = p.history.scrapes[-1].metrics
    assert m is not None and m.per_sequence_bytes == PER_SEQUENCE and m.reserve_bytes == 3 * PER_SEQUENCE
