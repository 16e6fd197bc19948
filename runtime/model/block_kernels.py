"""Weights kept in their GGUF blocks, multiplied by the CPU kernels (``native/kernels/block_gemm.cpp``):
packing ``Blocks`` for them, and the torch path used where they cannot be built (``native`` builds and
loads them). Without them ``gemv`` / ``dequantize`` compute the same values with torch ops (dequantize,
then an fp32 matmul): exact, but paying for a float32 copy of the weight on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdrive.runtime import native
from kvdrive.runtime.model.gguf_blocks import Blocks


@dataclass(frozen=True)
class PackedBlocks:
    """``Blocks`` in the kernels' layout: int8 levels [N, K], or two levels a byte [N, K / 2] (``nib``:
    levels 0..15, ggml's order within each block of 32)."""

    q: torch.Tensor  # [N, K] int8 or [N, K / 2] uint8
    scale: torch.Tensor  # [N, K / block] float32
    offset: torch.Tensor | None  # [N, K / block] float32
    nib: bool

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * (2 if self.nib else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)

    def levels(self) -> torch.Tensor:  # -> [N, K] int8
        if not self.nib:
            return self.q
        n, half = self.q.shape
        g = self.q.view(n, half // 16, 1, 16)
        return torch.cat([g & 15, g >> 4], dim=2).view(n, half * 2).to(torch.int8)

    def blocks(self) -> Blocks:
        return Blocks(self.levels(), self.scale, self.offset, self.in_features // self.scale.shape[1])


def pack(blocks: Blocks, nib: bool) -> PackedBlocks:
    """``nib`` needs ``blocks.nibbles_fit()``."""
    if nib:
        if not blocks.nibbles_fit():
            raise ValueError("only levels 0..15 in blocks of 32 pack two to a byte")
        n, k = blocks.shape
        g = blocks.levels.to(torch.uint8).view(n, k // 32, 2, 16)
        q = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    else:
        q = blocks.levels.contiguous()
    return PackedBlocks(q, blocks.scale.contiguous(), None if blocks.offset is None else blocks.offset.contiguous(), nib)


def gemv(x: torch.Tensor, w: PackedBlocks) -> torch.Tensor:  # [M, K] -> [M, N] float32
    if x.dtype != torch.float32 or not x.is_contiguous():  # a decode step's rows are already (no dispatch)
        x = x.float().contiguous()
    module = native.kernels()
    if module is None:
        return F.linear(x, w.blocks().dequantize())
    return module.block_gemv(x, w.q, w.scale, w.offset, w.nib)


def dequantize(w: PackedBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> [N, K] in ``dtype``: float32 equal to the file's values, or those rounded to bfloat16 (one pass)."""
    module = native.kernels()
    if module is None:
        return w.blocks().dequantize().to(dtype)
    # the kernel writes float32 or bfloat16 itself; .to is a no-op for those two
    return module.block_dequant(w.q, w.scale, w.offset, w.nib, dtype == torch.bfloat16).to(dtype)


def rows(w: PackedBlocks, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, K] float32
    picked = PackedBlocks(w.q[ids], w.scale[ids], None if w.offset is None else w.offset[ids], w.nib)
    return picked.blocks().dequantize()
