"""The three tiers (gpu, dram, ssd) behind one interface: the data half of the store.

Guarantees:
- a copy being written is invisible until its write completed (``ready``); readers skip it;
- a block being read, moved or written is pinned: eviction and compaction never touch it;
- a block marked ``needed`` (a running sequence's page) is demoted, never dropped; a budget change
  that cannot keep every needed block raises BudgetError and changes nothing;
- a tier never holds more slots than its budget allows; a corrupt SSD copy is dropped and reported
  as a miss, never served.
Promotion is inclusive (the lower copy stays as a clean backup); demotion moves. Reads of lower tiers
(``fetch``) run outside the store lock, so a background prefetch never stalls the decode loop; the
bookkeeping and eviction live in ``Residency``. The async scheduling of moves belongs to
``kvdrive.runtime.pipeline`` (placement decides, pipeline moves, tiers store).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.compression import Int8Codec
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.paged import CacheFullError, KVLayout
from kvdrive.runtime.kvcache.reads import BlockReads
from kvdrive.runtime.kvcache.residency import Block, Copy, VictimOrder
from kvdrive.runtime.kvcache.tiers.base import Tier, TierIOError
from kvdrive.runtime.kvcache.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.tiers.dram import DramTier
from kvdrive.runtime.kvcache.tiers.rows import gather_rows
from kvdrive.runtime.kvcache.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

__all__ = ["TieredKVStore", "VictimOrder"]


class TieredKVStore(BlockReads):
    def __init__(self, layout: KVLayout, budgets: TierBudgets, ssd_dir: str | None = None,
                 device: torch.device | str | None = None, hugetlbfs_dir: str | None = None,
                 ssd_codec: str = "none", victim_order: VictimOrder | None = None,
                 ssd_tier: SsdTier | None = None, io_threads: int = 4) -> None:
        super().__init__(victim_order)
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.block_shape = (2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.budgets = budgets
        bb = self.block_bytes
        self.tiers: dict[TierName, Tier] = {
            "gpu": DeviceTier(bb, budgets.gpu_bytes // bb, device),
            "dram": DramTier(bb, budgets.dram_bytes // bb, hugetlbfs_dir),
        }
        if ssd_tier is None and ssd_dir is not None:
            codec = Int8Codec(layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype) \
                if ssd_codec == "int8" else None
            ssd_tier = _make_ssd(ssd_dir, bb, budgets.ssd_bytes, codec, io_threads)
        if ssd_tier is not None:
            self.tiers["ssd"] = ssd_tier
        self.device = self.tiers["gpu"].device  # type: ignore[attr-defined]
        self.lookups = self.misses = 0
        self.page_reads: dict[TierName, int] = {t: 0 for t in self.tiers}  # needed pages found per tier
        for slot, key in ssd_tier.recovered() if ssd_tier is not None else []:
            self._blocks[key] = Block(key, {"ssd": Copy(slot, True)}, needed=False, persistent=True)
            self._owner[("ssd", slot)] = key

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

    def tiers_of(self, key: BlockKey) -> list[TierName]:
        with self._lock:
            b = self._blocks.get(key)
            return [t for t in TIER_ORDER if b and t in b.copies and b.copies[t].ready]

    def usage(self) -> list[TierUsage]:
        with self._lock:
            out = []
            for name, t in self.tiers.items():
                pages = t.allocator.used
                held = [b for b in self._blocks.values() if name in b.copies]
                pinned = sum(1 for b in held if b.pins)
                cached = sum(1 for b in held if not b.needed)
                out.append(TierUsage(name, self.budgets.of(name), t.allocator.capacity * t.slot_bytes,
                                     pages * t.slot_bytes, pages, pinned, t.backing, self.page_reads[name],
                                     t.errors, cached * t.slot_bytes))
            return out

    def residents(self, tier: TierName) -> tuple[list[BlockKey], int]:
        """Blocks with a ready copy in ``tier``, and the tier's free slots."""
        if tier not in self.tiers:
            return [], 0
        with self._lock:
            owner = self._owner
            alloc = self.tiers[tier].allocator
            keys = [k for k in (owner.get((tier, s)) for s in range(alloc.capacity)) if k is not None]
            return keys, alloc.free_count

    @property
    def capacity_blocks(self) -> int:
        return sum(t.allocator.capacity for t in self.tiers.values())

    # --- pins and flags ----------------------------------------------------------------------
    def pin(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                self._blocks[k].pins += 1

    def unpin(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                b = self._blocks.get(k)
                if b is not None:
                    b.pins -= 1

    @contextmanager
    def pinned(self, keys: list[BlockKey]) -> Iterator[None]:
        self.pin(keys)
        try:
            yield
        finally:
            self.unpin(keys)

    def set_needed(self, keys: list[BlockKey], needed: bool) -> None:
        """``needed``: a running sequence needs the block (demote, never drop)."""
        with self._lock:
            for k in keys:
                if k in self._blocks:
                    self._blocks[k].needed = needed

    def remove(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                b = self._blocks.get(k)
                if b is None:
                    continue
                if b.pins:
                    raise RuntimeError(f"{k} is pinned; unpin before removing")
                for t in list(b.copies):
                    self._drop(b, t)

    # --- data --------------------------------------------------------------------------------
    def to_block(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [S, Hkv, D] -> [block_bytes] uint8 on k's device."""
        return torch.stack([k.to(self.layout.dtype), v.to(self.layout.dtype)]).contiguous().view(torch.uint8).view(-1)

    def to_blocks(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [n, S, Hkv, D] -> [n, block_bytes] uint8 on k's device."""
        kv = torch.stack([k.to(self.layout.dtype), v.to(self.layout.dtype)], dim=1).contiguous()  # [n, 2, S, H, D]
        return kv.view(torch.uint8).view(k.shape[0], -1)

    def _room(self, tier: TierName, n: int) -> None:
        """Free slots for a batch of ``n`` in one eviction pass (lock held)."""
        t = self.tiers[tier]
        short = n - t.allocator.free_count
        if short > 0:
            self._evict(tier, max(short, self._evict_batch(tier)))

    def put(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu", needed: bool = True,
            persistent: bool = False, pin_wait_s: float = 2.0) -> None:
        """Store blocks [n, block_bytes] uint8 in ``tier``, evicting as needed. Copies become readable when
        their write completed. A persistent (content-addressed) key already stored is only touched. When
        every evictable block is pinned by in-flight transfers, waits up to ``pin_wait_s`` for them."""
        deadline = time.monotonic() + pin_wait_s
        while True:
            try:
                return self._put(keys, blocks, tier, needed, persistent)
            except CacheFullError:
                if time.monotonic() > deadline or not self._any_pinned():
                    raise
            time.sleep(0.002)

    def _any_pinned(self) -> bool:
        with self._lock:
            return any(b.pins for b in self._blocks.values())

    def _put(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName, needed: bool,
             persistent: bool) -> None:
        cap = self.tiers[tier].allocator.capacity
        if len(keys) > cap > 0:  # a batch bigger than the tier: in parts, so later parts can evict earlier
            for i in range(0, len(keys), cap):
                self._put(keys[i : i + cap], blocks[i : i + cap], tier, needed, persistent)
            return
        todo: list[tuple[int, BlockKey, int]] = []
        with self._lock:
            self._room(tier, len(keys))
            for i, key in enumerate(keys):
                b = self._blocks.get(key)
                if b is not None and persistent and b.persistent and self._fastest(b):
                    b.needed = b.needed or needed
                    self._touch(b)
                    continue
                if b is not None:
                    if b.pins:
                        raise RuntimeError(f"{key} is pinned (being read); cannot overwrite it")
                    for t in list(b.copies):
                        self._drop(b, t)
                b = self._blocks[key] = Block(key, needed=needed, persistent=persistent, pins=1)
                slot = self._alloc(tier, key)
                if slot is None:
                    del self._blocks[key]
                    for _, k2, _ in todo:
                        self._abort(k2, tier)
                    raise CacheFullError(f"{tier} tier: no slot for {key}: every block is pinned or needed")
                b.copies[tier] = Copy(slot, False)
                self._touch(b)
                todo.append((i, key, slot))
        if not todo:
            return
        rows = blocks if len(todo) == len(keys) else \
            gather_rows(blocks, [i for i, _, _ in todo])
        try:
            self.tiers[tier].write([s for _, _, s in todo], rows, [k for _, k, _ in todo], [persistent] * len(todo))
        except TierIOError:
            with self._lock:
                for _, k, _ in todo:
                    self._abort(k, tier)
            raise
        with self._lock:
            for _, k, s in todo:
                b = self._blocks[k]
                b.copies[tier] = Copy(s, True)
                b.pins -= 1

    def _abort(self, key: BlockKey, tier: TierName) -> None:
        b = self._blocks[key]
        b.pins -= 1
        self._drop(b, tier)

    def get_kv(self, keys: list[BlockKey]) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """K and V [n, S, Hkv, D] of ``keys`` on the compute device (zeros where missed)."""
        raw, hit = self.get(keys)
        kv = raw.view(self.layout.dtype).view(len(keys), *self.block_shape)
        return kv[:, 0], kv[:, 1], hit

    def admit(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu",
              src: list[TierName | None] | None = None) -> int:
        """Add a ``tier`` copy of existing blocks from bytes already read (blocks [n, block_bytes], e.g. from
        ``fetch``): inclusive promotion without a second read. Blocks already in ``tier``, gone, or for
        which no slot can be freed are skipped. Returns how many copies were added."""
        added = 0
        with self._lock:
            todo = [(i, self._blocks[k]) for i, k in enumerate(keys)
                    if k in self._blocks and tier not in self._blocks[k].copies]
            if not todo:
                return 0
            self._room(tier, len(todo))
            for i, b in todo:
                if b.key not in self._blocks or tier in b.copies:
                    continue
                b.pins += 1
                slot = self._alloc(tier, b.key)
                b.pins -= 1
                if slot is None:
                    break
                try:
                    self.tiers[tier].write([slot], blocks[i : i + 1], [b.key], [b.persistent])
                except TierIOError:
                    self.tiers[tier].allocator.release(slot)
                    del self._owner[(tier, slot)]
                    continue
                b.copies[tier] = Copy(slot, True)
                added += 1
                origin = src[i] if src is not None else None
                if origin is not None:
                    self._count(origin, tier, 1)
        return added

    def promote(self, keys: list[BlockKey], tier: TierName = "gpu") -> int:
        """Read blocks not yet in ``tier`` from their fastest copy (outside the lock) and admit them."""
        with self._lock:
            todo = [k for k in keys if k in self._blocks and tier not in self._blocks[k].copies]
        if not todo:
            return 0
        blocks, served, order = self.fetch_grouped(todo, count=False)  # order-free: no gather back
        todo = [todo[i] for i in order]
        got = [i for i, t in enumerate(served) if t is not None]
        if not got:
            return 0
        rows = blocks if len(got) == len(todo) else gather_rows(blocks, got)
        return self.admit([todo[i] for i in got], rows, tier, [served[i] for i in got])

    def replicate(self, keys: list[BlockKey], tier: TierName) -> int:
        """Write a copy of each block to a lower ``tier`` (e.g. ssd, for persistence), keeping its upper
        copies. Returns how many copies were added."""
        return self.promote(keys, tier) if tier in self.tiers else 0

    def move(self, key: BlockKey, dst: TierName) -> bool:
        """Copy ``key`` to ``dst``: promotion keeps the lower copy (clean backup), demotion drops the
        upper one. False when the block is gone, unreadable, or ``dst`` has no evictable room."""
        with self._lock:
            b = self._blocks.get(key)
            src = self._fastest(b) if b else None
            if b is None or src is None or dst not in self.tiers:
                return False
            self._touch(b)
            if dst in b.copies and b.copies[dst].ready:
                return True
            b.pins += 1
            try:
                ok = self._copy(b, src, dst)
            finally:
                b.pins -= 1
            if ok and TIER_ORDER.index(dst) > TIER_ORDER.index(src):
                self._drop(b, src)
            return ok

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()


def _make_ssd(directory: str, block_bytes: int, budget: int, codec: Int8Codec | None, io_threads: int) -> Tier:
    """The KvikIO backend when CUDA and kvikio are present, else the POSIX O_DIRECT one."""
    from kvdrive.runtime.kvcache.tiers.kvikio_backend import kvikio_usable

    if kvikio_usable():
        from kvdrive.runtime.kvcache.tiers.kvikio_backend import KvikioSsdTier

        return KvikioSsdTier(directory, block_bytes, budget, codec=codec, io_threads=io_threads)
    return SsdTier(directory, block_bytes, budget, codec=codec, io_threads=io_threads)
