"""Exact softmax attention of decode queries over gathered pages, batched across sequences.

Each sequence contributes its selected pages plus its open tail; sequences are padded to the longest
and masked, so one batched kernel serves the whole decode batch. Also returns the attention mass each
key received (summed over query heads), which placement turns into page hotness.
"""

from __future__ import annotations

import math

import torch


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D] one query per sequence
    k: list[torch.Tensor],  # B x [T_b, Hkv, D]
    v: list[torch.Tensor],  # B x [T_b, Hkv, D]
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # out [B, Hq, D], mass B x [T_b] (sums to Hq)
    b, hq, d = q.shape
    hkv = k[0].shape[1]
    lens = [t.shape[0] for t in k]
    tmax = max(lens)
    dtype = q.dtype
    if b == 1:  # nothing to pad
        kp, vp = k[0].to(dtype).unsqueeze(0), v[0].to(dtype).unsqueeze(0)  # [1, T, Hkv, D]
    else:
        kp = torch.nn.utils.rnn.pad_sequence([t.to(dtype) for t in k], batch_first=True)  # [B, T, Hkv, D]
        vp = torch.nn.utils.rnn.pad_sequence([t.to(dtype) for t in v], batch_first=True)
    qg = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bthd->bhgt", qg, kp) / math.sqrt(d)  # [B, Hkv, G, T]
    if min(lens) != tmax:
        valid = torch.arange(tmax, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(dtype)
    out = torch.einsum("bhgt,bthd->bhgd", p, vp).reshape(b, hq, d)
    mass = p.float().sum(dim=(1, 2))  # [B, T]
    return out, [mass[i, : lens[i]] for i in range(b)]
