"""Driving the engine in tests: the one tiered runner and engine every test builds (``tiered_runner``,
``tiered_engine``), run until dry, its tokens; one greedy generation."""

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
    kv_layout,
)
from kvdrive.runtime.kvcache import KVLayout, reserve_bytes
from kvdrive.runtime.model import LoadedModel

PAGE = 4  # tokens a page: small, so that short prompts span many pages


def with_reserve(layout: KVLayout, hot_bytes: int, config: EngineConfig) -> int:
    """The gpu budget (the device envelope) whose hot tier is ``hot_bytes`` for ``config``: plus every row's
    open page and each running sequence's decode step buffer."""
    return hot_bytes + reserve_bytes(layout, config)


def page_bytes(loaded: LoadedModel, page_size: int = PAGE) -> int:
    """Bytes of one page (every global layer's K and V) of ``loaded`` at ``page_size`` tokens."""
    return kv_layout(loaded, EngineConfig(page_size=page_size)).page_bytes


def tiered_runner(loaded: LoadedModel, rows: int = 2, hot_pages: int | None = None, dram_pages: int = 0,
                  ssd: Path | None = None, ssd_bytes: int = 64 << 20, reserve_running: int | None = None,
                  **config: Any) -> ModelRunner:
    """The one tiered runner the tests build: ``rows`` rows of ``PAGE``-token pages (``config``: any other
    ``EngineConfig`` field); a device tier of ``hot_pages`` pages beside what the envelope reserves for
    ``reserve_running`` running sequences (default: as many as start), DRAM of ``dram_pages`` pages, an SSD tier
    of ``ssd_bytes`` in ``ssd`` (none without it). ``hot_pages`` None: the default gpu budget."""
    shape = EngineConfig(page_size=PAGE, max_sequences=rows, **config)
    layout = kv_layout(loaded, shape)
    envelope = None if hot_pages is None else with_reserve(
        layout, hot_pages * layout.page_bytes,
        shape if reserve_running is None else replace(shape, max_running=reserve_running))
    return ModelRunner(loaded, replace(shape, tiers=TierConfig(
        envelope_bytes=envelope, dram_bytes=dram_pages * layout.page_bytes, ssd_dir=None if ssd is None else str(ssd),
        ssd_bytes=ssd_bytes if ssd is not None else 0)))


def tiered_engine(loaded: LoadedModel, running: int | None = None, step_tokens: int = 512,
                  scheduler: dict[str, Any] | None = None, **runner: Any) -> LLMEngine:
    """An ``LLMEngine`` over ``tiered_runner(loaded, **runner)`` scheduling ``running`` sequences at once (default:
    every row) and ``step_tokens`` tokens a step (``scheduler``: other ``SchedulerConfig`` fields)."""
    gen = tiered_runner(loaded, **runner)
    return LLMEngine(gen, SchedulerConfig(max_running=running or gen.config.start_running,
                                          step_token_budget=step_tokens, **(scheduler or {})))


def small_engine(loaded: LoadedModel, ssd: Path, gpu_pages: int, dram_pages: int, token_budget_pages: int,
                 placement: str = "kvdrive", selection_sketch: int = EngineConfig.selection_sketch) -> LLMEngine:
    """Two sequences at most, a device tier of ``gpu_pages`` pages (plus their open pages), DRAM of
    ``dram_pages``, a 64 MiB SSD tier in ``ssd``, under ``placement``, pages selected under
    ``selection_sketch``."""
    return tiered_engine(loaded, hot_pages=gpu_pages, dram_pages=dram_pages, ssd=ssd,
                         token_budget=token_budget_pages * PAGE, placement=placement, selection_sketch=selection_sketch)


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
