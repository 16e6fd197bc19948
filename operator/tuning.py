"""Live tier-budget tuning: a pure function from one pod's metric history to its next budgets.

Owns the policy. Each tier is a cache of the one below it (gpu > dram > ssd > recompute), so a tier
whose bytes would buy something is one that is full while the tier just below it keeps serving
needed pages: the GPU tier grows on DRAM reads (and late prefetches), DRAM on SSD reads, SSD on
pages recomputed because no tier held them. Growth of GPU/DRAM also needs decode steps to have
actually waited for reads (when the pod reports that). A tier that stayed mostly empty gives bytes
back, down to its peak use plus headroom. Every change stays within the spec's bounds and the
physical limits (``TierLimits``), moves in whole granules (hugepages for DRAM) and by at least
``min_step``.

Against flapping: a signal must hold in every interval of a window of ``window`` intervals, all
measured at the current budgets (a change restarts the evidence); shrinking needs
``idle_windows`` windows; full (>= 80%) and idle (<= 50%) leave a dead band between them; and a
shrink stops at peak use x ``headroom``, inside that band. Missing data (a failed scrape, a counter
reset) breaks the window, so it never changes anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvdrive.operator.manifests import runtime_settings
from kvdrive.operator.podmetrics import TIERS, Rates, Scrape, rates
from kvdrive.operator.quantity import format_bytes, to_bytes
from kvdrive.operator.spec import KVDriveSpec

MiB = 1 << 20
BELOW = {"gpu": "dram", "dram": "ssd", "ssd": "miss"}  # the source whose reads a bigger tier absorbs


@dataclass(frozen=True)
class TierLimits:
    """Where one tier's budget may go: [floor, ceiling], in multiples of ``granule`` bytes."""

    floor: int
    ceiling: int
    granule: int = MiB


@dataclass(frozen=True)
class TuningPolicy:
    window: int = 3  # intervals a growth signal must hold (spec.tuning.stabilizationIntervals)
    min_step: int = 64 * MiB  # smallest change worth making (spec.tuning.minStep)
    step_fraction: float = 0.25  # a step is this share of the budget, at least min_step
    full_fill: float = 0.8  # a tier at or above this fill is full (runtimes keep room for open pages)
    idle_fill: float = 0.5  # ... at or below this, idle
    idle_windows: int = 2  # windows a tier must stay idle before it shrinks
    min_share: float = 0.05  # reads from below: at least this share of all needed pages ...
    min_rate: float = 0.5  # ... and at least this many pages/s
    min_wait_fraction: float = 0.01  # GPU/DRAM growth: decode waited for reads at least this share of the time
    headroom: float = 1.25  # a shrink keeps peak use x headroom
    history: int = 64  # scrapes kept per pod


@dataclass(frozen=True)
class Change:
    tier: str
    old: int
    new: int
    reason: str

    def describe(self) -> str:
        sign = "+" if self.new > self.old else "-"
        delta = format_bytes(abs(self.new - self.old))
        return f"{self.tier} {format_bytes(self.old)} -> {format_bytes(self.new)} ({sign}{delta}): {self.reason}"


@dataclass(frozen=True)
class PodHistory:
    """What the operator remembers of one pod (by uid): recent scrapes, budget changes, learned limits."""

    scrapes: tuple[Scrape, ...] = ()
    last_change_time: float | None = None
    last_change: str | None = None
    ceilings: Mapping[str, int] = field(default_factory=dict)  # learned from the pod refusing a growth

    def add(self, scrape: Scrape, keep: int) -> PodHistory:
        return replace(self, scrapes=(*self.scrapes, scrape)[-keep:])

    def changed(self, time: float, summary: str) -> PodHistory:
        return replace(self, last_change_time=time, last_change=summary)

    def refused(self, changes: Sequence[Change], time: float, summary: str) -> PodHistory:
        """The pod answered 422: remember that it cannot grow there, and wait a window before trying more."""
        ceilings = dict(self.ceilings)
        for change in changes:
            if change.new > change.old:
                ceilings[change.tier] = min(ceilings.get(change.tier, change.old), change.old)
        return replace(self, ceilings=ceilings, last_change_time=time, last_change=summary)


@dataclass(frozen=True)
class Decision:
    """The budgets to apply (all tiers the pod has) when ``changes`` is not empty, else why not."""

    budgets: Mapping[str, int]
    changes: tuple[Change, ...] = ()
    note: str = ""

    @property
    def summary(self) -> str:
        return "; ".join(change.describe() for change in self.changes) or self.note


def limits_from_spec(spec: KVDriveSpec) -> dict[str, TierLimits]:
    """Bounds of the spec intersected with what a pod physically has.

    gpu: ``bounds.gpu.max``, else the spec's budget (the pod refusing a growth lowers it further:
    only the runtime knows the GPU's memory less the model); dram: the hugepage allocation
    (``tiers.dram.size``); ssd: the runtime's share of its claim (90% of ``tiers.ssd.size``).
    """
    bounds, settings = spec.tuning.bounds, runtime_settings(spec)
    hugepage = to_bytes(spec.tiers.dram.huge_page_size)
    caps = {
        "gpu": to_bytes(bounds.gpu.max) if bounds.gpu.max is not None else settings["gpu_budget"],
        "dram": min(settings["dram_budget"], to_bytes(bounds.dram.max) if bounds.dram.max else settings["dram_budget"]),
        "ssd": min(settings["ssd_budget"], to_bytes(bounds.ssd.max) if bounds.ssd.max else settings["ssd_budget"]),
    }
    granules = {"gpu": MiB, "dram": hugepage, "ssd": MiB}
    out = {}
    for tier in TIERS:
        granule = granules[tier]
        ceiling = caps[tier] // granule * granule
        tier_bounds = getattr(bounds, tier)
        floor = to_bytes(tier_bounds.min) if tier_bounds.min is not None else 0
        floor = min(-(-floor // granule) * granule, ceiling)
        out[tier] = TierLimits(floor=floor, ceiling=ceiling, granule=granule)
    return out


def policy_from_spec(spec: KVDriveSpec) -> TuningPolicy:
    return TuningPolicy(window=spec.tuning.stabilization_intervals, min_step=max(1, to_bytes(spec.tuning.min_step)))


def _recent_rates(history: PodHistory, count: int) -> list[Rates | None]:
    """Rates of the last ``count`` intervals measured after the last change (None: missing data)."""
    since = history.last_change_time
    scrapes = [s for s in history.scrapes if since is None or s.time > since]
    pairs = list(zip(scrapes, scrapes[1:], strict=False))[-count:]
    out: list[Rates | None] = [rates(a, b) for a, b in pairs]
    return out if len(out) == count else [*out, *([None] * (count - len(out)))]


def _share(r: Rates, source: str) -> tuple[float, float]:
    rate = r.page_reads.get(source, 0.0) + (r.prefetch.get("late", 0.0) if source == "dram" else 0.0)
    return rate, rate / r.reads_total if r.reads_total > 0 else 0.0


def _pressed(tier: str, r: Rates, fill: float, policy: TuningPolicy) -> bool:
    rate, share = _share(r, BELOW[tier])
    waited = tier == "ssd" or r.fetch_wait_fraction is None or r.fetch_wait_fraction >= policy.min_wait_fraction
    return fill >= policy.full_fill and rate >= policy.min_rate and share >= policy.min_share and waited


def _step(budget: int, policy: TuningPolicy, granule: int) -> int:
    return max(policy.min_step, int(budget * policy.step_fraction), granule)


def _grow(tier: str, budget: int, lim: TierLimits, window: list[Rates], fills: list[float],
          policy: TuningPolicy) -> Change | None:
    if budget >= lim.ceiling or not all(_pressed(tier, r, f, policy) for r, f in zip(window, fills, strict=True)):
        return None
    new = min(lim.ceiling, (budget + _step(budget, policy, lim.granule)) // lim.granule * lim.granule)
    if new <= budget or (new - budget < policy.min_step and new != lim.ceiling):
        return None
    below = BELOW[tier]
    rate = sum(_share(r, below)[0] for r in window) / len(window)
    share = sum(_share(r, below)[1] for r in window) / len(window)
    waits = [r.fetch_wait_fraction for r in window if r.fetch_wait_fraction is not None]
    what = "pages recomputed (in no tier)" if below == "miss" else f"{below} reads"
    if tier == "gpu":
        what = "dram reads + late prefetches"
    reason = (f"{what} {rate:.1f}/s = {share:.0%} of needed pages while {tier} was "
              f"{min(fills):.0%}+ full")
    if waits and tier != "ssd":
        reason += f", decode waited {sum(waits) / len(waits):.0%} of the time"
    return Change(tier, budget, new, reason + f", over {len(window)} intervals")


def _shrink(tier: str, budget: int, lim: TierLimits, window: list[Rates], fills: list[float], peak: int,
            policy: TuningPolicy) -> Change | None:
    if budget <= lim.floor or not all(f <= policy.idle_fill for f in fills):
        return None
    if any(_share(r, BELOW[tier])[0] >= policy.min_rate for r in window):
        return None  # pages come from below although this tier has room: placement, not size
    keep = max(lim.floor, -(-math.ceil(peak * policy.headroom) // lim.granule) * lim.granule)
    new = max(keep, -(-(budget - _step(budget, policy, lim.granule)) // lim.granule) * lim.granule)
    if new >= budget or (budget - new < policy.min_step and new != lim.floor):
        return None
    reason = f"at most {max(fills):.0%} full (peak {format_bytes(peak)}) for {len(window)} intervals"
    return Change(tier, budget, new, reason)


def decide(history: PodHistory, limits: Mapping[str, TierLimits], policy: TuningPolicy) -> Decision:
    """The next budgets of one pod from its history (pure; the caller applies and records them)."""
    if not history.scrapes or history.scrapes[-1].metrics is None:
        return Decision(budgets={}, note="metrics missing: budgets left alone")
    latest = history.scrapes[-1].metrics
    budgets = latest.budgets()
    changes: list[Change] = []
    for tier, budget in budgets.items():
        lim = limits.get(tier)
        if lim is None:
            continue
        if tier in history.ceilings:
            lim = replace(lim, ceiling=max(lim.floor, min(lim.ceiling, history.ceilings[tier])))
        if budget < lim.floor or budget > lim.ceiling:
            new = min(max(budget, lim.floor), lim.ceiling)
            changes.append(Change(tier, budget, new, f"outside the bounds [{format_bytes(lim.floor)}, "
                                                      f"{format_bytes(lim.ceiling)}]"))
            continue
        grow_window = _recent_rates(history, policy.window)
        grow_scrapes = _window_scrapes(history, policy.window)
        if all(r is not None for r in grow_window) and grow_scrapes:
            fills = [s.metrics.tiers[tier].fill for s in grow_scrapes if s.metrics and tier in s.metrics.tiers]
            if len(fills) == policy.window:
                change = _grow(tier, budget, lim, grow_window, fills, policy)  # type: ignore[arg-type]
                if change is not None:
                    changes.append(change)
                    continue
        idle_count = policy.window * policy.idle_windows
        idle_window = _recent_rates(history, idle_count)
        idle_scrapes = _window_scrapes(history, idle_count)
        if all(r is not None for r in idle_window) and idle_scrapes:
            states = [s.metrics.tiers[tier] for s in idle_scrapes if s.metrics and tier in s.metrics.tiers]
            if len(states) == idle_count:
                peak = max(state.held for state in states)
                change = _shrink(tier, budget, lim, idle_window, [s.fill for s in states], peak,  # type: ignore[arg-type]
                                 policy)
                if change is not None:
                    changes.append(change)
    if not changes:
        return Decision(budgets=budgets, note="no tier had a sustained reason to move")
    new = dict(budgets)
    for change in changes:
        new[change.tier] = change.new
    return Decision(budgets=new, changes=tuple(changes))


def _window_scrapes(history: PodHistory, count: int) -> list[Scrape]:
    """The scrapes ending each of the last ``count`` intervals after the last change."""
    since = history.last_change_time
    scrapes = [s for s in history.scrapes if since is None or s.time > since]
    return scrapes[1:][-count:] if len(scrapes) > count else []
