"""A Llama-family decoder in torch: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

Covers SmolLM2, Llama 2/3, Mistral and Qwen2 (q/k/v bias). Tokens of all sequences in a step are
flattened into one dimension (N); attention over the KV cache is delegated to an AttentionBackend.
Weights arrive as a Hugging Face-named state dict; q/k/v and gate/up are fused for fewer matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvdrive.runtime.model.config import ModelConfig
from kvdrive.runtime.model.interfaces import AttentionBackend
from kvdrive.runtime.model.layers import HFWeights, RMSNorm
from kvdrive.runtime.model.rope import RotaryEmbedding
from kvdrive.runtime.model.weight_formats import vocab_logits


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

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
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim).contiguous()
        q, k = rope.apply(q, k, positions)
        o = attn.attend(layer, q, k, v)  # [N, Hq, D]
        x = x + self.o_proj(o.reshape(n, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # tables stay real even when the model is built on 'meta'
            self.rope = RotaryEmbedding(cfg, rope_freq_factors)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:  # input_ids, positions: [N] -> hidden [N, H] (final norm applied)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, positions, self.rope, attn)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V] float32
        return vocab_logits(self.embed_tokens, self.lm_head, hidden).float()

    @torch.inference_mode()
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights (``model.layers.0.self_attn.q_proj.weight`` ...)."""
        w = HFWeights(weights)
        w.load_ends(self)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            w.load(layer.input_layernorm.weight, p + "input_layernorm.weight")
            w.load(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
            w.load_projections(layer, p, qkv_bias=self.cfg.attention_bias)
        w.check_all_used()
