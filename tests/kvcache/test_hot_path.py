"""The decode hot path's structural promises, on a tiny random model:

- a decode step whose selected pages all sit on the device tier asks the store nothing;
- the host work of a decode step does not grow with the context (the same Python calls at 250 and 1,800
  tokens, everything resident);
- no tier reads or writes while the store lock is held, whatever the tiers do (demotions, promotions,
  prefetch, write-through, a live shrink).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from modelkit import random_tokens

from kvdrive.runtime.engine import EngineConfig, LLMEngine, ModelRunner, SamplingParams, TierConfig
from kvdrive.runtime.kvcache.envelope import reserve_bytes
from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.store import BlockStore
from kvdrive.runtime.kvcache.store.tiers import ssd_index
from kvdrive.runtime.model import LoadedModel

PAGE = 4
STORE_LOOKUPS = ("where", "where_many", "key_of", "set_needed", "ref_page", "plan_reads", "rows_to_write",
                 "pin_for_promotion")
MOVER_CALLS = ("fetch", "admit", "put", "promote", "prepare_promote", "run_moves", "replicate", "make_room")


def _opened(gen: ModelRunner, n: int) -> tuple[int, int]:
    """A sequence with ``n`` prompt tokens, positioned so that the next decode step seals no page."""
    seq, _ = gen.open_sequence([])
    gen.prefill(seq, random_tokens(n))
    last = 5
    while gen.cache.length(seq) % PAGE != 1:
        last = int(gen.decode([(seq, last)])[0].argmax())
    return seq, last


def _count_calls(store: BlockStore, mover: Mover) -> dict[str, int]:
    """Spies on every store lookup and Mover call, on the part that owns it (the store's read and write
    bookkeeping, the Mover's reader and runner), so a call made inside the store or the Mover is counted too."""
    calls = dict.fromkeys(STORE_LOOKUPS + MOVER_CALLS, 0)
    owner: dict[str, Any] = {"plan_reads": store.reads, "rows_to_write": store.writes, "pin_for_promotion": store.writes,
                             "fetch": mover.reader, "run_moves": mover.runner, "make_room": mover.runner}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    for name in STORE_LOOKUPS:
        part = owner.get(name, store)
        setattr(part, name, spy(name, getattr(part, name)))
    for name in MOVER_CALLS:
        part = owner.get(name, mover)
        setattr(part, name, spy(name, getattr(part, name)))
    return calls


def test_a_decode_step_whose_pages_are_all_on_the_device_tier_asks_the_store_nothing(tiny: LoadedModel) -> None:
    gen = ModelRunner(tiny, EngineConfig(page_size=PAGE, max_sequences=1, token_budget=8 * PAGE))
    seq, last = _opened(gen, 300)  # 75 pages, all on the device tier; the budget selects 7 of them
    calls = _count_calls(gen.cache.store, gen.cache.mover)
    before = gen.cache.page_reads()
    gen.decode([(seq, last)])
    layers = tiny.config.num_layers
    assert gen.cache.page_reads()["gpu"] - before["gpu"] == layers * gen.cache.selection.budget_pages == layers * 7
    assert calls == dict.fromkeys(STORE_LOOKUPS + MOVER_CALLS, 0)


def test_each_sparse_step_leaves_the_mass_its_pages_drew_for_the_next_steps_selection(tiny: LoadedModel) -> None:
    """After a sparse decode step, every layer's row holds the attention mass (summed over query heads) that
    the step's selected pages drew, nothing on the others; the next step replaces it."""
    gen = ModelRunner(tiny, EngineConfig(page_size=PAGE, max_sequences=1, token_budget=8 * PAGE))
    seq, last = _opened(gen, 300)
    cache, hq = gen.cache, tiny.config.num_heads
    row = torch.tensor([cache.seq(seq).row])
    npages = cache.length(seq) // PAGE
    for _ in range(2):
        last = int(gen.decode([(seq, last)])[0].argmax())
        for layer in range(cache.layout.num_layers):
            drawn = cache.summaries.drawn(layer, row, None, cache.summaries.pages)[0]
            attended = int((drawn > 0).sum())
            assert 0 < attended <= cache.selection.budget_pages
            assert 0.0 < float(drawn.sum()) <= hq + 1e-4  # the open page's share is not a sealed page's
            assert float(drawn[npages + 1 :].abs().sum()) == 0.0
    gen.close()


def _python_calls(gen: ModelRunner, seq: int, last: int) -> int:
    prof = cProfile.Profile()
    prof.enable()
    gen.decode([(seq, last)])
    prof.disable()
    return pstats.Stats(prof).total_calls  # type: ignore[attr-defined,no-any-return]


def test_host_work_of_a_decode_step_does_not_grow_with_the_context(tiny: LoadedModel) -> None:
    """Every Python-level call of a decode step (torch ops included) counted at 250 and at 1,800 tokens of
    context, both beyond the token budget, everything on the device tier: the counts are equal."""
    counts = []
    for n in (250, 1800):
        gen = ModelRunner(tiny, EngineConfig(page_size=PAGE, max_sequences=1, token_budget=8 * PAGE))
        seq, last = _opened(gen, n)
        _python_calls(gen, seq, last)  # first step after the prompt: lazy state settles
        seq2, last2 = seq, int(gen.decode([(seq, last)])[0].argmax())
        while gen.cache.length(seq2) % PAGE != 1:
            last2 = int(gen.decode([(seq2, last2)])[0].argmax())
        counts.append(_python_calls(gen, seq2, last2))
        assert gen.cache.page_reads().get("ssd", 0) == 0 and gen.cache.page_reads().get("dram", 0) == 0
        gen.close()
    assert counts[0] == counts[1], counts


TIER_IO = ("read", "write", "discard", "resize", "size_files")


def _guard_tiers(store: BlockStore) -> tuple[list[str], dict[str, int]]:
    """Wrap every tier method that does I/O (read, write, discard, resize, and the SSD tier's slab sizing, index
    journal appends and fallocate) in a double that records a call made with the store lock held; returns
    (violations, calls per tier and per "tier.method")."""
    violations: list[str] = []
    io = dict.fromkeys(store.tiers, 0)

    def guard(name: str, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*a: Any, **kw: Any) -> Any:
            if store.table.lock._is_owned():  # type: ignore[attr-defined]
                violations.append(f"{name}.{op}")
            io[name] += 1
            io[f"{name}.{op}"] = io.get(f"{name}.{op}", 0) + 1
            return fn(*a, **kw)
        return checked

    for name, tier in store.tiers.items():
        for op in TIER_IO:
            if hasattr(tier, op):
                setattr(tier, op, guard(name, op, getattr(tier, op)))
    ssd = store.tiers.get("ssd")
    if ssd is not None:  # the SSD tier's journal (a record appended is a file write too) and its slab files
        ssd.index._append = guard("ssd", "journal", ssd.index._append)  # type: ignore[union-attr]
        ssd.io.fallocate = guard("ssd", "fallocate", ssd.io.fallocate)  # type: ignore[union-attr]
    return violations, io


def test_no_tier_io_while_the_store_lock_is_held(tiny: LoadedModel, tmp_path: Path) -> None:
    """Every tier method that does I/O is wrapped in a double that records a call made with the store lock
    held. A 600-token sequence decodes through tiny device and DRAM tiers (demotions, promotions, prefetch,
    write-through to SSD), with a live shrink of both memory tiers halfway: all three tiers move bytes, the
    demoted copies' slots are discarded, both memory pools are resized, none of it under the lock."""
    layout = ModelRunner(tiny, EngineConfig(page_size=PAGE)).cache.layout
    page = layout.page_bytes
    for placement in ("kvdrive", "lru"):
        shape = EngineConfig(page_size=PAGE, max_sequences=2, placement=placement, token_budget=16 * PAGE)
        reserve = reserve_bytes(layout, shape)  # the envelope's share for the rows' open pages and step buffers
        gen = ModelRunner(tiny, replace(shape, tiers=TierConfig(
            envelope_bytes=10 * page + reserve, dram_bytes=24 * page, ssd_dir=str(tmp_path / placement),
            ssd_bytes=64 << 20)))
        violations, io = _guard_tiers(gen.cache.store)
        out = []
        for i, tok in enumerate(LLMEngine(gen).generate_tokens(random_tokens(600, seed=7), SamplingParams(max_tokens=24, ignore_eos=True))):
            out.append(tok)
            if i == 12:
                gen.cache.set_budgets(6 * page + reserve, 16 * page, 64 << 20)
        gen.close()
        assert len(out) == 24
        assert all(io[t] > 0 for t in gen.cache.store.tiers), io
        assert all(io.get(op, 0) > 0 for op in ("gpu.discard", "dram.discard", "gpu.resize", "dram.resize")), io
        assert violations == [], f"{placement}: tier I/O under the store lock: {sorted(set(violations))}"


def _small_tiers(tiny: LoadedModel, ssd_dir: Path, ssd_bytes: int) -> tuple[ModelRunner, EngineConfig]:
    """A runner whose device tier holds 10 pages and DRAM 24, over an SSD tier of ``ssd_bytes``; and its shape."""
    layout = ModelRunner(tiny, EngineConfig(page_size=PAGE)).cache.layout
    page = layout.page_bytes
    shape = EngineConfig(page_size=PAGE, max_sequences=2, token_budget=16 * PAGE)
    return ModelRunner(tiny, replace(shape, tiers=TierConfig(
        envelope_bytes=10 * page + reserve_bytes(layout, shape), dram_bytes=24 * page, ssd_dir=str(ssd_dir),
        ssd_bytes=ssd_bytes))), shape


def test_an_ssd_tier_that_must_evict_frees_its_slots_without_journal_writes_under_the_store_lock(
        tiny: LoadedModel, tmp_path: Path) -> None:
    """A 1 MiB SSD tier under three 600-token prompts evicts persisted blocks; freeing each one is recorded in
    the SSD index's journal, on the tier's index thread, never while the store's lock is held (each record was
    a write under that lock: 458 of them in this run). Growing the tier live then sizes its slab files
    (fallocate) outside that lock too."""
    gen, shape = _small_tiers(tiny, tmp_path / "ssd", 1 << 20)
    store = gen.cache.store
    ssd = store.tiers["ssd"]
    violations, io = _guard_tiers(store)
    for seed in range(3):
        assert len(list(LLMEngine(gen).generate_tokens(random_tokens(600, seed=seed), SamplingParams(max_tokens=8, ignore_eos=True)))) == 8
    small = ssd.allocator.capacity
    assert 3 * 150 * tiny.config.num_layers > small  # more persisted blocks than the tier holds: it evicted
    grown = gen.cache.mover.set_budgets(ssd_bytes=2 << 20)  # a live SSD growth: its files sized outside the lock
    capacity = ssd.allocator.capacity
    assert grown.ssd_bytes == 2 << 20 and capacity > small
    gen.close()
    assert io["ssd"] > 0
    assert violations == [], f"tier I/O under the store lock: {sorted(set(violations))}"
    reopened = ModelRunner(tiny, replace(shape, tiers=TierConfig(ssd_dir=str(tmp_path / "ssd"), ssd_bytes=2 << 20)))
    try:  # every DEL reached the journal before the tier closed: what the index holds fits the tier
        assert len(reopened.cache.store.tiers["ssd"].recovered()) <= capacity
        assert reopened.cache.store.tiers["ssd"].forgotten_at_start == 0
    finally:
        reopened.close()


def _walked(store: BlockStore) -> dict[str, tuple[int, int]]:
    """(blocks with a copy, of them not needed) per tier, counted by walking the block table."""
    out = {t: (0, 0) for t in store.tiers}
    for b in store.table.blocks.values():
        for t in b.copies:
            held, cached = out[t]
            out[t] = (held + 1, cached + (not b.needed))
    return out


def test_usage_comes_from_counters_that_agree_with_the_block_table(tiny: LoadedModel, tmp_path: Path) -> None:
    """``usage()`` reads per-tier counters kept as copies come and go and ``needed`` flips, so a scrape does
    not walk the blocks under the store's lock. Through demotions, promotions, prefetch, write-through, a
    live shrink, sequences ending and a restart, the counters equal a walk of the block table."""
    layout = ModelRunner(tiny, EngineConfig(page_size=PAGE)).cache.layout
    page = layout.page_bytes
    shape = EngineConfig(page_size=PAGE, max_sequences=2, token_budget=16 * PAGE)
    tiers = TierConfig(envelope_bytes=10 * page + reserve_bytes(layout, shape), dram_bytes=24 * page,
                       ssd_dir=str(tmp_path / "ssd"), ssd_bytes=1 << 20)

    def check(gen: ModelRunner) -> None:
        store = gen.cache.store
        with store.table.lock:  # the transfer workers change blocks meanwhile: one consistent instant
            walked, usage = _walked(store), store.usage()
            counted = dict(store.table.copies_in)
        for u in usage:
            held, cached = walked[u.tier]
            assert (counted.get(u.tier, 0), u.cached_bytes) == (held, cached * store.tiers[u.tier].slot_bytes)

    gen = ModelRunner(tiny, replace(shape, tiers=tiers))
    seen_cached = 0
    for seed in range(3):
        for i, _ in enumerate(LLMEngine(gen).generate_tokens(random_tokens(600, seed=seed), SamplingParams(max_tokens=12, ignore_eos=True))):
            if i % 4 == 0:
                check(gen)
            if seed == 1 and i == 6:
                gen.cache.set_budgets(6 * page + reserve_bytes(layout, shape), 16 * page, 1 << 20)
        check(gen)  # the sequence ended: its pages are cached now
        seen_cached += sum(u.cached_bytes for u in gen.cache.store.usage())
    gen.close()
    assert seen_cached > 0
    again = ModelRunner(tiny, replace(shape, tiers=tiers))  # recovered SSD blocks: held, none needed
    try:
        check(again)
        ssd = next(u for u in again.cache.store.usage() if u.tier == "ssd")
        assert ssd.cached_bytes == ssd.used_bytes > 0
    finally:
        again.close()


def test_a_decode_goes_on_while_an_ssd_compaction_fsync_is_held_up(tiny: LoadedModel, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSD tier's index journal is capped small, so the pages a 600-token prompt writes through to the SSD
    tier start a compaction; every fsync of the index then hangs, as on a saturated drive. The prompt and 16
    decode steps still finish, with the fsync held up the whole time (nobody waits for it: no lock is held
    across it), and after it is released the tier closes with its snapshot in place."""
    gen, _ = _small_tiers(tiny, tmp_path / "ssd", 64 << 20)
    index = gen.cache.store.tiers["ssd"].index  # type: ignore[attr-defined]
    index.journal_cap = 4 << 10  # 85 records a journal: the prompt's write-through crosses it
    held, entered = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def hung_fsync(fd: int) -> None:
        entered.set()
        assert held.wait(120)
        real_fsync(fd)

    monkeypatch.setattr(ssd_index.os, "fsync", hung_fsync)
    out: list[int] = []
    decoding = threading.Thread(target=lambda: out.extend(
        LLMEngine(gen).generate_tokens(random_tokens(600, seed=3), SamplingParams(max_tokens=16, ignore_eos=True))))
    decoding.start()
    decoding.join(90)
    try:
        assert entered.is_set(), "no compaction started"
        assert not decoding.is_alive() and len(out) == 16, "the decode waited for the compaction's fsync"
        assert not held.is_set()
    finally:
        held.set()
        decoding.join(30)
        gen.close()
