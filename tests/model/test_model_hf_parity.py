"""Our Llama-family model against transformers on tiny random checkpoints loaded from safetensors.

Each case saves a random transformers model (architecture, RoPE scaling, GQA, tied embeddings,
q/k/v bias) to a Hugging Face directory, loads it with ``kvdrive.runtime.model.load_model`` and
compares the logits of every position.
"""

from __future__ import annotations

import pytest
import torch

from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.model import load_model

CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie=True),
    "llama-mha": dict(arch="llama", num_key_value_heads=4),
    "llama-linear-rope": dict(arch="llama", rope={"rope_type": "linear", "factor": 2.0}),
    "llama3-rope": dict(arch="llama", rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-rope": dict(arch="llama", rope={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 16}),
    "dynamic-rope": dict(arch="llama", rope={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=24),
    "qwen2-bias": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
}


def _ours_logits(path, ids: list[int], chunk: int = 512) -> torch.Tensor:
    loaded = load_model(str(path), progress=False)
    gen = ModelRunner(loaded, EngineConfig(page_size=4, prefill_chunk=chunk, tiers=TierConfig()))
    seq = gen.new_sequence()
    return gen.prefill(seq, ids, all_logits=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, hf_model_factory) -> None:
    path, ref = hf_model_factory(**CASES[case])
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (40,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()  # [T, V]
    ours = _ours_logits(path, ids)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_match_one_pass(hf_model_factory) -> None:
    """Prefill in chunks of 7 and token-by-token decode give the logits of one full forward."""
    path, ref = hf_model_factory(arch="llama")
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_ours_logits(path, ids, chunk=7), expected, atol=2e-4, rtol=1e-4)

    loaded = load_model(str(path), progress=False)
    gen = ModelRunner(loaded, EngineConfig(page_size=4, tiers=TierConfig()))
    seq = gen.new_sequence()
    gen.prefill(seq, ids[:10])
    steps = [gen.decode([(seq, t)])[0] for t in ids[10:]]
    torch.testing.assert_close(torch.stack(steps), expected[10:], atol=2e-4, rtol=1e-4)


def test_batched_decode_matches_single_sequences(hf_model_factory) -> None:
    """Two sequences of different lengths decoded in one batch equal each decoded alone."""
    path, ref = hf_model_factory(arch="qwen2")
    loaded = load_model(str(path), progress=False)
    gen = ModelRunner(loaded, EngineConfig(page_size=4, tiers=TierConfig()))
    a, b = [5, 6, 7, 8, 9, 10, 11], [40, 41, 42]
    sa, sb = gen.new_sequence(), gen.new_sequence()
    gen.prefill(sa, a)
    gen.prefill(sb, b)
    batched = gen.decode([(sa, 12), (sb, 43)])  # [2, V]
    with torch.no_grad():
        ea = ref(torch.tensor([a + [12]])).logits[0, -1]
        eb = ref(torch.tensor([b + [43]])).logits[0, -1]
    torch.testing.assert_close(batched, torch.stack([ea, eb]).float(), atol=2e-4, rtol=1e-4)


def test_hf_directory_tokenizer_and_chat_template(hf_model_factory) -> None:
    path, _ = hf_model_factory(arch="llama")
    loaded = load_model(str(path), progress=False)
    tok = loaded.tokenizer
    text = "héllo wörld 123 <s>"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<s>") == [tok.bos_token_id]  # special token is one id, not split into bytes
    from kvdrive.runtime.prompt import ChatMessage

    rendered = tok.render_chat([ChatMessage("user", "hi")])
    assert rendered == "<s>user: hi\n<s>assistant: "
    assert tok.eos_token_ids[0] == tok.backend.token_to_id("</s>")
