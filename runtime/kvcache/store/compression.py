"""Block codecs for a tier: identity, and int8 per page per KV head with float32 scales.

A block is one layer's page, K then V, each [Hkv, S, D] in the cache dtype (``layout.KVLayout``). The
int8 codec stores scales [2, Hkv] float32 followed by q [2, Hkv, S, D] int8 (symmetric, scale = absmax /
127 over the page's S x D values of one head), about half the bytes of a 16-bit block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class BlockCodec(Protocol):
    name: str
    payload_bytes: int

    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n, block_bytes] uint8 -> [n, payload_bytes] uint8 (CPU)."""
        ...

    def decode(self, payloads: torch.Tensor) -> torch.Tensor:
        """[n, payload_bytes] uint8 -> [n, block_bytes] uint8 (CPU)."""
        ...


@dataclass(frozen=True)
class IdentityCodec:
    block_bytes: int
    name: str = "none"

    @property
    def payload_bytes(self) -> int:
        return self.block_bytes

    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks

    def decode(self, payloads: torch.Tensor) -> torch.Tensor:
        return payloads


@dataclass(frozen=True)
class Int8Codec:
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    name: str = "int8"

    @property
    def _shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def _scale_bytes(self) -> int:
        return 2 * self.num_kv_heads * 4

    @property
    def block_bytes(self) -> int:
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def payload_bytes(self) -> int:
        return self._scale_bytes + 2 * self.page_size * self.num_kv_heads * self.head_dim

    def encode(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        x = blocks.cpu().contiguous().view(self.dtype).view(n, *self._shape).float()  # [n, 2, H, S, D]
        absmax = x.abs().amax(dim=(3, 4))  # [n, 2, H]
        scale = (absmax / 127.0).clamp_min(1e-12)
        q = torch.round(x / scale[:, :, :, None, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.contiguous().view(torch.uint8).view(n, -1), q.view(torch.uint8).view(n, -1)], dim=1)

    def decode(self, payloads: torch.Tensor) -> torch.Tensor:
        n = payloads.shape[0]
        sb = self._scale_bytes
        scale = payloads[:, :sb].contiguous().view(torch.float32).view(n, 2, self.num_kv_heads)
        q = payloads[:, sb:].contiguous().view(torch.int8).view(n, *self._shape).float()
        x = (q * scale[:, :, :, None, None]).to(self.dtype)
        return x.contiguous().view(torch.uint8).view(n, -1)


@dataclass(frozen=True)
class CodecError:
    """What a lossy codec did to a batch of blocks."""

    max_abs: float
    rms: float
    rel_rms: float  # rms error / rms value
    bytes_ratio: float  # payload bytes / block bytes


def measure_error(codec: BlockCodec, blocks: torch.Tensor, dtype: torch.dtype) -> CodecError:
    """Round-trip ``blocks`` [n, block_bytes] through ``codec`` and compare the values."""
    back = codec.decode(codec.encode(blocks))
    x = blocks.contiguous().view(dtype).float()
    y = back.contiguous().view(dtype).float()
    err = y - x
    rms = float(err.pow(2).mean().sqrt())
    return CodecError(float(err.abs().max()), rms, rms / max(float(x.pow(2).mean().sqrt()), 1e-12),
                      codec.payload_bytes / blocks.shape[1])
