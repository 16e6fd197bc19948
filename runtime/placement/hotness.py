"""Page hotness: the attention mass a block (one layer's page) received and how often it was selected.

score(t) = sum over steps s <= t of decay^(t - s) * (mass_s + selection_weight * selected_s), kept
lazily as (score, step of last update). Attention mass is what the decode query actually put on the
page's keys (summed over query heads, so it is between 0 and Hq); a selected page with little mass
cools down, a page that keeps receiving attention stays hot. The tier order follows the score: the
hottest blocks belong in the device tier, the next in DRAM, the rest on SSD.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdrive.runtime.kvcache import BlockKey, TierName


@dataclass(frozen=True)
class HotnessConfig:
    decay: float = 0.8  # per decode step
    selection_weight: float = 0.05  # credit for being selected at all, relative to attention mass


class Hotness:
    def __init__(self, config: HotnessConfig | None = None) -> None:
        self.config = config or HotnessConfig()
        self.step = 0
        self._scores: dict[BlockKey, tuple[float, int]] = {}

    def advance(self) -> None:
        """One decode step passed."""
        self.step += 1

    def record(self, keys: list[BlockKey], masses: list[float]) -> None:
        """The selected ``keys`` received ``masses`` of attention in the current step."""
        d, w, now = self.config.decay, self.config.selection_weight, self.step
        scores = self._scores
        for k, m in zip(keys, masses, strict=True):
            old = scores.get(k)
            base = old[0] * d ** (now - old[1]) if old else 0.0
            scores[k] = (base + m + w, now)

    def score(self, key: BlockKey) -> float:
        old = self._scores.get(key)
        return old[0] * self.config.decay ** (self.step - old[1]) if old else 0.0

    def scores(self, keys: list[BlockKey]) -> list[float]:
        """``score`` of each key (one pass, for eviction and admission over a whole tier)."""
        get, d, now = self._scores.get, self.config.decay, self.step
        out = []
        for k in keys:
            old = get(k)
            out.append(old[0] * d ** (now - old[1]) if old else 0.0)
        return out

    def forget(self, keys: list[BlockKey]) -> None:
        for k in keys:
            self._scores.pop(k, None)

    def coldest_first(self, tier: TierName, keys: list[BlockKey]) -> list[BlockKey]:
        """A victim order for the store: coldest blocks first (ties keep the store's LRU order)."""
        s = self.scores(keys)
        return [keys[i] for i in sorted(range(len(keys)), key=s.__getitem__)]

    @property
    def tracked(self) -> int:
        """Blocks with a score."""
        return len(self._scores)
