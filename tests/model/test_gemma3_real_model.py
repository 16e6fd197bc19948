"""The real Gemma 3 270M (base, Q4_K_M GGUF from its PyPI chunk packages) against transformers.

transformers dequantizes the same GGUF into its own Gemma3ForCausalLM (fp32); on short prompts our
logits (dense test backend) must agree at every position and the greedy next tokens must be equal.
Loading both models takes most of the time (about a minute on 2 cores), hence ``slow``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gemma3_support import (
    NOT_INSTALLED,
    gemma3_installed,
    hf_reference_model,
    real_gguf,
    real_loaded,
    run_logits,
)

from kvdrive.runtime.model import Gemma3Model, ModelLoadError
from kvdrive.runtime.model import loader as model_loader
from kvdrive.runtime.model import registry as model_registry

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village"]
# Measured on CPU, fp32: max |logit diff| 1.8e-05 .. 3.4e-05 on these prompts (logits up to ~32)
LOGIT_TOLERANCE = 1e-3

needs_model = pytest.mark.skipif(not gemma3_installed(), reason=NOT_INSTALLED)


@pytest.mark.slow
@needs_model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_and_greedy_tokens_match_transformers(prompt: str) -> None:
    loaded = real_loaded()
    ids = loaded.tokenizer.encode(prompt)
    ours = run_logits(loaded, ids)  # [T, V]
    with torch.no_grad():
        expected = hf_reference_model()(torch.tensor([ids])).logits[0].float()
    diff = (ours - expected).abs().max().item()
    print(f"gemma3-270m {prompt!r}: {len(ids)} tokens, max |logit diff| {diff:.2e}")
    assert diff < LOGIT_TOLERANCE, diff
    assert ours.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.slow
@needs_model
def test_config_and_identity() -> None:
    loaded = real_loaded()
    cfg = loaded.config
    assert isinstance(loaded.model, Gemma3Model)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.context_length) == (640, 262144, 32768)
    assert cfg.sliding_window == 512 and cfg.global_layers == (5, 11, 17)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    assert loaded.model_id == "gemma-3-270m" and loaded.path == real_gguf()
    assert model_loader.resolve_model_path("gemma3-270m") == real_gguf()  # cached: assembled once
    if importlib.util.find_spec(model_registry.DEMO_PACKAGE) is not None:
        from kvdrive.runtime.model.gguf_loader import open_gguf

        assert loaded.fingerprint != open_gguf(model_registry.demo_model_path())[3]


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_registry, "GEMMA3_PACKAGE", "gemma3_package_that_is_not_there")
    model_registry.gemma3_270m_path.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match="make install"):
            model_loader.load_model("gemma3-270m", progress=False)
    finally:
        model_registry.gemma3_270m_path.cache_clear()
