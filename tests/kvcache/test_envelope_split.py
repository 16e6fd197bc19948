"""The device envelope split live between the hot tier and concurrency, narrated on a tiny random model.

One gpu budget is the envelope: every running sequence the engine may run takes one decode step buffer
from it, the rest is the hot tier. Moving ``max_running`` moves real bytes (the store's device tier and
the reserved buffer change size), never loses a running sequence and never changes an output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from enginekit import PAGE, run_dry, submit, tiered_engine, tokens

from kvdrive.runtime.engine import LLMEngine, Request, SamplingParams
from kvdrive.runtime.kvcache import BudgetError
from kvdrive.runtime.model import LoadedModel

ROWS = 4


def _engine(loaded: LoadedModel, ssd: Path, hot_pages: int, start: int) -> LLMEngine:
    """Four rows; ``hot_pages`` of hot tier when all four run; ``start`` running to begin with."""
    return tiered_engine(loaded, running=start, step_tokens=16, rows=ROWS, hot_pages=hot_pages, reserve_running=ROWS,
                         dram_pages=32, ssd=ssd, token_budget=8 * PAGE, max_running=start)


def _prompts(n: int, length: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(11)
    return [tuple(torch.randint(3, 250, (length,), generator=g).tolist()) for _ in range(n)]


def test_each_running_slot_is_one_step_buffer_of_hot_tier(tiny: LoadedModel, tmp_path: Path) -> None:
    """Starting at one running sequence, the hot tier holds three step buffers more than at four; the
    envelope (the gpu budget every report shows) is the same."""
    four = _engine(tiny, tmp_path / "a", hot_pages=6, start=ROWS).runner.cache
    one = _engine(tiny, tmp_path / "b", hot_pages=6, start=1).runner.cache
    a, b = four.envelope.split(), one.envelope.split()
    assert a.envelope_bytes == b.envelope_bytes
    assert a.per_sequence_bytes == 8 * four.layout.block_bytes  # 7 selected pages + the open one, one layer
    assert b.hot_bytes - a.hot_bytes == 3 * a.per_sequence_bytes
    assert b.hot_bytes + b.reserve_bytes == a.hot_bytes + a.reserve_bytes == a.envelope_bytes
    assert one.store.tiers["gpu"].allocator.capacity > four.store.tiers["gpu"].allocator.capacity
    gpu = {u.tier: u for u in one.usage()}["gpu"]
    assert gpu.budget_bytes == b.envelope_bytes


def test_the_split_moves_live_without_losing_a_sequence_or_changing_an_output(tiny: LoadedModel,
                                                                             tmp_path: Path) -> None:
    """Three requests under a limit of three; halfway the limit drops to one. Nobody is preempted: the
    scheduler admits nothing more and the buffers go back to the hot tier once one sequence runs. Then the
    limit goes back to three for a second wave. Every output equals the same requests run at a fixed limit."""
    prompts = _prompts(5, 40)
    ref_engine = _engine(tiny, tmp_path / "ref", hot_pages=24, start=3)
    submit(ref_engine, prompts, max_tokens=12)
    ref = {rid: tokens(o) for rid, o in run_dry(ref_engine).items()}

    engine = _engine(tiny, tmp_path / "live", hot_pages=24, start=3)
    cache = engine.runner.cache
    submit(engine, prompts[:3], max_tokens=12)
    outs: dict[str, list[int]] = {}
    for _ in range(6):
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(engine.scheduler.running) == 3
    hot_before = cache.envelope.split().hot_bytes
    assert engine.set_max_running(1) is False  # three run: the shrink waits for them
    assert cache.envelope.split().pending_max_running == 1 and cache.envelope.max_running == 3
    for i in (3, 4):  # two more arrive: they wait, the limit is one now
        engine.add_request(_request(f"r{i}", prompts[i]))
    while True:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if cache.envelope.pending is None:
            break  # applied at the start of this step, once the three were done
        assert {s.request.request_id for s in engine.scheduler.running} <= {"r0", "r1", "r2"}
    assert engine.stats().preemptions_total == 0
    assert cache.envelope.max_running == 1
    assert cache.envelope.split().hot_bytes == hot_before + 2 * cache.envelope.per_sequence_bytes
    assert engine.set_max_running(3) is True  # growing: the hot tier gives the bytes back at once
    assert cache.envelope.split().hot_bytes == hot_before
    for rid, o in run_dry(engine).items():
        outs.setdefault(rid, []).extend(tokens(o))
    assert outs == ref
    for u in cache.usage():
        assert u.used_bytes <= u.capacity_bytes <= u.budget_bytes


def _request(rid: str, prompt: tuple[int, ...], max_tokens: int = 12) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 9.0)


def test_more_concurrency_than_the_hot_tier_can_give_is_refused_and_changes_nothing(tiny: LoadedModel,
                                                                                   tmp_path: Path) -> None:
    """At one running sequence the hot tier holds a long prompt's pages; four step buffers would leave it
    no room for the pages that sequence needs (DRAM is off): BudgetError, and the split is as it was."""
    engine = tiered_engine(tiny, running=1, step_tokens=64, rows=ROWS, hot_pages=2, reserve_running=ROWS,
                           token_budget=8 * PAGE, max_running=1)
    cache = engine.runner.cache
    layout = cache.layout
    per_seq = 8 * layout.block_bytes
    hot = cache.envelope.split().hot_bytes
    assert hot == 2 * layout.page_bytes + 3 * per_seq
    pages = hot // layout.page_bytes  # pages of all layers the hot tier holds at one running sequence
    engine.add_request(_request("long", _prompts(1, PAGE * (pages - 1))[0], max_tokens=3))
    for _ in range(2):
        engine.step()
    assert len(engine.scheduler.running) == 1
    with pytest.raises(BudgetError):
        engine.set_max_running(ROWS)
    assert cache.envelope.max_running == 1 and cache.envelope.split().hot_bytes == hot
    assert engine.scheduler.config.max_running == 1
    with pytest.raises(BudgetError, match="max_running must be in"):
        engine.set_max_running(ROWS + 1)
    run_dry(engine)
