"""The real demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' reference loader.

transformers + gguf dequantize the same file into its own Llama implementation; our logits must
agree at every position of a 64-token prompt, our tokenizer must produce the same ids, and our
chat template rendering must be the same string.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kvdrive.runtime.engine import LLMEngine, ModelRunner, SamplingParams
from kvdrive.runtime.model import LoadedModel
from kvdrive.runtime.model.registry import demo_model_path
from kvdrive.runtime.prompt import ChatMessage

KVDRIVE = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvdrive")
# Measured: max |log p diff| 6.5e-05 (float32 on CPU). The bound leaves room for BLAS differences.
LOGPROB_TOLERANCE = 1e-3

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, Apollo 11 landed on the Moon; Armstrong said: \"That's one small step.\"",
    "Numbers 3.14159 and 271828, emoji 🚀, accents naïve café, CJK 東京, tabs\tand\nnewlines.",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


def _prompt_64(demo: LoadedModel) -> list[int]:
    text = " ".join(TEXTS[:3]) + " The capital of France is Paris, and the capital of Italy is"
    ids = demo.tokenizer.encode(text)
    assert len(ids) >= 64
    return ids[:64]


def test_demo_config(demo: LoadedModel) -> None:
    c = demo.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.head_dim) == (30, 9, 3, 576, 64)
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192 and c.tie_word_embeddings
    assert demo.model_id == "SmolLM2-135M-Instruct"


def test_logits_match_reference(demo: LoadedModel, reference) -> None:  # type: ignore[no-untyped-def]
    model, _ = reference
    ids = _prompt_64(demo)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float()  # [64, V]
    gen = ModelRunner(demo)
    ours = gen.prefill(gen.new_sequence(), ids, all_logits=True)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1)), "top-1 token differs"
    diff = (torch.log_softmax(ours, -1) - torch.log_softmax(expected, -1)).abs().max().item()
    assert diff < LOGPROB_TOLERANCE, f"max |log p diff| {diff}"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_reference(demo: LoadedModel, reference, text: str) -> None:  # type: ignore[no-untyped-def]
    _, tok = reference
    ours = demo.tokenizer.encode(text)
    assert ours == tok(text, add_special_tokens=False)["input_ids"]
    assert demo.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_chat_template_matches_reference(demo: LoadedModel, reference) -> None:  # type: ignore[no-untyped-def]
    _, tok = reference
    msgs = [("system", "Be brief."), ("user", "Hi!"), ("assistant", "Hello."), ("user", "Capital of France?")]
    expected = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], tokenize=False,
                                       add_generation_prompt=True)
    assert demo.tokenizer.render_chat([ChatMessage(r, c) for r, c in msgs]) == expected


def test_greedy_chat_answer(demo: LoadedModel) -> None:
    ids = demo.tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    out = demo.tokenizer.decode(list(LLMEngine(ModelRunner(demo)).generate_tokens(ids, SamplingParams(max_tokens=16))))
    assert out == "The capital of France is Paris."


def test_seeded_sampling_is_reproducible(demo: LoadedModel) -> None:
    ids = demo.tokenizer.encode_chat([ChatMessage("user", "Write a short poem about the sea.")])
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    gen = ModelRunner(demo)
    first, second = list(LLMEngine(gen).generate_tokens(ids, params)), list(LLMEngine(gen).generate_tokens(ids, params))
    other = list(LLMEngine(gen).generate_tokens(ids, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8)))
    assert first == second
    assert first != other
    assert gen.cache.free_pages == gen.cache.num_pages  # every sequence released its pages


def test_cli_generate_prints_only_the_completion(tmp_path: Path) -> None:
    proc = subprocess.run(
        [KVDRIVE, "generate", "--model", "demo", "--chat", "--prompt", "What is the capital of France?",
         "--max-tokens", "16"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."


def test_cli_stop_string(tmp_path: Path) -> None:
    proc = subprocess.run(
        [KVDRIVE, "generate", "--model", "demo", "--chat", "--prompt", "What is the capital of France?",
         "--max-tokens", "16", "--stop", " is"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France"
