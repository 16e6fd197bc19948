"""The attention backend of one engine step: stores new K/V in the paged cache and attends.

It joins the model (which calls ``attend`` per layer) to the KV cache and the attention kernels;
the step's layout (which sequences, how many new tokens each, where they land) is fixed before
the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrive.runtime.attention import causal_attention
from kvdrive.runtime.kvcache import PagedKVCache, SlotMapping


@dataclass(frozen=True)
class StepSequence:
    seq_id: int
    num_new: int  # new tokens of this sequence in the step
    positions: torch.Tensor  # [num_new] absolute positions
    slots: SlotMapping


class PagedAttentionBackend:
    """Implements ``kvdrive.runtime.model.AttentionBackend`` over a ``PagedKVCache``."""

    def __init__(self, cache: PagedKVCache, sequences: list[StepSequence]) -> None:
        self.cache = cache
        self.sequences = sequences
        self._all_slots = SlotMapping(
            torch.cat([s.slots.pages for s in sequences]), torch.cat([s.slots.offsets for s in sequences])
        )
        # block tables do not change during a step: build each index once, not once per layer
        self._indices = [cache.page_index(s.seq_id) for s in sequences]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]
        self.cache.write(layer, self._all_slots, k, v)
        outs = []
        start = 0
        for s, index in zip(self.sequences, self._indices, strict=True):
            kk, vv = self.cache.gather(layer, s.seq_id, index)  # [T, Hkv, D]
            outs.append(causal_attention(q[start : start + s.num_new], kk, vv, s.positions))
            start += s.num_new
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
