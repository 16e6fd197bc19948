"""Admission into a tier during one step, decided on tensor scores in one batch.

A tier admits freely while it has free slots; after that each admission displaces the coldest resident
not yet displaced this step, and only a block hotter than that one by a hysteresis (``margin`` times,
and by ``gain``) is admitted. A working set larger than the tiers is then read in place instead of being
swapped through them every step. Candidates come sorted hottest first, the residents' scores coldest
first (one ``sort`` per tier and step, asked for only once the tier is full), so a batch's admissions
are one comparison of two sorted tensors: the leading run of candidates that beat their opposite number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Admission:
    free: int
    coldest: Callable[[], torch.Tensor]  # the residents' scores, ascending (asked for once the tier is full)
    margin: float
    gain: float
    displaced: int = 0
    _scores: torch.Tensor | None = None

    def admit(self, hottest_first: torch.Tensor) -> int:
        """How many of the candidates (scores [n], sorted descending) the tier takes, from the head."""
        n = hottest_first.numel()
        k = min(n, self.free)
        self.free -= k
        if k == n:
            return k
        if self._scores is None:
            self._scores = self.coldest()
        floors = self._scores[self.displaced :]
        m = min(n - k, floors.numel())
        if m == 0:
            return k
        f = floors[:m]
        beat = hottest_first[k : k + m] > torch.maximum(f * self.margin, f + self.gain)
        lead = int(beat.to(torch.int32).cumprod(0).sum())
        self.displaced += lead
        return k + lead
