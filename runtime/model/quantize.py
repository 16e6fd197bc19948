"""Putting a loaded model's weights into the format ``--weights`` asks for (``weight_formats``).

Owns which module gets which format: each decoder layer's fused q/k/v, output, fused gate/up and down
projections, the LM head and the embedding table (a tied one is one ``QuantLinear`` serving both), from
the source types of the tensors they were made of (``auto``) or as asked, and with the file's own blocks
when every tensor behind a module has them (a fused q/k/v or gate/up stacks its parts' blocks). A shape
the block layouts cannot take keeps fp32 (CPU) or falls back to bf16 (CUDA). ``fp32`` leaves the model as
loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kvdrive.runtime.model.gguf_blocks import Blocks, TensorSource
from kvdrive.runtime.model.weight_formats import QuantEmbedding, QuantLinear, resolve_format, supports

# the checkpoint tensors behind each fused projection (Hugging Face names below ``layers.<i>.``)
_SOURCES = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


@dataclass(frozen=True)
class WeightPlan:
    """What ``apply_weights`` did: the format of each converted module (``layers.3.down_proj``: int4)."""

    requested: str
    formats: Mapping[str, str]
    gemm: str = "fp32"  # the dtype of the CPU block layers' many-row GEMMs (``--gemm``, resolved)

    def summary(self) -> str:
        """``int4 x 90, int8 x 31`` (formats by count), or ``fp32`` when nothing was converted."""
        counts: dict[str, int] = {}
        for fmt in self.formats.values():
            counts[fmt] = counts.get(fmt, 0) + 1
        return ", ".join(f"{f} x {n}" for f, n in sorted(counts.items())) or "fp32"

    def blocked(self) -> bool:
        """Whether any module keeps block weights (int8/int4): the ones the GEMM dtype applies to on a CPU."""
        return bool(set(self.formats.values()) & {"int8", "int4"})

    def prompt_products(self) -> str:
        """The dtype of a prompt's products on a CPU: ``bf16`` when the block layers' GEMMs are bf16, which
        then also covers the prompt's attention to earlier keys (``attention/dense.py``), else ``fp32``."""
        return "bf16" if self.blocked() and self.gemm == "bf16" else "fp32"

    def fingerprint(self) -> str:
        """What the format adds to the model's page fingerprint: KV computed with other weights differs, and
        so does a prompt's KV computed with bf16 GEMMs: such pages are never matched against pages a
        float32-GEMM server stored, nor the other way."""
        if set(self.formats.values()) <= {"fp32"}:
            return ""
        bf16 = self.prompt_products() == "bf16"  # the GEMM dtype touches the block layers only
        return f"|weights={self.requested}:{self.summary()}" + (f"|gemm={self.gemm}" if bf16 else "")


def _types(sources: Mapping[str, TensorSource], names: tuple[str, ...]) -> list[str]:
    return [sources[n].kind for n in names if n in sources]


def _format(requested: str, types: list[str], shape: torch.Size, device: torch.device) -> str:
    fmt = resolve_format(requested, types, device)
    if not supports(fmt, shape[0], shape[1], device):
        fmt = "fp32" if device.type == "cpu" else "bf16"
    return fmt


def _exact(sources: Mapping[str, TensorSource], names: tuple[str, ...]) -> Blocks | None:
    """The module's weight in its file's blocks: every part's blocks stacked, or None when a part has none."""
    readers = [sources[n].read_blocks if n in sources else None for n in names]
    if not readers or any(r is None for r in readers):
        return None
    parts = [r() for r in readers if r is not None]
    return Blocks.cat(parts) if len(parts) > 1 else parts[0]


def _convert(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, device: torch.device,
             sources: Mapping[str, TensorSource], names: tuple[str, ...], gemm: str,
             keep_rows: bool = False) -> QuantLinear:
    blocks = _exact(sources, names) if fmt in ("int8", "int4") else None  # only the block formats read them
    return QuantLinear(weight, bias, fmt, device, blocks, keep_rows, gemm)


def apply_weights(model: nn.Module, requested: str, sources: Mapping[str, TensorSource], device: torch.device,
                  dtype: torch.dtype, gemm: str = "fp32") -> WeightPlan:
    """Convert ``model`` (loaded in float32) in place; ``sources``: Hugging Face name -> how the
    checkpoint stored the tensor (``Q4_1`` with its blocks, ``BF16``...); ``gemm``: the block layers'
    many-row GEMM dtype (``resolve_gemm``'s)."""
    sources = {k.removeprefix("model."): v for k, v in sources.items()}
    formats: dict[str, str] = {}
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined, arg-type]
        for attr, names in _SOURCES.items():
            linear = getattr(layer, attr)
            full = tuple(f"layers.{i}.{n}" for n in names)
            fmt = _format(requested, _types(sources, full), linear.weight.shape, device)
            if fmt != "fp32" or device.type != "cpu" or dtype != torch.float32:
                setattr(layer, attr, _convert(linear.weight, linear.bias, fmt, device, sources, full, gemm))
                formats[f"layers.{i}.{attr}"] = fmt
    embed: nn.Embedding = model.embed_tokens  # type: ignore[assignment]
    head: nn.Linear | None = model.lm_head  # type: ignore[assignment]
    table_names = ("embed_tokens.weight",)
    if head is not None:  # untied: the LM head is its own matrix (a file without one reuses the embedding's)
        head_names = ("lm_head.weight",) if "lm_head.weight" in sources else table_names
        head_fmt = _format(requested, _types(sources, head_names), head.weight.shape, device)
        if head_fmt != "fp32":
            model.lm_head = _convert(head.weight, None, head_fmt, device, sources, head_names, gemm)  # type: ignore[assignment]
            formats["lm_head"] = head_fmt
    embed_fmt = _format(requested, _types(sources, table_names), embed.weight.shape, device)
    if embed_fmt != "fp32":  # when tied, this one matrix is the LM head too
        table = _convert(embed.weight, None, embed_fmt, device, sources, table_names, gemm, keep_rows=True)
        model.embed_tokens = QuantEmbedding(table, dtype)  # type: ignore[assignment]
        formats["embed_tokens" if head is not None else "embed_tokens (tied LM head)"] = embed_fmt
    return WeightPlan(requested, formats, gemm)
