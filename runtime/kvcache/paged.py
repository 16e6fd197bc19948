"""A paged KV store in one tier: fixed-size pages in a preallocated pool, per-sequence block tables.

This is the single-tier cache the model runs on; the tiered store (device / DRAM / SSD) keeps the
same page layout so pages move between tiers as whole units.
Pool layout: k, v: [L, P, S, Hkv, D] (layer, page, slot in page, KV head, head dim): one layer's
page is one contiguous [S, Hkv, D] block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    """No free page is left in the pool for a sequence that needs one."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's page, K and V: the unit the tiered store moves (``[2, S, Hkv, D]``)."""
        return self.page_bytes // self.num_layers

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclass(frozen=True)
class SlotMapping:
    """Where the new tokens of one step land: page id and offset per token."""

    pages: torch.Tensor  # [n] int64
    offsets: torch.Tensor  # [n] int64


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu") -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (layout.num_layers, num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @classmethod
    def for_budget(cls, layout: KVLayout, budget_bytes: int, device: torch.device | str = "cpu") -> PagedKVCache:
        return cls(layout, max(1, budget_bytes // layout.page_bytes), device)

    # --- bookkeeping -------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.layout.page_bytes

    def length(self, seq_id: int) -> int:
        return self._lengths[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def num_pages_of(self, seq_id: int) -> int:
        return len(self._tables[seq_id])

    def page_index(self, seq_id: int) -> torch.Tensor:
        """The block table of ``seq_id`` as an index tensor [pages] on the cache's device."""
        return torch.tensor(self._tables[seq_id], dtype=torch.int64, device=self.device)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0

    def can_append(self, seq_id: int, n: int) -> bool:
        need = self.layout.pages_for(self._lengths[seq_id] + n) - len(self._tables[seq_id])
        return need <= len(self._free)

    def reserve(self, seq_id: int, n: int) -> SlotMapping:
        """Grow ``seq_id`` by ``n`` tokens, allocating pages; returns where those tokens go."""
        table, start = self._tables[seq_id], self._lengths[seq_id]
        need = self.layout.pages_for(start + n) - len(table)
        if need > len(self._free):
            raise CacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} more pages, {len(self._free)} free "
                f"of {self.num_pages} ({self.layout.page_size} tokens each)"
            )
        table.extend(self._free.pop() for _ in range(need))
        pos = torch.arange(start, start + n)
        size = self.layout.page_size
        pages = torch.tensor(table, dtype=torch.int64)[pos // size]
        self._lengths[seq_id] = start + n
        return SlotMapping(pages.to(self.device), (pos % size).to(self.device))

    def free(self, seq_id: int) -> None:
        self._free.extend(reversed(self._tables.pop(seq_id)))
        del self._lengths[seq_id]

    # --- data --------------------------------------------------------------------------------
    def write(self, layer: int, slots: SlotMapping, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, D] at ``slots`` of ``layer``."""
        self.k[layer, slots.pages, slots.offsets] = k.to(self.layout.dtype)
        self.v[layer, slots.pages, slots.offsets] = v.to(self.layout.dtype)

    def gather(self, layer: int, seq_id: int, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All K and V of ``seq_id`` in ``layer``: [T, Hkv, D] each, in token order.

        ``index`` is ``page_index(seq_id)`` when the caller gathers many layers of one step.
        """
        n = self._lengths[seq_id]
        idx = self.page_index(seq_id) if index is None else index
        lay = self.layout
        k = self.k[layer, idx].reshape(-1, lay.num_kv_heads, lay.head_dim)[:n]
        v = self.v[layer, idx].reshape(-1, lay.num_kv_heads, lay.head_dim)[:n]
        return k, v
