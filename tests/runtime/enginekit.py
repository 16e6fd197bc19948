"""Driving the engine in tests: a small tiered ``LLMEngine``, run until dry, its tokens; one greedy generation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvdrive.runtime.engine import (
    EngineConfig,
    LLMEngine,
    ModelRunner,
    Request,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
    TierConfig,
)
from kvdrive.runtime.kvcache.envelope import reserve_bytes
from kvdrive.runtime.kvcache.store import KVLayout
from kvdrive.runtime.model import LoadedModel

PAGE = 4  # tokens a page: small, so that short prompts span many pages


def with_reserve(layout: KVLayout, hot_bytes: int, config: EngineConfig) -> int:
    """The gpu budget (the device envelope) whose hot tier is ``hot_bytes`` for ``config``: plus every row's
    open page and each running sequence's decode step buffer."""
    return hot_bytes + reserve_bytes(layout, config)


def small_engine(loaded: LoadedModel, ssd: Path, gpu_pages: int, dram_pages: int, token_budget_pages: int,
                 placement: str = "kvdrive", selection_sketch: int = EngineConfig.selection_sketch) -> LLMEngine:
    """Two sequences at most, a device tier of ``gpu_pages`` pages (plus their open pages), DRAM of
    ``dram_pages``, a 64 MiB SSD tier in ``ssd``, under ``placement``, pages selected under
    ``selection_sketch``."""
    layout = ModelRunner(loaded, EngineConfig(page_size=PAGE)).cache.layout
    page = layout.page_bytes
    shape = EngineConfig(page_size=PAGE, max_sequences=2, token_budget=token_budget_pages * PAGE, placement=placement,
                         selection_sketch=selection_sketch)
    gen = ModelRunner(loaded, replace(shape, tiers=TierConfig(
        envelope_bytes=with_reserve(layout, gpu_pages * page, shape), dram_bytes=dram_pages * page, ssd_dir=str(ssd),
        ssd_bytes=64 << 20)))
    return LLMEngine(gen, SchedulerConfig(max_running=2))


def greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int, **config: Any) -> list[int]:
    """The greedy tokens ``LLMEngine.generate_tokens`` gives ``prompt`` on one sequence under ``EngineConfig(**config)``
    (default tiers), the runner closed after."""
    gen = ModelRunner(loaded, EngineConfig(tiers=TierConfig(), max_sequences=1, **config))
    try:
        return list(LLMEngine(gen).generate_tokens(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    finally:
        gen.close()


def plain_engine(loaded: LoadedModel, rows: int) -> LLMEngine:
    """An engine of ``rows`` sequences on the default (untiered) cache."""
    return LLMEngine(ModelRunner(loaded, EngineConfig(page_size=PAGE, max_sequences=rows)),
                     SchedulerConfig(max_running=rows))


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
