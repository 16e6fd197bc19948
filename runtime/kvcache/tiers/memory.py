"""A chunked block pool in memory: the shared body of the device and DRAM tiers.

Slots live in chunks (tensors [rows, slot_bytes] uint8); slot s is row s % chunk_slots of chunk
s // chunk_slots. Growing adds chunks, shrinking (after the store compacted used slots below the new
capacity) drops and trims trailing chunks, so memory follows the budget within one chunk.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvdrive.runtime.kvcache.budgets import TierName
from kvdrive.runtime.kvcache.keys import BlockKey
from kvdrive.runtime.kvcache.tiers.base import SlotAllocator
from kvdrive.runtime.kvcache.tiers.rows import gather_rows, scatter_rows

log = logging.getLogger(__name__)


class ChunkedMemoryTier:
    """Subclasses provide ``_new_chunk(rows)`` returning (tensor [rows, slot_bytes], handle)."""

    name: TierName

    def __init__(self, block_bytes: int, slots: int, chunk_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slot_bytes = block_bytes
        self.chunk_slots = max(1, chunk_bytes // block_bytes)
        self.allocator = SlotAllocator(0)
        self._chunks: list[tuple[torch.Tensor, Any]] = []  # (rows x slot_bytes tensor, backing handle)
        self.page_reads = 0
        self.errors = 0
        self.resize(slots)

    # --- memory ------------------------------------------------------------------------------
    def _new_chunk(self, rows: int) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _drop_chunk(self, handle: Any) -> None:
        """Release what ``_new_chunk`` acquired beyond the tensor (e.g. a CUDA host registration)."""

    @property
    def allocated_bytes(self) -> int:
        return sum(t.shape[0] for t, _ in self._chunks) * self.slot_bytes

    def resize(self, slots: int) -> int:
        cs = self.chunk_slots
        want = [min(cs, slots - i * cs) for i in range(-(-slots // cs))]  # rows per chunk
        new: list[tuple[torch.Tensor, Any]] = []
        usable = 0
        for i, rows in enumerate(want):
            old = self._chunks[i] if i < len(self._chunks) else None
            if old is not None and old[0].shape[0] == rows:
                new.append(old)
                usable += rows
                continue
            try:
                with torch.inference_mode(False):  # long-lived: writable from any thread and mode
                    chunk = self._new_chunk(rows)
            except (OSError, RuntimeError, MemoryError) as exc:
                self.errors += 1
                log.error("%s tier: could not allocate %d slots (%s); capacity stays at %d slots",
                          self.name, rows, exc, usable)
                if old is not None:  # keep the old chunk (it holds data), cut capacity to it
                    new.append(old)
                    usable += min(rows, old[0].shape[0])
                break
            if old is not None:
                n = min(rows, old[0].shape[0])
                chunk[0][:n].copy_(old[0][:n])
            new.append(chunk)
            usable += rows
        keep = {id(t) for t, _ in new}
        for t, h in self._chunks:
            if id(t) not in keep:
                self._drop_chunk(h)
        self._chunks = new
        self.allocator.resize(usable)
        return usable

    # --- data --------------------------------------------------------------------------------
    def _groups(self, slots: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """chunk index -> (positions in the batch, rows in the chunk)."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for pos, s in enumerate(slots):
            g = groups.setdefault(s // self.chunk_slots, ([], []))
            g[0].append(pos)
            g[1].append(s % self.chunk_slots)
        return groups

    def write(self, slots: list[int], blocks: torch.Tensor, keys: list[BlockKey], persist: list[bool]) -> None:
        """blocks: [n, block_bytes] uint8 on any device."""
        for ci, (pos, rows) in self._groups(slots).items():
            chunk = self._chunks[ci][0]
            src = blocks if len(pos) == blocks.shape[0] else gather_rows(blocks, pos)
            scatter_rows(chunk, rows, src)

    def read(self, slots: list[int], out: torch.Tensor) -> list[bool]:
        """out: [n, block_bytes] uint8 on any device."""
        for ci, (pos, rows) in self._groups(slots).items():
            chunk = self._chunks[ci][0]
            if pos == list(range(pos[0], pos[0] + len(pos))) and out.is_contiguous():  # a run of rows: in place
                gather_rows(chunk, rows, out[pos[0] : pos[0] + len(pos)])
            else:
                scatter_rows(out, pos, gather_rows(chunk, rows))
        self.page_reads += len(slots)
        return [True] * len(slots)

    def view(self, slot: int) -> torch.Tensor:
        """The stored block in place: [slot_bytes] uint8 (valid while the slot stays allocated)."""
        return self._chunks[slot // self.chunk_slots][0][slot % self.chunk_slots]

    def discard(self, slot: int) -> None:
        """Nothing persists in memory tiers."""

    def close(self) -> None:
        for _, h in self._chunks:
            self._drop_chunk(h)
        self._chunks = []
        self.allocator = SlotAllocator(0)
