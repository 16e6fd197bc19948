"""Autoscaling as narrated scenarios: the pods' load over time and the replicas the operator sets."""

from __future__ import annotations

from crdcheck import load_example

from kvdrive.operator.api.cr import parse_cr
from kvdrive.operator.api.podmetrics import PodMetrics, TierState
from kvdrive.operator.decide.autoscale import (
    PodLoad,
    Recommendation,
    ScalePolicy,
    decide,
    load_of,
    policy_from_spec,
)

MiB = 1 << 20
POLICY = ScalePolicy(min_replicas=1, max_replicas=8, max_step=2, up_window_s=30, down_window_s=300,
                     queue_target=8, kv_target=0.8)


def busy(waiting: float, kv: float = 0.5, tokens: float | None = None) -> PodLoad:
    return PodLoad(waiting=waiting, running=4, kv_utilization=kv, tokens_per_second=tokens)


class Autoscaler:
    """Rounds every ``interval`` seconds, keeping the recommendations as the operator does."""

    def __init__(self, replicas: int, policy: ScalePolicy = POLICY, interval: float = 10.0) -> None:
        self.replicas, self.policy, self.interval = replicas, policy, interval
        self.now = 0.0
        self.history: tuple[Recommendation, ...] = ()
        self.reasons: list[str] = []

    def round(self, loads: list[PodLoad | None]) -> int:
        self.now += self.interval
        decision = decide(loads, self.replicas, self.policy, self.history, self.now)
        self.history = decision.history
        self.reasons.append(decision.reason)
        self.replicas = decision.replicas
        return self.replicas


def test_a_queue_that_builds_up_scales_up_after_the_window_and_by_at_most_max_step() -> None:
    s = Autoscaler(replicas=2)
    # 2 pods with 24 requests waiting each: 48 waiting / 8 per pod -> 6 pods wanted
    seen = [s.round([busy(24), busy(24)]) for _ in range(4)]
    assert seen[0] == 4  # no earlier recommendation in the 30 s window: up at once, by maxStep 2
    assert "48 waiting on 2 pods (target 8/pod) -> 6" in s.reasons[0] and "maxStep 2" in s.reasons[0]
    assert seen[1:] == [6, 6, 6]  # the new pods are counted, the queue is unchanged in this scenario


def test_a_short_burst_does_not_scale_up_when_the_window_still_holds_a_calmer_round() -> None:
    s = Autoscaler(replicas=2)
    s.round([busy(8), busy(8)])  # at target
    assert s.round([busy(40), busy(40)]) == 2  # the calm round 10 s ago is inside the 30 s up window
    assert "scale-up window holds it at 2" in s.reasons[-1] or "stabilizing" in s.reasons[-1]
    s.round([busy(8), busy(8)])  # burst over
    assert s.replicas == 2


def test_an_emptied_queue_scales_down_only_after_the_down_window() -> None:
    s = Autoscaler(replicas=4)
    s.round([busy(8)] * 4)  # exactly at target
    downs = [s.round([busy(0, kv=0.0)] * s.replicas) for _ in range(40)]  # 400 s of quiet
    first_down = next(i for i, n in enumerate(downs) if n < 4)
    assert first_down >= 29  # the busy round stays in the 300 s window for 30 rounds
    assert downs[-1] == 1 and min(downs) == 1  # minReplicas
    assert all(a - b <= 2 for a, b in zip(downs, downs[1:], strict=False))  # maxStep on the way down too


def test_missing_metrics_never_scale_down() -> None:
    s = Autoscaler(replicas=3, policy=ScalePolicy(min_replicas=1, max_replicas=8, up_window_s=0, down_window_s=0))
    assert s.round([busy(0, kv=0.0), None, None]) == 3
    assert "2 pod(s) unread, so not below 3" in s.reasons[-1]
    assert s.round([None, None, None]) == 3 and "metrics of all 3 ready pods missing" in s.reasons[-1]
    # ... but a queue that is visible on the pods that answered can still scale up
    assert s.round([busy(40), None, None]) == 5


def test_kv_utilisation_of_running_sequences_scales_up_but_a_full_prefix_cache_does_not() -> None:
    s = Autoscaler(replicas=2, policy=ScalePolicy(min_replicas=1, max_replicas=8, up_window_s=0))
    assert s.round([busy(0, kv=1.0), busy(0, kv=1.0)]) == 3  # 2.0 / 0.8 -> 3
    full_of_cache = PodMetrics(tiers={"gpu": TierState(budget=8 * MiB, used=0, cached=8 * MiB)}, requests_running=0,
                               requests_waiting=0)
    assert load_of(full_of_cache, None).kv_utilization == 0.0
    serving = PodMetrics(tiers={"gpu": TierState(8 * MiB, 6 * MiB), "dram": TierState(8 * MiB, 2 * MiB),
                                "ssd": TierState(1 << 30, 1 << 30)}, requests_running=1, requests_waiting=0)
    assert load_of(serving, None).kv_utilization == 0.5  # gpu + dram only: the SSD tier is expected to fill


def test_tokens_per_second_is_a_signal_only_when_targeted() -> None:
    targeted = ScalePolicy(min_replicas=1, max_replicas=8, up_window_s=0, tokens_target=100)
    s = Autoscaler(replicas=1, policy=targeted)
    assert s.round([busy(0, kv=0.1, tokens=250)]) == 3
    assert "250.0 tokens/s (target 100/pod) -> 3" in s.reasons[-1]
    untargeted = Autoscaler(replicas=1, policy=ScalePolicy(min_replicas=1, max_replicas=8, up_window_s=0))
    assert untargeted.round([busy(0, kv=0.1, tokens=250)]) == 1


def test_small_deviations_from_the_target_keep_the_count() -> None:
    s = Autoscaler(replicas=4, policy=ScalePolicy(min_replicas=1, max_replicas=8, up_window_s=0, down_window_s=0))
    assert s.round([busy(8.5, kv=0.1)] * 4) == 4  # 34 waiting / (4 x 8) = 1.06: within 10%
    assert s.round([busy(10, kv=0.1)] * 4) == 5  # 40 / 32 = 1.25


def test_bounds_are_enforced_even_without_metrics() -> None:
    s = Autoscaler(replicas=12)
    assert s.round([]) == 10 and "outside [1, 8]" in s.reasons[-1]  # maxStep applies here too
    assert s.round([]) == 8


def test_policy_from_the_full_example() -> None:
    policy = policy_from_spec(parse_cr(load_example("full.yaml")).spec)
    assert policy == ScalePolicy(min_replicas=1, max_replicas=8, max_step=2, up_window_s=30, down_window_s=300,
                                 queue_target=8, kv_target=0.8, tokens_target=2000)
