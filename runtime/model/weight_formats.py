"""The linear layers' weight formats: how a model's projection, embedding and vocabulary weights are
kept in memory and multiplied (``--weights {auto,fp32,bf16,int8,int4}``).

- ``fp32``: float32, ``F.linear`` (the loader's dequantized GGUF values).
- ``bf16``: bfloat16 weights; inputs cast to bf16, outputs back to the activations' dtype.
- ``int8`` / ``int4`` on CPU: the GGUF file's own blocks (``gguf_blocks.Blocks``): integer levels with a
  float32 scale and offset per block of 32 (16 for Q6_K), int4 two levels a byte. Weights stored in the
  file as Q4_0/Q4_1/Q4_K take int4, Q5_0/Q5_1/Q6_K/Q8_0 int8, with exactly the file's values; a float
  weight asked into int8/int4 is requantized (symmetric int8 / asymmetric int4 per block of 32), which is
  lossy. Inputs stay float32 and products are summed in float32 (``block_kernels``), so an int8/int4 step
  computes what the fp32 path computes, in another order of additions, from 1.1 / 0.75 bytes a weight
  instead of 4. Above ``SMALL_BATCH`` rows (prompt chunks) a layer is dequantized for one GEMM, in the
  ``--gemm`` dtype: float32 (exact), or bfloat16 where the CPU has bf16 dot-product units (AVX512-BF16 or
  AMX), where torch's bf16 GEMM runs ~4x its float32 one (2 threads on this project's AVX512-BF16 EPYC:
  378 against 94 GFLOPS; Qwen2.5-Coder-0.5B's prefill at 4K 147 -> 232 tokens/s). ``auto`` picks bf16 on
  such a host and float32 elsewhere; a decode step (at most ``SMALL_BATCH`` rows) stays float32 either way.
- ``int8`` / ``int4`` on CUDA: tinygemm (``aten._weight_int4pack_mm``, bf16 inputs and bf16 scale/zero) for
  int4; int8 is dequantized to bf16 per call (torch has no CUDA int8 weight kernel). Not exact.

Why not torch's CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``): they are fast only
with bf16 inputs (2 threads, the demo's 30 layers at one row: int4 5.5 ms, int8 7.7 ms; with float32 inputs
88 and 39 ms against fp32's 16 ms), and bf16 inputs plus requantized levels cost the demo model its
greedy outputs: 0 of 20 chat prompts identical to fp32 for int4, 5 of 24 for int8, 10 of 24 for bf16.
The block kernels take 4.4 ms (int4) at one row with float32 inputs and keep the outputs.

``auto``: int8/int4 from the file's blocks where the kernels run (CPU with AVX-512 and a compiler),
BF16 weights as bf16, everything else (F16 included: its values do not fit bf16) fp32. On CUDA: int4 for 4-bit sources, bf16 otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvdrive.runtime import native
from kvdrive.runtime.model import block_kernels
from kvdrive.runtime.model.gguf_blocks import BLOCK_EXACT_TYPES, FOUR_BIT_TYPES, Blocks
from kvdrive.runtime.model.layers import vocab_projection

WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8", "int4")
FORMATS = ("fp32", "bf16", "int8", "int4")
GEMM_CHOICES = ("auto", "fp32", "bf16")
_GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GROUP = 32  # inputs per block when a float weight is requantized
INT4_INNER_K_TILES = 2  # tinygemm (CUDA)
SMALL_BATCH = 16  # rows up to which the block kernels beat dequantize + fp32 GEMM (2 threads, demo: 35 vs 43 ms at 16, 71 vs 57 at 32)
_HALF = {"BF16"}  # F16 values do not fit bf16 (3 fewer mantissa bits): they stay fp32


def auto_format(source_types: Sequence[str], device: torch.device) -> str:
    """The format ``auto`` gives a weight made of tensors of these GGUF/safetensors types."""
    types = set(source_types)
    if types and types <= set(BLOCK_EXACT_TYPES):
        if device.type == "cpu":
            if native.unavailable_reason():
                return "fp32"
            return "int4" if types <= set(FOUR_BIT_TYPES) else "int8"
        return "int4" if types <= set(FOUR_BIT_TYPES) else "bf16"
    if types and types <= _HALF:
        return "bf16"
    return "fp32"


def resolve_format(requested: str, source_types: Sequence[str], device: torch.device) -> str:
    """``requested`` (one of ``WEIGHT_CHOICES``: ``load_model`` checks) with ``auto`` resolved."""
    return auto_format(source_types, device) if requested == "auto" else requested


def host_has_bf16_units() -> bool:
    """Whether this CPU has bf16 dot-product units (AVX512-BF16 or AMX tiles), read at run time: machines
    of one kind differ, and a bf16 GEMM without them is slower than float32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_gemm(requested: str, device: torch.device) -> str:
    """The GEMM dtype in effect for ``--gemm`` (one of ``GEMM_CHOICES``, checked by the loader): fp32 off the
    CPU (CUDA block layers have their own kernels and never take this path), ``auto`` bf16 on a CPU with bf16
    units, else what was asked."""
    if device.type != "cpu":
        return "fp32"
    if requested != "auto":
        return requested
    return "bf16" if host_has_bf16_units() else "fp32"


def requantize(w: torch.Tensor, fmt: str) -> Blocks:
    """A float weight [N, K] (K a multiple of ``GROUP``) in blocks: int8 symmetric, int4 asymmetric."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    if fmt == "int8":
        scale = (g.abs().amax(-1) / 127).clamp(min=1e-12)
        levels = (g / scale.unsqueeze(-1)).round().clamp(-127, 127)
        return Blocks(levels.to(torch.int8).view(n, k), scale, None, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    levels = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
    return Blocks(levels.to(torch.int8).view(n, k), scale, lo, GROUP)


def supports(fmt: str, out_features: int, in_features: int, device: torch.device) -> bool:
    """Whether a weight of this shape can take the format: whole blocks of inputs; tinygemm's int4
    layout also needs outputs in multiples of 16."""
    if fmt in ("fp32", "bf16"):
        return True
    return in_features % GROUP == 0 and (device.type == "cpu" or fmt == "int8" or out_features % 16 == 0)


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` [out, in] kept in one of ``FORMATS``; also a table of rows
    (``rows``), for a vocabulary matrix that is the embedding too. ``blocks``: the weight's exact GGUF
    blocks, when it has them (else int8/int4 requantize ``weight``); ``gemm``: the dtype of a CPU block
    layer's GEMM over more than ``SMALL_BATCH`` rows (``resolve_gemm``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, device: torch.device,
                 blocks: Blocks | None = None, keep_rows: bool = False, gemm: str = "fp32") -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.fmt = fmt
        self.gemm_dtype = _GEMM_DTYPES[gemm]
        self.out_features, self.in_features = weight.shape
        self.cpu = device.type == "cpu"
        self.exact = blocks is not None and (fmt == "int8" or (fmt == "int4" and blocks.nibbles_fit()))
        # plain attributes, not parameters or buffers: a later model.to(dtype) must not touch them
        self.bias = None if bias is None else bias.detach().float().to(device)
        self.w: torch.Tensor | None = None  # fp32 / bf16 weight (CUDA: the bf16 rows of an int4 table)
        self.packed: block_kernels.PackedBlocks | None = None  # CPU int8 / int4
        self.blocks: Blocks | None = None  # CUDA int8: levels, scales, offsets on the device
        self.q: torch.Tensor | None = None  # CUDA int4: tinygemm's packed levels
        self.scales: torch.Tensor | None = None  # CUDA int4: [K/g, N, 2] bf16 scale and zero
        if fmt in ("fp32", "bf16"):
            self.w = weight.detach().to(device, torch.float32 if fmt == "fp32" else torch.bfloat16)
            return
        b = blocks if self.exact and blocks is not None else requantize(weight.detach().cpu(), fmt)
        if self.cpu:
            self.packed = block_kernels.pack(b, nib=fmt == "int4")
        elif fmt == "int8":
            self.blocks = b.to(device)
        else:  # CUDA int4: b's levels fit a nibble (exact Q4 blocks, or requantized above)
            offset = b.offset if b.offset is not None else torch.zeros_like(b.scale)
            scale_zero = torch.stack([b.scale, offset + 8 * b.scale], -1).transpose(0, 1).contiguous()
            lv = b.levels.to(torch.int32)
            pairs = (lv[:, ::2] << 4 | lv[:, 1::2]).to(torch.uint8).to(device)
            self.q = torch.ops.aten._convert_weight_to_int4pack(pairs, INT4_INNER_K_TILES)
            self.scales = scale_zero.to(device, torch.bfloat16)
            if keep_rows:
                self.w = b.dequantize(torch.bfloat16).to(device)

    @property
    def nbytes(self) -> int:
        """Bytes this layer keeps (every copy)."""
        b = self.blocks
        held = (self.w, self.q, self.scales, self.bias) + ((b.levels, b.scale, b.offset) if b is not None else ())
        n = self.packed.nbytes if self.packed is not None else 0
        return n + sum(t.numel() * t.element_size() for t in held if t is not None)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.fmt == "fp32":
            return F.linear(x.float(), self.w)
        if self.fmt == "bf16":
            return F.linear(x.to(torch.bfloat16), self.w)
        if self.packed is not None:
            if x.shape[0] <= SMALL_BATCH:
                return block_kernels.gemv(x, self.packed)
            dt = self.gemm_dtype
            return F.linear(x.to(dt), block_kernels.dequantize(self.packed, dt))
        xb = x.to(torch.bfloat16)
        if self.blocks is not None:  # CUDA int8
            return F.linear(xb, self.blocks.dequantize(torch.bfloat16))
        return torch.ops.aten._weight_int4pack_mm(xb, self.q, GROUP, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N] in x's dtype
        if (self.packed is not None and self.bias is None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH
                and x.dtype == torch.float32):  # a decode step's rows: no reshape or cast (121 calls a demo step)
            return block_kernels.gemv(x, self.packed)
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, K] float32: rows of W
        if self.packed is not None:
            return block_kernels.rows(self.packed, ids)
        if self.w is not None:
            return self.w[ids].float()
        if self.blocks is not None:
            return self.blocks.rows(ids).dequantize()
        raise RuntimeError("an int4 layer without a row table cannot serve as an embedding (keep_rows)")


class QuantEmbedding(nn.Module):
    """Token embeddings read from a ``QuantLinear`` vocabulary matrix ([vocab, hidden]); when the
    embeddings are tied the same object is also the LM head: the matrix is stored once."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, H] in the model dtype
        return self.table.rows(ids).to(self.dtype)


def vocab_logits(embed: nn.Module, lm_head: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden @ W_vocab.T`` ([M, H] -> [M, V]) through the LM head, or the embedding table when tied,
    in whatever format it is kept."""
    head = lm_head if lm_head is not None else embed
    if isinstance(head, QuantEmbedding):
        head = head.table
    if isinstance(head, QuantLinear):
        return head(hidden)
    return vocab_projection(hidden, head.weight)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights a model keeps: per format for its QuantLinear layers (a shared one once), and
    ``params`` for the plain parameters (norms, and every weight of a model left in fp32)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in seen:
            seen.add(id(module))
            out[module.fmt] = out.get(module.fmt, 0) + module.nbytes
    out["params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out
