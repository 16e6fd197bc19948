"""Model configuration: the architecture hyper-parameters every loader produces (frozen, plain data)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is one of default, linear, dynamic, llama3, yarn."""

    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (mscale); None = derived from factor
    mscale: float | None = None  # yarn (DeepSeek-style variant)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder: the Llama family (SmolLM2, Llama 2/3, Mistral, Qwen2) and Gemma 3 (text).

    The defaults of the Gemma fields keep a Llama-family model unchanged."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    name: str = "model"
    # hybrid attention (Gemma 2/3): these layers attend only to the last ``sliding_window`` positions (their
    # own included); every other layer attends to the whole context
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # Gemma 3: sliding layers rotate with this base and no scaling (None: every layer uses rope_theta and
    # rope_scaling); rope_theta and rope_scaling are then the global layers' settings
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # scores scale by 1/sqrt(this); None: 1/sqrt(head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_activation: str = "silu"  # the MLP's gate activation: silu (Llama) | gelu_pytorch_tanh | gelu

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_layers and self.sliding_window <= 0:
            raise ValueError("sliding_layers need a positive sliding_window")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} out of range for {self.num_layers} layers")
        if self.hidden_activation not in ("silu", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}")

    @property
    def context_length(self) -> int:
        """Longest sequence the model serves (dynamic NTK scaling stretches the trained context)."""
        if self.rope_scaling.kind == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Layers that attend to the whole context: the ones whose KV the tiers hold."""
        sliding = set(self.sliding_layers)
        return tuple(i for i in range(self.num_layers) if i not in sliding)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
