"""A GGUF tensor's own quantization blocks, kept as they are: integer levels with a float32 scale, and
optionally a float32 offset, per block of inputs (``Blocks``).

Owns reading the levels and scales out of the file's block types (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K,
Q8_0) so that ``levels * scale + offset`` is, bit for bit, what gguf's own dequantization gives (and so
what the fp32 path and the transformers reference compute with). Other types are not block-exact here
and are dequantized as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BLOCK_EXACT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q6_K", "Q8_0")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # levels 0..15 in blocks of 32: the int4 (nibble) layout


@dataclass(frozen=True)
class Blocks:
    """``W [N, K] = levels * scale[:, k // block] + offset[:, k // block]``."""

    levels: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K / block] float32
    offset: torch.Tensor | None  # [N, K / block] float32, or None for 0
    block: int  # 32, or 16 (Q6_K)

    @property
    def shape(self) -> torch.Size:
        return self.levels.shape

    def nibbles_fit(self) -> bool:
        """Whether the levels fit the int4 layout (0..15, blocks of 32)."""
        return self.block == 32 and int(self.levels.min()) >= 0 and int(self.levels.max()) <= 15

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # -> [N, K], computed in float32
        n, k = self.levels.shape
        g = self.levels.float().view(n, k // self.block, self.block) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            g = g + self.offset.unsqueeze(-1)
        return g.view(n, k).to(dtype)

    def to(self, device: torch.device) -> Blocks:
        return Blocks(self.levels.to(device), self.scale.to(device),
                      None if self.offset is None else self.offset.to(device), self.block)

    def with_block(self, block: int) -> Blocks:
        """The same weight with scales per ``block`` inputs (a divisor of the current block)."""
        if block == self.block:
            return self
        r = self.block // block
        return Blocks(self.levels, self.scale.repeat_interleave(r, dim=1).contiguous(),
                      None if self.offset is None else self.offset.repeat_interleave(r, dim=1).contiguous(), block)

    def rows(self, index: torch.Tensor) -> Blocks:
        """A selection / permutation of the output rows ([N'] indices)."""
        return Blocks(self.levels[index].contiguous(), self.scale[index].contiguous(),
                      None if self.offset is None else self.offset[index].contiguous(), self.block)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Output rows stacked (a fused q/k/v or gate/up), in the finest block of the parts; a missing
        offset is zeros."""
        block = min(p.block for p in parts)
        parts = [p.with_block(block) for p in parts]
        offset = None
        if any(p.offset is not None for p in parts):
            offset = torch.cat([p.offset if p.offset is not None else torch.zeros_like(p.scale) for p in parts])
        return Blocks(torch.cat([p.levels for p in parts]), torch.cat([p.scale for p in parts]), offset, block)


@dataclass(frozen=True)
class TensorSource:
    """How a checkpoint stored one tensor: its type (``Q4_1``, ``BF16``, ``F32``...) and, for a
    block-exact type, how to read its blocks (read when asked: only the formats that keep blocks do)."""

    kind: str
    read_blocks: Callable[[], Blocks] | None = None


def _f16(raw: np.ndarray) -> np.ndarray:  # [nb, 2] uint8 -> [nb, 1] float32
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """ggml's packing: each run of ``width`` bytes holds ``width`` inputs in its low nibbles, then the
    next ``width`` in its high ones. [nb, B/2] uint8 -> [nb, B] uint8."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(nb, -1)


def _levels(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """-> levels [nb, Bq] int8, scale [nb, S] float32, offset [nb, S] float32 or None (S scales per
    block of the type), following gguf.quants' dequantize_blocks formula for formula."""
    from gguf.quants import Q4_K

    nb = blocks.shape[0]
    if kind == "Q8_0":
        return blocks[:, 2:].copy().view(np.int8), _f16(blocks[:, :2]), None
    if kind == "Q4_0":  # d * (q - 8) == q * d + (-8 d), both exact (q * d has at most 15 significant bits)
        d = _f16(blocks[:, :2])
        return _nibbles(blocks[:, 2:], 16).astype(np.int8), d, -8 * d
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:], 16).astype(np.int8), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4
        qh = blocks[:, head:head + 4].copy().view(np.uint32).reshape(nb, 1) >> np.arange(32, dtype=np.uint32)
        q = _nibbles(blocks[:, head + 4:], 16) | ((qh & np.uint32(1)).astype(np.uint8) << np.uint8(4))
        if kind == "Q5_0":
            return (q.astype(np.int8) - np.int8(16)), _f16(blocks[:, :2]), None
        return q.astype(np.int8), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if kind == "Q4_K":
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:4 + Q4_K.K_SCALE_SIZE])
        q = _nibbles(blocks[:, 4 + Q4_K.K_SCALE_SIZE:], 32)
        return q.astype(np.int8), d * sc.reshape(nb, -1).astype(np.float32), -(dmin * m.reshape(nb, -1).astype(np.float32))
    if kind == "Q6_K":
        ql = _nibbles(blocks[:, :128], 64)
        qh = blocks[:, 128:192].reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(nb, -1)
        q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
        scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        return q, _f16(blocks[:, 208:210]) * scales, None
    raise ValueError(f"{kind} is not one of the block-exact types {BLOCK_EXACT_TYPES}")


def read_blocks(tensor: Any) -> Blocks:
    """A gguf ``ReaderTensor`` of a ``BLOCK_EXACT_TYPES`` type as ``Blocks`` [rows, inputs]."""
    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost-first
    n, k = shape[0], int(np.prod(shape[1:]))
    raw = np.asarray(tensor.data).reshape(-1)
    blocks = raw.view(np.uint8).reshape(n * k // _block_inputs(kind), -1)
    levels, scale, offset = _levels(kind, blocks)
    per = levels.shape[1] // scale.shape[1]  # inputs per scale
    return Blocks(torch.from_numpy(np.ascontiguousarray(levels)).view(n, k),
                  torch.from_numpy(np.ascontiguousarray(scale)).view(n, k // per),
                  None if offset is None else torch.from_numpy(np.ascontiguousarray(offset)).view(n, k // per),
                  per)


def _block_inputs(kind: str) -> int:
    return 256 if kind.endswith("_K") else 32
