"""Gemma 3 (text) in torch: the decoder of Gemma 3 270M / 1B and the text tower of the larger ones.

Owns what Gemma 3 does differently from the Llama family: embeddings scaled by sqrt(hidden) (in the
model dtype), zero-centred ``(1 + w)`` RMSNorms around both the attention and the MLP ("sandwich"
norms), RMSNorm on each query and key head, a GELU-tanh gated MLP, queries scaled by
``query_pre_attn_scalar``, tied embeddings with optional final logit soft-capping, and hybrid attention:
layers in ``cfg.sliding_layers`` attend to the last ``cfg.sliding_window`` positions and rotate with the
local RoPE base; the others (global) attend to everything and use ``rope_theta`` plus any rope scaling.

The model only computes; it hands each layer's q/k/v to the AttentionBackend with the layer index.
The backend reads ``ModelConfig.sliding_window`` / ``sliding_layers`` to know which layers slide.
Weights arrive as a Hugging Face-named state dict (zero-centred norms, as transformers stores them);
q/k/v and gate/up are fused for fewer matmuls.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from kvdrive.runtime.model.config import ModelConfig, RopeScaling
from kvdrive.runtime.model.interfaces import AttentionBackend
from kvdrive.runtime.model.layers import HFWeights, RMSNorm, activation
from kvdrive.runtime.model.rope import RotaryEmbedding
from kvdrive.runtime.model.weight_formats import vocab_logits

# Gemma's RMSNorm multiplies by (1 + w). llama.cpp's converter stores 1 + w in GGUF files, so the GGUF
# loader subtracts this again (as transformers' GGUF loader does) before the weights reach the model.
NORM_OFFSET = 1.0
# Gemma 3's defaults where a config leaves them out (transformers' Gemma3TextConfig and llama.cpp)
DEFAULT_ROPE_THETA = 1_000_000.0
DEFAULT_LOCAL_ROPE_THETA = 10_000.0
DEFAULT_SLIDING_PATTERN = 6  # every 6th layer is global, the others slide


def sliding_layers_for(num_layers: int, pattern: int = DEFAULT_SLIDING_PATTERN) -> tuple[int, ...]:
    """Gemma 3's layer pattern: layer i is global when (i + 1) % pattern == 0 (transformers, llama.cpp)."""
    return tuple(i for i in range(num_layers) if pattern <= 0 or (i + 1) % pattern != 0)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.input_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, eps, NORM_OFFSET)
        self.k_norm = RMSNorm(d, eps, NORM_OFFSET)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.post_feedforward_layernorm = RMSNorm(h, eps, NORM_OFFSET)
        self.act = activation(cfg.hidden_activation)
        # the backend scales scores by 1/sqrt(head_dim); Gemma wants 1/sqrt(query_pre_attn_scalar)
        scalar = cfg.query_pre_attn_scalar or d
        self.q_scale = math.sqrt(d / scalar)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [N, H]
        positions: torch.Tensor,  # [N]
        rope: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [N, H]
        cfg = self.cfg
        n = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))  # [N, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, cfg.num_heads, cfg.head_dim))  # [N, Hq, D]
        k = self.k_norm(k.reshape(n, cfg.num_kv_heads, cfg.head_dim))  # [N, Hkv, D]
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim).contiguous()  # [N, Hkv, D]
        q, k = rope.apply(q, k, positions)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = attn.attend(layer, q, k.contiguous(), v)  # [N, Hq, D]
        x = x + self.post_attention_layernorm(self.o_proj(o.reshape(n, self.q_size)))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)  # [N, I] each
        return x + self.post_feedforward_layernorm(self.down_proj(self.act(gate) * up))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # tables stay real even when the model is built on 'meta'
            self.rope_global = RotaryEmbedding(cfg)
            self.rope_local = self.rope_global
            if cfg.rope_local_theta is not None:
                local = replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=RopeScaling())
                self.rope_local = RotaryEmbedding(local)
        sliding = set(cfg.sliding_layers)
        self._ropes = [self.rope_local if i in sliding else self.rope_global for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:  # input_ids, positions: [N] -> hidden [N, H] (final norm applied)
        x = self.embed_tokens(input_ids)  # [N, H] in the model dtype
        # sqrt(hidden) rounded to the model dtype first, as transformers' Gemma3TextScaledWordEmbedding does
        x = x * torch.tensor(self.cfg.hidden_size**0.5, device=x.device).to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, positions, self._ropes[i], attn)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V] float32
        out = vocab_logits(self.embed_tokens, self.lm_head, hidden).float()
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    @torch.inference_mode()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named Gemma3ForCausalLM weights (zero-centred norm weights)."""
        w = HFWeights(weights)
        w.load_ends(self)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                w.load(getattr(layer, norm).weight, p + f"{norm}.weight")
            w.load(layer.q_norm.weight, p + "self_attn.q_norm.weight")
            w.load(layer.k_norm.weight, p + "self_attn.k_norm.weight")
            w.load_projections(layer, p, qkv_bias=self.cfg.attention_bias, o_bias=self.cfg.attention_bias)
        w.check_all_used()
