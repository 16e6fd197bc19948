"""A pod's metrics as a tape, interval by interval, for the tuning and autoscaling scenarios."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdrive.operator.podmetrics import PodMetrics, Scrape, TierState
from kvdrive.operator.tuning import PodHistory, TierLimits, TuningPolicy, decide

MiB = 1 << 20


@dataclass
class PodTape:
    """Accumulates the counters a pod's /metrics would show and records one scrape per interval.

    ``step`` runs one interval at the pod's current budgets: pages/s read per source, fill per tier
    (share of the budget in use), the share of time decode waited for reads, the queue.
    """

    budgets: dict[str, int]
    interval: float = 10.0
    now: float = 0.0
    history: PodHistory = field(default_factory=PodHistory)
    counters: dict[str, float] = field(default_factory=lambda: {"gpu": 0.0, "dram": 0.0, "ssd": 0.0, "miss": 0.0})
    late: float = 0.0
    waited: float = 0.0
    tokens: float = 0.0
    applied: list[str] = field(default_factory=list)

    def step(self, reads: dict[str, float], fill: dict[str, float], wait: float | None = 0.2, late: float = 0.0,
             waiting: float = 0, running: float = 1, tokens_per_s: float = 20.0) -> None:
        self.now += self.interval
        for source, rate in reads.items():
            self.counters[source] += rate * self.interval
        self.late += late * self.interval
        self.waited += (wait or 0.0) * self.interval
        self.tokens += tokens_per_s * self.interval
        tiers = {t: TierState(budget=b, used=int(b * fill.get(t, 0.0)), capacity=b) for t, b in self.budgets.items()}
        metrics = PodMetrics(tiers=tiers, page_reads=dict(self.counters),
                             prefetch={"hit": 0.0, "late": self.late, "wasted": 0.0},
                             fetch_wait_seconds=None if wait is None else self.waited, decode_steps=None,
                             generated_tokens=self.tokens, requests_running=running, requests_waiting=waiting)
        self.history = self.history.add(Scrape(self.now, metrics), keep=64)

    def missing(self, why: str = "timeout") -> None:
        self.now += self.interval
        self.history = self.history.add(Scrape(self.now, None, why), keep=64)

    def restart(self) -> None:
        """The pod's process restarted: its counters start again from zero."""
        self.counters = dict.fromkeys(self.counters, 0.0)
        self.late = self.waited = self.tokens = 0.0

    def tune(self, limits: dict[str, TierLimits], policy: TuningPolicy) -> list[str]:
        """What the operator does after a scrape: decide, and apply any change (the pod accepts it)."""
        decision = decide(self.history, limits, policy)
        if decision.changes:
            self.budgets = {t: decision.budgets.get(t, b) for t, b in self.budgets.items()}
            self.history = self.history.changed(self.now, decision.summary)
            self.applied.append(decision.summary)
        return [c.tier for c in decision.changes]
