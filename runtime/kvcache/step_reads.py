"""Reading one layer's pages for a batch into a step buffer, from wherever placement left them.

The buffer is ``[2 (K, V), B, Hkv, W, S*D]``: per sequence W page columns (the selected pages, then the
open tail page when asked for), head-major, so K and V come out as ``[B, Hkv, W*S, D]`` ready for
attention. The device tier is read in place with one ``index_select`` over the pool's (page, head) rows,
where every entry that is not on the device tier points at the pool's zero row. Only the entries that
missed reach further code: on the compute device, the DRAM tier's rows are gathered with tensor ops too
(on a CPU host the DRAM pool is the same memory; on CUDA it is pinned host memory copied up); what no
memory tier holds is read by the Mover (host code: the work grows with these misses, never with the
context length or the pages that hit), and placement decides whether it gets a copy further up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvdrive.runtime.attention import paged_kernels
from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import PrefetchLedger
from kvdrive.runtime.kvcache.promotions import PromotionQueue
from kvdrive.runtime.kvcache.sequence import PageLostError
from kvdrive.runtime.kvcache.store import BlockStore


@dataclass
class ReadCounters:
    """What the steps' page reads counted since start (written by the engine thread only)."""

    hot_reads: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "dram": 0})  # read in place, per tier
    fetch_wait_seconds: float = 0.0  # waiting for the Mover's reads of missed pages
    pages_lost: int = 0  # reads that found a page no tier could serve (the sequence is recomputed)
    prompt_store_reads: int = 0  # blocks prompt chunks read back from the tiers (they had spilled)


@dataclass(frozen=True)
class StepReadParts:
    """What reading a step's pages needs, wired once by ``KVCache``: where pages are (the store's index, arena and
    pools), the Mover (misses), the prefetch ledger (late prefetches), the promotion queue (what reads earn)."""

    store: BlockStore
    mover: Mover
    ledger: PrefetchLedger
    promotions: PromotionQueue
    counters: ReadCounters


class PageReader:
    def __init__(self, parts: StepReadParts, batch: int, pages: int, tail: bool,
                 storage: torch.Tensor | None = None) -> None:
        """``storage``: bytes to hold the buffer (a decode step's share of the envelope's reserve); None:
        allocated here (prompt chunks, full attention)."""
        lay = parts.store.layout
        self.parts, self.store, self.layout, self.counters = parts, parts.store, lay, parts.counters
        self.batch, self.pages, self.width = batch, pages, pages + int(tail)
        self.prompt = not tail  # a prompt chunk re-reading its own earlier pages (counted when they spilled)
        self.miss_seconds = 0.0  # time in the miss path (store reads, placement's admissions)
        hkv = lay.num_kv_heads
        shape = (2, batch, hkv, self.width, lay.row_elems)
        self.buf = storage.view(lay.dtype).view(shape) if storage is not None else \
            torch.empty(shape, dtype=lay.dtype, device=parts.store.device)
        # rows move as 8-byte words: PyTorch's CPU gathers and scatters run ~2x faster on int64 rows than on
        # the same bytes as float32 (measured: 720 rows of 4 KiB, 285 vs 138 us)
        self.word = torch.int64 if (lay.row_elems * lay.itemsize) % 8 == 0 else lay.dtype
        self.rows = self.buf.view(-1, lay.row_elems).view(self.word)
        dev = parts.store.device
        self._kv = torch.arange(2, device=dev).view(2, 1, 1)
        self._h = torch.arange(hkv, device=dev).view(1, 1, hkv)
        self._base = (self._kv * hkv + self._h)[..., None]  # [2, 1, Hkv, 1]: (page, kv, head) row = page * 2 Hkv + base
        self._no_stage = torch.empty((0, *lay.block_shape), dtype=lay.dtype, device=dev)

    def _rows_of(self, pool: torch.Tensor) -> torch.Tensor:
        """The (page, head) rows of a pool [slots, block_bytes]: [slots * 2 * Hkv, S * D] as words."""
        return pool.view(self.layout.dtype).view(-1, self.layout.row_elems).view(self.word)

    def read(self, layer: int, pids: torch.Tensor, valid: torch.Tensor, n_valid: int, tails: torch.Tensor | None,
             seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """pids [B, P] (padding at the index's scratch id), valid [B, P] (n_valid of them True), tails [B]
        (device pool rows of the open pages) -> K, V [B, Hkv, W * S, D]."""
        store, lay = self.store, self.layout
        b, p, hkv = self.batch, self.pages, lay.num_kv_heads
        gpu = store.device_tier
        flat = pids.view(-1)
        arena = store.arena
        if arena is not None:  # CPU host: one mapping holds both pools; ``row`` merges their slots
            rows = store.index.rows()[layer].index_select(0, flat).view(b, p)
            hit = rows >= 0
            src, source = torch.where(hit, rows, gpu.zero_slot), arena.table
        else:
            ds = store.index.slots("gpu")[layer].index_select(0, flat).view(b, p)
            hit = ds >= 0
            src, source = torch.where(hit, ds, gpu.zero_slot), gpu.pool
        if tails is not None:
            src = torch.cat([src, tails[:, None]], dim=1)
        sub = src[None, :, None, :] * (2 * hkv) + self._base  # [2, B, Hkv, W]
        torch.index_select(self._rows_of(source), 0, sub.view(-1), out=self.rows)
        if not n_valid:
            return self._outputs()
        miss = valid & ~hit  # padding points at the scratch page id: never a hit
        n_miss = int(miss.sum())
        if arena is not None:
            n_dev = int(((rows >= 0) & (rows < arena.dram_base)).sum())
            self.counters.hot_reads["gpu"] += n_dev
            self.counters.hot_reads["dram"] += n_valid - n_dev - n_miss
        else:
            self.counters.hot_reads["gpu"] += n_valid - n_miss
        if n_miss:
            t0 = time.perf_counter()
            if arena is not None:
                self._store_into_buffer(layer, pids, miss, seq_ids)
            else:
                self._misses(layer, pids, miss, n_miss, seq_ids)
            self.miss_seconds += time.perf_counter() - t0
        return self._outputs()

    def locate(self, layer: int, pids: torch.Tensor, valid: torch.Tensor, tails: torch.Tensor,
               seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each entry can be read in place, on a CPU host (one arena holds both memory tiers), for the
        paged kernels: pids [B, P], valid [B, P], tails [B] -> (rows [R, S * D] the arena's (slot, kv, head)
        rows, slots [B, P + 1] (each entry's arena slot, -1 - j for block j of the stage; the open page last),
        stage [M, 2, Hkv, S, D] the blocks that missed both memory tiers, read by the Mover)."""
        store, lay = self.store, self.layout
        arena = store.arena
        assert arena is not None, "locate reads in place in the host arena"
        slots, n_dev, n_dram, n_miss = paged_kernels.locate(store.index.rows()[layer], pids, valid, tails,
                                                            arena.dram_base)
        self.counters.hot_reads["gpu"] += n_dev
        self.counters.hot_reads["dram"] += n_dram
        stage = self._no_stage
        if n_miss:
            t0 = time.perf_counter()
            miss = valid & (slots[:, :-1] < 0)
            bi, ki, stage = self._from_store(layer, pids, miss, seq_ids)
            slots[bi, ki] = -1 - torch.arange(bi.numel(), device=slots.device)
            self.miss_seconds += time.perf_counter() - t0
        return arena.table.view(lay.dtype).view(-1, lay.row_elems), slots, stage

    def _outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout
        t = self.width * lay.page_size
        b, hkv = self.batch, lay.num_kv_heads
        return self.buf[0].view(b, hkv, t, lay.head_dim), self.buf[1].view(b, hkv, t, lay.head_dim)

    def _dst(self, bi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        """Rows of ``self.rows`` of entries (bi[i], ki[i]): [2 * m * Hkv] in (kv, entry, head) order."""
        hkv = self.layout.num_kv_heads
        return (((self._kv * self.batch + bi[None, :, None]) * hkv + self._h) * self.width
                + ki[None, :, None]).view(-1)

    def _misses(self, layer: int, pids: torch.Tensor, miss: torch.Tensor, n_miss: int, seq_ids: list[int]) -> None:
        store = self.store
        dram = store.dram_tier
        if dram.allocator.capacity:
            dm = store.index.slots("dram")[layer].index_select(0, pids.view(-1)).view(self.batch, self.pages)
            dhit = miss & (dm >= 0)
            bi, ki = dhit.nonzero(as_tuple=True)
            m = int(bi.numel())
            if m:
                hkv = self.layout.num_kv_heads
                sub = dm[bi, ki][None, :, None] * (2 * hkv) + self._base[:, :, :, 0]  # [2, m, Hkv]
                rows = self._rows_of(dram.pool)
                data = rows.index_select(0, sub.view(-1).to(rows.device)).to(self.buf.device, non_blocking=True)
                self.rows.index_copy_(0, self._dst(bi, ki), data)
                self.counters.hot_reads["dram"] += m
                miss = miss & ~dhit
                n_miss -= m
        if n_miss:
            self._store_into_buffer(layer, pids, miss, seq_ids)

    def _from_store(self, layer: int, pids: torch.Tensor, miss: torch.Tensor,
                    seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Misses of every memory tier: read by the Mover (waiting for a late prefetch first); the
        blocks read are queued for placement, which decides at the end of the step where each gets a copy.
        -> (bi, ki) [m] the entries read, and their blocks [m, 2, Hkv, S, D] in the cache dtype."""
        parts, store, lay, counters = self.parts, self.store, self.layout, self.counters
        bi, ki = miss.nonzero(as_tuple=True)
        ids = pids[bi, ki].tolist()
        keys = [store.key_of(pid, layer) for pid in ids]
        t0 = time.perf_counter()
        for late in parts.ledger.claim(keys):
            try:
                late.wait()
            except Exception:  # a failed prefetch only means the read below goes to a lower tier
                pass
        raw, served = parts.mover.fetch(keys)
        counters.fetch_wait_seconds += time.perf_counter() - t0
        if None in served:
            counters.pages_lost += 1
            seq = seq_ids[int(bi[served.index(None)])]
            raise PageLostError(seq, f"{served.count(None)} KV pages of sequence {seq} could not be read")
        if self.prompt:
            counters.prompt_store_reads += len(keys)
        parts.promotions.add(keys, ids, served, raw)  # placement decides at the end of the step
        return bi, ki, lay.typed(raw)

    def _store_into_buffer(self, layer: int, pids: torch.Tensor, miss: torch.Tensor, seq_ids: list[int]) -> None:
        lay = self.layout
        bi, ki, blocks = self._from_store(layer, pids, miss, seq_ids)
        data = blocks.permute(1, 0, 2, 3, 4).reshape(2 * bi.numel() * lay.num_kv_heads, lay.row_elems)
        self.rows.index_copy_(0, self._dst(bi, ki), data.to(self.buf.device).view(self.word))
