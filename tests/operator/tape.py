"""A pod's metrics as a tape, interval by interval, for the tuning scenarios."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdrive.operator.api.podmetrics import PodMetrics, Scrape, TierState
from kvdrive.operator.decide.tuning import Decision, PodHistory, RunningLimits, TuningPolicy, decide

MiB = 1 << 20
PER_SEQUENCE = 2 * MiB  # what one more running sequence takes from the hot tier
ENVELOPE = 64 * MiB


@dataclass
class PodTape:
    """Accumulates the counters a pod's /metrics would show and records one scrape per interval.

    ``step`` runs one interval at the pod's current ``max_running``: the share of time decode waited for
    lower-tier reads, the mean queue, the sequences running at the scrape, pages/s by source, tier fills.
    """

    max_running: int = 8
    max_sequences: int = 16
    interval: float = 10.0
    now: float = 0.0
    history: PodHistory = field(default_factory=PodHistory)
    reads: dict[str, float] = field(default_factory=lambda: {"gpu": 0.0, "dram": 0.0, "ssd": 0.0, "miss": 0.0})
    waited: float = 0.0
    queued: float = 0.0
    tokens: float = 0.0
    applied: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=lambda: {"dram": 64 * MiB, "ssd": 1024 * MiB})

    def step(self, wait: float | None = 0.0, queue: float = 0.0, running: float | None = None,
             rates: dict[str, float] | None = None, fill: dict[str, float] | None = None) -> None:
        self.now += self.interval
        for source, rate in (rates or {"gpu": 50.0, "dram": 10.0}).items():
            self.reads[source] += rate * self.interval
        self.waited += (wait or 0.0) * self.interval
        self.queued += queue * self.interval
        self.tokens += 20.0 * self.interval
        hot = ENVELOPE - self.max_running * PER_SEQUENCE
        fills = {"gpu": 0.9, "dram": 0.9, "ssd": 0.9, **(fill or {})}
        room = {"gpu": hot, "dram": self.sizes["dram"], "ssd": self.sizes["ssd"] * 9 // 10}
        tiers = {t: TierState(budget=b, used=int(b * fills[t]), capacity=b) for t, b in room.items()}
        metrics = PodMetrics(tiers=tiers, page_reads=dict(self.reads), prefetch={},
                             fetch_wait_seconds=None if wait is None else self.waited, decode_steps=None,
                             generated_tokens=self.tokens,
                             requests_running=float(self.max_running if running is None else running),
                             requests_waiting=queue, max_running=self.max_running, max_sequences=self.max_sequences,
                             hot_bytes=hot, reserve_bytes=self.max_running * PER_SEQUENCE,
                             per_sequence_bytes=PER_SEQUENCE, queue_wait_seconds=self.queued)
        self.history = self.history.add(Scrape(self.now, metrics), keep=64)

    def missing(self, why: str = "timeout") -> None:
        self.now += self.interval
        self.history = self.history.add(Scrape(self.now, None, why), keep=64)

    def restart(self) -> None:
        """The pod's process restarted: its counters start again from zero."""
        self.reads = dict.fromkeys(self.reads, 0.0)
        self.waited = self.queued = self.tokens = 0.0

    def decide(self, limits: RunningLimits, policy: TuningPolicy) -> Decision:
        return decide(self.history, limits, policy, self.sizes, {"dram": 2 * MiB, "ssd": MiB})

    def tune(self, limits: RunningLimits, policy: TuningPolicy, accept: bool = True) -> Decision:
        """What the operator does after a scrape: decide, and apply a change (the pod accepts it, or
        answers 422 when ``accept`` is False)."""
        decision = self.decide(limits, policy)
        if decision.changed:
            assert decision.new_max_running is not None
            if accept:
                self.max_running = decision.new_max_running
                self.history = self.history.changed(self.now, decision.summary)
                self.applied.append(decision.summary)
            else:
                self.history = self.history.refused(decision, self.now, "422")
        self.history = self.history.recommended(decision.recommendations)
        return decision
