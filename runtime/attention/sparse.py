"""Exact softmax attention of decode queries over their gathered pages, one sequence of the batch at a time.

Each sequence contributes its selected pages plus its open tail and is computed on its own: padding
the batch to one tensor would copy every gathered page once more (measured ~45 ms per step at 7K
context, batch 4 on CPU), more than the per-sequence kernels cost. Also returns the attention mass each
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
    outs: list[torch.Tensor] = []
    masses: list[torch.Tensor] = []
    for i in range(q.shape[0]):  # per sequence: padding to a batch would copy every gathered page again
        o, m = _one(q[i], k[i], v[i])
        outs.append(o)
        masses.append(m)
    return torch.stack(outs), masses


def _one(
    q: torch.Tensor,  # [Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Hq, D], mass [T]
    hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(hkv, hq // hkv, d)  # [Hkv, G, D]
    scores = torch.einsum("hgd,thd->hgt", qg, k.to(q.dtype)) / math.sqrt(d)  # [Hkv, G, T]
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.einsum("hgt,thd->hgd", p, v.to(q.dtype)).reshape(hq, d)
    return out, p.float().sum(dim=(0, 1))
