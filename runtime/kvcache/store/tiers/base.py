"""What every tier store shares: the slot allocator, the tier interface, tier errors.

A tier stores fixed-size blocks (one layer's page) in numbered slots. The unified store decides
which block goes in which slot; the tier moves bytes. Slot allocation is lowest-first so that a
shrink can release the top of the pool after compaction.
"""

from __future__ import annotations

import heapq
from typing import Protocol

import torch

from kvdrive.runtime.kvcache.store.budgets import TierName
from kvdrive.runtime.kvcache.store.keys import BlockKey


class TierIOError(OSError):
    """A tier could not store or load a block (ENOSPC, EIO, read-only, ...)."""


class SlotAllocator:
    """Lowest-free-first allocation of slots 0..capacity-1."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[int] = list(range(capacity))
        self._used: set[int] = set()
        self._parked: set[int] = set()  # free slots at or above a ceiling (a shrink in progress): not handed out
        self.ceiling: int | None = None

    @property
    def used(self) -> int:
        return len(self._used)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def take(self, slot: int) -> None:
        """Mark a specific slot used (recovery of a persisted index)."""
        self.take_many([slot])

    def take_many(self, slots: list[int]) -> None:
        """Mark slots used in one pass (O(capacity), not O(capacity) per slot)."""
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]
        heapq.heapify(self._free)
        self._used |= taken

    def release(self, slot: int) -> None:
        self._used.remove(slot)
        if self.ceiling is not None and slot >= self.ceiling:
            self._parked.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def cap(self, ceiling: int) -> None:
        """Hand out no slot at or above ``ceiling`` from now on (a shrink to ``ceiling`` has begun); the used
        ones there stay used until released or moved."""
        self._parked |= {s for s in self._free if s >= ceiling}
        self._free = [s for s in self._free if s < ceiling]
        heapq.heapify(self._free)
        self.ceiling = ceiling

    def uncap(self) -> None:
        """The shrink was abandoned: every free slot can be handed out again."""
        for s in self._parked:
            heapq.heappush(self._free, s)
        self._parked.clear()
        self.ceiling = None

    def used_at_or_above(self, limit: int) -> list[int]:
        return sorted(s for s in self._used if s >= limit)

    def resize(self, capacity: int) -> None:
        """Change capacity; every used slot must be below the new capacity."""
        if any(s >= capacity for s in self._used):
            raise ValueError("resize below a used slot: compact first")
        self._free = [s for s in self._free if s < capacity]
        self._free.extend(s for s in self._parked if s < capacity)
        self._free.extend(range(self.capacity, capacity))
        heapq.heapify(self._free)
        self._parked.clear()
        self.ceiling = None
        self.capacity = capacity


class Tier(Protocol):
    """The interface the unified store drives. Blocks are uint8 [block_bytes] tensors."""

    name: TierName
    block_bytes: int  # logical bytes of one block (one layer's page, K and V)
    slot_bytes: int  # bytes one block occupies in this tier (>= block_bytes or less when compressed)
    allocator: SlotAllocator
    backing: str
    page_reads: int
    errors: int

    def resize(self, slots: int) -> int:
        """Make room for ``slots`` slots (all used slots must be below); returns the slots now usable."""
        ...

    def write(self, slots: list[int], blocks: torch.Tensor, keys: list[BlockKey], persist: list[bool]) -> None:
        """Store blocks [n, block_bytes] in ``slots``. Raises TierIOError on a fault."""
        ...

    def read(self, slots: list[int], out: torch.Tensor) -> list[bool]:
        """Load blocks into out [n, block_bytes]; False where a block is corrupt or unreadable."""
        ...

    def discard(self, slot: int) -> None:
        """The block in ``slot`` is no longer stored here (forget any persisted record)."""
        ...

    @property
    def faults(self) -> dict[str, int]:
        """Faults since start by kind (an errno name, "crc")."""
        ...

    def degraded(self) -> str | None:
        """Why the tier is degraded now (unavailable, a recent fault), or None when it is healthy."""
        ...

    def failing(self) -> bool:
        """Whether the tier cannot be counted on to take new blocks now (unavailable, recent I/O faults)."""
        ...

    def close(self) -> None: ...
