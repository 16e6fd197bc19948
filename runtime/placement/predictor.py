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
