"""Reading blocks out of the tiers (``fetch``) and scrubbing a tier: the Mover's reader part.

Each block is read from its fastest ready copy while pinned; the store's lock is held only to plan and to
settle (``kvcache.reads``). A copy that fails its checksum is dropped and the next copy tried; a block no
tier can serve is reported as a miss (recompute it), never returned as data. The rows are laid out by
serving tier, so that each tier reads straight into one contiguous, aligned slice (no scatter; the SSD tier
reads into it without a staging copy), and key order is restored with one gather.

The first copy that fails its checksum in a tier starts a scrub of that tier in the background: every copy
there is read once and the corrupt ones dropped together, so that one bad disk region costs one recovery
rather than one per corrupt block found later by a decode step. A read that fails with an I/O error (EIO)
starts no scrub, and stops one: a disk that cannot read says nothing about what it holds.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvdrive.runtime.kvcache.mover.runner import MoveRunner
from kvdrive.runtime.kvcache.store.budgets import TIER_ORDER, TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.reads import ReadBook
from kvdrive.runtime.kvcache.store.tiers.rows import gather_rows, scatter_rows

log = logging.getLogger(__name__)


def _io_faults(faults: dict[str, int]) -> int:
    """Faults other than failed checksums (EIO and the like)."""
    return sum(n for kind, n in faults.items() if kind != "crc")


class BlockReader:
    def __init__(self, runner: MoveRunner, book: ReadBook) -> None:
        """``runner``: buffers and freed slots; ``book``: the store's read bookkeeping (plan / settle)."""
        self.runner = runner
        self.book = book
        self.tiers = runner.tiers
        self._scrub: threading.Thread | None = None  # the running scrub
        self._scrub_lock = threading.Lock()

    def fetch(self, keys: list[BlockKey], device: torch.device | None = None,
              count: bool = True) -> tuple[torch.Tensor, list[TierName | None]]:
        """Blocks [n, block_bytes] uint8 on ``device`` (the compute device by default), row i holding
        keys[i], and the tier each was read from (None: a miss, recompute it; its row is zeros).
        ``count``: a needed read (page_reads, misses), not a background prefetch."""
        out, served, row = self._fetch(keys, device, count)
        if row != list(range(len(keys))):  # tiers read into grouped slices: one gather restores key order
            out = gather_rows(out, row, self.runner.buffer(len(keys), out.device))
        return out, served

    def _fetch(self, keys: list[BlockKey], device: torch.device | None,
               count: bool) -> tuple[torch.Tensor, list[TierName | None], list[int]]:
        """Blocks grouped by serving tier, the tier each key was read from, and each key's row."""
        book, tiers = self.book, self.tiers
        n = len(keys)
        out = self.runner.buffer(n, device or self.runner.device)
        served: list[TierName | None] = [None] * n
        row = list(range(n))  # key index -> its row in out
        pending = list(range(n))
        first = True
        corrupt_ssd = False
        while pending:
            plan = book.plan_reads(keys, pending)
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
                crc = tiers[t].faults.get("crc", 0)
                ok = self._read_into(t, [(row[i], slot) for i, slot in items], out)
                failed = book.settle_reads(keys, t, items, ok, served, count)
                if failed:
                    log.debug("%d %s copies unreadable; dropped", len(failed), t)  # the tier logged why
                retry += failed
                corrupt_ssd = corrupt_ssd or (t == "ssd" and tiers[t].faults.get("crc", 0) > crc)
            self.runner.settle_freed()
            pending = retry
        if corrupt_ssd:  # started once this read is settled: the scrub meets only the other copies
            self._scrub_in_background("ssd")
        missed = [row[i] for i, t in enumerate(served) if t is None]
        if missed:
            out[missed] = 0
        if count and missed:
            book.count_misses(len(missed))
        return out, served, row

    def _read_into(self, tier: TierName, items: list[tuple[int, int]], out: torch.Tensor) -> list[bool]:
        """Read (row, slot) items of ``tier`` into those rows of out: in place when the rows are consecutive."""
        t = self.tiers[tier]
        rows = [r for r, _ in items]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return t.read([s for _, s in items], out[rows[0] : rows[0] + len(rows)])
        tmp = torch.empty((len(items), self.runner.block_bytes), dtype=torch.uint8, device=out.device)
        ok = t.read([s for _, s in items], tmp)
        good = [p for p, o in enumerate(ok) if o]
        if len(good) == len(ok):
            scatter_rows(out, rows, tmp)
        elif good:
            scatter_rows(out, [rows[p] for p in good], gather_rows(tmp, good))
        return ok

    # --- scrubs ----------------------------------------------------------------------------------
    def scrub(self, tier: TierName = "ssd", chunk: int = 256) -> int:
        """Read every ready copy in ``tier`` and drop those that fail their checksum (the store's lock is held
        only to list, pin and settle; the reads run outside it). Returns how many were dropped."""
        book = self.book
        t = self.tiers.get(tier)
        if t is None:
            return 0
        items = book.slots_of(tier)
        buf = torch.empty((min(chunk, max(1, len(items))), self.runner.block_bytes), dtype=torch.uint8)
        dropped = 0
        for i in range(0, len(items), chunk):
            part = book.pin_copies(tier, items[i : i + chunk])
            io_faults = _io_faults(t.faults)
            ok = t.read([slot for slot, _ in part], buf[: len(part)]) if part else []
            if _io_faults(t.faults) > io_faults:  # the disk fails to read, not to verify: keep what it holds
                book.unpin([b for _, b in part])
                log.warning("%s tier scrub stopped by I/O errors after dropping %d corrupt copies", tier, dropped)
                return dropped
            dropped += book.settle_scrub(tier, part, ok)
            self.runner.settle_freed()
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
        with self._scrub_lock:
            if self._scrub is not None and self._scrub.is_alive():
                return
            self._scrub = threading.Thread(target=self.scrub, args=(tier,), name=f"kvdrive-scrub-{tier}",
                                           daemon=True)
            self._scrub.start()
