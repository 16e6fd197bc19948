"""The store: the tiers (gpu, dram, ssd) and what they hold, its bookkeeping in parts over one block table.

``build_tiers`` builds the tiers; ``BlockStore`` keeps their bookkeeping, composed of parts that share one
``BlockTable`` (block -> copies per tier, pins, slot owners): ``ReadBook`` (reads), ``WriteBook`` (puts,
admissions, promotions), ``ResizeBook`` (live budgets); it answers queries itself (where a block is, usage,
health) and keeps flags and page references. It never moves a byte: ``kvcache.mover.Mover`` runs every put,
read, promotion, demotion and resize as prepare (a part, under the lock) -> run (the Mover, no lock held) ->
complete (a part, under the lock), as ``kvcache.contract`` states. Placement decides which tier
(``kvcache.placement``; its ``Eviction`` is passed in).

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
from dataclasses import dataclass
from typing import Any

import torch

from kvdrive.runtime.kvcache.contract import Copy, Eviction
from kvdrive.runtime.kvcache.store.block_index import BlockIndex
from kvdrive.runtime.kvcache.store.budgets import TierBudgets, TierName, TierUsage
from kvdrive.runtime.kvcache.store.compression import Int8Codec
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.layout import KVLayout
from kvdrive.runtime.kvcache.store.page_events import PageEvents
from kvdrive.runtime.kvcache.store.reads import ReadBook
from kvdrive.runtime.kvcache.store.resize import ResizeBook
from kvdrive.runtime.kvcache.store.table import BlockTable
from kvdrive.runtime.kvcache.store.tiers.arena import HostArena
from kvdrive.runtime.kvcache.store.tiers.base import Tier
from kvdrive.runtime.kvcache.store.tiers.device import DeviceTier
from kvdrive.runtime.kvcache.store.tiers.dram import DramTier
from kvdrive.runtime.kvcache.store.tiers.ssd import SsdTier
from kvdrive.runtime.kvcache.store.writes import WriteBook

log = logging.getLogger(__name__)

__all__ = ["BlockStore", "StoreCounters", "build_tiers", "device_tier"]


def build_tiers(layout: KVLayout, budgets: TierBudgets, ssd_dir: str | None = None,
                device: torch.device | str | None = None, hugetlbfs_dir: str | None = None, ssd_codec: str = "none",
                ssd_tier: Tier | None = None, io_threads: int = 4, device_extra_rows: int = 0,
                ssd_backend: str = "posix") -> dict[TierName, Tier]:
    """The tiers under ``budgets``: the device pool (with ``device_extra_rows`` rows outside its slots), DRAM
    (hugetlbfs when ``hugetlbfs_dir``), and the SSD tier when ``ssd_dir`` (or a ready ``ssd_tier``) is given.
    ValueError, with the reason, for an SSD backend that cannot run here."""
    bb = layout.block_bytes
    tiers: dict[TierName, Tier] = {
        "gpu": DeviceTier(bb, budgets.hot_bytes // bb, device, extra_rows=device_extra_rows),
        "dram": DramTier(bb, DramTier.slots_for_budget(budgets.dram_bytes, bb, bool(hugetlbfs_dir)), hugetlbfs_dir),
    }
    if ssd_tier is None and ssd_dir is not None:
        codec = Int8Codec(layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype) \
            if ssd_codec == "int8" else None
        ssd_tier = _make_ssd(ssd_dir, bb, budgets.ssd_bytes, codec, io_threads, ssd_backend)
    if ssd_tier is not None:
        tiers["ssd"] = ssd_tier
    return tiers


@dataclass(frozen=True)
class StoreCounters:
    """The store's cumulative counters, read in one consistent instant."""

    page_reads: dict[TierName, int]  # needed pages found per tier (by the Mover's reads)
    misses: int  # needed pages no tier could serve (recomputed)
    transfer_bytes: dict[tuple[str, str], int]  # (src, dst) -> bytes moved
    dropped: int  # blocks dropped with no copy left (nobody needed them: recomputed if asked again)
    scrubbed: int  # corrupt copies dropped by scrubs


def device_tier(tiers: dict[TierName, Tier]) -> DeviceTier:
    """The device tier of ``tiers`` (``build_tiers`` always makes one), typed."""
    gpu = tiers["gpu"]
    assert isinstance(gpu, DeviceTier)
    return gpu


class BlockStore:
    def __init__(self, layout: KVLayout, budgets: TierBudgets, tiers: dict[TierName, Tier], eviction: Eviction,
                 index: BlockIndex | None = None) -> None:
        """The store over ``tiers`` (``build_tiers``), applying placement's ``eviction``; ``index``: the page ids
        placement shares (built here when None)."""
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.tiers = tiers
        self.device_tier = gpu = device_tier(tiers)  # its pool is read in place by the decode loop
        self.device = gpu.device
        self.index = index if index is not None else BlockIndex(layout.num_layers, self.device)
        self.table = BlockTable(tiers, self.index, eviction, layout.block_bytes)  # shared by the parts below
        self.reads = ReadBook(self.table)
        self.writes = WriteBook(self.table)
        self.resize = ResizeBook(self.table, budgets)
        self.dram_tier = dram = tiers["dram"]
        assert isinstance(dram, DramTier)
        # on a CPU host both memory tiers are host memory: one mapping, so one gather reads either;
        # not on hugetlbfs, whose pages are reserved for the DRAM budget alone (a pod's hugepages)
        self.arena = HostArena(gpu, dram, self._rebased) \
            if self.device.type == "cpu" and dram.hugetlbfs_dir is None else None
        ssd = tiers.get("ssd")
        for slot, key in ssd.recovered() if isinstance(ssd, SsdTier) else []:
            b = self.table.new_block(key, needed=False, persistent=True)
            self.table.set_copy(b, "ssd", Copy(slot, True))
            self.table.owner[("ssd", slot)] = key

    @classmethod
    def build(cls, layout: KVLayout, budgets: TierBudgets, eviction: Eviction, **tier_options: Any) -> BlockStore:
        """A store over new tiers (``build_tiers(layout, budgets, **tier_options)``)."""
        return cls(layout, budgets, build_tiers(layout, budgets, **tier_options), eviction)

    @property
    def budgets(self) -> TierBudgets:
        return self.resize.budgets

    def bind_owner(self) -> None:
        """The calling thread runs the decode loop: only it may drop published memory-tier copies."""
        self.table.bind_owner()

    def _rebased(self, base: int) -> None:
        with self.table.lock:
            self.index.set_dram_base(base)

    # --- queries -----------------------------------------------------------------------------
    def where(self, key: BlockKey) -> TierName | None:
        """The fastest tier with a readable copy of ``key``."""
        with self.table.lock:
            b = self.table.blocks.get(key)
            return self.table.fastest(b) if b else None

    def where_many(self, keys: list[BlockKey]) -> list[TierName | None]:
        with self.table.lock:
            out: list[TierName | None] = []
            for k in keys:
                b = self.table.blocks.get(k)
                out.append(self.table.fastest(b) if b else None)
            return out

    def usage(self) -> list[TierUsage]:
        """Each tier's budget, capacity and what it holds, from counters kept as blocks change (no walk over
        the blocks: a scrape costs the same with a million blocks as with ten)."""
        with self.table.lock:
            out = []
            for name, t in self.tiers.items():
                pages = t.allocator.used
                cached = self.table.copies_in.get(name, 0) - self.table.needed_in.get(name, 0)
                out.append(TierUsage(name, self.budgets.of(name), t.allocator.capacity * t.slot_bytes,
                                     pages * t.slot_bytes, pages, t.backing, self.reads.page_reads[name], t.errors,
                                     cached * t.slot_bytes))
            return out

    def counters(self) -> StoreCounters:
        with self.table.lock:
            return StoreCounters(dict(self.reads.page_reads), self.reads.misses, dict(self.table.transfer_bytes),
                                 self.table.dropped, self.reads.scrubbed)

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
        with self.table.lock:
            for k in keys:
                if k in self.table.blocks:
                    self.table.mark_needed(self.table.blocks[k], needed)

    def page_digests(self) -> list[bytes]:
        """Digests of the pages whose first layer's block is held in some tier (what a router indexes)."""
        with self.table.lock:
            return [k.digest for k in self.table.blocks if k.layer == 0]

    def watch_pages(self, events: PageEvents) -> None:
        """From now on tell ``events`` whenever a page gains or loses a tier, starting with what is held now."""
        with self.table.lock:
            events.seed((k.digest, t) for k, b in self.table.blocks.items() if k.layer == 0
                        for t, c in b.copies.items() if c.ready)
            self.table.page_events = events

    def ref_page(self, digest: bytes) -> int:
        """The dense id of page ``digest``, held for a sequence until ``unref_page`` (ids of pages a
        sequence references are never reused, even if every copy of the page is lost)."""
        with self.table.lock:
            return self.index.acquire(digest)

    def unref_page(self, pid: int) -> None:
        with self.table.lock:
            self.index.release(pid)

    def drain_freed(self) -> list[int]:
        """Page ids freed since the last call (placement resets their scores)."""
        with self.table.lock:
            return self.index.drain_freed()

    def key_of(self, pid: int, layer: int) -> BlockKey:
        digest = self.index.digests[pid]
        assert digest is not None, f"page id {pid} is not in use"
        return BlockKey(digest, layer)

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
    from kvdrive.runtime.kvcache.store.tiers.kvikio_backend import KvikioSsdTier, kvikio_unusable_reason

    reason = kvikio_unusable_reason()
    if reason:
        raise ValueError(f"--ssd-backend kvikio: {reason}")
    return KvikioSsdTier(directory, block_bytes, budget, codec=codec, io_threads=io_threads)
