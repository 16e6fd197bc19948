"""The ledger of prefetch outcomes.

Decode queries change slowly from one step to the next, so the pages a layer selected in step t (and
its runners-up) are the engine's guess for step t+1 (temporal locality); this ledger measures how good
the guess is. It records what was prefetched and classifies each prefetched block once the step that
needed it ran:
``hit`` (ready in the device tier when needed), ``late`` (needed before its transfer finished: the
step waited) and ``wasted`` (not selected after all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvdrive.runtime.kvcache import BlockKey


class Pending(Protocol):
    def done(self) -> bool: ...


@dataclass
class PrefetchLedger:
    hit: int = 0
    late: int = 0
    wasted: int = 0
    _outstanding: dict[BlockKey, Pending] = field(default_factory=dict)

    def issued(self, keys: list[BlockKey], transfer: Pending) -> None:
        for k in keys:
            self._outstanding[k] = transfer

    def claim(self, keys: list[BlockKey]) -> list[Pending]:
        """The step needs ``keys`` now: account their prefetches; returns the transfers still running
        (the caller waits for them: a late prefetch)."""
        waiting: dict[int, Pending] = {}
        for k in keys:
            t = self._outstanding.pop(k, None)
            if t is None:
                continue
            if t.done():
                self.hit += 1
            else:
                self.late += 1
                waiting[id(t)] = t
        return list(waiting.values())

    def end_step(self) -> None:
        """Prefetched blocks no step used are wasted."""
        self.wasted += len(self._outstanding)
        self._outstanding.clear()

    def counts(self) -> dict[str, int]:
        return {"hit": self.hit, "late": self.late, "wasted": self.wasted}


@dataclass
class PrefetchThrottle:
    """Readahead-style throttle: prefetch while the decayed precision of recent prefetches (blocks a step
    then used over blocks prefetched) is at least ``min_precision``; below it, only every
    ``probe_every``-th step prefetches, so that the engine notices when prediction pays again. Only
    steps that brought prefetch outcomes move the estimate: a step without prefetching neither helps
    nor hurts it."""

    min_precision: float = 0.5
    probe_every: int = 8
    keep: float = 0.7  # weight of the old estimate per step with outcomes
    precision: float = 1.0
    throttled: int = 0  # steps that skipped prefetching
    _seen: tuple[int, int] = (0, 0)  # ledger (used, wasted) when outcomes were last taken in

    def allow(self, counts: dict[str, int], step: int) -> bool:
        """Whether decode step ``step`` prefetches, given the ledger's cumulative ``counts``."""
        used, wasted = counts["hit"] + counts["late"], counts["wasted"]
        du, dw = used - self._seen[0], wasted - self._seen[1]
        self._seen = (used, wasted)
        if du + dw:
            self.precision = self.keep * self.precision + (1 - self.keep) * du / (du + dw)
        if self.precision >= self.min_precision:
            return True
        probe = step % self.probe_every == 0
        self.throttled += not probe
        return probe
