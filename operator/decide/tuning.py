"""Live tuning of one pod: a pure function from its metric history to its next concurrency limit.

Owns the policy. A pod's device memory for KV is one fixed envelope (``tiers.gpu.budget``), split
between the hot KV tier and a reserve per running sequence (its open pages and decode step buffer):
every sequence the engine may run at once (``max_running``) takes ``per_sequence_bytes`` from the hot
tier. The tuner moves that split, and only that:

- **more concurrency** when requests queue in every interval of a window while the running batch is
  at the limit (not held back by memory: a prompt that would not fit waits whatever the limit) and
  either decode steps barely waited for lower-tier reads (the hot tier serves them) or the queue would
  grow the batch by a larger share than decode spent waiting for reads (a step's work grows with the
  batch far slower than its size, so even if the smaller hot tier doubled the waits the step would
  carry more tokens): the limit rises to what ran plus the longest queue of the window, so the queue
  drains in one move;
- **a bigger hot tier** when decode steps waited for lower-tier reads in every interval of a window,
  nothing queued, and fewer sequences ran than the limit allows: the limit falls to the most that ran,
  and the slots nobody used go back to the hot tier;
- nothing when both argue at once (the queue is a smaller share of the batch than the waits are of the
  step), or in the dead band: waits between ``wait_low`` and ``wait_high`` with no queue, or a queue
  too short for the waits.

Against flapping: every interval of the window must agree, all measured at the current limit (a change
restarts the evidence); a move must be at least ``min_step`` sequences; missing data (a failed scrape,
a counter reset, a runtime that does not report its split) breaks the window, so it changes nothing.
A pod that refuses a growth (422: the hot tier would not hold the pages running sequences need) caps
the limit where it stood.

The DRAM and SSD tiers are not tuned: hugepages are reserved at pod start and the SSD is a claimed
volume, so bytes handed back from either would go nowhere. Where one stays mostly empty for
``idle_windows`` windows, the tuner *recommends* a smaller ``tiers.*.size`` for the CR (status and an
Event) and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvdrive.operator.api.podmetrics import Rates, Scrape, rates
from kvdrive.operator.api.quantity import format_bytes, to_bytes
from kvdrive.operator.api.spec import KVDriveSpec
from kvdrive.operator.render.manifests import SSD_BUDGET_FRACTION_PERCENT

MiB = 1 << 20
SIZED = {"dram": "tiers.dram.size", "ssd": "tiers.ssd.size"}  # tiers the tuner only recommends sizes for


@dataclass(frozen=True)
class RunningLimits:
    """Where ``max_running`` may go: [floor, ceiling], moving by at least ``min_step``."""

    floor: int = 1
    ceiling: int = 16
    min_step: int = 1


@dataclass(frozen=True)
class TuningPolicy:
    window: int = 3  # intervals a signal must hold (spec.tuning.stabilizationIntervals)
    wait_low: float = 0.05  # decode waited at most this share of the time: the hot tier serves the steps
    wait_high: float = 0.15  # ... at least this share: the hot tier is too small for what runs
    queue_min: float = 0.5  # requests queued on average over an interval: a queue
    idle_fill: float = 0.5  # a tier at most this full is idle (a recommendation to shrink it)
    idle_windows: int = 2  # windows a tier must stay idle before a recommendation
    headroom: float = 1.25  # a recommended size keeps peak use x headroom
    history: int = 64  # scrapes kept per pod


@dataclass(frozen=True)
class Recommendation:
    """A right-sizing hint for the CR: nothing is changed on the pod."""

    tier: str
    field: str  # the CR field, e.g. tiers.dram.size
    current: int  # bytes the CR gives the tier now
    recommended: int
    reason: str

    def describe(self) -> str:
        return (f"{self.field}: {format_bytes(self.current)} -> recommend {format_bytes(self.recommended)} "
                f"({self.reason}; nothing changed on the pod)")


@dataclass(frozen=True)
class PodHistory:
    """What the operator remembers of one pod (by uid): recent scrapes, its last change, learned limits."""

    scrapes: tuple[Scrape, ...] = ()
    last_change_time: float | None = None
    last_change: str | None = None
    running_ceiling: int | None = None  # learned from the pod refusing a growth
    recommendations: tuple[Recommendation, ...] = ()  # the last ones reported (an Event only when they change)
    unconfirmed: int | None = None  # a max_running asked for that got no answer in time (it may apply later)
    unconfirmed_change: str | None = None  # that change's summary, for the Event once the pod shows it

    def add(self, scrape: Scrape, keep: int) -> PodHistory:
        return replace(self, scrapes=(*self.scrapes, scrape)[-keep:])

    def changed(self, time: float, summary: str) -> PodHistory:
        return replace(self, last_change_time=time, last_change=summary, unconfirmed=None, unconfirmed_change=None)

    def unanswered(self, decision: Decision, time: float, summary: str) -> PodHistory:
        """No answer in time: the pod may still apply the change at its next engine step."""
        return replace(self, last_change_time=time, last_change=summary, unconfirmed=decision.new_max_running,
                       unconfirmed_change=decision.summary)

    def confirmed(self) -> PodHistory:
        """The pod's metrics show the unanswered change: it took effect."""
        return replace(self, last_change=self.unconfirmed_change, unconfirmed=None, unconfirmed_change=None)

    def refused(self, decision: Decision, time: float, summary: str) -> PodHistory:
        """The pod answered 422: it cannot run more than it did; wait a window before trying anything."""
        ceiling = self.running_ceiling
        if decision.new_max_running is not None and decision.current is not None \
                and decision.new_max_running > decision.current:
            ceiling = decision.current if ceiling is None else min(ceiling, decision.current)
        return replace(self, running_ceiling=ceiling, last_change_time=time, last_change=summary)

    def recommended(self, recommendations: Sequence[Recommendation]) -> PodHistory:
        return replace(self, recommendations=tuple(recommendations))


@dataclass(frozen=True)
class Decision:
    """The pod's next ``max_running`` (``new_max_running`` None: leave it) and the tier-size hints."""

    current: int | None  # the pod's max_running now (None: it does not report one)
    new_max_running: int | None = None
    reason: str = ""
    recommendations: tuple[Recommendation, ...] = ()

    @property
    def changed(self) -> bool:
        return self.new_max_running is not None and self.new_max_running != self.current

    @property
    def summary(self) -> str:
        if self.changed:
            return f"max_running {self.current} -> {self.new_max_running}: {self.reason}"
        return self.reason


def limits_from_spec(spec: KVDriveSpec) -> RunningLimits:
    bounds = spec.tuning.concurrency
    return RunningLimits(floor=bounds.min, ceiling=bounds.max, min_step=bounds.min_step)


def policy_from_spec(spec: KVDriveSpec) -> TuningPolicy:
    return TuningPolicy(window=spec.tuning.stabilization_intervals)


def tier_sizes(spec: KVDriveSpec) -> dict[str, int]:
    """What the CR gives each recommended tier, in its own field's terms (bytes)."""
    return {"dram": to_bytes(spec.tiers.dram.size), "ssd": to_bytes(spec.tiers.ssd.size)}


def _since_change(history: PodHistory) -> list[Scrape]:
    since = history.last_change_time
    return [s for s in history.scrapes if since is None or s.time > since]


def _window(history: PodHistory, count: int) -> tuple[list[Rates], list[Scrape]] | None:
    """The last ``count`` intervals after the last change (their rates and closing scrapes), or None
    when any is missing."""
    scrapes = _since_change(history)[-(count + 1):]
    if len(scrapes) < count + 1:
        return None
    out = [rates(a, b) for a, b in zip(scrapes, scrapes[1:], strict=False)]
    if any(r is None for r in out):
        return None
    return out, scrapes[1:]  # type: ignore[return-value]


def _concurrency(history: PodHistory, limits: RunningLimits, policy: TuningPolicy) -> Decision:
    latest = history.scrapes[-1].metrics
    assert latest is not None
    current = latest.max_running
    if current is None:
        return Decision(current=None, reason="the pod does not report max_running: concurrency left alone")
    ceiling = limits.ceiling
    for cap in (history.running_ceiling, latest.max_sequences):
        if cap is not None:
            ceiling = min(ceiling, cap)
    ceiling = max(ceiling, limits.floor)
    if not limits.floor <= current <= ceiling:
        new = min(max(current, limits.floor), ceiling)
        return Decision(current, new, f"outside the bounds [{limits.floor}, {ceiling}]")
    found = _window(history, policy.window)
    if found is None:
        return Decision(current, reason="not enough intervals measured at this limit")
    window, scrapes = found
    queues = [r.queue_length if r.queue_length is not None else s.metrics.requests_waiting  # type: ignore[union-attr]
              for r, s in zip(window, scrapes, strict=True)]
    waits = [r.fetch_wait_fraction for r in window]
    if any(w is None for w in waits):
        return Decision(current, reason="the pod does not report fetch waits: concurrency left alone")
    running = [s.metrics.requests_running for s in scrapes]  # type: ignore[union-attr]
    ran, full = max(running), min(running) >= current  # full: the limit, not memory, held the queue back
    hot = _hot_share(latest.page_reads, scrapes[0].metrics.page_reads)  # type: ignore[union-attr]
    queued, waited = min(queues), [float(w) for w in waits]  # type: ignore[arg-type]
    span = f"over {len(window)} intervals"
    served = max(waited) <= policy.wait_low  # the hot tier serves the steps: it can spare bytes
    gain = queued / max(1.0, min(running))  # the share by which the queue would grow the batch
    if queued >= policy.queue_min and full and (served or gain > max(waited)):
        new = min(ceiling, max(current + limits.min_step, math.ceil(ran + max(queues))))  # type: ignore[type-var]
        if new > current:
            why = (f"decode waited at most {max(waited):.0%} of the time for lower tiers{hot}" if served else
                   f"the queue would grow the batch of {min(running):.0f} by {gain:.0%}, more than the "
                   f"{max(waited):.0%} of the time decode waited for lower tiers{hot}")
            return Decision(current, new, f"requests queued ({queued:.1f} on average at least) while {why}, {span}")
        return Decision(current, reason=f"requests queue but the limit is at its ceiling {ceiling}")
    if queued < policy.queue_min and min(waited) >= policy.wait_high and ran < current:
        new = max(limits.floor, math.ceil(ran))
        if current - new >= limits.min_step:
            return Decision(current, new, f"decode waited at least {min(waited):.0%} of the time for lower-tier "
                                          f"reads{hot} with no queue and at most {ran:.0f} of {current} sequences "
                                          f"running, {span}: the unused slots go to the hot tier")
    if queued >= policy.queue_min and max(waited) >= gain:
        return Decision(current, reason=f"requests queue (growing the batch by {gain:.0%}) and decode waits up to "
                                        f"{max(waited):.0%} of the time for reads: the split cannot serve both")
    return Decision(current, reason="no sustained reason to move the split")


def _hot_share(now: Mapping[str, float], before: Mapping[str, float]) -> str:
    delta = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in now}
    total = sum(delta.values())
    return f" (hot tier served {delta.get('gpu', 0.0) / total:.0%} of needed pages)" if total > 0 else ""


def _recommend(history: PodHistory, policy: TuningPolicy, sizes: dict[str, int],
               granules: dict[str, int]) -> tuple[Recommendation, ...]:
    count = policy.window * policy.idle_windows
    found = _window(history, count)
    if found is None:
        return history.recommendations  # missing data: keep what was said
    _, scrapes = found
    out = []
    for tier, field in SIZED.items():
        states = [s.metrics.tiers.get(tier) for s in scrapes]  # type: ignore[union-attr]
        if tier not in sizes or any(state is None or state.room <= 0 for state in states):
            continue
        fills = [state.fill for state in states]  # type: ignore[union-attr]
        if max(fills) > policy.idle_fill:
            continue
        peak = max(state.held for state in states)  # type: ignore[union-attr]
        need = peak * policy.headroom
        if tier == "ssd":  # the runtime gets a share of the claim
            need = need * 100 / SSD_BUDGET_FRACTION_PERCENT
        granule = granules.get(tier, MiB)
        size = max(granule, -(-math.ceil(need) // granule) * granule)
        if size < sizes[tier]:
            reason = f"at most {max(fills):.0%} full (peak {format_bytes(peak)}) for {len(scrapes)} intervals"
            out.append(Recommendation(tier, field, sizes[tier], size, reason))
    return tuple(out)


def decide(history: PodHistory, limits: RunningLimits, policy: TuningPolicy,
           sizes: dict[str, int] | None = None, granules: dict[str, int] | None = None) -> Decision:
    """The next concurrency limit of one pod and its tier-size recommendations (pure; the caller applies
    and records them). ``sizes``: the CR's tier sizes (bytes) to recommend against; ``granules``: their
    units (hugepages for DRAM)."""
    if not history.scrapes or history.scrapes[-1].metrics is None:
        return Decision(current=None, reason="metrics missing: nothing changed", recommendations=history.recommendations)
    decision = _concurrency(history, limits, policy)
    return replace(decision, recommendations=_recommend(history, policy, sizes or {}, granules or {}))
