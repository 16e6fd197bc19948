"""Exact softmax attention of one decode query per sequence over its gathered pages, batched.

K and V arrive as ``[B, Hkv, T, D]`` (the selected pages and the open tail page, gathered head-major);
``mask`` hides what is not attended (pages a short sequence does not have, the tail's unwritten tokens);
``rest``, when given, is one more column per query head standing for the pages the selection left out
(``selection.rest_of_pages``).
One matmul, one softmax and one matmul for the whole batch; the probabilities come back too, since the
attention mass each page received is what placement turns into hotness. The compute floor of the
decode benchmark calls the same function over a contiguous KV tensor.
"""

from __future__ import annotations

import math

import torch


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D] one query per sequence
    k: torch.Tensor,  # [B, Hkv, T, D]
    v: torch.Tensor,  # [B, Hkv, T, D]
    mask: torch.Tensor | None = None,  # [B, 1, 1, T] bool, True = not attended
    rest: tuple[torch.Tensor, torch.Tensor] | None = None,  # one more column: lse [B, Hkv, G], value [B, Hkv, G, D]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Hq, D], probs [B, Hkv, G, T] float32
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if k.dtype == torch.float16 and not k.is_cuda:  # CPUs without AVX512-FP16 multiply float16 ~4x slower than
        k, v = k.float(), v.float()  # float32 (measured here); one conversion pass is cheaper
    qg = (q * (1.0 / math.sqrt(d))).view(b, hkv, hq // hkv, d).to(k.dtype)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [B, Hkv, G, T]
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    if rest is None:
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.to(v.dtype), v)  # [B, Hkv, G, D]
        return out.view(b, hq, d).to(q.dtype), probs
    lse, mean = rest  # the pages the selection left out (selection.rest_of_pages), as one column
    probs = torch.softmax(torch.cat([scores, lse.float()[..., None]], dim=-1), dim=-1)  # [B, Hkv, G, T + 1]
    out = torch.matmul(probs[..., :t].to(v.dtype), v).float() + probs[..., t:] * mean.float()
    return out.view(b, hq, d).to(q.dtype), probs[..., :t]
