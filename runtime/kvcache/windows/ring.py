"""The KV of sliding-window layers (Gemma 2/3): a ring of the last ``window`` positions per sequence, on
the compute device, never paged, never tiered, never selected.

A sliding layer's query at position p attends to keys at positions (p - window, p]; nothing older is ever
read again, so those layers need ``window`` tokens of KV per sequence however long the context grows
(Gemma 3 270M: 15 of 18 layers, window 512; at 32K tokens they hold 512 tokens, not 32K). Position p lives
in ring slot p mod C. Keys carry RoPE already, so attention does not care about slot order, only
about which slots are in the window:

    decode (one token per sequence, batched):  write k, v at slot p mod C, attend over the C slots,
        masking the slots whose position is outside the window or not written yet      ring rows [B, C]
        (on a CPU host the paged decode kernel, reading the ring in place with each slot a one-token page)
    prompt chunk (positions s .. s+n-1):  attend over the ring (positions s-C .. s-1, those >= 0) and the
        chunk itself, each query within its window; then the chunk's last min(n, C) tokens go in

(C, the ring's capacity, is the window plus one page; see ``__init__``.)

The ring is indexed by the sequence's row (as the page table is), so a row reused by a new sequence
needs no clearing: slots at or past a position the new sequence has not reached are masked by position.
Prefix reuse of a hybrid model therefore needs the window too; see ``PrefixPages.stored_prefix`` (prefix.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvdrive.runtime.attention import decode_attention, paged_kernels


class SlidingWindows:
    def __init__(self, layers: tuple[int, ...], window: int, page_size: int, rows: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers = layers
        self.index = {layer: j for j, layer in enumerate(layers)}  # model layer -> ring layer
        self.window = window
        # one page more than the window: whatever a sequence's length, the ring still holds the window that
        # ended at its last page boundary (what a prefix snapshot keeps, see ``snapshot``)
        self.capacity = c = window + page_size
        self.device = device
        with torch.inference_mode(False):  # written in place by every step
            # [rows, sliding layers, C, 2 (K, V), Hkv, D]
            self.ring = torch.zeros((rows, len(layers), c, 2, num_kv_heads, head_dim), dtype=dtype, device=device)
        self._slots = torch.arange(c, device=device)  # [C]: the ring's slots, the same for every step and layer
        # the paged kernel's staging buffer, always empty: every slot is read in place in the ring
        self._no_stage = torch.empty((0, 2, num_kv_heads, 1, head_dim), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.ring.numel() * self.ring.element_size()

    def bytes_per_sequence(self) -> int:
        return self.nbytes // self.ring.shape[0]

    def decode_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B] -> [B, 1, 1, C], True where a ring slot is outside the window or not written yet
        (the same for every sliding layer of a step: computed once)."""
        c = self.capacity
        held = positions[:, None] - torch.remainder(positions[:, None] - self._slots[None, :], c)  # [B, C]: each slot's position
        return ((held <= positions[:, None] - self.window) | (held < 0))[:, None, None, :]

    def decode(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, outside: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One new token per sequence: rows, positions [B], ``decode_mask(positions)``; q [B, Hq, D], k, v
        [B, Hkv, D] -> [B, Hq, D]."""
        j, c = self.index[layer], self.capacity
        self.ring[rows, j, positions % c] = torch.stack([k, v], dim=1).to(self.ring.dtype)
        hkv, d = self.ring.shape[4], self.ring.shape[5]
        if paged_kernels.available(self.device) and paged_kernels.fits(q, hkv):
            # the paged kernel, each ring slot a page of one token: slot (row, layer, c) of the ring
            # [rows, layers, C, 2, Hkv, D] is page (row * layers + j) * C + c of its [.., 2, Hkv, 1 * D] rows
            slots = ((rows * len(self.layers) + j) * c)[:, None] + self._slots  # [B, C]
            ntok = (~outside).view(-1, c).long()  # [B, C]: 1 where the slot is in the window
            return paged_kernels.attend(q, self.ring.view(-1, d), self._no_stage, slots, ntok, hkv, 1)[0]
        kv = self.ring[rows, j]  # [B, C, 2, Hkv, D]
        kk, vv = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, Hkv, C, D]
        return decode_attention(q, kk, vv, outside)[0]

    def prompt_mask(self, start: int, n: int) -> torch.Tensor:
        """[n, T]: which keys (the ring's C slots when ``start`` > 0, then the chunk's n tokens) each query of
        a chunk at positions start .. start+n-1 sees (the same for every sliding layer: computed once)."""
        pos = torch.arange(start, start + n, device=self.device)  # [n]
        keys_pos = pos
        if start:
            slots = torch.arange(self.capacity, device=self.device)
            ring_pos = start - 1 - torch.remainder(start - 1 - slots, self.capacity)  # [C]: the newest position in each slot
            keys_pos = torch.cat([ring_pos, pos])  # [C + n]
        return (keys_pos[None, :] <= pos[:, None]) & (keys_pos[None, :] > pos[:, None] - self.window) \
            & (keys_pos[None, :] >= 0)

    def prompt(self, layer: int, row: int, start: int, visible: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """A prompt chunk of one sequence at positions start .. start+n-1 (``visible`` = ``prompt_mask``):
        q [n, Hq, D], k, v [n, Hkv, D] -> [n, Hq, D]."""
        j, c = self.index[layer], self.capacity
        n = q.shape[0]
        if start:
            ring = self.ring[row, j]  # [C, 2, Hkv, D]
            ak = torch.cat([ring[:, 0], k.to(ring.dtype)]).transpose(0, 1)  # [Hkv, C + n, D]
            av = torch.cat([ring[:, 1], v.to(ring.dtype)]).transpose(0, 1)
        else:
            ak, av = k.transpose(0, 1), v.transpose(0, 1)
        # 4-D, as SDPA's fused kernels take (3-D inputs always run its math kernel): PyTorch's CPU flash kernel
        # takes the mask and grouped heads; on CUDA the memory-efficient kernel takes the mask, not grouped heads
        qh, ak, av = q.transpose(0, 1).to(ak.dtype)[None], ak[None], av[None]  # [1, H, n | C + n, D]
        if q.is_cuda:
            g = qh.shape[1] // ak.shape[1]
            ak, av = ak.repeat_interleave(g, dim=1), av.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(qh, ak, av, attn_mask=visible, scale=1.0 / math.sqrt(q.shape[-1]),
                                             enable_gqa=not q.is_cuda)[0]  # [Hq, n, D]
        keep = min(n, c)
        slots = torch.arange(start + n - keep, start + n, device=self.device) % c
        self.ring[row, j, slots] = torch.stack([k[n - keep :], v[n - keep :]], dim=1).to(self.ring.dtype)
        return out.transpose(0, 1).to(q.dtype)

    # --- prefix snapshots (``windows.snapshots``) -----------------------------------------------------
    def _span(self, end: int) -> torch.Tensor:
        """Ring slots of the window that ends before position ``end``: [n], n = min(W, end)."""
        return torch.arange(max(0, end - self.window), end, device=self.device) % self.capacity

    def snapshot(self, row: int, end: int) -> torch.Tensor:
        """The window before position ``end`` of the sequence in ``row`` (its length may be up to a page
        past ``end``): [layers, n, 2, Hkv, D]."""
        return self.ring[row][:, self._span(end)]

    def empty_snapshot(self, end: int) -> torch.Tensor:
        return torch.empty_like(self.ring[0][:, self._span(end)])

    def restore(self, row: int, end: int, window: torch.Tensor) -> None:
        """Put a snapshot of the window before ``end`` into ``row`` (a sequence resuming at ``end``)."""
        self.ring[row][:, self._span(end)] = window.to(self.ring.dtype)
