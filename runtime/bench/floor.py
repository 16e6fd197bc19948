"""The compute floor of a sparse decode step: the same model and weights, exact attention over one
contiguous KV tensor holding exactly ``token_budget`` tokens per sequence. No selection, no tiers, no
page tables: plain torch, the least a step can cost with this model code.

The KV values are random (the floor's tokens are not meaningful); what matters is that every byte a
sparse step attends to is read once from a contiguous tensor. Attention runs through the same
``decode_attention`` the tiered engine uses, and also through PyTorch's fused SDPA; the floor is the
faster of the two, so that the comparison is with the strongest plain-torch step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvdrive.runtime.attention import decode_attention
from kvdrive.runtime.model import LoadedModel

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _matmul_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return decode_attention(q, k, v)[0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, hq, d = q.shape
    return F.scaled_dot_product_attention(q.view(b, hq, 1, d).to(k.dtype), k, v, enable_gqa=True).view(b, hq, d)


KERNELS: dict[str, Attention] = {"matmul-softmax": _matmul_softmax, "sdpa": _sdpa}


class FloorBackend:
    """``AttentionBackend`` over a contiguous KV per layer [2, B, Hkv, T, D] (T: the token budget, or a sliding
    layer's window when that is shorter); the step's token is written at T-1."""

    def __init__(self, loaded: LoadedModel, batch: int, tokens: int, dtype: torch.dtype, attention: Attention) -> None:
        cfg = loaded.config
        dev = loaded.device
        g = torch.Generator(device=dev).manual_seed(0)
        sliding = set(cfg.sliding_layers)
        self.kv = [torch.randn((2, batch, cfg.num_kv_heads, min(tokens, cfg.sliding_window) if i in sliding
                                else tokens, cfg.head_dim), generator=g, device=dev).to(dtype)
                   for i in range(cfg.num_layers)]
        self.attention = attention

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, Hq, D]; k, v: [B, Hkv, D] -> [B, Hq, D]
        kv = self.kv[layer]
        kv[:, :, :, -1] = torch.stack([k, v]).to(kv.dtype)
        return self.attention(q, kv[0], kv[1])


def floor_step_times(loaded: LoadedModel, batch: int, tokens: int, dtype: torch.dtype, steps: int,
                     warmup: int) -> dict[str, list[float]]:
    """Seconds per decode step (model forward + logits + argmax) for each attention kernel."""
    model = loaded.model
    dev = loaded.device
    out: dict[str, list[float]] = {}
    for name, kernel in KERNELS.items():
        backend = FloorBackend(loaded, batch, tokens, dtype, kernel)
        ids = torch.randint(0, loaded.config.vocab_size, (batch,), device=dev)
        pos = torch.full((batch,), tokens - 1, device=dev)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            ids = model.logits(model(ids, pos, backend)).argmax(dim=-1)
            ids.tolist()  # the tiered engine hands tokens to the host each step too
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[name] = times
        del backend
    return out
