"""Exact (dense) causal attention over a sequence's gathered K/V, with grouped-query heads."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor,  # [N, Hq, D] new tokens' queries
    k: torch.Tensor,  # [T, Hkv, D] all keys of the sequence (positions 0..T-1)
    v: torch.Tensor,  # [T, Hkv, D]
    q_positions: torch.Tensor,  # [N] absolute positions of the queries
) -> torch.Tensor:  # [N, Hq, D]
    n, t = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, N|T, D]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kh.dtype != qh.dtype:
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    if n == 1:  # decode: the one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif n == t:  # fresh prefill: queries are positions 0..T-1
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = torch.arange(t, device=q.device)[None, :] <= q_positions[:, None]  # [N, T]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
