"""Prefetch accounting: the ledger of outcomes and the throttle that stops prefetch while it is wasted.

Decode queries change slowly from one step to the next, so the pages a layer selected in step t (and
its runners-up) are the guess for step t+1 (temporal locality). The ledger records what each step
prefetched and classifies every prefetched block once the next step ran: ``hit`` (in a memory tier when
the step needed it), ``late`` (needed while its transfer was still running: the step waited) and
``wasted`` (not selected after all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvdrive.runtime.kvcache.store import BlockKey


class Pending(Protocol):
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> object: ...


@dataclass
class PrefetchLedger:
    hit: int = 0
    late: int = 0
    wasted: int = 0
    _issued: dict[BlockKey, Pending] = field(default_factory=dict)  # last step's prefetches
    _late: set[BlockKey] = field(default_factory=set)

    def issued(self, keys: list[BlockKey], transfer: Pending) -> None:
        for k in keys:
            self._issued[k] = transfer

    def claim(self, keys: list[BlockKey]) -> list[Pending]:
        """Keys the step could not find in a memory tier: the transfers among them still running (the
        caller waits for them: late prefetches)."""
        waiting: dict[int, Pending] = {}
        for k in keys:
            t = self._issued.get(k)
            if t is not None and k not in self._late and not t.done():
                self._late.add(k)
                waiting[id(t)] = t
        return list(waiting.values())

    @property
    def outstanding(self) -> list[BlockKey]:
        return list(self._issued)

    def settle(self, used: set[BlockKey]) -> None:
        """The step that the prefetches were for has run; ``used``: the prefetched keys it selected."""
        late = len(self._late & used)
        n_used = len(used & self._issued.keys())
        self.late += late
        self.hit += n_used - late
        self.wasted += len(self._issued) - n_used
        self._issued.clear()
        self._late.clear()

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
