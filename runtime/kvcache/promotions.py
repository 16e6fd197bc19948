"""The copies a step's lower-tier reads earn: decided once at the end of the step, made in the next one's load phase.

A decode step reads the pages that no memory tier holds from the SSD tier, layer by layer, straight into
the step buffer (``page_reads``). Whether each of those blocks also gets a copy in a faster tier is
placement's decision, and making the copy costs eviction, demotion and a row copy. Taken per layer, that
was 30 small admissions per step, each walking the tier's coldest residents again; here the step's reads
are queued with the bytes already read, and at the end of the step placement decides for all of them in
one batch (``plan``: one sort, one admission per tier, with the attention mass this step gave them); the
next step's load phase (``KVCache.prepare_step``) has the Mover admit each destination's blocks in
one call (``run``). A block is read by one layer only, so nothing in the same step misses it again for want
of the copy. The queue holds at most ``max_bytes`` of read blocks; reads past that earn no copy this step.
Nothing is ever admitted mid-step: an admission evicts, and a decode layer's in-place attention reads the
slots its pages held when they were located (``PageReader.locate``), so a copy made between locating and
attending would overwrite pages the layer is about to read (it did: tiered full attention at 16K answered
wrong while every page on the device answered right). A step that fails leaves its undecided reads to be
dropped: the copies are an optimisation, never needed for correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvdrive.runtime.kvcache.store import BlockKey, TierName
from kvdrive.runtime.kvcache.store.tiers.rows import gather_rows

if TYPE_CHECKING:
    from kvdrive.runtime.kvcache.mover import Mover
    from kvdrive.runtime.kvcache.placement import Placer


@dataclass(frozen=True)
class Promotion:
    """Copies placement decided for one destination tier: the blocks and the bytes already read."""

    dst: TierName
    keys: list[BlockKey]
    raw: torch.Tensor  # [n, block_bytes] uint8, row i holding keys[i]
    served: list[TierName | None]  # where each was read from


class PromotionQueue:
    def __init__(self, placer: Placer, mover: Mover, max_bytes: int = 32 << 20) -> None:
        self.placer, self.mover, self.max_bytes = placer, mover, max_bytes
        self._keys: list[BlockKey] = []
        self._pids: list[int] = []
        self._served: list[TierName | None] = []
        self._raw: list[torch.Tensor] = []  # [n_i, block_bytes] uint8, one per add
        self._bytes = 0
        self._planned: list[Promotion] = []  # decided at the end of a step, made in the next step's load phase

    def add(self, keys: list[BlockKey], pids: list[int], served: list[TierName | None], raw: torch.Tensor) -> None:
        """Blocks just read (raw [n, block_bytes], row i holding keys[i], read from served[i]); once the queue
        holds ``max_bytes``, further reads of the step are not queued (they earn no copy)."""
        if not self.placer.policy.promote_on_read or not keys or self._bytes >= self.max_bytes:
            return
        self._keys += keys
        self._pids += pids
        self._served += served
        self._raw.append(raw)
        self._bytes += raw.numel()

    def plan(self) -> None:
        """The end of a step: placement decides the queued copies, in one batch (made by ``run``)."""
        if not self._keys:
            return
        keys, served = self._keys, self._served
        raw = self._raw[0] if len(self._raw) == 1 else torch.cat(self._raw)
        plans = self.placer.promotion(keys, self._pids, served)
        self.drop_unplanned()
        self._planned += [Promotion(p.dst, list(p.keys), gather_rows(raw, list(p.rows)), [served[i] for i in p.rows])
                          for p in plans]

    def run(self) -> int:
        """The load phase of the next step: the Mover makes the planned copies (blocks gone meanwhile are
        skipped). Returns how many were made."""
        planned, self._planned = self._planned, []
        return sum(self.mover.admit(p.keys, p.raw, p.dst, p.served) for p in planned)

    def drop_unplanned(self) -> None:
        """Forget the reads queued and not decided (a step that failed leaves them)."""
        self._keys, self._pids, self._served, self._raw, self._bytes = [], [], [], [], 0
