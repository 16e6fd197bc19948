"""Reading blocks from the tiers: the store's read half (``fetch``), outside the store lock.

Each block is read from its fastest ready copy while pinned; the lock is held only to plan and to
settle. A copy that fails its checksum is dropped and the next copy tried; a block no tier can serve
is reported as a miss (recompute it), never returned as data. The rows are laid out by serving tier, so
that each tier reads straight into one contiguous, aligned slice (no scatter; the SSD tier reads into it
without a staging copy), and key order is restored with one gather.
"""

from __future__ import annotations

import logging

import torch

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.residency import Copy, Residency
from kvdrive.runtime.kvcache.tiers.rows import gather_rows, scatter_rows

log = logging.getLogger(__name__)

IO_ALIGN = 4096  # row 0 of a fetch buffer on a CPU device is page aligned (O_DIRECT reads land in place)


class BlockReads(Residency):
    page_reads: dict[TierName, int]
    lookups: int
    misses: int

    def _buffer(self, n: int, device: torch.device) -> torch.Tensor:
        """[n, block_bytes] uint8 on ``device``; on a CPU device the first row is IO_ALIGN-aligned."""
        bb = self.block_bytes
        if device.type != "cpu":
            return torch.empty((n, bb), dtype=torch.uint8, device=device)
        raw = torch.empty(n * bb + IO_ALIGN, dtype=torch.uint8)
        off = -raw.data_ptr() % IO_ALIGN
        return raw[off : off + n * bb].view(n, bb)

    def fetch(self, keys: list[BlockKey], device: torch.device | None = None,
              count: bool = True) -> tuple[torch.Tensor, list[TierName | None]]:
        """Blocks [n, block_bytes] uint8 on ``device`` (the compute device by default), row i holding
        keys[i], and the tier each was read from (None: a miss, recompute it; its row is zeros).
        ``count``: a needed read (page_reads, lookups), not a background prefetch."""
        out, served, row = self._fetch(keys, device, count)
        if row != list(range(len(keys))):  # tiers read into grouped slices: one gather restores key order
            out = gather_rows(out, row, self._buffer(len(keys), out.device))
        return out, served

    def _fetch(self, keys: list[BlockKey], device: torch.device | None,
               count: bool) -> tuple[torch.Tensor, list[TierName | None], list[int]]:
        """Blocks grouped by serving tier, the tier each key was read from, and each key's row."""
        n = len(keys)
        out = self._buffer(n, device or self.device)
        served: list[TierName | None] = [None] * n
        row = list(range(n))  # key index -> its row in out
        pending = list(range(n))
        first = True
        while pending:
            plan: dict[TierName, list[tuple[int, int]]] = {}
            with self._lock:
                for i in pending:
                    b = self._blocks.get(keys[i])
                    t = self._fastest(b) if b else None
                    if b is None or t is None:
                        continue
                    b.pins += 1
                    self._touch(b)
                    plan.setdefault(t, []).append((i, b.copies[t].slot))
            if first:  # rows follow the plan: one contiguous slice per tier, misses last
                for items in plan.values():
                    items.sort(key=lambda it: it[1])  # slot order: a memory tier's chunks map to row ranges
                planned = [i for t in TIER_ORDER for i, _ in plan.get(t, [])]
                rest = sorted(set(range(n)) - set(planned))
                for r, i in enumerate(planned + rest):
                    row[i] = r
            first = False
            retry: list[int] = []
            for t, items in plan.items():
                ok = self._read_into(t, [(row[i], slot) for i, slot in items], out)
                with self._lock:
                    for (i, slot), o in zip(items, ok, strict=True):
                        b = self._blocks[keys[i]]
                        b.pins -= 1
                        if o:
                            served[i] = t
                            self.page_reads[t] += count
                        elif b.copies.get(t, Copy(-1, False)).slot == slot:
                            log.warning("%s copy of %s unreadable; dropped", t, keys[i])
                            self._drop(b, t)
                            retry.append(i)
            pending = retry
        missed = [row[i] for i, t in enumerate(served) if t is None]
        if missed:
            out[missed] = 0
        if count:
            with self._lock:
                self.lookups += n
                self.misses += len(missed)
        return out, served, row

    def _read_into(self, tier: TierName, items: list[tuple[int, int]], out: torch.Tensor) -> list[bool]:
        """Read (row, slot) items of ``tier`` into those rows of out: in place when the rows are consecutive."""
        rows = [r for r, _ in items]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return self.tiers[tier].read([s for _, s in items], out[rows[0] : rows[0] + len(rows)])
        tmp = torch.empty((len(items), self.block_bytes), dtype=torch.uint8, device=out.device)
        ok = self.tiers[tier].read([s for _, s in items], tmp)
        good = [p for p, o in enumerate(ok) if o]
        if len(good) == len(ok):
            scatter_rows(out, rows, tmp)
        elif good:
            scatter_rows(out, [rows[p] for p in good], gather_rows(tmp, good))
        return ok
