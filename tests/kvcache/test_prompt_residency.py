"""A prompt in progress keeps its pages in the memory tiers until it is in.

Every chunk of a prompt attends exactly to all of the prompt's earlier pages. The soak found engine
turns of 2-6 s: long documents' fresh pages, with no attention mass yet, were the coldest blocks in
the memory tiers, so they were demoted to the SSD between chunks and every later chunk read them back
(48,096 of 93,485 SSD block reads in the same workload at engine level). Two rules fix it:

- placement *holds* a prompt's pages (they rank above every other block, for eviction and admission)
  until its first decode;
- admission keeps the prompts in progress within ``prompt_memory_share`` of the memory tiers; one
  prompt always runs, however large.
"""

from __future__ import annotations

from pathlib import Path

from enginekit import PAGE, tiered_engine
from modelkit import random_tokens

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.model import LoadedModel, load_model

MEMORY_PAGES = 24  # device tier 12 pages + DRAM 12 pages


def _engine(loaded: LoadedModel, ssd: Path, step_tokens: int = 8, **sched: float) -> LLMEngine:
    return tiered_engine(loaded, step_tokens=step_tokens, scheduler=sched, hot_pages=12, dram_pages=12, ssd=ssd,
                         token_budget=8 * PAGE)


def _loaded(hf_model_factory) -> LoadedModel:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=512)
    return load_model(str(path), progress=False)


def _long_prompt_beside_a_hot_decode(engine: LLMEngine) -> list[int]:
    """A (12 pages) decodes for a while, so its pages carry attention mass; then B's 20-page prompt goes
    in 7 tokens a step beside A's decode. 32 pages do not fit the 24 of the memory tiers. B's tokens."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request(Request("A", random_tokens(48, 1), params, 0.0))
    for _ in range(12):
        engine.step()
    engine.add_request(Request("B", random_tokens(80, 2), SamplingParams(max_tokens=4, ignore_eos=True), 1.0))
    out: list[int] = []
    while engine.has_work():
        out += [t for o in engine.step() if o.request_id == "B" for t in o.new_token_ids]
    return out


def test_a_prompt_in_progress_is_never_read_back_from_the_ssd(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    loaded = _loaded(hf_model_factory)
    held = _engine(loaded, tmp_path / "held")
    b_tokens = _long_prompt_beside_a_hot_decode(held)
    cache = held.runner.cache
    assert cache.page_reads()["ssd"] > 0  # the memory tiers overflowed: A's cold pages went to the SSD
    assert cache.counters().prompt_rereads == 0  # ... and none of B's pages did while B was going in
    assert cache.placer.held_pages == 0  # nothing stays held once the prompts are in

    # the contrast: the same run without holding (B's fresh pages are the coldest) reads B back chunk by chunk
    loose = _engine(loaded, tmp_path / "loose")
    loose.runner.cache.placer.hold = lambda pids: None  # type: ignore[method-assign]
    loose.runner.cache.placer.release = lambda pids: None  # type: ignore[method-assign]
    assert _long_prompt_beside_a_hot_decode(loose) == b_tokens  # same exact prefill, same greedy tokens
    assert loose.runner.cache.counters().prompt_rereads > 0


def _running_after_one_step(engine: LLMEngine, prompts: list[tuple[int, ...]]) -> int:
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=2, ignore_eos=True), float(i)))
    engine.step()
    n = len(engine.scheduler.running)
    while engine.has_work():
        engine.step()
    return n


def test_prompts_in_progress_stay_within_their_share_of_the_memory_tiers(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    loaded = _loaded(hf_model_factory)
    two = [random_tokens(48, 3), random_tokens(48, 4)]  # 12 pages each: together past 3/4 of the 24 memory pages
    # a step's budget of 64 tokens would start both
    assert _running_after_one_step(_engine(loaded, tmp_path / "a", 64), two) == 1  # the second waits its turn
    assert _running_after_one_step(_engine(loaded, tmp_path / "b", 64, prompt_memory_share=1.0), two) == 2
    # one prompt always runs, even one larger than the memory tiers (its pages spill to the SSD)
    assert _running_after_one_step(_engine(loaded, tmp_path / "c", 64), [random_tokens(4 * (MEMORY_PAGES + 6), 5)]) == 1
