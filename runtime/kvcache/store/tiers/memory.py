"""A block pool in memory: the shared body of the device and DRAM tiers.

The pool is one tensor ``[capacity + 1 + extra_rows, slot_bytes]`` uint8: slot s is row s, row
``capacity`` is kept all zeros (``zero_slot``, a harmless target for the masked entries of a batched
gather), and ``extra_rows`` rows after it belong to the pool's user (the engine keeps its sequences'
open pages there, so that one gather reads them with the sealed pages). One tensor per
tier is what lets the decode loop gather every page it needs with a single ``index_select``. A budget
change allocates a new pool and copies the rows still in use (the store has compacted them below the new
capacity first), so memory follows the budget.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey
from kvdrive.runtime.kvcache.store.tiers.base import SlotAllocator
from kvdrive.runtime.kvcache.store.tiers.rows import copy_rows, gather_rows, scatter_rows

if TYPE_CHECKING:
    from kvdrive.runtime.kvcache.store.tiers.arena import HostArena

log = logging.getLogger(__name__)


class MemoryPoolTier:
    """Subclasses provide ``_new_pool(rows)`` returning (tensor [rows, slot_bytes] uint8, backing handle)."""

    name: TierName

    def __init__(self, block_bytes: int, slots: int, extra_rows: int = 0) -> None:
        self.extra_rows = extra_rows
        self.arena: HostArena | None = None  # set when this pool is a view of a shared host mapping
        self.block_bytes = block_bytes
        self.slot_bytes = block_bytes
        self.allocator = SlotAllocator(0)
        self.pool = torch.empty((0, block_bytes), dtype=torch.uint8)
        self._handle: Any = None
        self.page_reads = 0
        self.errors = 0
        self.resize(slots)

    @property
    def faults(self) -> dict[str, int]:
        """Memory tiers do no I/O that can fail after they are sized: none."""
        return {}

    def degraded(self) -> str | None:
        return None

    def failing(self) -> bool:
        return False

    # --- memory ------------------------------------------------------------------------------
    def _new_pool(self, rows: int) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _drop_pool(self, handle: Any) -> None:
        """Release what ``_new_pool`` acquired beyond the tensor (e.g. a CUDA host registration)."""

    @property
    def zero_slot(self) -> int:
        """A row that is always zeros (never allocated)."""
        return self.allocator.capacity

    @property
    def extra_base(self) -> int:
        """The first of the ``extra_rows`` rows."""
        return self.allocator.capacity + 1

    @property
    def allocated_bytes(self) -> int:
        """Bytes of block slots allocated (the zero row excluded)."""
        return self.allocator.capacity * self.slot_bytes

    def log_alloc_failure(self, slots: int, exc: BaseException) -> None:
        log.error("%s tier: could not allocate %d slots (%s); capacity stays at %d slots",
                  self.name, slots, exc, self.allocator.capacity)

    def resize(self, slots: int) -> int:
        """Make the pool ``slots`` slots; every used slot must be below. Returns the slots now usable."""
        if self.arena is not None:
            return self.arena.resize(self, slots)
        extra = self.extra_rows
        if slots == self.allocator.capacity and self.pool.shape[0] == slots + 1 + extra:
            return slots
        try:
            with torch.inference_mode(False):  # long-lived: writable from any thread and mode
                pool, handle = self._new_pool(slots + 1 + extra)
                keep = min(slots, self.allocator.capacity, max(0, self.pool.shape[0] - 1 - extra))
                if keep:
                    pool[:keep].copy_(self.pool[:keep])
                pool[slots].zero_()
                if extra:
                    old = self.pool[self.pool.shape[0] - extra :] if self.pool.shape[0] >= extra else None
                    if old is not None and old.shape[0] == extra:
                        pool[slots + 1 :].copy_(old)
                    else:
                        pool[slots + 1 :].zero_()
        except (OSError, RuntimeError, MemoryError) as exc:
            self.errors += 1
            if slots < self.allocator.capacity and not extra:  # a shrink keeps the old memory, cut down
                log.error("%s tier: could not reallocate %d slots (%s); keeping the old pool", self.name, slots, exc)
                self.pool = self.pool[: slots + 1]
                self.pool[slots].zero_()
                self.allocator.resize(slots)
                return slots
            self.log_alloc_failure(slots, exc)
            return self.allocator.capacity
        old = self._handle
        self.pool, self._handle = pool, handle
        if old is not None:
            self._drop_pool(old)
        self.allocator.resize(slots)
        return slots

    # --- data --------------------------------------------------------------------------------
    def write(self, slots: list[int], blocks: torch.Tensor, keys: list[BlockKey], persist: list[bool]) -> None:
        """blocks: [n, block_bytes] uint8 on any device."""
        scatter_rows(self.pool, slots, blocks)

    def read(self, slots: list[int], out: torch.Tensor) -> list[bool]:
        """out: [n, block_bytes] uint8 on any device."""
        if out.device == self.pool.device and out.is_contiguous():
            gather_rows(self.pool, slots, out)
        else:
            copy_rows(out, gather_rows(self.pool, slots))
        self.page_reads += len(slots)
        return [True] * len(slots)

    def discard(self, slot: int) -> None:
        """Nothing persists in memory tiers."""

    def close(self) -> None:
        self.arena = None
        if self._handle is not None:
            self._drop_pool(self._handle)
        self._handle = None
        self.pool = torch.empty((0, self.block_bytes), dtype=torch.uint8)
        self.allocator = SlotAllocator(0)
