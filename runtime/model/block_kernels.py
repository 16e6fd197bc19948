"""The CPU kernels that multiply by weights kept in their GGUF blocks (``kernels/block_gemm.cpp``):
packing ``Blocks`` for them, building and loading them, and the torch path used where they cannot be built.

The C++ source is compiled on first use with torch's extension builder (ninja and a C++ compiler; about
20 s on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and reused after
that. It needs AVX-512 (``torch.backends.cpu.get_cpu_capability()``). Without it, or without a compiler,
``available()`` is False with the reason, and ``gemv`` / ``dequantize`` compute the same values with torch
ops (dequantize, then an fp32 matmul): exact, but paying for a float32 copy of the weight on every call.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvdrive.runtime.model.gguf_blocks import Blocks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "block_gemm.cpp"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-ffp-contract=off", "-fopenmp")


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


def _build() -> tuple[Any, str]:
    """(the extension module or None, why not)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        return None, f"the CPU offers {capability}; the kernels need AVX512"
    try:
        from torch.utils.cpp_extension import load

        module = load("kvdrive_block_gemm", [str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                      verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        lines = str(exc).strip().splitlines()
        return None, f"building {SOURCE.name} failed: {lines[-1] if lines else type(exc).__name__}"
    return module, ""


@functools.cache
def _load() -> tuple[Any, str]:
    """The build, tried once a process, and what came of it in the log."""
    module, why = _build()
    if module is None:
        log.warning("block kernels unavailable (%s): auto keeps fp32; int8/int4 dequantize on every call", why)
    else:
        log.info("block kernels ready (%s)", SOURCE.name)
    return module, why


def unavailable_reason() -> str:
    """Empty when the kernels are built and loaded; otherwise why they are not (logged once)."""
    module, why = _load()
    return why


def gemv(x: torch.Tensor, w: PackedBlocks) -> torch.Tensor:  # [M, K] -> [M, N] float32
    x = x.float().contiguous()
    module, _ = _load()
    if module is None:
        return F.linear(x, w.blocks().dequantize())
    return module.block_gemv(x, w.q, w.scale, w.offset, w.nib)


def dequantize(w: PackedBlocks) -> torch.Tensor:  # -> [N, K] float32, equal to the file's values
    module, _ = _load()
    if module is None:
        return w.blocks().dequantize()
    return module.block_dequant(w.q, w.scale, w.offset, w.nib)


def rows(w: PackedBlocks, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, K] float32
    picked = PackedBlocks(w.q[ids], w.scale[ids], None if w.offset is None else w.offset[ids], w.nib)
    return picked.blocks().dequantize()
