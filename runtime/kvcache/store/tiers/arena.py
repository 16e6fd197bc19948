"""One host mapping for the device and DRAM pools when the compute device is the CPU.

On a CPU-only host both tiers are host memory. ``HostArena`` keeps them as views of one mapping (the
DRAM tier's backing: hugetlbfs or transparent huge pages), device pool first: ``[device slots, zero row,
extra rows | DRAM slots, zero row]``. A page is then read from either tier by the same single gather over
``table`` (device slot s is row s, DRAM slot s is row ``dram_base + s``) instead of a second gather and
a scatter for the DRAM part. Each tier keeps its own slots, budget and accounting; resizing either one
rebuilds the mapping and copies what both hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvdrive.runtime.kvcache.store.tiers.dram import DramTier
    from kvdrive.runtime.kvcache.store.tiers.memory import MemoryPoolTier


class HostArena:
    def __init__(self, gpu: MemoryPoolTier, dram: DramTier, on_rebase: Callable[[int], None] | None = None) -> None:
        self.gpu, self.dram = gpu, dram
        self.on_rebase = on_rebase  # told the DRAM pool's first row after every rebuild
        self.table = torch.empty((0, gpu.slot_bytes), dtype=torch.uint8)
        self._handle: Any = None
        self.dram_base = 0
        gpu.arena = dram.arena = self
        self._rebuild({id(gpu): gpu.allocator.capacity, id(dram): dram.allocator.capacity})

    def resize(self, tier: MemoryPoolTier, slots: int) -> int:
        """Resize one tier (its used slots below ``slots``); returns its usable slots."""
        caps = {id(self.gpu): self.gpu.allocator.capacity, id(self.dram): self.dram.allocator.capacity}
        caps[id(tier)] = slots
        return slots if self._rebuild(caps) else tier.allocator.capacity

    def _rebuild(self, caps: dict[int, int]) -> bool:
        tiers = (self.gpu, self.dram)
        rows = [caps[id(t)] + 1 + t.extra_rows for t in tiers]
        try:
            with torch.inference_mode(False):
                table, handle = self.dram._new_pool(sum(rows))
        except (OSError, RuntimeError, MemoryError) as exc:
            self.dram.errors += 1
            self.dram.log_alloc_failure(sum(rows), exc)
            return False
        off = 0
        views = []
        with torch.inference_mode(False):
            for t, n in zip(tiers, rows, strict=True):
                view = table[off : off + n]
                cap, old = caps[id(t)], t.pool
                keep = min(cap, t.allocator.capacity, max(0, old.shape[0] - 1 - t.extra_rows))
                if keep:
                    view[:keep].copy_(old[:keep])
                view[cap].zero_()
                if t.extra_rows:
                    tail = old[old.shape[0] - t.extra_rows :] if old.shape[0] > t.extra_rows else None
                    if tail is not None:
                        view[cap + 1 :].copy_(tail)
                    else:
                        view[cap + 1 :].zero_()
                views.append(view)
                off += n
        old_handle = self._handle
        self.table, self._handle = table, handle
        self.dram_base = rows[0]
        for t, view in zip(tiers, views, strict=True):
            t.pool = view
            t.allocator.resize(caps[id(t)])
            if t._handle is not None:  # the tier's own pool from before the arena
                t._drop_pool(t._handle)
                t._handle = None
        if old_handle is not None:
            self.dram._drop_pool(old_handle)
        if self.on_rebase is not None:
            self.on_rebase(self.dram_base)
        return True
