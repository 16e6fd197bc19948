"""Model configuration: the architecture hyper-parameters every loader produces (frozen, plain data)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


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
    """Hyper-parameters of a Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2)."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def context_length(self) -> int:
        """Longest sequence the model serves (dynamic NTK scaling stretches the trained context)."""
        if self.rope_scaling.kind == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
