"""The contracts around the model's forward pass: what attends over KV, and what every model offers.

The model computes projections, RoPE and MLPs; it hands each layer's new queries, keys and values
to an ``AttentionBackend`` that owns where K/V live (pages, tiers) and how attention is computed
(dense or attention-aware sparse). The engine provides the backend for each step. ``CausalLM`` is
what the engine sees of a model (LlamaModel, Gemma3Model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from kvdrive.runtime.model.config import ModelConfig


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``/``v`` of the step's new tokens and attend.

        q: [N, Hq, D], k and v: [N, Hkv, D] for the N new tokens of the step (all sequences of the
        batch concatenated, RoPE already applied). Returns the attention output [N, Hq, D].
        Scores are scaled by 1/sqrt(D) (a model wanting another scale pre-multiplies q). A layer in
        ``ModelConfig.sliding_layers`` lets a query at position p see keys at positions in
        (p - sliding_window, p]; every other layer sees all positions up to p.
        """
        ...


class CausalLM(Protocol):
    """A decoder the engine can drive (an ``nn.Module``: calling it runs ``forward``)."""

    cfg: ModelConfig
    embed_tokens: nn.Embedding

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [N] -> hidden states [N, H], final norm applied."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] -> [M, V] float32 (soft-capped where the model does that)."""
        ...

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy in Hugging Face-named weights; KeyError / ValueError on a missing or misshapen one."""
        ...
