"""Exact (dense) causal attention over a sequence's gathered K/V, with grouped-query heads.

A prompt chunk that continues a sequence attends through an explicit mask, which PyTorch's CPU kernel
materialises together with the scores ([Hq, N, T] floats each). The queries are therefore processed in
row tiles sized so that one tile's scores stay under ``SCORE_TILE_BYTES``: prefill working memory is
bounded by a constant instead of growing with chunk size x context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SCORE_TILE_BYTES = 16 << 20  # scores of one query tile: Hq x rows x T x 4 bytes at most


def causal_attention(
    q: torch.Tensor,  # [N, Hq, D] new tokens' queries
    k: torch.Tensor,  # [Hkv, T, D] all keys of the sequence (positions 0..T-1), head-major
    v: torch.Tensor,  # [Hkv, T, D]
    q_positions: torch.Tensor,  # [N] absolute positions of the queries
    tile_bytes: int = SCORE_TILE_BYTES,
) -> torch.Tensor:  # [N, Hq, D]
    n, t = q.shape[0], k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k, v  # [H, N|T, D]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kh.dtype != qh.dtype:
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    if n == 1:  # decode: the one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif n == t:  # fresh prefill: queries are positions 0..T-1 (fused causal kernel, no mask)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = max(1, tile_bytes // (qh.shape[0] * t * 4))
        tiles = []
        for a in range(0, n, rows):
            pos = q_positions[a : a + rows]
            end = min(t, int(pos.max()) + 1)  # keys after the tile's last position are masked anyway
            mask = torch.arange(end, device=q.device)[None, :] <= pos[:, None]  # [rows, end]
            tiles.append(F.scaled_dot_product_attention(qh[:, a : a + rows], kh[:, :end], vh[:, :end],
                                                        attn_mask=mask, scale=scale, enable_gqa=True))
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)
    return out.transpose(0, 1)
