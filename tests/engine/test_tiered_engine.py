"""The engine on the three tiers, narrated on a tiny random model: sparse attention, prefix reuse and
its isolation, persistence across restarts, every placement policy, lost pages, live budgets."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from enginekit import page_bytes, tiered_runner
from modelkit import random_tokens

from kvdrive.runtime.engine import LLMEngine, ModelRunner, Request, SamplingParams, SchedulerConfig
from kvdrive.runtime.kvcache.store.tiers.ssd import SsdTier
from kvdrive.runtime.model import LoadedModel


def _greedy(gen: ModelRunner, prompt: Sequence[int], n: int = 12) -> list[int]:
    return list(LLMEngine(gen).generate_tokens(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))


def _decode_logits(gen: ModelRunner, prompt: Sequence[int], tokens: list[int]) -> torch.Tensor:
    seq, reused = gen.open_sequence(prompt)
    out = [gen.prefill(seq, prompt[reused:])]
    for t in tokens:
        out.append(gen.decode([(seq, t)])[0])
    gen.release(seq)
    return torch.stack(out)


def test_sparse_attention_with_a_covering_budget_equals_full_attention(tiny: LoadedModel) -> None:
    prompt = random_tokens(150)
    ref = _greedy(tiered_runner(tiny, full_attention=True), prompt)
    full = _decode_logits(tiered_runner(tiny, full_attention=True), prompt, ref)
    sparse = _decode_logits(tiered_runner(tiny, token_budget=1024), prompt, ref)
    torch.testing.assert_close(sparse, full, atol=1e-5, rtol=1e-5)


def test_a_small_token_budget_reads_only_the_selected_pages(tiny: LoadedModel) -> None:
    """300 tokens = 75 pages; a 32-token budget attends to 7 sealed pages + the open one per layer."""
    gen = tiered_runner(tiny, token_budget=32)
    seq, _ = gen.open_sequence([])
    gen.prefill(seq, random_tokens(300))
    layers = tiny.config.num_layers
    before = gen.page_reads
    gen.decode([(seq, 5)])
    assert gen.page_reads - before == layers * gen.cache.selection.budget_pages == layers * 7
    full = tiered_runner(tiny, full_attention=True)
    s2, _ = full.open_sequence([])
    full.prefill(s2, random_tokens(300))
    before = full.page_reads
    full.decode([(s2, 5)])
    assert full.page_reads - before == layers * 75


def test_prefix_pages_are_shared_only_by_identical_token_prefixes(tiny: LoadedModel) -> None:
    """A second request with the same 40-token prefix reuses 10 pages and gets the same output as a
    fresh cache; a prompt that differs in its very first token reuses nothing."""
    base = list(random_tokens(40, seed=1))
    gen = tiered_runner(tiny)
    first = _greedy(gen, base + [7, 8, 9])
    assert gen.cache.prefix_hit_pages == 0
    again = _greedy(gen, base + [7, 8, 9])
    assert again == first and gen.cache.prefix_hit_pages == 10
    other = [base[0] + 1] + base[1:] + [7, 8, 9]
    hits = gen.cache.prefix_hit_pages
    assert _greedy(gen, other) == _greedy(tiered_runner(tiny), other)
    assert gen.cache.prefix_hit_pages == hits  # not one page of the other prompt was reused


def test_prefix_pages_survive_a_restart_on_the_same_ssd_dir(tiny: LoadedModel, tmp_path: Path) -> None:
    prompt = random_tokens(120, seed=2)
    g1 = tiered_runner(tiny, ssd=tmp_path, ssd_bytes=8 << 20)
    out1 = _greedy(g1, prompt)
    g1.close()
    g2 = tiered_runner(tiny, ssd=tmp_path, ssd_bytes=8 << 20)
    assert _greedy(g2, prompt) == out1
    assert g2.cache.prefix_hit_pages == 29  # (120 - 1) // 4 pages reused, the rest recomputed
    assert g2.cache.page_reads()["ssd"] >= 29 * tiny.config.num_layers


@pytest.mark.parametrize("placement", ["kvdrive", "lru", "ondemand", "fullfetch"])
def test_every_placement_uses_all_three_tiers_and_changes_no_output(tiny: LoadedModel, tmp_path: Path,
                                                                     placement: str) -> None:
    """A 600-token sequence in a device tier of ~8 pages and a DRAM tier of ~16: pages are read from all
    three tiers and the greedy output equals the all-on-device reference (covering token budget)."""
    prompt = random_tokens(600, seed=3)
    ref = _greedy(tiered_runner(tiny, full_attention=True), prompt, 16)
    gen = tiered_runner(tiny, hot_pages=8, dram_pages=16, ssd=tmp_path,
                        ssd_bytes=64 << 20, placement=placement, token_budget=2048)
    assert _greedy(gen, prompt, 16) == ref
    reads = gen.cache.page_reads()
    assert reads["gpu"] > 0 and reads["dram"] > 0 and reads["ssd"] > 0, reads
    for u in gen.cache.usage():
        assert u.used_bytes <= u.capacity_bytes <= u.budget_bytes
    if placement == "kvdrive":
        assert sum(gen.cache.placer.ledger.counts().values()) > 0  # it prefetched


@pytest.mark.parametrize("placement", ["kvdrive", "lru"])
def test_full_attention_on_tight_tiers_equals_every_page_on_the_device(tiny: LoadedModel, tmp_path: Path,
                                                                       placement: str) -> None:
    """Exact attention reads every page each step, most from DRAM and SSD, and the reads earn promotions.
    With the promotion queue's cap at 4 blocks, a step's reads overflow it in its first layers: the copies
    must wait for the next step's load phase (an admission mid-step evicted pages a layer had located and
    was about to attend to in place; the logits drifted from the second decode step on, as tiered full
    attention did at 16K on Qwen2.5-Coder-0.5B)."""
    prompt = random_tokens(600, seed=3)
    ref = _greedy(tiered_runner(tiny, full_attention=True), prompt, 12)
    full = _decode_logits(tiered_runner(tiny, full_attention=True), prompt, ref)
    gen = tiered_runner(tiny, hot_pages=8, dram_pages=16, ssd=tmp_path, ssd_bytes=64 << 20,
                        full_attention=True, placement=placement)
    gen.cache.promotions.max_bytes = 4 * gen.cache.layout.block_bytes
    torch.testing.assert_close(_decode_logits(gen, prompt, ref), full, atol=1e-5, rtol=1e-5)
    reads = gen.cache.page_reads()
    assert reads["dram"] > 0 and reads["ssd"] > 0, reads


def test_a_write_back_stalled_on_a_slow_disk_fails_no_step(tiny: LoadedModel, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Write-back to the SSD pins the device copies it reads until the disk has written them. Every SSD
    write off the engine thread is held until the sequence is done (a disk busy elsewhere, as CI's was
    while a test cluster unpacked its images): the device tier of 8 pages fills with pinned blocks, and a
    seal used to wait 2 s for them, then fail the step ("every block is pinned or needed"). New blocks now
    go to the tier below, and the logits are those of every page on the device."""
    prompt = random_tokens(600, seed=3)
    ref = _greedy(tiered_runner(tiny, full_attention=True), prompt, 6)
    full = _decode_logits(tiered_runner(tiny, full_attention=True), prompt, ref)
    disk = threading.Event()
    write = SsdTier.write

    def held(tier: SsdTier, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith("kvdrive-transfer"):
            assert disk.wait(60), "the test never let the disk go"
        write(tier, *args, **kwargs)

    monkeypatch.setattr(SsdTier, "write", held)
    gen = tiered_runner(tiny, hot_pages=8, dram_pages=16, ssd=tmp_path, ssd_bytes=64 << 20, full_attention=True,
                        placement="lru")
    try:
        torch.testing.assert_close(_decode_logits(gen, prompt, ref), full, atol=1e-5, rtol=1e-5)
        assert gen.cache.mover.spilled > 0  # the pins did fill the device tier
    finally:
        disk.set()
        gen.close()


def test_a_corrupt_ssd_page_is_recomputed_never_served(tiny: LoadedModel, tmp_path: Path) -> None:
    """Every SSD slab is scribbled over between two steps; the pages that lived only there fail their
    checksum, the engine recomputes the sequence and the output is unchanged."""
    prompt = random_tokens(200, seed=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = _greedy(tiered_runner(tiny, full_attention=True), prompt, 20)
    gen = tiered_runner(tiny, hot_pages=4, ssd=tmp_path, ssd_bytes=16 << 20,
                        placement="ondemand", token_budget=4096)
    engine = LLMEngine(gen, SchedulerConfig(max_running=2))
    engine.add_request(Request("r", prompt, params, 0.0))
    out: list[int] = []
    corrupted = False
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
        if out and not corrupted:
            gen.cache.transfers.close()  # let pending write-backs land, then corrupt what they wrote
            gen.cache.transfers = type(gen.cache.transfers)(gen.cache.mover)
            for slab in tmp_path.glob("slab*"):
                data = bytearray(slab.read_bytes())
                data[::997] = bytes(len(data[::997]))
                slab.write_bytes(bytes(d ^ 0x5A for d in data))
            corrupted = True
    assert out == ref
    assert gen.cache.counters().pages_lost >= 1 and engine.stats().preemptions_total >= 1


def test_budgets_shrink_live_without_changing_outputs(tiny: LoadedModel, tmp_path: Path) -> None:
    prompt = random_tokens(300, seed=5)
    ref = _greedy(tiered_runner(tiny, full_attention=True), prompt, 24)
    page = page_bytes(tiny)
    gen = tiered_runner(tiny, hot_pages=118, dram_pages=60, ssd=tmp_path,
                        ssd_bytes=32 << 20, token_budget=4096)
    engine = LLMEngine(gen, SchedulerConfig(max_running=2))
    engine.add_request(Request("r", prompt, SamplingParams(max_tokens=24, ignore_eos=True), 0.0))
    out: list[int] = []
    shrunk = False
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
        if len(out) == 8 and not shrunk:
            gen.cache.set_budgets(8 * page + gen.cache.envelope.reserve(), 12 * page, 32 << 20)
            shrunk = True
            for u in gen.cache.usage():
                assert u.used_bytes <= u.budget_bytes
    assert out == ref
    gpu = next(u for u in gen.cache.usage() if u.tier == "gpu")
    assert gpu.budget_bytes == 8 * page + gen.cache.envelope.reserve() and gpu.used_bytes <= gpu.capacity_bytes


def test_pages_computed_by_sparse_decode_are_never_reused_as_exact(tiny: LoadedModel) -> None:
    """Generated tokens whose KV came from sparse decode (selection active) live in pages addressed apart
    from exact ones: a follow-up prompt that repeats the conversation reuses only the prompt's pages and
    computes the generated text's KV exactly, as a full-attention server would."""
    prompt = list(random_tokens(200, seed=6))  # 50 full pages; a 32-token budget selects 7 of them
    gen = tiered_runner(tiny, token_budget=32)
    out = _greedy(gen, prompt, 40)
    follow = prompt + out + [5, 6, 7]
    _, reused = gen.open_sequence(follow)
    assert reused == len(prompt)  # the 10 pages of generated text were not taken from the sparse run
    exact = tiered_runner(tiny, full_attention=True)
    exact_out = _greedy(exact, prompt, 40)
    _, reused_exact = exact.open_sequence(prompt + exact_out + [5, 6, 7])
    assert reused_exact == 236  # exact decode pages are shared: the 39 fed generated tokens fill 9 pages
    seq, _ = gen.open_sequence(prompt[:40])
    assert gen.cache.seq(seq).inexact is False  # a prompt is exact; only decode past the budget taints
