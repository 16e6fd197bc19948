"""The single-tier paged KV store: block tables, page reuse, a full pool, exact data placement."""

from __future__ import annotations

import pytest
import torch

from kvdrive.runtime.kvcache import CacheFullError, KVLayout, PagedKVCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float32)


def test_page_bytes_and_budget() -> None:
    assert LAYOUT.page_bytes == 2 * 2 * 4 * 2 * 4 * 4
    cache = PagedKVCache.for_budget(LAYOUT, 10 * LAYOUT.page_bytes + 5)
    assert cache.num_pages == 10 and cache.capacity_bytes == 10 * LAYOUT.page_bytes
    assert cache.used_bytes == 0


def test_sequences_grow_by_pages_and_free_them() -> None:
    cache = PagedKVCache(LAYOUT, num_pages=4)
    cache.add_sequence(1)
    cache.reserve(1, 5)  # 5 tokens -> 2 pages
    assert len(cache.block_table(1)) == 2 and cache.free_pages == 2
    cache.reserve(1, 3)  # 8 tokens still fit in 2 pages
    assert len(cache.block_table(1)) == 2 and cache.length(1) == 8
    cache.add_sequence(2)
    cache.reserve(2, 1)
    assert cache.used_bytes == 3 * LAYOUT.page_bytes
    cache.free(1)
    assert cache.free_pages == 3


def test_full_pool_raises_and_keeps_state() -> None:
    cache = PagedKVCache(LAYOUT, num_pages=2)
    cache.add_sequence(1)
    cache.reserve(1, 8)
    assert not cache.can_append(1, 1)
    with pytest.raises(CacheFullError, match="needs 1 more pages, 0 free"):
        cache.reserve(1, 1)
    assert cache.length(1) == 8  # the failed reservation changed nothing


def test_write_then_gather_returns_tokens_in_order() -> None:
    cache = PagedKVCache(LAYOUT, num_pages=6)
    cache.add_sequence(7)
    cache.add_sequence(8)
    k = torch.randn(10, 2, 4)
    v = torch.randn(10, 2, 4)
    # interleave two sequences so their pages are not contiguous
    s1 = cache.reserve(7, 3)
    cache.write(1, s1, k[:3], v[:3])
    other = cache.reserve(8, 4)
    cache.write(1, other, torch.zeros(4, 2, 4), torch.zeros(4, 2, 4))
    s2 = cache.reserve(7, 7)
    cache.write(1, s2, k[3:], v[3:])
    gk, gv = cache.gather(1, 7)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert torch.count_nonzero(cache.gather(0, 7)[0]) == 0  # layer 0 untouched
