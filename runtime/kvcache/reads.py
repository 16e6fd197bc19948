"""Reading blocks from the tiers: the store's read half (``fetch``), outside the store lock.

Each block is read from its fastest ready copy while pinned; the lock is held only to plan and to
settle. A copy that fails its checksum is dropped and the next copy tried; a block no tier can serve
is reported as a miss (recompute it), never returned as data. The rows are laid out by serving tier, so
that each tier reads straight into one contiguous, aligned slice (no scatter; the SSD tier reads into it
without a staging copy), and key order is restored with one gather.

The first copy that fails its checksum in a tier starts a scrub of that tier in the background: every
copy there is read once and the corrupt ones dropped together, so that one bad disk region costs one
recovery rather than one per corrupt block found later by a decode step. A read that fails with an I/O
error (EIO) starts no scrub, and stops one: a disk that cannot read says nothing about what it holds.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.residency import Copy, Residency
from kvdrive.runtime.kvcache.tiers.rows import gather_rows, scatter_rows

log = logging.getLogger(__name__)

IO_ALIGN = 4096  # row 0 of a fetch buffer on a CPU device is page aligned (O_DIRECT reads land in place)


def _io_faults(faults: dict[str, int]) -> int:
    """Faults other than failed checksums (EIO and the like)."""
    return sum(n for kind, n in faults.items() if kind != "crc")


class BlockReads(Residency):
    page_reads: dict[TierName, int]
    misses: int
    scrubbed: int = 0  # corrupt copies dropped by scrubs
    _scrub: threading.Thread | None = None

    def scrub(self, tier: TierName = "ssd", chunk: int = 256) -> int:
        """Read every ready copy in ``tier`` and drop those that fail their checksum (the lock is held
        only to list and to settle; the reads run outside it). Returns how many were dropped."""
        t = self.tiers.get(tier)
        if t is None:
            return 0
        with self._lock:
            items = sorted((slot, key) for (name, slot), key in self._owner.items() if name == tier)
        buf = torch.empty((min(chunk, max(1, len(items))), self.block_bytes), dtype=torch.uint8)
        dropped = 0
        for i in range(0, len(items), chunk):
            with self._lock:  # pinned while read: nothing moves or frees them meanwhile
                part = [(slot, self._blocks[key]) for slot, key in items[i : i + chunk]
                        if key in self._blocks and tier in self._blocks[key].copies
                        and self._blocks[key].copies[tier].slot == slot and self._blocks[key].copies[tier].ready]
                for _, b in part:
                    b.pins += 1
            io_faults = _io_faults(t.faults)
            ok = t.read([slot for slot, _ in part], buf[: len(part)]) if part else []
            if _io_faults(t.faults) > io_faults:  # the disk fails to read, not to verify: keep what it holds
                for _, b in part:
                    with self._lock:
                        b.pins -= 1
                log.warning("%s tier scrub stopped by I/O errors after dropping %d corrupt copies", tier, dropped)
                self.scrubbed += dropped
                return dropped
            with self._lock:
                for (slot, b), good in zip(part, ok, strict=True):
                    b.pins -= 1
                    # a block another reader holds pinned is left to that reader (it meets the same failure
                    # and drops the copy itself): a pinned block never loses a copy under its reader
                    if not good and b.pins == 0 and b.copies.get(tier, Copy(-1, False)).slot == slot:
                        self._drop(b, tier)
                        dropped += 1
        self.scrubbed += dropped
        log.warning("%s tier scrubbed after a checksum failure: %d of %d copies corrupt, dropped", tier,
                    dropped, len(items))
        return dropped

    def wait_for_scrub(self, timeout: float | None = None) -> None:
        """Return when no scrub runs (or after ``timeout`` seconds)."""
        scrub = self._scrub
        if scrub is not None:
            scrub.join(timeout)

    def _scrub_in_background(self, tier: TierName) -> None:
        """One scrub at a time, started by a checksum failure found by a read."""
        with self._lock:
            if self._scrub is not None and self._scrub.is_alive():
                return
            self._scrub = threading.Thread(target=self.scrub, args=(tier,), name=f"kvdrive-scrub-{tier}",
                                           daemon=True)
            self._scrub.start()

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
        ``count``: a needed read (page_reads, misses), not a background prefetch."""
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
        corrupt_ssd = False
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
                crc = self.tiers[t].faults.get("crc", 0)
                ok = self._read_into(t, [(row[i], slot) for i, slot in items], out)
                with self._lock:
                    for (i, slot), o in zip(items, ok, strict=True):
                        b = self._blocks.get(keys[i])
                        if b is None:  # a key asked twice (a page two sequences share) whose only copy failed
                            continue   # and was dropped for its first asker: a miss here too
                        b.pins -= 1
                        if o:
                            served[i] = t
                            self.page_reads[t] += count
                        elif b.copies.get(t, Copy(-1, False)).slot == slot:
                            log.debug("%s copy of %s unreadable; dropped", t, keys[i])  # the tier logged why
                            self._drop(b, t)
                            retry.append(i)
                corrupt_ssd = corrupt_ssd or (t == "ssd" and self.tiers[t].faults.get("crc", 0) > crc)
            pending = retry
        if corrupt_ssd:  # started once this read is settled: the scrub meets only the other copies
            self._scrub_in_background("ssd")
        missed = [row[i] for i, t in enumerate(served) if t is None]
        if missed:
            out[missed] = 0
        if count:
            with self._lock:
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
