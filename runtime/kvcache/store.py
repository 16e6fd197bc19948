"""The three tiers (gpu, dram, ssd) and the block table over them: what is stored where (``kvcache`` stores).

``TieredKVStore`` builds the tiers and keeps their bookkeeping: the block table (``Residency``), the read and
resize halves of it (``BlockReads``, ``LiveResize``), queries, flags and page references. It never moves a
byte: ``kvdrive.runtime.pipeline.Mover`` runs every put, read, promotion, demotion and resize as prepare
(here, under the lock) -> run (the Mover, no lock held) -> complete (here, under the lock). Placement
decides which tier (``kvdrive.runtime.placement``).

Guarantees the bookkeeping keeps:
- a copy being written is invisible until its write completed (``ready``); readers skip it;
- a block being read, moved or written is pinned: eviction and compaction never touch it;
- a block marked ``needed`` (a running sequence's page) is demoted, never dropped; a budget change
  that cannot keep every needed block raises BudgetError and changes nothing;
- a tier never holds more slots than its budget allows; a corrupt SSD copy is dropped and reported
  as a miss, never served;
- no tier I/O while the store lock is held (every tier method is called by the Mover, outside it).
Promotion is inclusive (the lower copy stays as a clean backup); demotion moves. The memory tiers'
placement is mirrored in tensors (``index``) that the decode loop reads directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvdrive.runtime.kvcache.block_index import BlockIndex
from kvdrive.runtime.kvcache.budgets import TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.compression import Int8Codec
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.layout import CacheFullError, KVLayout
from kvdrive.runtime.kvcache.live_resize import LiveResize
from kvdrive.runtime.kvcache.page_events import PageEvents
from kvdrive.runtime.kvcache.reads import BlockReads
from kvdrive.runtime.kvcache.residency import Block, Copy, Move, VictimOrder
from kvdrive.runtime.kvcache.tiers.arena import HostArena
from kvdrive.runtime.kvcache.tiers.base import Tier
from kvdrive.runtime.kvcache.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.tiers.dram import DramTier
from kvdrive.runtime.kvcache.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

__all__ = ["Move", "TieredKVStore", "VictimOrder"]


class TieredKVStore(BlockReads, LiveResize):
    def __init__(self, layout: KVLayout, budgets: TierBudgets, ssd_dir: str | None = None,
                 device: torch.device | str | None = None, hugetlbfs_dir: str | None = None,
                 ssd_codec: str = "none", victim_order: VictimOrder | None = None,
                 ssd_tier: SsdTier | None = None, io_threads: int = 4, device_extra_rows: int = 0,
                 ssd_backend: str = "posix") -> None:
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.budgets = budgets
        bb = self.block_bytes
        self.tiers: dict[TierName, Tier] = {
            "gpu": DeviceTier(bb, budgets.gpu_bytes // bb, device, extra_rows=device_extra_rows),
            "dram": DramTier(bb, DramTier.slots_for_budget(budgets.dram_bytes, bb, bool(hugetlbfs_dir)), hugetlbfs_dir),
        }
        self.device = self.tiers["gpu"].device  # type: ignore[attr-defined]
        super().__init__(victim_order, BlockIndex(layout.num_layers, self.device))
        # on a CPU host both memory tiers are host memory: one mapping, so one gather reads either;
        # not on hugetlbfs, whose pages are reserved for the DRAM budget alone (a pod's hugepages)
        self.arena = HostArena(self.tiers["gpu"], self.tiers["dram"], self._rebased) \
            if self.device.type == "cpu" and not hugetlbfs_dir else None  # type: ignore[arg-type]
        if ssd_tier is None and ssd_dir is not None:
            codec = Int8Codec(layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype) \
                if ssd_codec == "int8" else None
            ssd_tier = _make_ssd(ssd_dir, bb, budgets.ssd_bytes, codec, io_threads, ssd_backend)
        if ssd_tier is not None:
            self.tiers["ssd"] = ssd_tier
        self.misses = 0
        self.page_reads: dict[TierName, int] = {t: 0 for t in self.tiers}  # needed pages found per tier
        for slot, key in ssd_tier.recovered() if ssd_tier is not None else []:
            b = self._new_block(key, needed=False, persistent=True)
            self._set_copy(b, "ssd", Copy(slot, True))
            self._owner[("ssd", slot)] = key

    def _rebased(self, base: int) -> None:
        with self._lock:
            self.index.set_dram_base(base)

    # --- queries -----------------------------------------------------------------------------
    def where(self, key: BlockKey) -> TierName | None:
        """The fastest tier with a readable copy of ``key``."""
        with self._lock:
            b = self._blocks.get(key)
            return self._fastest(b) if b else None

    def where_many(self, keys: list[BlockKey]) -> list[TierName | None]:
        with self._lock:
            out: list[TierName | None] = []
            for k in keys:
                b = self._blocks.get(k)
                out.append(self._fastest(b) if b else None)
            return out

    def usage(self) -> list[TierUsage]:
        """Each tier's budget, capacity and what it holds, from counters kept as blocks change (no walk over
        the blocks: a scrape costs the same with a million blocks as with ten)."""
        with self._lock:
            out = []
            for name, t in self.tiers.items():
                pages = t.allocator.used
                cached = self._copies_in.get(name, 0) - self._needed_in.get(name, 0)
                out.append(TierUsage(name, self.budgets.of(name), t.allocator.capacity * t.slot_bytes,
                                     pages * t.slot_bytes, pages, t.backing, self.page_reads[name], t.errors,
                                     cached * t.slot_bytes))
            return out

    def health(self) -> dict[TierName, str]:
        """The degraded tiers and why (empty when every tier is healthy)."""
        return {name: why for name, t in self.tiers.items() if (why := t.degraded()) is not None}

    def faults(self) -> dict[tuple[TierName, str], int]:
        """(tier, fault kind) -> faults since start."""
        return {(name, kind): n for name, t in self.tiers.items() for kind, n in t.faults.items()}

    @property
    def capacity_blocks(self) -> int:
        return sum(t.allocator.capacity for t in self.tiers.values())

    @property
    def healthy_capacity_blocks(self) -> int:
        """Blocks the tiers that can take new blocks now hold: a failing tier (recent I/O faults) counts 0."""
        return sum(t.allocator.capacity for t in self.tiers.values() if not t.failing())

    # --- flags and page references -----------------------------------------------------
    def set_needed(self, keys: list[BlockKey], needed: bool) -> None:
        """``needed``: a running sequence needs the block (demote, never drop)."""
        with self._lock:
            for k in keys:
                if k in self._blocks:
                    self._set_needed(self._blocks[k], needed)

    def page_digests(self) -> list[bytes]:
        """Digests of the pages whose first layer's block is held in some tier (what a router indexes)."""
        with self._lock:
            return [k.digest for k in self._blocks if k.layer == 0]

    def watch_pages(self, events: PageEvents) -> None:
        """From now on tell ``events`` whenever a page gains or loses a tier, starting with what is held now."""
        with self._lock:
            events.seed((k.digest, t) for k, b in self._blocks.items() if k.layer == 0
                        for t, c in b.copies.items() if c.ready)
            self.page_events = events

    def ref_page(self, digest: bytes) -> int:
        """The dense id of page ``digest``, held for a sequence until ``unref_page`` (ids of pages a
        sequence references are never reused, even if every copy of the page is lost)."""
        with self._lock:
            return self.index.acquire(digest)

    def unref_page(self, pid: int) -> None:
        with self._lock:
            self.index.release(pid)

    def drain_freed(self) -> list[int]:
        """Page ids freed since the last call (placement resets their scores)."""
        with self._lock:
            return self.index.drain_freed()

    def key_of(self, pid: int, layer: int) -> BlockKey:
        digest = self.index.digests[pid]
        assert digest is not None, f"page id {pid} is not in use"
        return BlockKey(digest, layer)

    # --- writing: the bookkeeping of ``Mover.put`` / ``Mover.admit`` ----------------------------------
    def rows_to_write(self, keys: list[BlockKey], needed: bool, persistent: bool,
                      replaces: Callable[[Tier], bool]) -> list[int]:
        """Which of ``keys`` a put writes: a persistent (content-addressed) key already stored is only touched,
        unless placement's ``replaces`` says its fastest tier's copy must be replaced by the fresh bytes; any
        other stored key has its copies dropped (its new bytes replace them)."""
        rows: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                b = self._blocks.get(key)
                fastest = self._fastest(b) if b is not None else None
                if b is not None and persistent and b.persistent and fastest and not replaces(self.tiers[fastest]):
                    self._set_needed(b, b.needed or needed)
                    self._touch(b)
                    continue
                if b is not None:
                    if b.pins:
                        raise RuntimeError(f"{key} is pinned (being read); cannot overwrite it")
                    for t in list(b.copies):
                        self._drop(b, t)
                rows.append(i)
        return rows

    def any_pinned(self) -> bool:
        with self._lock:
            return bool(self._pinned)

    def rows_to_admit(self, keys: list[BlockKey], tier: TierName) -> list[int]:
        """Which of ``keys`` are stored and have no ``tier`` copy yet."""
        with self._lock:
            return [i for i, k in enumerate(keys) if k in self._blocks and tier not in self._blocks[k].copies]

    def count_admitted(self, src: list[TierName | None], tier: TierName) -> None:
        with self._lock:
            for origin in src:
                if origin is not None:
                    self._count(origin, tier, 1)

    def reserve_writes(self, keys: list[BlockKey], rows: list[int], tier: TierName, needed: bool, persistent: bool,
                       strict: bool) -> list[tuple[int, Block, int]]:
        """Reserve a ``tier`` slot for each key (new blocks are created with ``needed`` and ``persistent``) and
        pin its block: (row, block, slot) per reservation. ``strict``: all or nothing (CacheFullError, nothing
        reserved); else keys gone meanwhile or past the last free slot are skipped."""
        todo: list[tuple[int, Block, int]] = []
        with self._lock:
            for key, row in zip(keys, rows, strict=True):
                b = self._blocks.get(key)
                if b is None:
                    if not strict:
                        continue  # gone meanwhile: nothing to admit
                    b = self._new_block(key, needed, persistent)
                elif tier in b.copies:
                    continue
                slot = self._reserve(b, tier)
                if slot is None:
                    if strict:
                        self.abort_writes(todo, tier)
                        if not b.copies:
                            self._forget(b)
                        raise CacheFullError(f"{tier} tier: no slot for {key}: every block is pinned or needed")
                    break
                self._pin(b)
                self._touch(b)
                todo.append((row, b, slot))
        return todo

    def publish_writes(self, todo: list[tuple[int, Block, int]], tier: TierName) -> None:
        with self._lock:
            for _, b, slot in todo:
                self._unpin(b)
                self._publish(b, tier, slot)

    def abort_writes(self, todo: list[tuple[int, Block, int]], tier: TierName) -> None:
        """Give up reserved (never published) copies."""
        with self._lock:
            for _, b, _ in todo:
                self._unpin(b)
                self._drop(b, tier)

    # --- promotion: the bookkeeping of ``Mover.prepare_promote`` -------------------------------------
    def pin_for_promotion(self, keys: list[BlockKey], tier: TierName) -> list[Block]:
        """The stored blocks of ``keys`` without a ``tier`` copy, pinned (making room never evicts them)."""
        with self._lock:
            want = [b for k in keys if (b := self._blocks.get(k)) is not None and tier not in b.copies
                    and self._fastest(b) is not None]
            for b in want:
                self._pin(b)
            return want

    def reserve_promotions(self, want: list[Block], tier: TierName) -> list[Move]:
        """A reserved ``tier`` slot for each pinned block of ``pin_for_promotion``, as moves from its fastest
        copy (each keeps its pin until ``complete``); the blocks that got none are unpinned."""
        moves: list[Move] = []
        with self._lock:
            for b in want:
                src = self._fastest(b)
                slot = self._reserve(b, tier) if src is not None and tier not in b.copies \
                    and b.key in self._blocks else None
                if src is None or slot is None:
                    self._unpin(b)  # not promoted: released now
                    continue
                moves.append(Move(b, src, b.copies[src].slot, tier, slot, demote=False))
        return moves

    def close(self) -> None:
        """Close the tiers (the Mover waits for its background work first)."""
        for t in self.tiers.values():
            t.close()


def _make_ssd(directory: str, block_bytes: int, budget: int, codec: Int8Codec | None, io_threads: int,
              backend: str) -> Tier:
    """The POSIX O_DIRECT backend, or KvikIO when asked for (``backend``): ValueError, with the reason, when it
    cannot run here."""
    if backend == "posix":
        return SsdTier(directory, block_bytes, budget, codec=codec, io_threads=io_threads)
    if backend != "kvikio":
        raise ValueError(f"ssd backend {backend!r}: expected posix or kvikio")
    from kvdrive.runtime.kvcache.tiers.kvikio_backend import KvikioSsdTier, kvikio_unusable_reason

    reason = kvikio_unusable_reason()
    if reason:
        raise ValueError(f"--ssd-backend kvikio: {reason}")
    return KvikioSsdTier(directory, block_bytes, budget, codec=codec, io_threads=io_threads)
