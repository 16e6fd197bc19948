"""Shared helpers of the KV store tests: a tiny layout, deterministic block contents per key."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.store import DIGEST_BYTES, BlockKey, BlockStore, KVLayout, TierName

# 2 layers, page of 16 tokens, 3 KV heads of 64 dims, fp16: one block (layer page) = 12 KiB
LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.float16)
BB = LAYOUT.block_bytes


def content(key: BlockKey, nbytes: int = BB) -> torch.Tensor:
    """The bytes a block with ``key`` holds in these tests: [nbytes] uint8, a function of the key."""
    g = torch.Generator().manual_seed(int.from_bytes(key.digest[:8], "little") ^ key.layer)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def make_keys(n: int, layer: int = 0) -> list[BlockKey]:
    return [BlockKey(os.urandom(DIGEST_BYTES), layer) for _ in range(n)]


def blocks_for(keys: list[BlockKey], nbytes: int = BB) -> torch.Tensor:
    return torch.stack([content(k, nbytes) for k in keys])  # [n, nbytes]


def read(mover: Mover, keys: list[BlockKey]) -> tuple[torch.Tensor, list[bool]]:
    """Blocks of ``keys`` (rows in key order) and whether each was found in some tier."""
    out, served = mover.fetch(keys)
    return out, [t is not None for t in served]


def tiers_of(store: BlockStore, key: BlockKey) -> list[TierName]:
    """The tiers holding a readable copy of ``key``, fastest first."""
    b = store.table.blocks.get(key)
    return [t for t in ("gpu", "dram", "ssd") if b is not None and t in b.copies and b.copies[t].ready]


@contextmanager
def pinned(store: BlockStore, keys: list[BlockKey]) -> Iterator[None]:
    """Hold ``keys`` pinned, as an in-flight read does."""
    with store.table.lock:
        for k in keys:
            store.table.pin(store.table.blocks[k])
    try:
        yield
    finally:
        with store.table.lock:
            for k in keys:
                store.table.unpin(store.table.blocks[k])
