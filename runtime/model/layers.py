"""Building blocks shared by the decoders: RMSNorm (Llama's and Gemma's ``1 + w`` form), MLP activations and
the vocabulary projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvdrive.runtime import native


def vocab_projection(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, H], [V, H] -> [M, V]
    """``hidden @ weight.T`` for the logits, the largest matmul of a decode step.

    On CPU, with a handful of rows against a vocabulary-sized weight, the BLAS call behind ``F.linear`` takes
    a slow path (SmolLM2's 49K x 576 at 2 rows: 17 ms; Gemma 3's 262K x 640: 105 ms, slower than at 4 rows).
    The same product as ``weight @ hidden.T``, transposed back, runs 2-6x faster there; a single row is
    doubled to stay on the matrix-matrix kernel. Other devices and dtypes use ``F.linear``.
    """
    m = hidden.shape[0]
    if hidden.device.type != "cpu" or hidden.dtype != torch.float32 or m == 0 or m > 64:
        return F.linear(hidden, weight)
    rows = hidden if m > 1 else hidden.repeat(2, 1)
    return (weight @ rows.T).T[:m]


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension.

    ``offset=0`` is Llama's: normalise in float32, cast back, multiply by ``w`` in the model dtype.
    ``offset=1`` is Gemma's: the weight is stored zero-centred and the float32 result is multiplied by
    ``1 + w`` (in float32) before the cast, as transformers' Gemma3RMSNorm does.
    float32 rows on a CPU go through one kernel (``native``): the same roundings, except that the sum of
    squares adds in another order.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32 \
                and x.dim() in (2, 3) and x.stride(-1) == 1:
            module = native.kernels()  # one call for the seven ops below (``native/kernels/norm.cpp``)
            if module is not None:
                return module.rms_norm(x, self.weight, self.eps, self.offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset == 0.0:
            return self.weight * xf.to(x.dtype)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP gate activation named as in Hugging Face configs (``hidden_act`` / ``hidden_activation``)."""
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")


class HFWeights:
    """A Hugging Face-named state dict being copied into a model: every weight taken once, shapes checked,
    leftovers reported (``model.`` prefixes are dropped, so names read ``layers.0.self_attn.q_proj.weight``)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.w = {k.removeprefix("model."): v for k, v in weights.items()}
        self.consumed: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.w

    def take(self, name: str) -> torch.Tensor:
        if name not in self.w:
            raise KeyError(f"missing weight {name!r}")
        self.consumed.add(name)
        return self.w[name]

    @staticmethod
    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"weight {name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))

    def load(self, param: torch.Tensor, name: str) -> None:
        self.put(param, self.take(name), name)

    def load_ends(self, model: nn.Module) -> None:
        """The embeddings, the final norm and the LM head (the embeddings again when it is tied or absent)."""
        self.load(model.embed_tokens.weight, "embed_tokens.weight")
        self.load(model.norm.weight, "norm.weight")
        if model.lm_head is not None:
            name = "lm_head.weight"
            self.put(model.lm_head.weight, self.take(name) if name in self else self.take("embed_tokens.weight"), name)
        self.consumed.add("lm_head.weight")

    def load_projections(self, layer: nn.Module, prefix: str, qkv_bias: bool, o_bias: bool = False) -> None:
        """A decoder layer's fused q/k/v and gate/up projections, its output and down projections."""
        def cat(names: list[str]) -> torch.Tensor:
            return torch.cat([self.take(prefix + n) for n in names], dim=0)

        self.put(layer.qkv_proj.weight, cat([f"self_attn.{n}_proj.weight" for n in "qkv"]), prefix + "qkv_proj")
        if qkv_bias:
            self.put(layer.qkv_proj.bias, cat([f"self_attn.{n}_proj.bias" for n in "qkv"]), prefix + "qkv_proj.bias")
        self.load(layer.o_proj.weight, prefix + "self_attn.o_proj.weight")
        if o_bias:
            self.load(layer.o_proj.bias, prefix + "self_attn.o_proj.bias")
        self.put(layer.gate_up_proj.weight, cat(["mlp.gate_proj.weight", "mlp.up_proj.weight"]), prefix + "gate_up_proj")
        self.load(layer.down_proj.weight, prefix + "mlp.down_proj.weight")

    def check_all_used(self, ignore: tuple[str, ...] = ("rotary_emb",)) -> None:
        unused = sorted(k for k in self.w if k not in self.consumed and not any(s in k for s in ignore))
        if unused:
            raise ValueError(f"unexpected weights in checkpoint: {unused[:5]}{' ...' if len(unused) > 5 else ''}")
