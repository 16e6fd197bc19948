"""The contract between the model's forward pass and whatever stores and attends over KV.

The model computes projections, RoPE and MLPs; it hands each layer's new queries, keys and values
to an ``AttentionBackend`` that owns where K/V live (pages, tiers) and how attention is computed
(dense or attention-aware sparse). The engine provides the backend for each step.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``/``v`` of the step's new tokens and attend.

        q: [N, Hq, D], k and v: [N, Hkv, D] for the N new tokens of the step (all sequences of the
        batch concatenated, RoPE already applied). Returns the attention output [N, Hq, D].
        """
        ...
