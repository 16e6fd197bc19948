"""Admission into a full tier during one step, decided on tensor scores.

A tier admits freely while it has free slots; after that each admission displaces the coldest resident
not yet displaced this step, and only a block hotter than that one (by ``margin`` and ``gain``: hysteresis
on the device tier) is admitted. A working set larger than the tier is then read in place instead of
being swapped through it every step. The residents' scores come from one ``topk`` over the tier's
owners, asked for only when the tier is full, and extended when a step admits more than it fetched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

COLDEST_BATCH = 64  # residents' scores fetched per topk


@dataclass
class Admission:
    free: int
    coldest: Callable[[int], list[float]]  # the k coldest residents' scores, ascending
    margin: float
    gain: float
    residents: int  # blocks in the tier
    displaced: int = 0
    _scores: list[float] = field(default_factory=list)

    def admit(self, score: float) -> bool:
        if self.free > 0:
            self.free -= 1
            return True
        if self.displaced >= self.residents:
            return False
        if self.displaced >= len(self._scores):
            self._scores = self.coldest(min(self.residents, max(COLDEST_BATCH, 2 * len(self._scores))))
            if self.displaced >= len(self._scores):
                return False
        floor = self._scores[self.displaced]
        if score > max(floor * self.margin, floor + self.gain):
            self.displaced += 1
            return True
        return False
