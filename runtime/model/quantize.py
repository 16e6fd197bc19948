"""Putting a loaded model's weights into the format ``--weights`` asks for (``weight_formats``).

Owns which module gets which format: each decoder layer's fused q/k/v, output, fused gate/up and down
projections, the LM head and the embedding table (a tied one is one ``QuantLinear`` serving both), from
the source types of the tensors they were made of (``auto``) or as asked, and with the file's own blocks
when every tensor behind a module has them (a fused q/k/v or gate/up stacks its parts' blocks). A shape
the block layouts cannot take keeps fp32 (CPU) or falls back to bf16 (CUDA). ``fp32`` leaves the model as
loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kvdrive.runtime.model.gguf_blocks import Blocks
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

    def summary(self) -> str:
        """``int4 x 90, int8 x 31`` (formats by count), or ``fp32`` when nothing was converted."""
        counts: dict[str, int] = {}
        for fmt in self.formats.values():
            counts[fmt] = counts.get(fmt, 0) + 1
        return ", ".join(f"{f} x {n}" for f, n in sorted(counts.items())) or "fp32"

    def fingerprint(self) -> str:
        """What the format adds to the model's page fingerprint: KV computed with other weights differs."""
        return "" if set(self.formats.values()) <= {"fp32"} else f"|weights={self.requested}:{self.summary()}"


def _types(sources: Mapping[str, str], names: tuple[str, ...]) -> list[str]:
    return [sources[n] for n in names if n in sources]


def _format(requested: str, types: list[str], shape: torch.Size, device: torch.device) -> str:
    fmt = resolve_format(requested, types, device)
    if not supports(fmt, shape[0], shape[1], device):
        fmt = "fp32" if device.type == "cpu" else "bf16"
    return fmt


def _blocks(blocks_of: Callable[[str], Blocks | None], names: tuple[str, ...]) -> Blocks | None:
    parts = [blocks_of(f"model.{n}") or blocks_of(n) for n in names]  # lm_head.weight has no model. prefix
    if not parts or any(p is None for p in parts):
        return None
    return Blocks.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]


def apply_weights(model: nn.Module, requested: str, sources: Mapping[str, str], device: torch.device,
                  dtype: torch.dtype, blocks_of: Callable[[str], Blocks | None] | None = None) -> WeightPlan:
    """Convert ``model`` (loaded in float32) in place; ``sources``: Hugging Face name (``model.``
    prefix dropped) -> the type the checkpoint stored it in (``Q4_1``, ``BF16``...); ``blocks_of``: the
    same names -> the tensor's exact GGUF blocks, or None."""
    sources = {k.removeprefix("model."): v for k, v in sources.items()}

    def exact(names: tuple[str, ...]) -> Blocks | None:
        return None if blocks_of is None else _blocks(blocks_of, names)

    formats: dict[str, str] = {}
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined, arg-type]
        for attr, names in _SOURCES.items():
            linear = getattr(layer, attr)
            full = tuple(f"layers.{i}.{n}" for n in names)
            fmt = _format(requested, _types(sources, full), linear.weight.shape, device)
            if fmt != "fp32" or device.type != "cpu" or dtype != torch.float32:
                blocks = exact(full) if fmt in ("int8", "int4") else None
                setattr(layer, attr, QuantLinear(linear.weight, linear.bias, fmt, device, blocks))
                formats[f"layers.{i}.{attr}"] = fmt
    embed: nn.Embedding = model.embed_tokens  # type: ignore[assignment]
    head: nn.Linear | None = model.lm_head  # type: ignore[assignment]
    embed_fmt = _format(requested, _types(sources, ("embed_tokens.weight",)), embed.weight.shape, device)
    if head is None:  # tied: one matrix for both
        if embed_fmt != "fp32":
            table = QuantLinear(embed.weight, None, embed_fmt, device, _if_int(embed_fmt, exact(("embed_tokens.weight",))),
                                keep_rows=True)
            model.embed_tokens = QuantEmbedding(table, dtype)  # type: ignore[assignment]
            formats["embed_tokens (tied LM head)"] = embed_fmt
    else:
        head_types = _types(sources, ("lm_head.weight",)) or _types(sources, ("embed_tokens.weight",))
        head_fmt = _format(requested, head_types, head.weight.shape, device)
        if head_fmt != "fp32":
            head_blocks = exact(("lm_head.weight",)) if "lm_head.weight" in sources else exact(("embed_tokens.weight",))
            model.lm_head = QuantLinear(head.weight, None, head_fmt, device,  # type: ignore[assignment]
                                        _if_int(head_fmt, head_blocks))
            formats["lm_head"] = head_fmt
        if embed_fmt != "fp32":
            table = QuantLinear(embed.weight, None, embed_fmt, device, _if_int(embed_fmt, exact(("embed_tokens.weight",))),
                                keep_rows=True)
            model.embed_tokens = QuantEmbedding(table, dtype)  # type: ignore[assignment]
            formats["embed_tokens"] = embed_fmt
    return WeightPlan(requested, formats)


def _if_int(fmt: str, blocks: Blocks | None) -> Blocks | None:
    return blocks if fmt in ("int8", "int4") else None
