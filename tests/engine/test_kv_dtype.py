"""The KV cache's dtype (``--kv-dtype``): the compute dtype by default, or one of its own; a 16-bit cache
holds half a float32 cache's bytes and decodes the same text here (its measured cost: docs/weights.md)."""

from __future__ import annotations

import pytest
import torch

from kvdrive.runtime.cli import engine_config, parse_args
from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams
from kvdrive.runtime.model import LoadedModel, load_model


@pytest.mark.parametrize(("flags", "want"), [
    ([], None),  # the model's dtype, resolved at load: float32 on a CPU, bfloat16 on CUDA
    (["--dtype", "float32"], torch.float32),
    (["--dtype", "float16"], torch.float16),
    (["--dtype", "float16", "--kv-dtype", "bfloat16"], torch.bfloat16),
    (["--kv-dtype", "bfloat16"], torch.bfloat16),
    (["--dtype", "bfloat16", "--kv-dtype", "float32"], torch.float32),
])
def test_the_cache_dtype_from_the_flags(flags: list[str], want: torch.dtype | None) -> None:
    args = parse_args(["serve", *flags])
    assert engine_config(args, max_sequences=1).kv_dtype == want


def test_a_bad_kv_dtype_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--kv-dtype", "int8"])
    assert exc.value.code == 2 and "--kv-dtype: invalid choice: 'int8'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return load_model("demo", progress=False)


def test_a_bfloat16_cache_holds_half_the_bytes_and_answers_the_same(demo: LoadedModel) -> None:
    prompt = demo.tokenizer.encode("The three primary colors are red, yellow and")
    answers, page_bytes = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = ModelRunner(demo, EngineConfig(max_sequences=1, kv_dtype=dtype))
        try:
            page_bytes[dtype] = gen.cache.layout.page_bytes
            answers[dtype] = list(LLMEngine(gen).generate_tokens(prompt, SamplingParams(max_tokens=12, temperature=0.0)))
        finally:
            gen.close()
    assert page_bytes[torch.bfloat16] * 2 == page_bytes[torch.float32]
    assert answers[torch.bfloat16] == answers[torch.float32]
