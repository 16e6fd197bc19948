"""Replica autoscaling from LLM signals: a pure function of the pods' load and past recommendations.

Owns how many pods a KVDriveDeployment should have (``autoscaling.mode: operator``). Each signal
asks for ``ceil(sum over pods / per-pod target)`` pods: requests waiting (``targets.queueDepth``),
KV utilisation of the fast tiers by running sequences (``targets.kvUtilization``; cached
prefix pages do not count: a cache is meant to be full) and generated tokens/s (``targets.tokensPerSecond``, optional).
The recommendation is the largest, within a 10% tolerance of the current count, clamped to
[minReplicas, maxReplicas]. As in the HPA, scaling up goes to the *lowest* recommendation of the
last ``scaleUpStabilizationSeconds`` and down to the *highest* of the last
``scaleDownStabilizationSeconds``; one decision moves at most ``maxStep`` replicas. A pod whose
metrics are missing makes the round unable to scale down (its load is unknown, not zero).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvdrive.operator.api.podmetrics import PodMetrics, Rates
from kvdrive.operator.api.spec import KVDriveSpec

TOLERANCE = 0.1


@dataclass(frozen=True)
class PodLoad:
    waiting: float
    running: float
    kv_utilization: float  # bytes of running sequences / capacity of the gpu + dram tiers
    tokens_per_second: float | None  # None until two scrapes give a rate


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    max_step: int = 2
    up_window_s: float = 30.0
    down_window_s: float = 300.0
    queue_target: float = 8.0
    kv_target: float = 0.8
    tokens_target: float | None = None


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int  # what the StatefulSet should have now
    recommendation: int  # what this round's metrics alone call for
    history: tuple[Recommendation, ...]
    reason: str

    def changed(self, current: int) -> bool:
        return self.replicas != current


def policy_from_spec(spec: KVDriveSpec) -> ScalePolicy:
    a = spec.autoscaling
    return ScalePolicy(min_replicas=a.min_replicas, max_replicas=a.max_replicas, max_step=a.max_step,
                       up_window_s=a.scale_up_stabilization_seconds, down_window_s=a.scale_down_stabilization_seconds,
                       queue_target=a.targets.queue_depth, kv_target=a.targets.kv_utilization,
                       tokens_target=a.targets.tokens_per_second)


def load_of(metrics: PodMetrics, rate: Rates | None) -> PodLoad:
    """One pod's load from its latest scrape (and the rate over the last interval, when there is one)."""
    fast = [metrics.tiers[t] for t in ("gpu", "dram") if t in metrics.tiers]
    room = sum(t.room for t in fast)
    kv = sum(t.used for t in fast) / room if room else 0.0
    return PodLoad(waiting=metrics.requests_waiting, running=metrics.requests_running, kv_utilization=min(1.0, kv),
                   tokens_per_second=None if rate is None else rate.tokens_per_second)


def _signal(total: float, target: float, current: int) -> int:
    if current > 0 and abs(total / (current * target) - 1.0) <= TOLERANCE:
        return current
    return math.ceil(total / target - 1e-9)


def recommend(loads: Sequence[PodLoad | None], current: int, policy: ScalePolicy) -> tuple[int, str]:
    """This round's recommendation and the numbers behind it (before stabilization and maxStep)."""
    read = [load for load in loads if load is not None]
    missing = len(loads) - len(read)
    clamp = lambda n: min(max(n, policy.min_replicas), policy.max_replicas)  # noqa: E731
    if not read:
        why = f"metrics of all {missing} ready pods missing" if missing else "no ready pods to measure"
        return clamp(current), f"{why}: keep {current}"
    waiting = sum(load.waiting for load in read)
    kv = sum(load.kv_utilization for load in read)
    signals = {
        "queue": (_signal(waiting, policy.queue_target, current),
                  f"{waiting:g} waiting on {len(read)} pods (target {policy.queue_target:g}/pod)"),
        "kv": (_signal(kv, policy.kv_target, current),
               f"KV utilisation {kv / len(read):.2f}/pod (target {policy.kv_target:g})"),
    }
    rated = [load.tokens_per_second for load in read if load.tokens_per_second is not None]
    if policy.tokens_target and rated:
        tokens = sum(rated)
        signals["tokens"] = (_signal(tokens, policy.tokens_target, current),
                             f"{tokens:.1f} tokens/s (target {policy.tokens_target:g}/pod)")
    parts = [f"{text} -> {wanted}" for wanted, text in signals.values()]
    wanted = clamp(max(wanted for wanted, _ in signals.values()))
    if missing and wanted < current:
        parts.append(f"{missing} pod(s) unread, so not below {current}")
        wanted = current
    return wanted, "; ".join(parts)


def decide(loads: Sequence[PodLoad | None], current: int, policy: ScalePolicy,
           history: Sequence[Recommendation], now: float) -> ScaleDecision:
    """Replicas to set now, given this round's loads and the recommendations of earlier rounds."""
    wanted, why = recommend(loads, current, policy)
    horizon = max(policy.up_window_s, policy.down_window_s)
    kept = tuple(r for r in history if now - r.time <= horizon) + (Recommendation(now, wanted),)
    up = min(r.replicas for r in kept if now - r.time <= policy.up_window_s)
    down = max(r.replicas for r in kept if now - r.time <= policy.down_window_s)
    if current < policy.min_replicas or current > policy.max_replicas:
        target = min(max(current, policy.min_replicas), policy.max_replicas)
        why = f"outside [{policy.min_replicas}, {policy.max_replicas}]; {why}"
    elif up > current:
        target = up
        if up < wanted:
            why += f"; {policy.up_window_s:g}s scale-up window holds it at {up}"
    elif down < current:
        target = down
        if down > wanted:
            why += f"; {policy.down_window_s:g}s scale-down window holds it at {down}"
    else:
        target = current
        if wanted != current:
            window = policy.up_window_s if wanted > current else policy.down_window_s
            why += f"; stabilizing ({window:g}s window)"
    step = max(-policy.max_step, min(policy.max_step, target - current))
    if current + step != target:
        why += f"; maxStep {policy.max_step}"
    return ScaleDecision(replicas=current + step, recommendation=wanted, history=kept, reason=why)
