"""The byte layout of a KV block, the unit every tier stores and moves.

A block is one layer's page: K and V of ``page_size`` tokens for all KV heads, head-major:
``[2 (K, V), Hkv, S, D]`` in the cache dtype. Head-major rows make one (page, head) a contiguous
``[S, D]`` run, so the decode gather copies whole runs into an attention-ready ``[B, Hkv, T, D]``
buffer. ``LAYOUT_VERSION`` is part of every page fingerprint: pages persisted under another layout
are never read back as this one (they simply stop matching and age out of the SSD tier).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUT_VERSION = 2  # 1: token-major [2, S, Hkv, D]; 2: head-major [2, Hkv, S, D]


class CacheFullError(RuntimeError):
    """No tier has room for a block that must be stored (every slot is needed or pinned)."""


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
        """Bytes of one layer's page, K and V: the unit the tiered store moves (``[2, Hkv, S, D]``)."""
        return self.page_bytes // self.num_layers

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def row_elems(self) -> int:
        """Elements of one (page, head) run of K or V: ``S * D``."""
        return self.page_size * self.head_dim

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def typed(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n, block_bytes] uint8 (contiguous) -> the same memory as [n, 2, Hkv, S, D] in the cache dtype."""
        return blocks.view(self.dtype).view(blocks.shape[0], *self.block_shape)

    def fingerprint(self) -> str:
        """What the layout adds to a model's page fingerprint."""
        return f"kv={self.dtype}|page={self.page_size}|layout={LAYOUT_VERSION}"
