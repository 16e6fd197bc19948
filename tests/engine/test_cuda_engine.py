"""The runtime on a CUDA device, narrated on tiny random models: the model and its device tier live in CUDA
memory, pages travel device -> pinned DRAM -> SSD and back, and what a CUDA step computes is what the CPU
step computes (in float32 exactly enough that greedy outputs agree), for every weight format.

These run only where torch sees a CUDA device (``-m gpu``; ``bench/gpu_check.sh`` runs them on a GPU machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from enginekit import run_dry, small_engine, submit, tokens, with_reserve
from gguf_builder import decoded_logits, written_reference
from modelkit import random_tokens

from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.model import LoadedModel, load_model
from kvdrive.runtime.model.weight_formats import QuantLinear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE = 4
CUDA = torch.device("cuda")


def _runner(loaded: LoadedModel, hot_pages: int | None = None, dram_pages: int = 0, ssd: Path | None = None,
            **kw: object) -> ModelRunner:
    """Two rows; ``hot_pages``: a device tier of that many pages beside the rows' reserves (None: all)."""
    shape = EngineConfig(page_size=PAGE, max_sequences=2, **kw)  # type: ignore[arg-type]
    layout = ModelRunner(loaded, EngineConfig(page_size=PAGE)).cache.layout
    page = layout.page_bytes
    gpu = None if hot_pages is None else with_reserve(layout, hot_pages * page, shape)
    tiers = TierConfig(envelope_bytes=gpu, dram_bytes=dram_pages * page, ssd_dir=None if ssd is None else str(ssd),
                       ssd_bytes=0 if ssd is None else 64 << 20)
    return ModelRunner(loaded, replace(shape, tiers=tiers))


def _logits(gen: ModelRunner, prompt: Sequence[int], tokens: list[int]) -> torch.Tensor:
    """The prompt's last logits, then one decode step per token: [1 + len(tokens), V] on the CPU."""
    seq, reused = gen.open_sequence(prompt)
    out = [gen.prefill(seq, prompt[reused:]).reshape(-1)]
    for t in tokens:
        out.append(gen.decode([(seq, t)])[0])
    gen.release(seq)
    return torch.stack(out).float().cpu()


def _greedy(gen: ModelRunner, prompt: Sequence[int], n: int = 12) -> list[int]:
    return list(LLMEngine(gen).generate_tokens(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))


@pytest.fixture
def tiny_path(hf_model_factory) -> Path:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=1024)
    return Path(path)


def test_the_model_and_its_device_tier_live_in_cuda_memory(tiny_path: Path) -> None:
    loaded = load_model(str(tiny_path), device="cuda", progress=False)
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16  # a GPU computes in bf16 by default
    assert all(p.device.type == "cuda" for p in loaded.model.parameters())
    gen = _runner(loaded)
    try:
        assert gen.cache.device.type == "cuda"
        out = _greedy(gen, random_tokens(40))
        assert len(out) == 12 and all(0 <= t < loaded.config.vocab_size for t in out)
    finally:
        gen.close()


def test_cuda_decodes_what_the_cpu_decodes_with_pages_on_every_tier(tiny_path: Path, tmp_path: Path) -> None:
    """float32 on both devices: a 150-token prompt (38 pages) under a 4-page device tier and a 6-page DRAM
    tier (pinned) lives mostly on the SSD; full attention reads every page each step, so each step fetches
    from all three tiers. Greedy tokens equal the CPU's, and the logits agree to float32 rounding."""
    prompt = random_tokens(150)
    cpu = load_model(str(tiny_path), device="cpu", progress=False)
    ref_gen = _runner(cpu, full_attention=True)
    ref = _greedy(ref_gen, prompt)
    ref_logits = _logits(ref_gen, prompt, ref)
    ref_gen.close()
    gpu = load_model(str(tiny_path), device="cuda", dtype=torch.float32, progress=False)
    gen = _runner(gpu, hot_pages=4, dram_pages=6, ssd=tmp_path / "ssd", full_attention=True, placement="ondemand")
    try:
        assert _greedy(gen, prompt) == ref
        torch.testing.assert_close(_logits(gen, prompt, ref), ref_logits, atol=2e-4, rtol=1e-3)
        reads = gen.cache.page_reads()
        assert reads.get("ssd", 0) > 0 and reads.get("dram", 0) > 0 and reads.get("gpu", 0) > 0, reads
    finally:
        gen.close()


def test_sparse_attention_with_a_covering_budget_equals_full_attention_on_cuda(tiny_path: Path) -> None:
    loaded = load_model(str(tiny_path), device="cuda", dtype=torch.float32, progress=False)
    prompt = random_tokens(150)
    full_gen = _runner(loaded, full_attention=True)
    ref = _greedy(full_gen, prompt)
    full = _logits(full_gen, prompt, ref)
    full_gen.close()
    sparse_gen = _runner(loaded, token_budget=1024)
    try:
        torch.testing.assert_close(_logits(sparse_gen, prompt, ref), full, atol=1e-5, rtol=1e-5)
    finally:
        sparse_gen.close()


def test_prefix_pages_written_from_cuda_are_reused_after_a_restart(tiny_path: Path, tmp_path: Path) -> None:
    loaded = load_model(str(tiny_path), device="cuda", progress=False)
    prompt = random_tokens(120, seed=3)
    first = _runner(loaded, ssd=tmp_path / "ssd")
    try:
        expected = _greedy(first, prompt)
    finally:
        first.close()
    second = _runner(loaded, ssd=tmp_path / "ssd")
    try:
        seq, reused = second.open_sequence(prompt)
        assert reused >= 116  # every sealed page of the prompt came back from the SSD into CUDA memory
        second.release(seq)
        assert _greedy(second, prompt) == expected
    finally:
        second.close()


def test_the_engines_loop_on_cuda_gives_the_same_tokens_under_a_small_device_tier(tiny_path: Path,
                                                                                   tmp_path: Path) -> None:
    """The scheduler's loop on CUDA, two requests batched: under a 6-page device tier (pages spill to pinned
    DRAM and the SSD, preemption included) each request gets the tokens it gets with every page on the device."""
    loaded = load_model(str(tiny_path), device="cuda", dtype=torch.float32, progress=False)
    prompts = [random_tokens(60, seed=i) for i in range(2)]
    results = []
    for gpu_pages, ssd in ((400, tmp_path / "roomy"), (6, tmp_path / "small")):
        engine = small_engine(loaded, ssd, gpu_pages=gpu_pages, dram_pages=8, token_budget_pages=4)
        try:
            submit(engine, prompts, max_tokens=10)
            outs = run_dry(engine)
            results.append({rid: tokens(o) for rid, o in outs.items()})
        finally:
            engine.runner.close()
    assert sorted(results[0]) == ["r0", "r1"] and all(len(t) == 10 for t in results[0].values())
    assert results[1] == results[0]


@pytest.mark.parametrize("fmt,bound", [("fp32", 1e-6), ("bf16", 1e-2), ("int8", 2e-2), ("int4", 0.2)])
def test_each_weight_format_multiplies_on_cuda(fmt: str, bound: float) -> None:
    """tinygemm int4, int8 dequantized per call, bf16 and fp32: each within what its rounding costs."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 128)
    layer = QuantLinear(w, None, fmt, CUDA, keep_rows=True)
    ref = x.double() @ w.double().T
    y = layer(x.to(CUDA)).cpu()
    assert y.shape == (3, 64)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < bound
    rows = layer.rows(torch.tensor([0, 5], device=CUDA)).cpu()  # the embedding reads the same table
    assert float((rows.double() - w[[0, 5]].double()).abs().max() / w.abs().max()) < bound


@pytest.mark.parametrize("qtype,weights", [("Q4_0", "auto"), ("Q8_0", "int8"), ("Q4_1", "bf16")])
def test_a_quantized_gguf_decodes_on_cuda_close_to_its_fp32_reference(qtype: str, weights: str,
                                                                       hf_model_factory, tmp_path: Path) -> None:
    """The file's blocks on CUDA (auto: tinygemm int4 for Q4) against transformers in fp32 with the values the
    file holds: bf16 activations cost some precision, so the bar is on the greedy tokens and a loose KL."""
    _, ref = hf_model_factory(arch="llama", tie=False, hidden_size=128, intermediate_size=256)
    ids, expected = written_reference(tmp_path / "tiny.gguf", ref, qtype)
    got = decoded_logits(tmp_path / "tiny.gguf", ids, weights, device="cuda")
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert float(kl) < 5e-3, float(kl)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
