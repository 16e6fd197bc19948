"""Driving an ``LLMEngine`` in the engine tests: a small tiered engine, run until dry, its tokens."""

from __future__ import annotations

from pathlib import Path

from kvdrive.runtime.engine import (
    EngineConfig,
    Generator,
    LLMEngine,
    Request,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
    TierConfig,
)
from kvdrive.runtime.model import LoadedModel

PAGE = 4  # tokens a page: small, so that short prompts span many pages


def small_engine(loaded: LoadedModel, ssd: Path, gpu_pages: int, dram_pages: int, token_budget_pages: int) -> LLMEngine:
    """Two sequences at most, a device tier of ``gpu_pages`` pages (plus their open pages), DRAM of
    ``dram_pages``, a 64 MiB SSD tier in ``ssd``."""
    page = Generator(loaded, EngineConfig(page_size=PAGE)).cache.layout.page_bytes
    gen = Generator(loaded, EngineConfig(
        tiers=TierConfig(gpu_bytes=(gpu_pages + 2) * page, dram_bytes=dram_pages * page, ssd_dir=str(ssd),
                         ssd_bytes=64 << 20),
        page_size=PAGE, max_sequences=2, token_budget=token_budget_pages * PAGE))
    return LLMEngine(gen, SchedulerConfig(max_running=2))


def run_dry(engine: LLMEngine, steps: int = 3000) -> dict[str, list[RequestOutput]]:
    """Step until the engine has no work (asserting that it gets there); outputs by request id."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(steps):
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_work(), "the engine is still looping"
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def submit(engine: LLMEngine, prompts: list[tuple[int, ...]], max_tokens: int) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), float(i)))
