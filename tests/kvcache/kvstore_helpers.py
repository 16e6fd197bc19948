"""Shared helpers of the KV store tests: a tiny layout, deterministic block contents per key."""

from __future__ import annotations

import os

import torch

from kvdrive.runtime.kvcache import DIGEST_BYTES, BlockKey, KVLayout

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
