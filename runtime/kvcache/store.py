"""The three tiers (gpu, dram, ssd) behind one interface: where each block is, budgets, guarantees.

Owns the bookkeeping: which tiers hold a copy of each block (one layer's page, [2, S, Hkv, D]), byte
budgets changed live, eviction order, pins, and the visibility rule. Guarantees:
- a copy being written is invisible until its write completed (``ready``); readers skip it;
- a block being read, moved or written is pinned: eviction and compaction never touch it;
- a block marked ``needed`` (a running sequence's page) is demoted, never dropped; a budget change
  that cannot keep every needed block raises BudgetError and changes nothing;
- a tier never holds more slots than its budget allows; a corrupt SSD copy is dropped and reported
  as a miss, never served.
Promotion is inclusive (the lower copy stays as a clean backup); demotion moves. The bytes move
through the tiers' read/write; the async scheduling of moves belongs to ``kvdrive.runtime.pipeline``
(placement decides, pipeline moves, tiers store). Eviction I/O runs under the store lock (simple and
safe; reads of other blocks run outside it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from kvdrive.runtime.kvcache.budgets import TIER_ORDER, BudgetError, TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.compression import Int8Codec
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.paged import CacheFullError, KVLayout
from kvdrive.runtime.kvcache.tiers.base import Tier, TierIOError
from kvdrive.runtime.kvcache.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.tiers.dram import DramTier
from kvdrive.runtime.kvcache.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

VictimOrder = Callable[[TierName, list[BlockKey]], list[BlockKey]]


@dataclass(frozen=True)
class Copy:
    slot: int
    ready: bool


@dataclass
class _Block:
    key: BlockKey
    copies: dict[TierName, Copy] = field(default_factory=dict)
    pins: int = 0
    needed: bool = True
    persistent: bool = False
    last_use: int = 0


class TieredKVStore:
    def __init__(self, layout: KVLayout, budgets: TierBudgets, ssd_dir: str | None = None,
                 device: torch.device | str | None = None, hugetlbfs_dir: str | None = None,
                 ssd_codec: str = "none", victim_order: VictimOrder | None = None,
                 ssd_tier: SsdTier | None = None, io_threads: int = 4) -> None:
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.block_shape = (2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.budgets = budgets
        self.victim_order = victim_order
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
        self._lock = threading.RLock()
        self._blocks: dict[BlockKey, _Block] = {}
        self._owner: dict[tuple[TierName, int], BlockKey] = {}
        self._clock = 0
        self.transfer_bytes: dict[tuple[str, str], int] = {}
        self.lookups = self.misses = self.dropped = 0
        self.page_reads: dict[TierName, int] = {t: 0 for t in self.tiers}  # needed pages found per tier
        for slot, key in ssd_tier.recovered() if ssd_tier is not None else []:
            self._blocks[key] = _Block(key, {"ssd": Copy(slot, True)}, needed=False, persistent=True)
            self._owner[("ssd", slot)] = key

    # --- queries -----------------------------------------------------------------------------
    def where(self, key: BlockKey) -> TierName | None:
        """The fastest tier with a readable copy of ``key``."""
        with self._lock:
            b = self._blocks.get(key)
            return self._fastest(b) if b else None

    def tiers_of(self, key: BlockKey) -> list[TierName]:
        with self._lock:
            b = self._blocks.get(key)
            return [t for t in TIER_ORDER if b and t in b.copies and b.copies[t].ready]

    def usage(self) -> list[TierUsage]:
        with self._lock:
            out = []
            for name, t in self.tiers.items():
                pages = t.allocator.used
                pinned = sum(1 for b in self._blocks.values() if b.pins and name in b.copies)
                out.append(TierUsage(name, self.budgets.of(name), t.allocator.capacity * t.slot_bytes,
                                     pages * t.slot_bytes, pages, pinned, t.backing, self.page_reads[name],
                                     t.errors))
            return out

    def _fastest(self, b: _Block) -> TierName | None:
        return next((t for t in TIER_ORDER if t in b.copies and b.copies[t].ready), None)

    def _touch(self, b: _Block) -> None:
        self._clock += 1
        b.last_use = self._clock

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

    # --- slots and eviction (lock held) ------------------------------------------------------
    def _alloc(self, tier: TierName, key: BlockKey) -> int | None:
        t = self.tiers[tier]
        while True:
            slot = t.allocator.alloc()
            if slot is not None:
                self._owner[(tier, slot)] = key
                return slot
            if not self._evict_one(tier):
                return None

    def _drop(self, b: _Block, tier: TierName) -> None:
        c = b.copies.pop(tier)
        t = self.tiers[tier]
        t.discard(c.slot)
        t.allocator.release(c.slot)
        del self._owner[(tier, c.slot)]
        if not b.copies:
            del self._blocks[b.key]

    def _candidates(self, tier: TierName) -> list[_Block]:
        cands = [b for b in self._blocks.values() if b.pins == 0 and tier in b.copies and b.copies[tier].ready]
        if self.victim_order is None:
            return sorted(cands, key=lambda b: b.last_use)
        order = self.victim_order(tier, [b.key for b in cands])
        return [self._blocks[k] for k in order if k in self._blocks]

    def _evict_one(self, tier: TierName) -> bool:
        """Free one slot of ``tier``: drop a clean copy, demote, or drop a block nobody needs."""
        lower = [t for t in TIER_ORDER[TIER_ORDER.index(tier) + 1 :] if t in self.tiers]
        for b in self._candidates(tier):
            if any(t in b.copies and b.copies[t].ready for t in lower):
                self._drop(b, tier)
                return True
            b.pins += 1
            try:
                moved = any(self._copy(b, tier, dst) for dst in lower)
            finally:
                b.pins -= 1
            if moved or not b.needed:
                if not moved:
                    self.dropped += 1
                    log.debug("dropped %s from %s (recomputable)", b.key, tier)
                self._drop(b, tier)
                return True
        return False

    def _copy(self, b: _Block, src: TierName, dst: TierName) -> bool:
        """Copy b's ready copy in src to a new slot of dst (b pinned by the caller, lock held)."""
        slot = self._alloc(dst, b.key)
        if slot is None:
            return False
        buf = torch.empty((1, self.block_bytes), dtype=torch.uint8, device=self.device)
        ok = self.tiers[src].read([b.copies[src].slot], buf)[0]
        if ok:
            try:
                self.tiers[dst].write([slot], buf, [b.key], [b.persistent])
            except TierIOError:
                ok = False
        if not ok:
            self.tiers[dst].allocator.release(slot)
            del self._owner[(dst, slot)]
            return False
        b.copies[dst] = Copy(slot, True)
        k = (src, dst)
        self.transfer_bytes[k] = self.transfer_bytes.get(k, 0) + self.block_bytes
        return True

    # --- data --------------------------------------------------------------------------------
    def to_block(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [S, Hkv, D] -> [block_bytes] uint8 on k's device."""
        return torch.stack([k.to(self.layout.dtype), v.to(self.layout.dtype)]).contiguous().view(torch.uint8).view(-1)

    def put(self, keys: list[BlockKey], blocks: torch.Tensor, tier: TierName = "gpu", needed: bool = True,
            persistent: bool = False) -> None:
        """Store blocks [n, block_bytes] uint8 in ``tier``, evicting as needed. Copies become readable when
        their write completed. A persistent (content-addressed) key already stored is only touched."""
        cap = self.tiers[tier].allocator.capacity
        if len(keys) > cap > 0:  # a batch bigger than the tier: in parts, so later parts can evict earlier
            for i in range(0, len(keys), cap):
                self.put(keys[i : i + cap], blocks[i : i + cap], tier, needed, persistent)
            return
        todo: list[tuple[int, BlockKey, int]] = []
        with self._lock:
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
                b = self._blocks[key] = _Block(key, needed=needed, persistent=persistent, pins=1)
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
        idx = torch.tensor([i for i, _, _ in todo], device=blocks.device)
        try:
            self.tiers[tier].write([s for _, _, s in todo], blocks.index_select(0, idx),
                                   [k for _, k, _ in todo], [persistent] * len(todo))
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

    def get(self, keys: list[BlockKey], device: torch.device | None = None) -> tuple[torch.Tensor, list[bool]]:
        """Blocks [n, block_bytes] uint8 on ``device`` (the compute device by default) and a hit flag per
        key. Each block is read from its fastest ready copy while pinned; a corrupt copy is dropped and
        the next copy tried; a block with none left is a miss (recompute it)."""
        device = device or self.device
        out = torch.zeros((len(keys), self.block_bytes), dtype=torch.uint8, device=device)
        hit = [False] * len(keys)
        pending = list(range(len(keys)))
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
            retry: list[int] = []
            for t, items in plan.items():
                tmp = torch.empty((len(items), self.block_bytes), dtype=torch.uint8, device=device)
                ok = self.tiers[t].read([s for _, s in items], tmp)
                good = [p for p, o in enumerate(ok) if o]
                if good:
                    out.index_copy_(0, torch.tensor([items[p][0] for p in good], device=device),
                                    tmp.index_select(0, torch.tensor(good, device=device)))
                with self._lock:
                    for (i, slot), o in zip(items, ok, strict=True):
                        b = self._blocks[keys[i]]
                        b.pins -= 1
                        hit[i] = o
                        self.page_reads[t] += o
                        if not o and b.copies.get(t, Copy(-1, False)).slot == slot:
                            log.warning("%s copy of %s unreadable; dropped", t, keys[i])
                            self._drop(b, t)
                            retry.append(i)
            pending = retry
        with self._lock:
            self.lookups += len(keys)
            self.misses += hit.count(False)
        return out, hit

    def get_kv(self, keys: list[BlockKey]) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """K and V [n, S, Hkv, D] of ``keys`` on the compute device (zeros where missed)."""
        raw, hit = self.get(keys)
        kv = raw.view(self.layout.dtype).view(len(keys), *self.block_shape)
        return kv[:, 0], kv[:, 1], hit

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

    # --- live budgets ------------------------------------------------------------------------
    def _slots_for(self, tier: TierName, budget: int) -> int:
        t = self.tiers[tier]
        return t.slots_for_budget(budget) if isinstance(t, SsdTier) else budget // t.slot_bytes

    def set_budgets(self, gpu_bytes: int | None = None, dram_bytes: int | None = None,
                    ssd_bytes: int | None = None) -> TierBudgets:
        """Apply new budgets live. Shrinking demotes (or drops blocks nobody needs) and compacts;
        raises BudgetError, changing nothing, when the needed or pinned blocks cannot fit."""
        new = self.budgets.replace(gpu_bytes=gpu_bytes, dram_bytes=dram_bytes, ssd_bytes=ssd_bytes)
        with self._lock:
            slots = {t: self._slots_for(t, new.of(t)) for t in self.tiers}
            needed = sum(1 for b in self._blocks.values() if b.needed)
            if needed > sum(slots.values()):
                raise BudgetError(f"{needed} pages needed by running sequences do not fit in "
                                  f"{sum(slots.values())} pages of the new budgets")
            for t, n in slots.items():
                pinned = sum(1 for b in self._blocks.values() if b.pins and t in b.copies)
                if pinned > n:
                    raise BudgetError(f"{t} tier: {pinned} pages are pinned (being read) but the new "
                                      f"budget holds {n}; retry when the reads complete")
            for t, n in slots.items():  # grow first so that demotions have room
                if n > self.tiers[t].allocator.capacity:
                    got = self.tiers[t].resize(n)
                    if got < n:
                        log.error("%s tier grew to %d of %d pages only (see the tier's errors)", t, got, n)
            for t in TIER_ORDER:
                if t in slots and slots[t] < self.tiers[t].allocator.capacity:
                    self._shrink(t, slots[t])
            self.budgets = new
            log.info("tier budgets now gpu=%d dram=%d ssd=%d bytes", new.gpu_bytes, new.dram_bytes, new.ssd_bytes)
            return new

    def _shrink(self, tier: TierName, n: int) -> None:
        t = self.tiers[tier]
        while t.allocator.used > n:
            if not self._evict_one(tier):
                raise BudgetError(f"{tier} tier: cannot evict below {t.allocator.used} pages (all needed or pinned)")
        for slot in t.allocator.used_at_or_above(n):  # compact: move survivors below n
            key = self._owner[(tier, slot)]
            b = self._blocks[key]
            new_slot = t.allocator.alloc()
            assert new_slot is not None and new_slot < n
            buf = torch.empty((1, self.block_bytes), dtype=torch.uint8, device=self.device)
            ok = t.read([slot], buf)[0]
            if ok:
                try:
                    t.write([new_slot], buf, [key], [b.persistent])
                except TierIOError:
                    ok = False
            if ok:
                t.allocator.release(slot)
                t.discard(slot)
                del self._owner[(tier, slot)]
                self._owner[(tier, new_slot)] = key
                b.copies[tier] = replace(b.copies[tier], slot=new_slot)
            else:
                t.allocator.release(new_slot)
                log.warning("%s tier: %s unreadable while compacting; dropped", tier, key)
                self._drop(b, tier)
        got = t.resize(n)
        log.info("%s tier shrunk to %d pages", tier, got)

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
