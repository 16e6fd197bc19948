"""Prefill attention of a continuing chunk is computed in query tiles: same result as one pass."""

from __future__ import annotations

import math

import torch

from kvdrive.runtime.attention import causal_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [T, Hq, D]
    scores = torch.einsum("nhd,thd->hnt", q, kk) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), vv)


def test_tiled_chunk_attention_equals_the_explicit_softmax() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(300, 6, 32), torch.randn(1000, 2, 32), torch.randn(1000, 2, 32)
    pos = torch.arange(700, 1000)  # a chunk continuing a 700-token sequence
    ref = _reference(q, k, v, pos)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # head-major, as the cache holds them
    one_pass = causal_attention(q, kh, vh, pos)
    tiled = causal_attention(q, kh, vh, pos, tile_bytes=6 * 1000 * 4 * 7)  # 7 query rows per tile
    assert torch.allclose(one_pass, ref, atol=1e-5)
    assert torch.allclose(tiled, ref, atol=1e-5)


def test_a_single_row_tile_still_sees_exactly_its_own_prefix() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 4, 16), torch.randn(12, 4, 16), torch.randn(12, 4, 16)
    pos = torch.arange(7, 12)
    out = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), pos, tile_bytes=1)
    assert torch.allclose(out, _reference(q, k, v, pos), atol=1e-5)
