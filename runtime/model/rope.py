"""Rotary position embeddings, including the common frequency-scaling variants.

Owns the inverse frequencies (default, linear, dynamic NTK, Llama 3, YaRN, explicit per-dimension
factors as stored in Llama 3 GGUF files) and applying the rotation to queries and keys in the
"rotate half" (NeoX / Hugging Face) layout.
"""

from __future__ import annotations

import math

import torch

from kvdrive.runtime import native
from kvdrive.runtime.model.config import ModelConfig, RopeScaling


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:  # [dim/2]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling, default_ctx: int) -> torch.Tensor:
    old_ctx = s.original_max_position_embeddings or default_ctx
    low_wavelen = old_ctx / s.low_freq_factor
    high_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, s: RopeScaling, default_ctx: int) -> tuple[torch.Tensor, float]:
    orig_ctx = s.original_max_position_embeddings or default_ctx
    factor = s.factor
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_extra, inv_inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq, attention_factor


class RotaryEmbedding:
    """cos/sin tables for positions, computed lazily and grown on demand."""

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None = None) -> None:
        self.config = config
        self.dim = config.head_dim
        s = config.rope_scaling
        base = config.rope_theta
        self.attention_scaling = 1.0
        inv_freq = _base_inv_freq(base, self.dim)
        if s.kind == "linear":
            inv_freq = inv_freq / s.factor
        elif s.kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, s, config.max_position_embeddings)
        elif s.kind == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(base, self.dim, s, config.max_position_embeddings)
        elif s.kind not in ("default", "dynamic"):
            raise ValueError(f"unsupported rope scaling type {s.kind!r}")
        if freq_factors is not None:  # Llama 3 GGUF files store the scaling as rope_freqs.weight
            inv_freq = inv_freq / freq_factors.to(torch.float32)
        self.inv_freq = inv_freq  # [D/2]
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._dynamic_len = config.max_position_embeddings
        # the last positions rotated by, with their rows: (positions, dtype, cos, sin)
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """Dynamic NTK: grow the base once positions pass the trained context."""
        c = self.config
        orig = c.rope_scaling.original_max_position_embeddings or c.max_position_embeddings
        f = c.rope_scaling.factor
        base = c.rope_theta * ((f * seq_len / orig) - (f - 1)) ** (self.dim / (self.dim - 2))
        return _base_inv_freq(base, self.dim)

    def _tables(self, needed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.rope_scaling.kind == "dynamic" and needed > self._dynamic_len:
            self.inv_freq = self._dynamic_inv_freq(needed)
            self._dynamic_len = needed
            self._cos = torch.empty(0)
        if self._cos.shape[0] < needed or self._cos.device != device:
            n = max(needed, 2 * self._cos.shape[0], 256)
            t = torch.arange(n, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)  # [n, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
            self._cos = (emb.cos() * self.attention_scaling).to(device)
            self._sin = (emb.sin() * self.attention_scaling).to(device)
        return self._cos, self._sin

    def _at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] of positions [N]. Every layer of a forward pass rotates by the same positions
        tensor, so the last one's rows are kept and looked up once per pass, not once per layer."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos_t, sin_t = self._tables(int(positions.max().item()) + 1, positions.device)
        cos = cos_t[positions].unsqueeze(1).to(dtype)  # [N, 1, D]
        sin = sin_t[positions].unsqueeze(1).to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [N, Hq, D] and k [N, Hkv, D] by their positions [N]: on a CPU in float32 by the kernel
        (``native/kernels/rope.cpp``, equal bit for bit), elsewhere by the same formula in torch ops."""
        cos, sin = self._at(positions, q.dtype)
        module = native.kernels() if q.device.type == "cpu" and q.dtype == torch.float32 else None
        if module is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            q, k = module.rope_rotate(q, k, cos, sin)
            return q, k
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
