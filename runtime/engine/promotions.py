"""The copies a step's lower-tier reads earn: decided and made once, at the end of the step.

A decode step reads the pages that no memory tier holds from the SSD tier, layer by layer, straight into
the step buffer (``page_reads``). Whether each of those blocks also gets a copy in a faster tier is
placement's decision, and making the copy costs eviction, demotion and a row copy. Taken per layer, that
was 30 small admissions per step, each walking the tier's coldest residents again; here the step's reads
are queued with the bytes already read, and at the end of the step placement decides for all of them in
one batch (one sort, one admission per tier, with the attention mass this step gave them), and the Mover
admits each destination's blocks in one call. A block is read by one layer only, so nothing in the same
step misses it again for want of the copy. The queue holds at most ``max_bytes`` of read blocks; past that
it is settled at once. A step that fails leaves its queue to be dropped: the copies are an optimisation,
never needed for correctness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdrive.runtime.kvcache import BlockKey, TierName
from kvdrive.runtime.kvcache.tiers.rows import gather_rows

if TYPE_CHECKING:
    from kvdrive.runtime.pipeline import Mover
    from kvdrive.runtime.placement import Placer


class PromotionQueue:
    def __init__(self, placer: Placer, mover: Mover, max_bytes: int = 32 << 20) -> None:
        self.placer, self.mover, self.max_bytes = placer, mover, max_bytes
        self._keys: list[BlockKey] = []
        self._pids: list[int] = []
        self._served: list[TierName | None] = []
        self._raw: list[torch.Tensor] = []  # [n_i, block_bytes] uint8, one per add
        self._bytes = 0

    def add(self, keys: list[BlockKey], pids: list[int], served: list[TierName | None], raw: torch.Tensor) -> None:
        """Blocks just read (raw [n, block_bytes], row i holding keys[i], read from served[i])."""
        if not self.placer.policy.promote_on_read or not keys:
            return
        self._keys += keys
        self._pids += pids
        self._served += served
        self._raw.append(raw)
        self._bytes += raw.numel()
        if self._bytes > self.max_bytes:
            self.settle()

    def settle(self) -> int:
        """Decide and make the queued copies. Returns how many were made."""
        if not self._keys:
            return 0
        keys, served = self._keys, self._served
        raw = self._raw[0] if len(self._raw) == 1 else torch.cat(self._raw)
        plan = self.placer.promotion(keys, self._pids, served)
        self.drop()
        made = 0
        for dst, rows in plan.items():
            made += self.mover.admit([keys[i] for i in rows], gather_rows(raw, rows), dst, [served[i] for i in rows])
        return made

    def drop(self) -> None:
        self._keys, self._pids, self._served, self._raw, self._bytes = [], [], [], [], 0
