"""Our Gemma 3 model against transformers' Gemma3ForCausalLM on tiny random checkpoints (fp32, CPU).

Each case saves a random Gemma 3 (sliding and global layers, window 8, per-layer RoPE bases, q/k norms,
random (1 + w) norm weights) and loads it with ``load_model`` from safetensors, from a GGUF written the
way llama.cpp writes Gemma (norms stored as 1 + w), or as the text part of a multimodal checkpoint. The
logits of all 40 positions (five times the window) must match transformers at full attention. Our model
is driven by a dense test backend, not the engine's KV cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gemma3_support import config_json, run_logits, spm_vocab, tiny_gemma3, write_gemma3_gguf

from kvdrive.runtime.model import Gemma3Model, LoadedModel, load_model
from kvdrive.runtime.model.hf_loader import config_from_hf, weight_renamer

ATOL, RTOL = 2e-4, 1e-4  # as the Llama cases
WINDOW = 8

CASES = {
    # layers 2 and 5 global, linear rope scaling on them, queries scaled by 24 (not head_dim 32)
    "gqa-linear-rope": {},
    # one KV head, untied lm_head, q/k/v/o biases, final logit soft-capping, query scalar = head_dim
    "mqa-untied-bias-softcap": dict(num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True,
                                    final_logit_softcapping=0.5, query_pre_attn_scalar=32),
    # no layer_types: Gemma 3's default pattern (every 6th layer global), default rope bases
    "default-pattern": dict(layer_types=None, rope_parameters=None),
}


def _ids(n: int = 40, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()  # [T, V]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    ref = tiny_gemma3(tmp_path, **CASES[case])
    loaded = load_model(str(tmp_path), progress=False)
    assert isinstance(loaded.model, Gemma3Model)
    cfg = loaded.config
    types = config_json(tmp_path)["layer_types"]
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert cfg.sliding_layers and cfg.global_layers and cfg.sliding_window == WINDOW
    ids = _ids()
    expected = _reference(ref, ids)
    ours = run_logits(loaded, ids)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_matches_one_pass(tmp_path: Path) -> None:
    """Chunks of 7 tokens (windows straddle chunk boundaries) give the logits of one pass."""
    ref = tiny_gemma3(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    ids = _ids(seed=2)
    torch.testing.assert_close(run_logits(loaded, ids, chunk=7), _reference(ref, ids), atol=ATOL, rtol=RTOL)


def test_sliding_window_and_local_rope_matter(tmp_path: Path) -> None:
    """The comparison can fail: attending past the window, or rotating sliding layers with the global
    base, leaves the first positions equal and changes the ones past the window."""
    ref = tiny_gemma3(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    ids = _ids(seed=3)
    expected = _reference(ref, ids)
    no_window = run_logits(loaded, ids, sliding=False)
    torch.testing.assert_close(no_window[:WINDOW], expected[:WINDOW], atol=ATOL, rtol=RTOL)
    assert (no_window[WINDOW:] - expected[WINDOW:]).abs().max() > 100 * ATOL

    model = loaded.model
    assert isinstance(model, Gemma3Model)
    model._ropes = [model.rope_global] * len(model._ropes)  # every layer with the global base and scaling
    assert (run_logits(loaded, ids) - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("pattern", [False, True], ids=["implied-pattern", "pattern-in-file"])
def test_gguf_written_like_llama_cpp_matches(pattern: bool, tmp_path: Path) -> None:
    """A GGUF whose norm weights hold 1 + w (llama.cpp's converter) loads to transformers' logits. Without
    a pattern in the file every 6th layer is global (llama.cpp's rule); with one, its flags are used."""
    tokens, _ = spm_vocab()
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2 if pattern else None
    ref = tiny_gemma3(tmp_path, vocab_size=len(tokens), query_pre_attn_scalar=32,  # llama.cpp: head_dim
                      layer_types=layer_types, rope_parameters=None)  # transformers' defaults: 1e6 and 1e4
    write_gemma3_gguf(tmp_path / "tiny.gguf", ref, pattern=pattern)
    loaded = load_model(str(tmp_path / "tiny.gguf"), progress=False)
    cfg = loaded.config
    assert (cfg.architecture, cfg.sliding_window) == ("gemma3", WINDOW)
    assert cfg.sliding_layers == ((0, 1, 3, 4) if pattern else (0, 1, 2, 3, 4))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 32.0)
    assert cfg.hidden_activation == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    ids = _ids()
    torch.testing.assert_close(run_logits(loaded, ids), _reference(ref, ids), atol=ATOL, rtol=RTOL)


def _multimodal_checkpoint(directory: Path) -> torch.nn.Module:
    """A tiny Gemma3ForConditionalGeneration (vision tower included) saved as transformers saves it."""
    import transformers
    from tokenizerkit import byte_level_tokenizer_json

    vocab = byte_level_tokenizer_json(directory)
    text = transformers.Gemma3TextConfig(
        vocab_size=vocab + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=vocab + 3, boi_token_index=vocab + 1, eoi_token_index=vocab + 2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def test_multimodal_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    ref = _multimodal_checkpoint(tmp_path)
    raw = config_json(tmp_path)
    assert raw["model_type"] == "gemma3" and "text_config" in raw
    rename = weight_renamer(raw)
    assert rename is not None and rename("model.vision_tower.vision_model.post_layernorm.weight") is None
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config.num_layers == 3 and loaded.config.sliding_layers == (0, 2)
    ids = _ids(seed=4)
    torch.testing.assert_close(run_logits(loaded, ids), _reference(ref, ids), atol=ATOL, rtol=RTOL)


def test_transformers_v4_style_config() -> None:
    """Older configs: rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern."""
    raw = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300, hidden_size=64,
               intermediate_size=96, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1,
               head_dim=32, rope_theta=500000.0, rope_local_base_freq=20000.0, sliding_window=16,
               sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0},
               final_logit_softcapping=None, query_pre_attn_scalar=32)
    cfg = config_from_hf(raw)
    assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and cfg.global_layers == (5, 11)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (500000.0, 20000.0)
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 8.0)
    assert cfg.final_logit_softcapping is None and cfg.tie_word_embeddings  # Gemma 3's default


def test_llama_config_is_unchanged(hf_model_factory) -> None:
    """The Gemma fields' defaults leave a Llama-family model as it was."""
    path, _ = hf_model_factory(arch="llama")
    loaded: LoadedModel = load_model(str(path), progress=False)
    cfg = loaded.config
    assert cfg.sliding_layers == () and cfg.global_layers == tuple(range(cfg.num_layers))
    assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (None, None, None)
    assert cfg.hidden_activation == "silu" and not isinstance(loaded.model, Gemma3Model)
