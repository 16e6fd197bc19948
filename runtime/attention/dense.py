"""Exact (dense) causal attention over a sequence's gathered K/V, with grouped-query heads.

A prompt chunk that continues a sequence (its N queries are the last N of the T positions) has a
bottom-right aligned causal mask. On CUDA that mask is passed as ``causal_lower_right``, which the fused
flash / memory-efficient kernels take without materialising it. Given as an explicit boolean mask, SDPA
falls back to its math kernel, which upcasts bf16 to fp32 and materialises the scores: on an H200 that
made a 7,168-token prefill of the demo model 2 s of mostly attention (bench/results/gpu/). The fused
kernels also take only 4-D inputs, so every call here adds a batch dimension of one.

On the CPU such a chunk is two mask-free parts merged by their log-sum-exps: the queries against the
earlier T-N keys (every one visible), and against their own N keys with the square causal mask (upper-left
alignment is lower-right when N = T), each through PyTorch's CPU flash kernel. With an explicit mask the
kernel reads a [N, T] mask beside its scores and cannot skip the masked blocks: Qwen2.5-Coder-0.5B's 8K
prompt in 512-token chunks spent most of its attention time there. With ``products="bf16"`` (the model's
prompt GEMMs are bf16: ``WeightPlan.prompt_products``) the first part runs in the CPU kernel of bf16 dot
products (``native/kernels/prefix_attention.cpp``, AVX512-BF16) where the host has it: 2.1x the flash
kernel's speed at 8K keys, within bf16 rounding of it.

Elsewhere (positions that are not one contiguous run ending at T-1) the mask is explicit, and PyTorch's
CPU kernel materialises it together with the scores ([Hq, N, T] floats each). The queries are therefore
processed in row tiles sized so that one tile's scores stay under ``SCORE_TILE_BYTES``: working memory is
bounded by a constant instead of growing with chunk size x context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvdrive.runtime import native

SCORE_TILE_BYTES = 16 << 20  # scores of one query tile: Hq x rows x T x 4 bytes at most


def causal_attention(
    q: torch.Tensor,  # [N, Hq, D] new tokens' queries
    k: torch.Tensor,  # [Hkv, T, D] all keys of the sequence (positions 0..T-1), head-major
    v: torch.Tensor,  # [Hkv, T, D]
    q_positions: torch.Tensor,  # [N] absolute positions of the queries
    tile_bytes: int = SCORE_TILE_BYTES,
    fused: bool | None = None,  # a chunk ending its sequence: True the lower-right mask kernel, False explicit-mask
    # tiles, None the device's own (CUDA: lower-right; CPU: prefix and chunk without masks, merged)
    products: str = "fp32",  # "bf16": on the CPU path, the prefix's q.k and p.v as bf16 products (bf16_prefix)
) -> torch.Tensor:  # [N, Hq, D]
    n, t = q.shape[0], k.shape[1]
    # [1, H, N|T, D]: SDPA's fused CUDA kernels take 4-D inputs only (3-D ones always run the math kernel)
    qh, kh, vh = q.transpose(0, 1)[None], k[None], v[None]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kh.dtype != qh.dtype:
        kh, vh = kh.to(qh.dtype), vh.to(qh.dtype)
    if n == 1:  # decode: the one query sees every key
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif n == t:  # fresh prefill: queries are positions 0..T-1 (fused causal kernel, no mask)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    elif (q.is_cuda if fused is None else fused) and _ends_the_sequence(q_positions, t):
        g = qh.shape[1] // kh.shape[1]  # the fused lower-right path takes equal head counts
        kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)  # [1, Hq, T, D]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, t), scale=scale)
    elif fused is None and q.device.type == "cpu" and _ends_the_sequence(q_positions, t):
        out = _prefix_then_causal(qh, kh, vh, t - n, scale, products == "bf16" and bf16_prefix_available())
    else:
        rows = max(1, tile_bytes // (qh.shape[1] * t * 4))
        tiles = []
        for a in range(0, n, rows):
            pos = q_positions[a : a + rows]
            end = min(t, int(pos.max()) + 1)  # keys after the tile's last position are masked anyway
            mask = torch.arange(end, device=q.device)[None, :] <= pos[:, None]  # [rows, end]
            tiles.append(F.scaled_dot_product_attention(qh[:, :, a : a + rows], kh[:, :, :end], vh[:, :, :end],
                                                        attn_mask=mask, scale=scale, enable_gqa=True))
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=2)
    return out[0].transpose(0, 1)


def bf16_prefix_available() -> bool:
    """Whether the prefix's bf16-product kernel runs here: the CPU kernels built, on a CPU with AVX512-BF16."""
    return native.kernels() is not None and torch.cpu._is_avx512_bf16_supported()


def _prefix_then_causal(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, prefix: int, scale: float,
                        bf16: bool = False) -> torch.Tensor:
    """qh [1, Hq, N, D] the last N positions; kh, vh [1, Hkv, T, D] with T = prefix + N -> [1, Hq, N, D]:
    attention to the prefix (no mask) and, causally, to the chunk itself, merged by log-sum-exp. ``bf16``:
    the prefix through the CPU kernel of bf16 products (``native/kernels/prefix_attention.cpp``; float32
    inputs only), else PyTorch's flash kernel."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, hq, n, d = qh.shape
    hkv = kh.shape[1]
    if bf16 and qh.dtype == torch.float32 and d in (32, 64, 128):
        o1, l1 = native.kernels().prefix_attention_bf16(qh[0].contiguous(), kh[0, :, :prefix], vh[0, :, :prefix],
                                                        scale)  # [Hq, N, D], [Hq, N]
        o1, l1 = o1[None], l1[None]
    else:
        # the prefix needs no mask, so each key head's g query heads are one block of g*N query rows: the
        # kernel reads each key/value block once for all of them instead of once per query head
        # (Qwen2.5-Coder-0.5B, 512 queries against 8K keys on 2 threads: 119 -> 100 ms a layer)
        o1, l1 = flash(qh.reshape(1, hkv, hq // hkv * n, d), kh[:, :, :prefix], vh[:, :, :prefix], 0.0, False,
                       scale=scale)
        o1, l1 = o1.reshape(1, hq, n, d), l1.reshape(1, hq, n)  # l: [1, Hq, N]
    o2, l2 = flash(qh, kh[:, :, prefix:], vh[:, :, prefix:], 0.0, True, scale=scale)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


def _ends_the_sequence(q_positions: torch.Tensor, t: int) -> bool:
    """Whether the queries' positions ([N], increasing) are exactly T-N..T-1 (one sync, per layer)."""
    n = q_positions.shape[0]
    first, last = (int(x) for x in q_positions[[0, -1]].tolist())
    return first == t - n and last == t - 1
