"""The three tiers (gpu, dram, ssd) behind one interface: the data half of the store.

Guarantees:
- a copy being written is invisible until its write completed (``ready``); readers skip it;
- a block being read, moved or written is pinned: eviction and compaction never touch it;
- a block marked ``needed`` (a running sequence's page) is demoted, never dropped; a budget change
  that cannot keep every needed block raises BudgetError and changes nothing;
- a tier never holds more slots than its budget allows; a corrupt SSD copy is dropped and reported
  as a miss, never served;
- no tier reads or writes while the store lock is held: every write is prepared (slots reserved, sources
  pinned) under the lock, runs outside it, and is published under it (``Residency``).
Promotion is inclusive (the lower copy stays as a clean backup); demotion moves. The memory tiers'
placement is mirrored in tensors (``index``) that the decode loop reads directly. The async
scheduling of moves belongs to ``kvdrive.runtime.pipeline`` (placement decides, pipeline moves, tiers
store).
"""

from __future__ import annotations

import logging
import time

import torch

from kvdrive.runtime.kvcache.block_index import BlockIndex
from kvdrive.runtime.kvcache.budgets import TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.compression import Int8Codec
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.layout import CacheFullError, KVLayout
from kvdrive.runtime.kvcache.live_resize import LiveResize
from kvdrive.runtime.kvcache.reads import BlockReads
from kvdrive.runtime.kvcache.residency import Block, Copy, Move, VictimOrder
from kvdrive.runtime.kvcache.tiers.arena import HostArena
from kvdrive.runtime.kvcache.tiers.base import Tier, TierIOError
from kvdrive.runtime.kvcache.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.tiers.dram import DramTier
from kvdrive.runtime.kvcache.tiers.rows import gather_rows
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

    # --- writing -----------------------------------------------------------------------------
    def put(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu", needed: bool = True,
            persistent: bool = False, pin_wait_s: float = 2.0) -> None:
        """Store blocks [n, block_bytes] uint8 in ``tier``, evicting as needed. Copies become readable when
        their write completed. A persistent (content-addressed) key already stored is only touched, unless its
        only copies lie in a failing tier (recent I/O errors): then they are replaced. When every evictable
        block is pinned by in-flight transfers, waits up to ``pin_wait_s`` for them."""
        cap = self.tiers[tier].allocator.capacity
        if len(keys) > cap > 0:  # a batch bigger than the tier: in parts, so later parts can evict earlier
            for i in range(0, len(keys), cap):
                self.put(keys[i : i + cap], blocks[i : i + cap], tier, needed, persistent, pin_wait_s)
            return
        rows: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                b = self._blocks.get(key)
                fastest = self._fastest(b) if b is not None else None
                # a copy only a failing tier holds is as good as lost: the fresh bytes replace it
                if b is not None and persistent and b.persistent and fastest and not self.tiers[fastest].failing():
                    self._set_needed(b, b.needed or needed)
                    self._touch(b)
                    continue
                if b is not None:
                    if b.pins:
                        raise RuntimeError(f"{key} is pinned (being read); cannot overwrite it")
                    for t in list(b.copies):
                        self._drop(b, t)
                rows.append(i)
        if not rows:
            return
        deadline = time.monotonic() + pin_wait_s
        while True:
            try:
                self._add_copies([keys[i] for i in rows], blocks, rows, tier, needed, persistent, strict=True)
                return
            except CacheFullError:
                if time.monotonic() > deadline or not self._any_pinned():
                    raise
            time.sleep(0.002)

    def _any_pinned(self) -> bool:
        with self._lock:
            return any(b.pins for b in self._blocks.values())

    def admit(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu",
              src: list[TierName | None] | None = None) -> int:
        """Add a ``tier`` copy of existing blocks from bytes already read (blocks [n, block_bytes], e.g. from
        ``fetch``): inclusive promotion without a second read. Blocks already in ``tier``, gone, or for
        which no slot can be freed are skipped. Returns how many copies were added."""
        with self._lock:
            rows = [i for i, k in enumerate(keys) if k in self._blocks and tier not in self._blocks[k].copies]
        if not rows:
            return 0
        added = self._add_copies([keys[i] for i in rows], blocks, rows, tier, True, False, strict=False)
        if src is not None:
            with self._lock:
                for i in added:
                    origin = src[i]
                    if origin is not None:
                        self._count(origin, tier, 1)
        return len(added)

    def _add_copies(self, keys: list[BlockKey], blocks: torch.Tensor, rows: list[int], tier: TierName,
                    needed: bool, persistent: bool, strict: bool) -> list[int]:
        """Write blocks[rows[i]] as the ``tier`` copy of keys[i] (new blocks are created with ``needed`` and
        ``persistent``): make room, reserve under the lock, write outside it, publish. ``strict``: all or
        nothing (CacheFullError); else the blocks that got no slot are skipped. Returns the rows written."""
        self._make_room(tier, len(keys))
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
                        for _, b2, _ in todo:
                            self._abort(b2, tier)
                        if not b.copies:
                            del self._blocks[key]
                            self.index.release(b.pid)
                        raise CacheFullError(f"{tier} tier: no slot for {key}: every block is pinned or needed")
                    break
                b.pins += 1
                self._touch(b)
                todo.append((row, b, slot))
        if not todo:
            return []
        src = blocks if [r for r, _, _ in todo] == list(range(blocks.shape[0])) else \
            gather_rows(blocks, [r for r, _, _ in todo])
        try:
            self.tiers[tier].write([s for _, _, s in todo], src, [b.key for _, b, _ in todo],
                                   [b.persistent for _, b, _ in todo])
        except TierIOError:
            with self._lock:
                for _, b, _ in todo:
                    self._abort(b, tier)
            if strict:
                raise
            return []
        with self._lock:
            for _, b, slot in todo:
                b.pins -= 1
                self._publish(b, tier, slot)
        return [r for r, _, _ in todo]

    def _abort(self, b: Block, tier: TierName) -> None:
        """Give up a reserved (never published) copy (lock held)."""
        b.pins -= 1
        self._drop(b, tier)

    # --- moving between tiers ----------------------------------------------------------------
    def prepare_promote(self, keys: list[BlockKey], tier: TierName) -> list[Move]:
        """Plan ``tier`` copies of ``keys`` from their fastest copies: the blocks are pinned (making room
        never evicts what is being promoted), room is made (demotions run now, in this thread), destination
        slots reserved. Run the returned moves with ``run_moves`` (any thread, no lock) and settle them
        with ``complete_moves``."""
        with self._lock:
            want = [b for k in keys if (b := self._blocks.get(k)) is not None and tier not in b.copies
                    and self._fastest(b) is not None]
            for b in want:
                b.pins += 1
        if not want:
            return []
        self._make_room(tier, len(want))
        moves: list[Move] = []
        with self._lock:
            for b in want:
                src = self._fastest(b)
                slot = self._reserve(b, tier) if src is not None and tier not in b.copies \
                    and b.key in self._blocks else None
                if src is None or slot is None:
                    b.pins -= 1  # not promoted: released now
                    continue
                moves.append(Move(b, src, b.copies[src].slot, tier, slot, demote=False))  # keeps its pin
        return moves

    def run_moves(self, moves: list[Move]) -> list[bool]:
        """Copy the bytes of prepared moves (no lock held)."""
        return self._run_moves(moves)

    def complete_moves(self, moves: list[Move], ok: list[bool]) -> int:
        """Publish the moves that arrived; returns how many."""
        self._complete(moves, ok)
        return sum(ok)

    def promote(self, keys: list[BlockKey], tier: TierName = "gpu") -> int:
        """Give ``keys`` a ``tier`` copy now (prepare, run and complete in this thread); returns how many."""
        moves = self.prepare_promote(keys, tier)
        return self.complete_moves(moves, self.run_moves(moves)) if moves else 0

    def replicate(self, keys: list[BlockKey], tier: TierName) -> int:
        """Write a copy of each block to a lower ``tier`` (e.g. ssd, for persistence), keeping its upper
        copies. Returns how many copies were added."""
        return self.promote(keys, tier) if tier in self.tiers else 0

    def close(self) -> None:
        self.wait_for_scrub()  # a scrub reads the tiers: let it finish first
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
